//! The write-before-send path: assigning seq, handing each handler's batch
//! to the store, and on commit moving events into the replay buffer and out
//! to every live attachment.

use super::*;

impl State {
    /// Assigns the next seq to an event and adds it to the current batch.
    pub(super) fn append(&mut self, data: EventData) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let record = Arc::new(EventRecord::new(&self.id, seq, &data));
        self.last_activity = Instant::now();
        self.last_activity_at = record.ts.clone();
        self.batch.push(record);
        seq
    }

    /// Hands the batch to the store; the commit comes back as a message.
    pub(super) fn flush(&mut self, myself: &ActorRef<ConversationMsg>) {
        if self.batch.is_empty() {
            return;
        }
        let events = std::mem::take(&mut self.batch);
        let upto = self.next_seq - 1;
        let credits = std::mem::take(&mut self.batch_credits);
        self.in_flight.extend(events.iter().cloned());
        let status = if self.stopping.is_some() {
            Status::Stopped
        } else {
            self.status()
        };
        let batch = AppendBatch {
            conversation_id: self.id.clone(),
            create: self.batch_create.take(),
            events,
            state: ConversationState {
                status,
                head_seq: upto,
                last_activity_at: self.last_activity_at.clone(),
                current_turn_id: self.turn.as_ref().map(|t| t.id.to_string()),
                last_turn_message_seq: self.last_turn_message_seq,
            },
            client_msg_ids: std::mem::take(&mut self.batch_client_ids),
        };
        let me = myself.clone();
        let epoch = self.epoch;
        self.store.append(
            batch,
            Box::new(move |result| {
                let _ = me.cast(ConversationMsg::Committed {
                    upto,
                    credits,
                    epoch,
                    result,
                });
            }),
        );
    }

    /// Replaces the replay buffer with the newest part of `tail` (stored
    /// events, oldest first) that fits the byte cap.
    pub(super) fn refill_buffer(&mut self, tail: Vec<Arc<EventRecord>>) {
        self.buffer.clear();
        self.buffer_bytes = 0;
        for record in tail.into_iter().rev() {
            if self.buffer_bytes + record.frame.len() > REPLAY_BUFFER_MAX_BYTES
                && !self.buffer.is_empty()
            {
                break;
            }
            self.buffer_bytes += record.frame.len();
            self.buffer.push_front(record);
        }
    }

    pub(super) fn on_committed(&mut self, myself: &ActorRef<ConversationMsg>, upto: u64) {
        let cap = self.config.get().conversations.replay_buffer_events;
        let mut new_events = Vec::new();
        while self.in_flight.front().is_some_and(|r| r.seq <= upto) {
            if let Some(record) = self.in_flight.pop_front() {
                self.buffer_bytes += record.frame.len();
                self.buffer.push_back(record.clone());
                // Bounded in events and in bytes: a replay the buffer no
                // longer holds comes from the store.
                while self.buffer.len() > cap
                    || (self.buffer_bytes > REPLAY_BUFFER_MAX_BYTES && self.buffer.len() > 1)
                {
                    if let Some(old) = self.buffer.pop_front() {
                        self.buffer_bytes -= old.frame.len();
                    }
                }
                new_events.push(record);
            }
        }
        m::events_appended(new_events.iter().map(|r| &*r.kind));
        self.committed = self.committed.max(upto);
        // The creator hears `created` only now that the conversation exists,
        // and is then attached like anyone else (its replay sends `created`
        // first, then the events from seq 1).
        if let Some(creator) = self.pending_creator.take() {
            self.attach(
                myself,
                creator.conn,
                AttachAsk {
                    mode: creator.mode,
                    last_seq: 0,
                    compact: false,
                    req: creator.req,
                    announce: Announce::Created,
                },
            );
        }
        let mut fallen_behind = Vec::new();
        let mut gone = Vec::new();
        for (conn_id, attachment) in &self.attachments {
            if attachment.cursor != Cursor::Live {
                continue;
            }
            for record in &new_events {
                match attachment.conn.outbound.try_send(record.frame.clone()) {
                    Ok(()) => {}
                    Err(QueueError::Full) => {
                        fallen_behind.push((*conn_id, record.seq));
                        break;
                    }
                    Err(QueueError::Closed) => {
                        gone.push(*conn_id);
                        break;
                    }
                }
            }
        }
        for conn_id in gone {
            self.remove_attachment(conn_id);
        }
        for (conn_id, from) in fallen_behind {
            debug!(conversation = %self.id, connection = conn_id, from, "connection fell behind; catching up from the log");
            self.spawn_catch_up(myself, conn_id, from, None, None);
        }
        while self
            .deferred
            .front()
            .is_some_and(|d| d.seq <= self.committed)
        {
            if let Some(reply) = self.deferred.pop_front() {
                self.reply_to(reply.conn, &reply.frame);
            }
        }
    }
}

//! The write-before-send path as I/O: handing the log's batch to the
//! store, and on commit sending what the log released to every live
//! attachment and to the replies that waited for it. What is assigned,
//! written and committed is the log's (`log.rs`).

use super::*;

impl State {
    /// Assigns the next seq to an event and adds it to the batch.
    pub(super) fn append(&mut self, data: EventData) -> u64 {
        let record = self.log.append(&data);
        self.last_activity = Instant::now();
        record.seq
    }

    /// Hands the batch to the store; the commit comes back as a message.
    pub(super) fn flush(&mut self, myself: &ActorRef<ConversationMsg>) {
        let Some(write) = self.log.take_batch() else {
            return;
        };
        let status = if self.stopping.is_some() {
            Status::Stopped
        } else {
            self.status()
        };
        // The last event's time: the conversation's last activity.
        let last_activity_at = write
            .events
            .last()
            .map_or_else(now_rfc3339, |event| event.ts().to_owned());
        let batch = AppendBatch {
            conversation_id: self.id.clone(),
            create: write.create,
            events: write.events,
            state: ConversationState {
                status,
                head_seq: write.upto,
                last_activity_at,
                current_turn_id: self.turn.as_ref().map(|t| t.id.to_string()),
                last_turn_message_seq: self.last_turn_message_seq,
            },
            client_msg_ids: write.client_msg_ids,
            forget_client_msg_ids_before: write.forget_client_msg_ids_before,
        };
        let me = myself.clone();
        let (upto, credits, epoch) = (write.upto, write.credits, write.epoch);
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

    pub(super) fn on_committed(&mut self, myself: &ActorRef<ConversationMsg>, upto: u64) {
        let cap = self.config.get().conversations.replay_buffer_events;
        let released = self.log.commit(upto, cap);
        let new_events = released.events;
        m::events_appended(new_events.iter().map(|r| &*r.kind));
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
            if !attachment.cursor.is_live() {
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
        for reply in released.replies {
            self.reply_to(reply.conn, &reply.frame);
        }
    }
}

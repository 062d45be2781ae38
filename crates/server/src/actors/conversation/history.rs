//! The write-before-send path as I/O: handing the log's batch to the
//! store, and on commit sending what the log released to every live
//! attachment and to the replies that waited for it; while a turn runs,
//! the store's commit callback sends to the live attachments itself
//! through the fanout (`fanout.rs`), and the actor takes in what it sent.
//! What is assigned, written and committed is the log's (`log.rs`).

use super::fanout::{send_events, Commit, Dropped, News};
use super::log::Released;
use super::*;
use crate::event::EventRecord;

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
        let batch = AppendBatch {
            conversation_id: self.id.clone(),
            create: write.create,
            events: write.events,
            state: ConversationState {
                status,
                head_seq: write.upto,
                // The last event's time (a batch is never empty).
                last_activity_at: None,
                current_turn_id: self.turn.as_ref().map(|t| t.id.clone()),
                last_turn_message_seq: self.last_turn_message_seq,
            },
            client_msg_ids: write.client_msg_ids,
            forget_client_msg_ids_before: write.forget_client_msg_ids_before,
        };
        let me = myself.clone();
        let (upto, credits, epoch) = (write.upto, write.credits, write.epoch);
        // While a turn streams, the commit is sent from the store's side
        // (`fanout.rs`); the actor hears of it only when something waits.
        let fast = self
            .fanout
            .clone()
            .map(|fanout| (fanout, self.credits.clone()));
        self.store.append(
            batch,
            Box::new(move |result, events| {
                if let (Ok(()), Some((fanout, permits))) = (&result, &fast) {
                    if let Commit::Sent { wake } = fanout.on_commit(epoch, events, upto) {
                        permits.add_permits(credits);
                        if wake {
                            let _ = me.cast(ConversationMsg::CommitSeen);
                        }
                        return;
                    }
                }
                let _ = me.cast(ConversationMsg::Committed {
                    upto,
                    credits,
                    epoch,
                    result,
                });
            }),
        );
    }

    /// A commit the fanout did not send (or there is none): its events go
    /// to every live attachment from here.
    pub(super) fn on_committed(&mut self, myself: &ActorRef<ConversationMsg>, upto: u64) {
        let released = self.commit_upto(myself, upto);
        if let Some(fanout) = &self.fanout {
            let dropped = fanout.send_now(&released.events, upto);
            self.deal_with_dropped(myself, dropped);
        } else {
            self.send_live(myself, &released.events);
        }
        for reply in released.replies {
            self.reply_to(reply.conn, &reply.frame);
        }
    }

    /// The log's commit up to `upto`, counted, with the creator attached
    /// once the conversation exists: what it released is the caller's to
    /// send (events first, then the replies that waited on them).
    fn commit_upto(&mut self, myself: &ActorRef<ConversationMsg>, upto: u64) -> Released {
        self.count_committed(upto);
        let cap = self.config.get().conversations.replay_buffer_events;
        let released = self.log.commit(upto, cap);
        self.attach_creator(myself);
        released
    }

    /// [`State::commit_upto`] of events the fanout sent: only the replies
    /// that waited on them are left to send.
    fn commit_sent_upto(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        upto: u64,
    ) -> Vec<DeferredReply> {
        self.count_committed(upto);
        let cap = self.config.get().conversations.replay_buffer_events;
        let replies = self.log.commit_sent(upto, cap);
        self.attach_creator(myself);
        replies
    }

    fn count_committed(&self, upto: u64) {
        m::events_appended(self.log.releasing(upto).map(|r| &*r.kind));
    }

    /// The creator hears `created` only once the conversation exists (its
    /// first commit), and is then attached like anyone else (its replay
    /// sends `created` first, then the events from seq 1).
    fn attach_creator(&mut self, myself: &ActorRef<ConversationMsg>) {
        if self.log.committed() == 0 {
            return;
        }
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
    }

    /// Sends newly committed events to every live attachment (no fanout).
    fn send_live(&mut self, myself: &ActorRef<ConversationMsg>, events: &[Arc<EventRecord>]) {
        let dropped = self
            .attachments
            .iter()
            .filter(|(_, a)| a.cursor.is_live())
            .filter_map(|(id, a)| send_events(*id, &a.conn.outbound, events))
            .collect();
        self.deal_with_dropped(myself, dropped);
    }

    /// Live attachments that could not be sent an event: a closed
    /// connection is detached, a full one catches up from the log.
    fn deal_with_dropped(&mut self, myself: &ActorRef<ConversationMsg>, dropped: Vec<Dropped>) {
        for Dropped { conn, from, gone } in dropped {
            let live = self.attachments.get(&conn).map(|a| a.cursor.is_live());
            match (live, gone) {
                (Some(true), true) => {
                    self.remove_attachment(conn);
                }
                (Some(true), false) => {
                    debug!(conversation = %self.id, connection = conn, from, "connection fell behind; catching up from the log");
                    self.spawn_catch_up(myself, conn, from, None, None);
                }
                // Detached or attached again since: its own cursor rules.
                _ => {}
            }
        }
    }

    /// Takes in what the fanout sent since the last look: those events
    /// are committed (into the replay buffer), the replies that waited on
    /// them go out, and connections it could not send to are dealt with.
    pub(super) fn take_in_commits(&mut self, myself: &ActorRef<ConversationMsg>) {
        let Some(news) = self.fanout.as_ref().map(|fanout| fanout.news()) else {
            return;
        };
        self.take_in(myself, news);
    }

    fn take_in(&mut self, myself: &ActorRef<ConversationMsg>, news: News) {
        if news.sent > self.log.committed() {
            // Its events went out from the fanout already.
            for reply in self.commit_sent_upto(myself, news.sent) {
                self.reply_to(reply.conn, &reply.frame);
            }
        }
        self.deal_with_dropped(myself, news.dropped);
    }

    /// Opens the fanout when a turn streams, closes it otherwise: called
    /// after each message, before the batch is handed to the store.
    pub(super) fn settle_fanout(&mut self, myself: &ActorRef<ConversationMsg>) {
        let wanted = self.turn.is_some() && self.stopping.is_none() && self.store_failure.is_none();
        match (&self.fanout, wanted) {
            (None, true) => {
                // Every live attachment was sent everything committed, by
                // this actor: the fanout starts from there.
                let conns = self
                    .attachments
                    .iter()
                    .filter(|(_, a)| a.cursor.is_live())
                    .map(|(id, a)| (*id, a.conn.outbound.clone()))
                    .collect();
                self.fanout = Some(Fanout::new(conns, self.log.committed(), self.log.epoch()));
            }
            (Some(_), false) => self.close_fanout(myself),
            _ => {}
        }
    }

    /// Closes the fanout (if open) and takes in what it sent: from here
    /// the actor handles every commit. Before anything that must see each
    /// commit (a stop, a failure) or discards what is in flight.
    pub(super) fn close_fanout(&mut self, myself: &ActorRef<ConversationMsg>) {
        if let Some(fanout) = self.fanout.take() {
            let news = fanout.close();
            self.take_in(myself, news);
        }
    }

    /// Asks the fanout to wake the actor at the next commit when something
    /// here waits on it: a batch to hand over, a reply, a creator.
    pub(super) fn wake_on_commit(&mut self, myself: &ActorRef<ConversationMsg>) {
        let Some(fanout) = &self.fanout else {
            return;
        };
        let wake = self.log.batch_len() > 0
            || self.log.has_waiting_replies()
            || self.pending_creator.is_some();
        if fanout.wake_on_commit(wake, self.log.committed()) {
            let _ = myself.cast(ConversationMsg::CommitSeen);
        }
    }

    /// A live attachment stops being sent commits by the fanout.
    pub(super) fn leave_fanout(&self, conn: ConnId) {
        if let Some(fanout) = &self.fanout {
            fanout.leave(conn);
        }
    }
}

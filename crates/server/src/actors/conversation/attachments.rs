//! Attachments as cursors over the log: attach, the replay task that
//! catches a cursor up, the switch to live, and detach.

use super::cursor::{self, AfterRound};
use super::*;
use crate::actors::replay::{AttachedFacts, Greeting};

/// How a connection asked to attach.
pub(super) struct AttachAsk {
    pub mode: Mode,
    pub last_seq: u64,
    /// Protocol §11: a compact replay.
    pub compact: bool,
    pub req: Option<ReqId>,
    pub announce: Announce,
}

impl State {
    pub(super) fn attach(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        conn: ConnectionHandle,
        ask: AttachAsk,
    ) {
        let AttachAsk {
            mode,
            last_seq,
            compact,
            req,
            announce,
        } = ask;
        if self.stopping.is_some() && announce == Announce::Created && self.log.committed() == 0 {
            self.refuse_creator_now(myself, conn, req);
            return;
        }
        if self.stopping.is_some() {
            conn.outbound.reply(&ServerFrame::error(
                req,
                ErrorCode::NotFound,
                "the conversation is stopping; attach again",
                Some(self.id.to_string()),
            ));
            conn.detached_by(&self.id, myself.get_id());
            return;
        }
        if announce == Announce::Created && self.log.committed() == 0 {
            self.pending_creator = Some(Box::new(PendingCreator { conn, mode, req }));
            return;
        }
        let conn_id = conn.id;
        self.leave_fanout(conn_id);
        if let Some(old) = self.attachments.remove(&conn_id) {
            old.stop_replay();
        }
        let head_seq = self.log.committed();
        let from = cursor::attach_from(last_seq, head_seq);
        let greeting = match announce {
            Announce::Created => Greeting::Created {
                req,
                conversation_id: self.id.to_string(),
            },
            Announce::Attached => Greeting::Attached(AttachedFacts {
                req,
                conversation_id: self.id.to_string(),
                status: self.status(),
                mode,
                head_seq,
                pending_calls: self
                    .turn
                    .as_ref()
                    .map(|t| t.pending_calls.clone())
                    .unwrap_or_default(),
                queued_messages: self.queue.len(),
                compact,
            }),
        };
        info!(conversation = %self.id, user = %self.user, connection = conn_id,
            attach_user = %conn.user, mode = mode.as_str(), last_seq, head_seq, "attached");
        self.attachments.insert(
            conn_id,
            Box::new(Attachment {
                conn,
                mode,
                cursor: Cursor::attaching(),
                cancel: None,
            }),
        );
        self.last_activity = Instant::now();
        // Published before the replay starts, so that anyone who has seen
        // this attachment's frames also sees it counted.
        self.publish_gauge();
        // A compact replay keeps every event of the turn running now; of
        // the turns before it (all finished), it leaves the deltas out.
        let compact = (compact && announce == Announce::Attached).then(|| Compact {
            running_turn: self.turn.as_ref().map(|t| t.id.clone()),
        });
        self.spawn_catch_up(myself, conn_id, from, Some(greeting), compact);
    }

    /// Starts (or restarts) a replay task for one attachment from `from` up
    /// to the committed head.
    pub(super) fn spawn_catch_up(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        conn_id: ConnId,
        from: u64,
        greeting: Option<Greeting>,
        compact: Option<Compact>,
    ) {
        // Taken out of the live stream before its round reads the head.
        self.leave_fanout(conn_id);
        let round = self.rounds.next();
        let to = self.log.committed();
        let from_buffer = self.log.buffer().since(from, to);
        let Some(attachment) = self.attachments.get_mut(&conn_id) else {
            return;
        };
        attachment.cursor.catch_up(round);
        if greeting.is_some() && from <= to {
            m::replay(if from_buffer.is_some() {
                "buffer"
            } else {
                "store"
            });
        }
        let job = Replay {
            conversation: myself.clone(),
            conversation_id: self.id.clone(),
            store: self.store.clone(),
            conn: attachment.conn.clone(),
            cancel: attachment
                .cancel
                .get_or_insert_with(CancellationToken::new)
                .clone(),
            generation: round,
            from,
            to,
            from_buffer,
            greeting,
            compact,
        };
        tokio::spawn(job.run());
    }

    pub(super) fn caught_up(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        conn_id: ConnId,
        generation: u64,
        next_seq: u64,
    ) {
        let Some(attachment) = self.attachments.get_mut(&conn_id) else {
            return;
        };
        let committed = self.log.committed();
        let after = attachment
            .cursor
            .round_ended(generation, next_seq, committed);
        match after {
            AfterRound::CatchUpFrom(from) => self.spawn_catch_up(myself, conn_id, from, None, None),
            AfterRound::Live => {
                // No round serves a live cursor: nothing is left to cancel.
                attachment.cancel = None;
                let joined = match &self.fanout {
                    Some(fanout) => fanout.join(conn_id, &attachment.conn.outbound, committed),
                    None => true,
                };
                if !joined {
                    // The fanout sent more since this message was taken in:
                    // another round, over what this connection missed.
                    self.take_in_commits(myself);
                    self.spawn_catch_up(myself, conn_id, committed + 1, None, None);
                }
            }
            AfterRound::Stale => {}
        }
    }

    pub(super) fn detach(&mut self, conn_id: ConnId, cause: DetachCause) {
        let Some(attachment) = self.remove_attachment(conn_id) else {
            return;
        };
        if let DetachCause::Client { req } = cause {
            attachment.conn.outbound.reply(&ServerFrame::Detached {
                req,
                conversation_id: self.id.to_string(),
                reason: crate::protocol::DetachReason::Client,
            });
        }
    }

    pub(super) fn remove_attachment(&mut self, conn_id: ConnId) -> Option<Box<Attachment>> {
        self.leave_fanout(conn_id);
        let attachment = self.attachments.remove(&conn_id)?;
        attachment.stop_replay();
        self.last_activity = Instant::now();
        info!(conversation = %self.id, user = %self.user, connection = conn_id,
            status = self.status().as_str(), attached = self.attachments.len(), "detached");
        Some(attachment)
    }
}

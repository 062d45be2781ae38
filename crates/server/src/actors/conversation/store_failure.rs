//! When the store cannot write (disk full, I/O error, a locked or corrupt
//! database): what was not committed is discarded, never sent; everyone who
//! waited on it hears `store_unavailable`; the running turn ends; and the
//! conversation retries with backoff until a write works, then goes on from
//! what is committed, with seq contiguous and never reused.
//!
//! Why discard rather than hold and retry the failed append: a client told
//! `store_unavailable` must be able to trust that nothing was recorded (the
//! protocol says so), and a retried append could record, later, a message
//! whose sender was told it failed. Discarding keeps that promise; the seq
//! numbers of discarded events were never sent to anyone, so assigning them
//! again reuses nothing a client saw.
//!
//! The turn that was running cannot continue (its output has nowhere to
//! go), so it is stopped; once the store works again its end is recorded as
//! `turn_finished {status: "failed", error}` naming the store, which is how
//! the history explains the gap. Queued messages that were committed run
//! after that.

use super::*;

/// The first retry comes after this long; each failure in a row doubles it
/// up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(5);

impl State {
    /// An append failed. Returns whether the actor stopped.
    pub(super) fn on_store_failure(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        error: crate::store::StoreError,
    ) -> bool {
        if let crate::store::StoreError::Fenced { .. } = &error {
            self.moved(myself, &error.to_string());
            return true;
        }
        m::store_append_failed();
        let committed = self.log.committed();
        let lost_from = committed + 1;
        let lost_to = self.log.last_assigned();
        warn!(conversation = %self.id, user = %self.user, error = %error,
            committed, lost_from, lost_to,
            "store append failed: discarding what was not committed");
        let message =
            format!("the store cannot write ({error}); nothing after seq {committed} was recorded");
        self.discard_uncommitted(myself, &message);

        // Nothing of the conversation exists: the creator is told so and
        // the actor goes (the supervisor forgets it as for any stop).
        self.refuse_creator(myself, &message);
        if self.log.committed() == 0 || self.stopping.is_some() {
            // Never created, or stopping anyway: its stop could not be
            // recorded, which the next activation explains (an open turn is
            // closed then) or start-up recovery does.
            self.stopping.get_or_insert(StopReason::Closed);
            self.finish_stop(myself);
            return true;
        }

        if let Some(turn) = self.turn.take() {
            turn.timeout.abort();
            self.session.stop_turn();
            info!(conversation = %self.id, user = %self.user, turn = %turn.id,
                "turn stopped: the store cannot record it");
        }
        for attachment in self.attachments.values() {
            attachment.conn.outbound.reply(&ServerFrame::error(
                None,
                ErrorCode::StoreUnavailable,
                format!(
                    "{message}; the running turn was stopped; retrying, and the history will \
                     say so once the store works again"
                ),
                Some(self.id.to_string()),
            ));
        }
        self.store_failure = Some(error.to_string().into());
        self.schedule_store_retry(myself);
        false
    }

    /// Cluster mode: another node owns the conversation now (this node's
    /// append was refused by the fence, or its lease was found lost). Nothing
    /// more may be written here, not even `agent_stopped`: what was not
    /// committed is dropped, the turn stops without a record (the new owner
    /// closes it), and every client is told `detached moved` to attach
    /// again, on any node.
    pub(super) fn moved(&mut self, myself: &ActorRef<ConversationMsg>, why: &str) {
        warn!(conversation = %self.id, user = %self.user, committed = self.log.committed(), why,
            "the conversation moved to another node: stopping it here without writing");
        let message = format!("this node no longer owns the conversation ({why})");
        self.discard_uncommitted(myself, &message);
        self.refuse_creator(myself, &message);
        self.cancel_timers();
        if let Some(turn) = self.turn.take() {
            turn.timeout.abort();
            self.session.stop_turn();
        }
        self.session.close();
        self.stopping = Some(StopReason::NodeLost);
        self.finish_stop(myself);
    }

    /// Tells a creator still waiting for the first commit that the
    /// conversation could not be created.
    fn refuse_creator(&mut self, myself: &ActorRef<ConversationMsg>, message: &str) {
        if self.log.committed() == 0 {
            self.creation_failed = Some(
                format!("the conversation could not be created: {message}; retry later").into(),
            );
        }
        if let Some(creator) = self.pending_creator.take() {
            self.refuse_creator_now(myself, creator.conn, creator.req);
        }
    }

    /// Answers a creator with why the first commit failed.
    pub(super) fn refuse_creator_now(
        &self,
        myself: &ActorRef<ConversationMsg>,
        conn: ConnectionHandle,
        req: Option<ReqId>,
    ) {
        let message = self
            .creation_failed
            .as_deref()
            .unwrap_or("the conversation could not be created; retry later");
        conn.outbound.reply(&ServerFrame::error(
            req,
            ErrorCode::StoreUnavailable,
            message,
            None,
        ));
        conn.detached_by(&self.id, myself.get_id());
    }

    /// Drops every event not committed and answers whoever waited on one.
    fn discard_uncommitted(&mut self, myself: &ActorRef<ConversationMsg>, message: &str) {
        // What the fanout sent is committed and must not be discarded; from
        // here every outcome reaches the actor.
        self.close_fanout(myself);
        let discarded = self.log.discard();
        self.credits.add_permits(discarded.credits);
        for reply in discarded.replies {
            self.refuse(
                reply.conn,
                reply.req,
                ErrorCode::StoreUnavailable,
                format!("{message}; retry later"),
            );
        }
        // What these held may name discarded events: they are read back
        // from the store before the conversation goes on.
        self.queue.clear();
        self.seen_msg_ids = MsgIdLedger::default();
    }

    fn schedule_store_retry(&mut self, myself: &ActorRef<ConversationMsg>) {
        let wait = RETRY_FIRST
            .saturating_mul(1 << self.failed_attempts.min(16))
            .min(RETRY_MAX);
        self.failed_attempts += 1;
        ractor::time::send_after(wait, myself.get_cell(), || ConversationMsg::RetryStore);
    }

    /// Probes the store and, if it writes again, reads back the committed
    /// state (`Reloaded`).
    pub(super) fn retry_store(&mut self, myself: &ActorRef<ConversationMsg>) {
        if self.store_failure.is_none() {
            return;
        }
        let store = self.store.clone();
        let id = self.id.clone();
        let config = self.config.get();
        let tail = config.conversations.replay_buffer_events;
        let window = config.conversations.client_msg_id_window;
        let me = myself.clone();
        tokio::spawn(async move {
            let result = match store.probe().await {
                Ok(()) => store
                    .snapshot(&id, tail, window)
                    .await
                    .map(|s| s.map(Box::new)),
                Err(e) => Err(e),
            };
            let _ = me.cast(ConversationMsg::Reloaded(result));
        });
    }

    /// Goes on from the committed state once the store writes again.
    /// Returns whether the actor stopped.
    pub(super) fn on_reloaded(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        result: Result<Option<Box<Snapshot>>, crate::store::StoreError>,
    ) -> bool {
        if self.store_failure.is_none() {
            return false;
        }
        let snapshot = match result {
            Ok(Some(snapshot)) => snapshot,
            Ok(None) => {
                // Deleted meanwhile.
                self.stopping.get_or_insert(StopReason::Deleted);
                self.finish_stop(myself);
                return true;
            }
            Err(e) => {
                debug!(conversation = %self.id, error = %e, "the store still cannot write");
                self.schedule_store_retry(myself);
                return false;
            }
        };
        let failure = self.store_failure.take().unwrap_or_default();
        let meta = &snapshot.meta;
        info!(conversation = %self.id, user = %self.user, head_seq = meta.head_seq,
            "the store writes again: going on from what was committed");
        // The store may hold more than we saw committed: a write whose
        // outcome was lost (a timeout after the data was written). Those
        // events were never sent; the buffer is refilled from the store and
        // every live connection catches up over them, so nobody has a gap.
        let previous = self.log.reset_to(meta.head_seq, snapshot.tail.clone());
        if meta.head_seq > previous {
            let live: Vec<ConnId> = self
                .attachments
                .iter()
                .filter(|(_, a)| a.cursor.is_live())
                .map(|(id, _)| *id)
                .collect();
            for conn in live {
                self.spawn_catch_up(myself, conn, previous + 1, None, None);
            }
        }
        self.queue = snapshot.queued.iter().cloned().collect();
        let window = self.config.get().conversations.client_msg_id_window;
        self.seen_msg_ids = MsgIdLedger::restored(snapshot.client_msg_ids.clone(), window);
        self.last_turn_message_seq = meta.last_turn_message_seq;
        self.close_orphaned_turn(
            meta,
            TurnStatus::Failed,
            &format!("the store could not record this turn ({failure}); it was stopped"),
        );
        self.start_next_turn(myself);
        false
    }

    /// A turn the stored state says is running, while no turn runs here:
    /// its actor died, or the store failed, before its end was recorded.
    pub(super) fn close_orphaned_turn(
        &mut self,
        meta: &crate::store::ConversationMeta,
        status: TurnStatus,
        why: &str,
    ) {
        let open = matches!(meta.status, Status::Running | Status::Waiting);
        if let (true, None, Some(turn_id)) = (open, &self.turn, &meta.current_turn_id) {
            m::turn_finished(status);
            self.append(EventData::TurnFinished {
                turn_id: turn_id.as_str().into(),
                status,
                error: Some(why.to_owned()),
            });
        }
    }

    /// While the store cannot write, requests that would append are
    /// answered at once: nothing is recorded.
    pub(super) fn refuse_while_store_fails(&self, message: &ConversationMsg) -> bool {
        let Some((conn, req)) = message.recording_request() else {
            return false;
        };
        let failure = self.store_failure.as_deref().unwrap_or("");
        self.refuse(
            conn,
            req,
            ErrorCode::StoreUnavailable,
            format!("the store cannot write now ({failure}); nothing was recorded, retry later"),
        );
        true
    }
}

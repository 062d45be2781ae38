//! The conversation's own lifecycle: the stop sequence (record why, wait
//! for the commit, detach everyone) and the timers of its rules.

use super::*;

impl State {
    /// Ends the turn, records `agent_stopped`, and waits for the commit
    /// before detaching everyone and stopping (`finish_stop`).
    pub(super) fn begin_stop(&mut self, myself: &ActorRef<ConversationMsg>, reason: StopReason) {
        if self.stopping.is_some() {
            return;
        }
        self.cancel_timers();
        // Set first: ending the turn must not start a queued one. Queued
        // messages stay recorded and run when the conversation comes back.
        self.stopping = Some(reason);
        if self.turn.is_some() {
            self.session.stop_turn();
            let status = if reason == StopReason::Shutdown {
                TurnStatus::Interrupted
            } else {
                TurnStatus::Stopped
            };
            self.end_turn(myself, status, None);
        }
        self.session.close();
        self.append(EventData::AgentStopped { reason });
        self.flush(myself);
    }

    pub(super) fn finish_stop(&mut self, myself: &ActorRef<ConversationMsg>) {
        let Some(reason) = self.stopping else {
            return;
        };
        let detach_reason = reason.detach_reason();
        for (conn_id, attachment) in self.attachments.drain() {
            attachment.cancel.cancel();
            self.departed.insert(conn_id, attachment.conn.clone());
            attachment.conn.outbound.reply(&ServerFrame::Detached {
                req: None,
                conversation_id: self.id.to_string(),
                reason: detach_reason,
            });
            let _ = attachment.conn.actor.cast(ConnectionMsg::DetachedBy {
                conversation_id: self.id.clone(),
                actor: myself.get_id(),
            });
        }
        self.gauge.set_stopped();
        // Drain, not stop: requests already in the mailbox are answered
        // (refused: the conversation is stopping) rather than dropped, and
        // the supervisor logs the reason it stopped us for.
        if myself.drain().is_err() {
            myself.stop(Some(reason.as_str().to_owned()));
        }
    }

    pub(super) fn cancel_timers(&mut self) {
        if let Some((_, t)) = self.idle_timer.take() {
            t.abort();
        }
        if let Some((_, t)) = self.grace_timer.take() {
            t.abort();
        }
    }

    /// Arms or disarms the detach-grace and idle timers to match the state.
    /// One timer per rule per conversation, owned here: no global scan.
    pub(super) fn rearm_timers(&mut self, myself: &ActorRef<ConversationMsg>) {
        let detached_turn = self.turn.is_some() && self.attachments.is_empty();
        match (&self.grace_timer, detached_turn) {
            (None, true) => {
                self.next_generation += 1;
                let generation = self.next_generation;
                let handle = ractor::time::send_after(
                    self.config.conversations.detach_grace,
                    myself.get_cell(),
                    move || ConversationMsg::DetachGraceOver { generation },
                );
                self.grace_timer = Some((generation, handle));
            }
            (Some(_), false) => {
                if let Some((_, t)) = self.grace_timer.take() {
                    t.abort();
                }
            }
            _ => {}
        }
        let idle = self.is_idle_detached();
        match (&self.idle_timer, idle) {
            (None, true) => {
                self.next_generation += 1;
                let generation = self.next_generation;
                let wait = self
                    .close_delay
                    .saturating_sub(self.last_activity.elapsed());
                let handle = ractor::time::send_after(wait, myself.get_cell(), move || {
                    ConversationMsg::IdleCheck { generation }
                });
                self.idle_timer = Some((generation, handle));
            }
            (Some(_), false) => {
                if let Some((_, t)) = self.idle_timer.take() {
                    t.abort();
                }
            }
            _ => {}
        }
    }

    pub(super) fn on_turn_timeout(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        turn_id: Arc<str>,
    ) {
        if self.turn.as_ref().is_none_or(|t| t.id != turn_id) {
            return;
        }
        let limit = humantime::format_duration(self.config.agent.turn_timeout);
        info!(conversation = %self.id, user = %self.user, turn = %turn_id,
            rule = "turn_timeout", timeout = %limit, "turn timed out");
        self.session.stop_turn();
        self.end_turn(
            myself,
            TurnStatus::Failed,
            Some(format!(
                "the turn timed out after {limit} (agent.turn_timeout)"
            )),
        );
    }

    pub(super) fn on_detach_grace_over(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        generation: u64,
    ) {
        if self
            .grace_timer
            .as_ref()
            .is_none_or(|(g, _)| *g != generation)
        {
            return;
        }
        self.grace_timer = None;
        if self.turn.is_some() && self.attachments.is_empty() {
            let grace = humantime::format_duration(self.config.conversations.detach_grace);
            info!(conversation = %self.id, user = %self.user,
                rule = "detach_grace", detach_grace = %grace,
                "turn abandoned: nobody attached");
            // Queued messages stay queued: they were recorded, and each of
            // their turns gets its own grace.
            self.session.stop_turn();
            self.end_turn(myself, TurnStatus::Abandoned, None);
        }
    }

    /// The idle timer ran out: if still idle and detached, ask the
    /// supervisor (which decides stops) to close it.
    pub(super) fn on_idle_check(&mut self, generation: u64) {
        if self
            .idle_timer
            .as_ref()
            .is_none_or(|(g, _)| *g != generation)
        {
            return;
        }
        self.idle_timer = None;
        let idle_for = self.last_activity.elapsed();
        if self.is_idle_detached() && idle_for >= self.close_delay {
            let _ = self.supervisor.cast(SupervisorMsg::IdleExpired {
                id: self.id.clone(),
                idle_for,
                close_delay: self.close_delay,
            });
        }
    }
}

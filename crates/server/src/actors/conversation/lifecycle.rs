//! The conversation's own lifecycle: the stop sequence (record why, wait
//! for the commit, detach everyone) and the timers of its rules.
//!
//! Each rule reads its duration from the running configuration when its
//! timer is armed and again when it fires; a reload re-arms every armed
//! timer for what is left under the new value (`reconfigure`).

use serde_json::json;

use super::*;

fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64)
}

/// Arms `timer` to send this actor `message(generation)` after `wait`.
fn arm(
    timer: &mut RuleTimer,
    myself: &ActorRef<ConversationMsg>,
    since: Instant,
    wait: Duration,
    message: fn(u64) -> ConversationMsg,
) {
    let cell = myself.get_cell();
    timer.arm(since, |generation| {
        ractor::time::send_after(wait, cell, move || message(generation)).abort_handle()
    });
}

impl State {
    /// Ends the turn, records `agent_stopped`, and waits for the commit
    /// before detaching everyone and stopping (`finish_stop`).
    pub(super) fn begin_stop(&mut self, myself: &ActorRef<ConversationMsg>, reason: StopReason) {
        if self.stopping.is_some() {
            return;
        }
        // The stop's commits must each reach the actor (the last one ends it).
        self.close_fanout(myself);
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
        self.close_fanout(myself);
        for (_, attachment) in self.attachments.drain() {
            attachment.stop_replay();
            self.departed.push(attachment.conn.clone());
            attachment.conn.outbound.reply(&ServerFrame::Detached {
                req: None,
                conversation_id: self.id.to_string(),
                reason: detach_reason,
            });
            attachment.conn.detached_by(&self.id, myself.get_id());
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
        self.idle_timer.disarm();
        self.grace_timer.disarm();
    }

    /// The idle close delay: the conversation's own (capped by
    /// `conversations.max_close_delay`) or `conversations.close_delay`,
    /// as configured now.
    pub(super) fn close_delay(&self) -> Duration {
        let config = self.config.get();
        match self.own_close_delay {
            Some(own) => own.min(config.conversations.max_close_delay),
            None => config.conversations.close_delay,
        }
    }

    /// The configuration changed: every armed rule timer is armed again
    /// for what is left of its condition under the new durations (a
    /// condition already older than the new duration fires at once).
    pub(super) fn reconfigure(&mut self, myself: &ActorRef<ConversationMsg>) {
        if self.stopping.is_some() {
            return;
        }
        self.idle_timer.disarm();
        if let Some(since) = self.grace_timer.disarm() {
            self.arm_grace(myself, since);
        }
        self.arm_turn_timeout(myself);
        self.rearm_timers(myself);
    }

    fn arm_grace(&mut self, myself: &ActorRef<ConversationMsg>, since: Instant) {
        let wait = self
            .config
            .get()
            .conversations
            .detach_grace
            .saturating_sub(since.elapsed());
        arm(&mut self.grace_timer, myself, since, wait, |generation| {
            ConversationMsg::DetachGraceOver { generation }
        });
    }

    /// (Re-)arms the running turn's timeout for what is left of
    /// `agent.turn_timeout` since it started.
    pub(super) fn arm_turn_timeout(&mut self, myself: &ActorRef<ConversationMsg>) {
        let timeout = self.config.get().agent.turn_timeout;
        let Some(turn) = self.turn.as_mut() else {
            return;
        };
        turn.timeout.abort();
        let wait = timeout.saturating_sub(turn.started.elapsed());
        let turn_id = turn.id.clone();
        turn.timeout = ractor::time::send_after(wait, myself.get_cell(), move || {
            ConversationMsg::TurnTimeout { turn_id }
        });
    }

    /// Arms or disarms the detach-grace and idle timers to match the state.
    /// One timer per rule per conversation, owned here: no global scan.
    pub(super) fn rearm_timers(&mut self, myself: &ActorRef<ConversationMsg>) {
        let detached_turn = self.turn.is_some() && self.attachments.is_empty();
        match (self.grace_timer.is_armed(), detached_turn) {
            (false, true) => self.arm_grace(myself, Instant::now()),
            (true, false) => {
                self.grace_timer.disarm();
            }
            _ => {}
        }
        let idle = self.is_idle_detached();
        match (self.idle_timer.is_armed(), idle) {
            (false, true) => {
                let wait = self
                    .close_delay()
                    .saturating_sub(self.last_activity.elapsed());
                arm(
                    &mut self.idle_timer,
                    myself,
                    self.last_activity,
                    wait,
                    |generation| ConversationMsg::IdleCheck { generation },
                );
            }
            (true, false) => {
                self.idle_timer.disarm();
            }
            _ => {}
        }
    }

    pub(super) fn on_turn_timeout(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        turn_id: Arc<str>,
    ) {
        let Some(turn) = self.turn.as_ref().filter(|t| t.id == turn_id) else {
            return;
        };
        let timeout = self.config.get().agent.turn_timeout;
        let ran_for = turn.started.elapsed();
        if ran_for < timeout {
            // A timer armed before `agent.turn_timeout` grew: wait for the rest.
            self.arm_turn_timeout(myself);
            return;
        }
        let limit = humantime::format_duration(timeout);
        info!(conversation = %self.id, user = %self.user, turn = %turn_id,
            rule = "turn_timeout", timeout = %limit, "turn timed out");
        self.decisions.record(NewDecision {
            rule: "turn_timeout",
            conversation: Some(&self.id),
            user: Some(&self.user),
            inputs: json!({
                "turn": &*turn_id,
                "turn_timeout": limit.to_string(),
                "ran_for": humantime::format_duration(round_ms(ran_for)).to_string(),
            }),
            outcome: "failed",
        });
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
        if !self.grace_timer.fire(generation) {
            return;
        }
        if self.turn.is_some() && self.attachments.is_empty() {
            let grace = humantime::format_duration(self.config.get().conversations.detach_grace);
            info!(conversation = %self.id, user = %self.user,
                rule = "detach_grace", detach_grace = %grace,
                "turn abandoned: nobody attached");
            self.decisions.record(NewDecision {
                rule: "detach_grace",
                conversation: Some(&self.id),
                user: Some(&self.user),
                inputs: json!({
                    "turn": self.turn.as_ref().map(|t| t.id.to_string()),
                    "detach_grace": grace.to_string(),
                    "attached": 0,
                }),
                outcome: "abandoned",
            });
            // Queued messages stay queued: they were recorded, and each of
            // their turns gets its own grace.
            self.session.stop_turn();
            self.end_turn(myself, TurnStatus::Abandoned, None);
        }
    }

    /// The idle timer ran out: if still idle and detached, ask the
    /// supervisor (which decides stops) to close it.
    pub(super) fn on_idle_check(&mut self, generation: u64) {
        if !self.idle_timer.fire(generation) {
            return;
        }
        let idle_for = self.last_activity.elapsed();
        let close_delay = self.close_delay();
        if self.is_idle_detached() && idle_for >= close_delay {
            let _ = self.supervisor.cast(SupervisorMsg::IdleExpired {
                id: self.id.clone(),
                idle_for,
                close_delay,
            });
        }
    }
}

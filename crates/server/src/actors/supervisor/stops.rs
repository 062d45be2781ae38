//! Stopping conversations and what follows: a stop for a rule (request,
//! idle close, user limit, delete, shutdown) is recorded as a decision and
//! sent to the actor; once the child is gone (`child_gone`) its waiters are
//! answered, its lease given back, and activations queued behind the stop
//! (or the delete waiting for it) go on.

use std::sync::Arc;
use std::time::Duration;

use ractor::{ActorId, ActorRef, RpcReplyPort};
use serde_json::json;
use tracing::{error, info, warn};

use super::calls::ActivateError;
use super::cluster::spawn_stop_on_owner;
use super::{State, SupervisorMsg};
use crate::actors::conversation::ConversationMsg;
use crate::actors::supervision_log::NewDecision;
use crate::cluster::remote::wire::StopKind;
use crate::metrics as m;
use crate::protocol::{Status, StopReason};

impl State {
    /// A `Stop` request: stopped here if it runs here, on its owner if
    /// this node only holds a stand-in for it; `reply` once it has.
    pub(super) fn stop_requested(
        &mut self,
        id: Arc<str>,
        reason: StopReason,
        reply: Option<RpcReplyPort<()>>,
    ) {
        if let Some((cluster, owner)) = self.owner_elsewhere(&id) {
            let kind = match reason {
                StopReason::Deleted => StopKind::Deleted,
                _ => StopKind::Closed,
            };
            spawn_stop_on_owner(cluster, owner, id, kind, reply);
        } else if self.active.contains_key(&id) {
            if let Some(reply) = reply {
                self.stop_waiters.entry(id.clone()).or_default().push(reply);
            }
            self.stop(&id, reason, "request", json!({}));
        } else if let Some(reply) = reply {
            let _ = reply.send(());
        }
    }

    /// A conversation's idle timer ran out: stopped if it is still idle
    /// with nobody attached (the gauge says so now; the timer's view may
    /// be a message old).
    pub(super) fn idle_expired(
        &mut self,
        id: &Arc<str>,
        idle_for: Duration,
        close_delay: Duration,
    ) {
        let Some(entry) = self.active.get(id) else {
            return;
        };
        if entry.stopping.is_some()
            || entry.gauge.attached() != 0
            || entry.gauge.status() != Status::Idle
        {
            return;
        }
        let idle_for = humantime::format_duration(round_ms(idle_for));
        let close_delay = humantime::format_duration(close_delay);
        info!(conversation = %id, user = %entry.user, rule = "idle_close",
            reason = "idle", idle_for = %idle_for, close_delay = %close_delay,
            "stopping idle conversation");
        let inputs = json!({
            "idle_for": idle_for.to_string(),
            "close_delay": close_delay.to_string(),
            "attached": 0,
            "status": "idle",
        });
        self.stop(id, StopReason::Idle, "idle_close", inputs);
    }

    /// Stops an active conversation for `rule`, recording the decision
    /// with the `inputs` the rule looked at (a JSON object).
    pub(super) fn stop(
        &mut self,
        id: &Arc<str>,
        reason: StopReason,
        rule: &'static str,
        mut inputs: serde_json::Value,
    ) {
        let Some(entry) = self.active.get_mut(id) else {
            return;
        };
        if entry.stopping.is_some() {
            return;
        }
        entry.stopping = Some(reason);
        info!(conversation = %id, user = %entry.user, rule, reason = reason.as_str(),
            status = entry.gauge.status().as_str(), attached = entry.gauge.attached(),
            "stopping conversation");
        if let Some(fields) = inputs.as_object_mut() {
            fields.insert("reason".into(), reason.as_str().into());
            fields
                .entry("status")
                .or_insert_with(|| entry.gauge.status().as_str().into());
            fields
                .entry("attached")
                .or_insert_with(|| entry.gauge.attached().into());
        }
        self.decisions.record(NewDecision {
            rule,
            conversation: Some(id),
            user: Some(&entry.user),
            inputs,
            outcome: "stopped",
        });
        m::conversation_stopped(reason);
        if entry
            .actor
            .cast(ConversationMsg::Shutdown { reason })
            .is_err()
        {
            warn!(conversation = %id, "conversation actor already gone");
        }
    }

    /// A conversation actor stopped or failed: forgotten, logged as a
    /// supervision line, and whoever waited for it goes on.
    pub(super) fn child_gone(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        actor: ActorId,
        reason: Option<String>,
        failure: Option<String>,
    ) {
        let Some(id) = self.by_actor.remove(&actor) else {
            return;
        };
        let entry = self.active.remove(&id);
        let user = entry
            .as_ref()
            .map(|e| e.user.to_string())
            .unwrap_or_default();
        // A conversation drains its mailbox before it stops, which carries
        // no reason: the one it was stopped for is here.
        let reason = reason.or_else(|| {
            entry
                .as_ref()
                .and_then(|e| e.stopping)
                .map(|r| r.as_str().to_owned())
        });
        let lived = entry.as_ref().map(|e| round_ms(e.started.elapsed()));
        let lived = lived
            .map(|d| humantime::format_duration(d).to_string())
            .unwrap_or_default();
        if let Some(err) = &failure {
            self.decisions.record(NewDecision {
                rule: "actor_failed",
                conversation: Some(&id),
                user: Some(&user),
                inputs: json!({ "error": err, "lived": lived }),
                outcome: "removed",
            });
        }
        match &failure {
            Some(err) => error!(conversation = %id, user = %user, actor = %actor, error = %err,
                lived = %lived, "conversation actor failed"),
            None => info!(conversation = %id, user = %user, actor = %actor,
                reason = %reason.as_deref().unwrap_or("none"), lived = %lived,
                "conversation actor stopped"),
        }
        for reply in self.stop_waiters.remove(&id).unwrap_or_default() {
            let _ = reply.send(());
        }
        // Reactivated at once, the lease is kept for the next actor.
        if !self.after_stop.contains_key(&id) {
            self.release(&id);
        }
        if self.deleting.contains_key(&id) {
            for waiter in self.after_stop.remove(&id).unwrap_or_default() {
                let _ = waiter.reply.send(Err(ActivateError::NotFound));
            }
            self.start_deleting(myself, id.clone());
        } else if let Some(waiters) = self.after_stop.remove(&id) {
            for waiter in waiters {
                self.load(myself, id.clone(), waiter);
            }
        }
        self.maybe_finish_shutdown();
    }

    /// Stops every conversation (stand-ins included) and refuses every
    /// waiting activation; `reply` once no conversation is left.
    pub(super) fn shut_down(&mut self, reply: RpcReplyPort<()>) {
        info!(
            active = self.active.len(),
            "shutting down every conversation"
        );
        self.shutdown.get_or_insert_with(Vec::new).push(reply);
        let ids: Vec<Arc<str>> = self.active.keys().cloned().collect();
        for id in ids {
            self.stop(&id, StopReason::Shutdown, "shutdown", json!({}));
        }
        for (proxy, _) in self.proxies.values() {
            let _ = proxy.cast(ConversationMsg::Shutdown {
                reason: StopReason::Shutdown,
            });
        }
        for (_, waiters) in self
            .loading
            .drain()
            .chain(self.after_stop.drain())
            .chain(self.recovering.drain())
        {
            for waiter in waiters {
                let _ = waiter.reply.send(Err(ActivateError::ShuttingDown));
            }
        }
        self.maybe_finish_shutdown();
    }

    fn maybe_finish_shutdown(&mut self) {
        if self.active.is_empty() {
            if let Some(replies) = self.shutdown.as_mut() {
                for reply in replies.drain(..) {
                    let _ = reply.send(());
                }
            }
        }
    }
}

/// Durations in logs and decisions, to the millisecond.
fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64)
}

//! The per-user limit (protocol §6), counted here in the supervisor's
//! single-threaded state so that two activations at the same instant are
//! decided one after the other. Which conversations go is
//! [`eviction::plan`]'s choice; this module reads the gauges for it, then
//! carries the plan out: logs, records and stops each victim (on its own
//! node in cluster mode).

use std::sync::Arc;

use serde_json::json;
use tracing::info;

use super::calls::ActivateError;
use super::cluster::spawn_stop_on_owner;
use super::State;
use crate::actors::eviction::{self, Candidate, Eviction, Refusal};
use crate::actors::supervision_log::NewDecision;
use crate::cluster::lease::Activity;
use crate::cluster::remote::wire::StopKind;
use crate::protocol::StopReason;

impl State {
    /// `user`'s conversations active on this node and not stopping.
    pub(super) fn active_count(&self, user: &str) -> usize {
        self.active
            .of_user(user)
            .filter(|(_, e)| e.stopping.is_none())
            .count()
    }

    /// Makes room for one more active conversation of `user`: with
    /// `on_limit = "evict"`, stops the ones chosen by protocol §6 (in cluster
    /// mode possibly one another node runs, from `others`: that node stops
    /// it); with `"reject"`, refuses.
    pub(super) fn make_room(
        &mut self,
        user: &Arc<str>,
        activating: Option<&Arc<str>>,
        others: Vec<Activity>,
    ) -> Result<(), ActivateError> {
        let config = self.config.get();
        let max = config.conversations.max_per_user;
        if max == 0 {
            return Ok(());
        }
        let others: Vec<Candidate> = others
            .into_iter()
            .filter(|a| activating.is_none_or(|id| **id != *a.conversation))
            .map(Candidate::from)
            .collect();
        let active_for_user = self.active_count(user) + others.len();
        let mut candidates: Vec<Candidate> = self
            .active
            .of_user(user)
            .filter(|(id, e)| e.stopping.is_none() && Some(*id) != activating)
            .map(|(id, e)| Candidate::local(id.clone(), &e.gauge))
            .collect();
        candidates.extend(others);
        let plan = eviction::plan(
            active_for_user,
            max,
            config.conversations.on_limit,
            candidates,
        );
        for eviction in plan.evict {
            self.evict(user, activating, max, eviction);
        }
        match plan.refused {
            None => Ok(()),
            Some(Refusal::NothingToEvict) => Err(ActivateError::LimitReached { max }),
            Some(Refusal::Rejected { active_for_user }) => {
                info!(user = %user, rule = "user_limit", decision = "reject",
                    active_for_user, max_per_user = max,
                    "activation refused: the user is at the limit");
                self.decisions.record(NewDecision {
                    rule: "user_limit",
                    conversation: activating.map(|id| &**id),
                    user: Some(user),
                    inputs: json!({
                        "active_for_user": active_for_user,
                        "max_per_user": max,
                        "on_limit": "reject",
                    }),
                    outcome: "refused",
                });
                Err(ActivateError::LimitReached { max })
            }
        }
    }

    /// Stops one victim of the per-user limit, here or on its node.
    fn evict(
        &mut self,
        user: &Arc<str>,
        activating: Option<&Arc<str>>,
        max: usize,
        eviction: Eviction,
    ) {
        let Eviction {
            victim,
            active_for_user,
        } = eviction;
        info!(conversation = %victim.id, user = %user, rule = "user_limit", reason = "user_limit",
            class = victim.class_name(), running = victim.running, attached = victim.attached,
            node = victim.node.as_deref().unwrap_or("here"),
            active_for_user, max_per_user = max,
            "evicting the least recently active conversation");
        let inputs = json!({
            "class": victim.class_name(),
            "running": victim.running,
            "attached": victim.attached,
            "node": victim.node.as_deref().unwrap_or("here"),
            "active_for_user": active_for_user,
            "max_per_user": max,
            "activating": activating.map(|id| &**id),
        });
        match (victim.node, &self.cluster) {
            (Some(node), Some(cluster)) => {
                self.decisions.record(NewDecision {
                    rule: "user_limit",
                    conversation: Some(&victim.id),
                    user: Some(user),
                    inputs,
                    outcome: "stopped on its node",
                });
                spawn_stop_on_owner(cluster.clone(), node, victim.id, StopKind::UserLimit, None);
            }
            _ => self.stop(&victim.id, StopReason::UserLimit, "user_limit", inputs),
        }
    }
}

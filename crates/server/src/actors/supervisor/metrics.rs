//! What the supervisor reports about the conversations it runs: the
//! Prometheus gauges (active conversations by status, attached
//! connections) and the operators' list (`GET /v1/admin/conversations`),
//! both read from each conversation's gauge without asking it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::State;
use crate::actors::active_view::{self, ActiveConversation};
use crate::metrics as m;
use crate::protocol::Status;

/// How often the supervisor refreshes the active-conversation gauges: by a
/// timer at least this often, and after its messages at most four times as
/// often. Reading every conversation's gauge is O(active conversations), so
/// doing it after every message made a storm of N reconnects O(N²).
pub const METRICS_EVERY: Duration = Duration::from_millis(1000);

impl State {
    /// Every conversation active on this node, by user then id.
    pub(super) fn list_active(&self) -> Vec<ActiveConversation> {
        let node = self.cluster.as_ref().map(|c| c.node.as_str());
        let mut list: Vec<ActiveConversation> = self
            .active
            .iter()
            .map(|(id, e)| {
                active_view::view(id, &e.user, &e.gauge, e.stopping, e.started.elapsed(), node)
            })
            .collect();
        list.sort_by(|a, b| a.user.cmp(&b.user).then_with(|| a.id.cmp(&b.id)));
        list
    }

    /// Publishes the gauges unless that was done less than a quarter of
    /// [`METRICS_EVERY`] ago.
    pub(super) fn publish_metrics(&mut self) {
        let now = Instant::now();
        if self
            .metrics_published
            .is_some_and(|at| now.duration_since(at) < METRICS_EVERY / 4)
        {
            return;
        }
        self.metrics_published = Some(now);
        let mut counts: HashMap<Status, usize> = HashMap::new();
        let mut attached = 0;
        for entry in self.active.values() {
            *counts.entry(entry.gauge.status()).or_default() += 1;
            attached += entry.gauge.attached();
        }
        for status in [Status::Running, Status::Waiting, Status::Idle] {
            m::active_conversations(status, counts.get(&status).copied().unwrap_or(0));
        }
        m::attached_connections(attached);
    }
}

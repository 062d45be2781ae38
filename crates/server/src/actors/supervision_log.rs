//! The recent supervision decisions, in memory, for operators
//! (`GET /v1/admin/supervision`, `linger top`): each rule that acted, the
//! inputs it looked at and what it did. A bounded ring: the newest
//! [`CAPACITY`] decisions, numbered from 1 in the order they were taken,
//! so a reader asks for those after the last number it saw.
//!
//! The log lines (README, "Reading the supervision log") say the same and
//! are the durable record; this ring is what a running server can show.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::event::now_rfc3339;

/// Most decisions kept.
pub const CAPACITY: usize = 1000;

/// One decision as recorded.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Decision {
    /// 1, 2, … in the order decisions were taken (never reused while the
    /// process runs).
    pub seq: u64,
    /// When, RFC 3339 UTC with milliseconds.
    #[schema(example = "2026-11-30T10:04:31.870Z")]
    pub at: String,
    /// The rule that acted: `user_limit`, `idle_close`, `detach_grace`,
    /// `turn_timeout`, `request`, `shutdown`, `lease_lost`,
    /// `actor_failed`, `config_reload`.
    #[schema(value_type = String, example = "idle_close")]
    pub rule: &'static str,
    pub conversation: Option<String>,
    pub user: Option<String>,
    /// What the rule looked at (a JSON object).
    #[schema(value_type = Object)]
    pub inputs: Value,
    /// What it did: `stopped`, `refused`, `abandoned`, `failed`,
    /// `removed`, `applied`, `invalid`, ….
    #[schema(example = "stopped")]
    pub outcome: String,
}

/// A decision about to be recorded.
pub struct NewDecision<'a> {
    pub rule: &'static str,
    pub conversation: Option<&'a str>,
    pub user: Option<&'a str>,
    pub inputs: Value,
    pub outcome: &'a str,
}

/// What a reader gets: the decisions after the number it gave.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(as = SupervisionPage)]
pub struct Page {
    /// Oldest first.
    pub decisions: Vec<Decision>,
    /// The number of the newest decision taken (0: none yet); ask again
    /// with `since` = this.
    pub head: u64,
    /// The oldest number still held; older ones were dropped (a reader
    /// whose `since` + 1 is below it missed some).
    pub oldest: u64,
}

#[derive(Default)]
struct Ring {
    last_seq: u64,
    decisions: VecDeque<Decision>,
}

/// The ring; shared by the supervisor, the conversations and the reloader.
#[derive(Default)]
pub struct SupervisionLog {
    ring: Mutex<Ring>,
}

impl SupervisionLog {
    /// Records a decision; returns its number.
    pub fn record(&self, decision: NewDecision<'_>) -> u64 {
        let mut ring = self.lock();
        ring.last_seq += 1;
        let seq = ring.last_seq;
        if ring.decisions.len() == CAPACITY {
            ring.decisions.pop_front();
        }
        ring.decisions.push_back(Decision {
            seq,
            at: now_rfc3339(),
            rule: decision.rule,
            conversation: decision.conversation.map(str::to_owned),
            user: decision.user.map(str::to_owned),
            inputs: decision.inputs,
            outcome: decision.outcome.to_owned(),
        });
        seq
    }

    /// The decisions numbered after `since`, oldest first, at most `limit`
    /// (the oldest of them: page on with the last number).
    pub fn since(&self, since: u64, limit: usize) -> Page {
        let ring = self.lock();
        let oldest = ring.decisions.front().map_or(ring.last_seq + 1, |d| d.seq);
        // Numbers are consecutive in the ring: skip straight to `since`.
        let skip = since.saturating_add(1).saturating_sub(oldest) as usize;
        let decisions = ring
            .decisions
            .iter()
            .skip(skip)
            .take(limit)
            .cloned()
            .collect();
        Page {
            decisions,
            head: ring.last_seq,
            oldest,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        // A panic while recording leaves a consistent ring: go on with it.
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn decide(log: &SupervisionLog, n: u64) -> u64 {
        log.record(NewDecision {
            rule: "idle_close",
            conversation: Some("c_1"),
            user: Some("alice"),
            inputs: json!({ "n": n }),
            outcome: "stopped",
        })
    }

    #[test]
    fn numbers_decisions_and_pages_from_since() {
        let log = SupervisionLog::default();
        let empty = log.since(0, 10);
        assert!(empty.decisions.is_empty());
        assert_eq!((empty.head, empty.oldest), (0, 1));
        for n in 1..=5 {
            assert_eq!(decide(&log, n), n);
        }
        let page = log.since(2, 2);
        let seqs: Vec<u64> = page.decisions.iter().map(|d| d.seq).collect();
        assert_eq!(seqs, [3, 4]);
        assert_eq!((page.head, page.oldest), (5, 1));
        assert!(log.since(5, 10).decisions.is_empty());
        assert!(log.since(99, 10).decisions.is_empty());
    }

    #[test]
    fn keeps_only_the_newest() {
        let log = SupervisionLog::default();
        for n in 1..=(CAPACITY as u64 + 10) {
            decide(&log, n);
        }
        let page = log.since(0, usize::MAX);
        assert_eq!(page.decisions.len(), CAPACITY);
        assert_eq!(page.oldest, 11);
        assert_eq!(page.decisions[0].seq, 11);
        assert_eq!(page.head, CAPACITY as u64 + 10);
        let tail = log.since(CAPACITY as u64 + 8, 10);
        assert_eq!(tail.decisions.len(), 2);
    }
}

//! Which of a user's active conversations makes room for one more
//! (protocol §6): a pure function over what the supervisor knows of each,
//! from its gauge here or, in cluster mode, from the activity other nodes
//! publish with their leases.

use std::sync::Arc;

/// One active conversation of the user, as eviction sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub id: Arc<str>,
    /// A turn is running or waiting on a client tool.
    pub running: bool,
    /// At least one connection is attached.
    pub attached: bool,
    /// Unix time of its last activity, in microseconds.
    pub last_activity_us: u64,
    /// The node that runs it; `None`: this one.
    pub node: Option<String>,
}

/// Names of the classes, lowest (evicted first) first.
pub const CLASS_NAMES: [&str; 4] = [
    "idle_detached",
    "idle_attached",
    "running_detached",
    "running_attached",
];

impl Candidate {
    /// The eviction class of protocol §6: lower goes first.
    pub fn class(&self) -> u8 {
        match (self.running, self.attached) {
            (false, false) => 0,
            (false, true) => 1,
            (true, false) => 2,
            (true, true) => 3,
        }
    }

    pub fn class_name(&self) -> &'static str {
        CLASS_NAMES[self.class() as usize]
    }
}

/// The conversation to stop: the lowest class, then the least recently
/// active, then (for a stable choice) the smallest id.
pub fn victim(candidates: &[Candidate]) -> Option<&Candidate> {
    candidates.iter().min_by(|a, b| {
        (a.class(), a.last_activity_us, &a.id).cmp(&(b.class(), b.last_activity_us, &b.id))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(id: &str, running: bool, attached: bool, last: u64) -> Candidate {
        Candidate {
            id: Arc::from(id),
            running,
            attached,
            last_activity_us: last,
            node: None,
        }
    }

    #[test]
    fn the_victim_follows_the_classes_then_the_oldest_activity() {
        // (candidates, expected victim)
        let table: Vec<(Vec<Candidate>, Option<&str>)> = vec![
            (vec![], None),
            (vec![c("a", true, true, 1)], Some("a")),
            // Idle and detached goes before anything else, however recent.
            (
                vec![c("run_att", true, true, 1), c("idle_det", false, false, 99)],
                Some("idle_det"),
            ),
            // Idle attached before running detached, however recent.
            (
                vec![c("run_det", true, false, 5), c("idle_att", false, true, 10)],
                Some("idle_att"),
            ),
            // Running detached before running attached.
            (
                vec![c("run_att", true, true, 1), c("run_det", true, false, 50)],
                Some("run_det"),
            ),
            // Same class: the least recently active.
            (
                vec![
                    c("new", false, false, 30),
                    c("old", false, false, 10),
                    c("mid", false, false, 20),
                ],
                Some("old"),
            ),
            // Same class and time: the smallest id, so every node agrees.
            (
                vec![c("b", false, false, 10), c("a", false, false, 10)],
                Some("a"),
            ),
        ];
        for (candidates, expected) in table {
            assert_eq!(
                victim(&candidates).map(|v| &*v.id),
                expected,
                "{candidates:?}"
            );
        }
    }

    #[test]
    fn a_conversation_of_another_node_is_chosen_by_the_same_rule() {
        let mut remote = c("remote", false, false, 1);
        remote.node = Some("n2".into());
        let candidates = vec![c("local", false, true, 0), remote];
        let v = victim(&candidates).expect("a victim");
        assert_eq!((&*v.id, v.node.as_deref()), ("remote", Some("n2")));
        assert_eq!(v.class_name(), "idle_detached");
    }
}

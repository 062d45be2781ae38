//! Which of a user's active conversations make room for one more
//! (protocol §6): pure functions over what the supervisor knows of each,
//! read from its gauge here or, in cluster mode, from the activity other
//! nodes publish with their leases. [`plan`] decides how many to stop and
//! which (or that the activation is refused); the supervisor only carries
//! the plan out, so the rule is tested here as a table.

use std::sync::Arc;

use super::gauge::ConversationGauge;
use crate::cluster::lease::Activity;
use crate::config::OnLimit;
use crate::protocol::Status;

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

    /// A conversation this node runs, as its gauge shows it now.
    pub fn local(id: Arc<str>, gauge: &ConversationGauge) -> Candidate {
        Candidate {
            id,
            running: matches!(gauge.status(), Status::Running | Status::Waiting),
            attached: gauge.attached() > 0,
            last_activity_us: gauge.last_activity_unix_us(),
            node: None,
        }
    }
}

impl From<Activity> for Candidate {
    /// A conversation another node runs, as that node last published it.
    fn from(a: Activity) -> Candidate {
        Candidate {
            id: Arc::from(a.conversation.as_str()),
            running: a.running,
            attached: a.attached,
            last_activity_us: a.last_activity_us,
            node: Some(a.node),
        }
    }
}

/// Is a user with `active_for_user` active conversations at the limit
/// `max` (0: no limit)?
pub fn at_limit(active_for_user: usize, max: usize) -> bool {
    max > 0 && active_for_user >= max
}

/// One conversation to stop, with the count that made it necessary (for
/// the decision's record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eviction {
    pub victim: Candidate,
    pub active_for_user: usize,
}

/// Why there is no room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `on_limit = "reject"` and the user is at the limit.
    Rejected { active_for_user: usize },
    /// Evicting, but nothing is left to evict.
    NothingToEvict,
}

/// What making room takes: the conversations to stop, in order, then
/// whether the activation may go on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    pub evict: Vec<Eviction>,
    pub refused: Option<Refusal>,
}

/// Makes room for one more active conversation of a user who has
/// `active_for_user` (counting `candidates` and any conversation that is
/// not one, such as one being stopped elsewhere in its lifecycle): each
/// eviction lowers the count by one, until it is under `max`.
pub fn plan(
    mut active_for_user: usize,
    max: usize,
    on_limit: OnLimit,
    mut candidates: Vec<Candidate>,
) -> Plan {
    let mut plan = Plan::default();
    while at_limit(active_for_user, max) {
        if on_limit == OnLimit::Reject {
            plan.refused = Some(Refusal::Rejected { active_for_user });
            break;
        }
        let Some(victim) = victim(&candidates).cloned() else {
            plan.refused = Some(Refusal::NothingToEvict);
            break;
        };
        candidates.retain(|c| c.id != victim.id);
        plan.evict.push(Eviction {
            victim,
            active_for_user,
        });
        active_for_user -= 1;
    }
    plan
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

    fn evicted(plan: &Plan) -> Vec<(&str, usize)> {
        plan.evict
            .iter()
            .map(|e| (&*e.victim.id, e.active_for_user))
            .collect()
    }

    #[test]
    fn the_plan_stops_just_enough_or_refuses() {
        let two = || vec![c("old", false, false, 1), c("new", false, false, 2)];
        // (count, max, on_limit, candidates, expected evictions, refusal)
        type Row = (
            usize,
            usize,
            OnLimit,
            Vec<Candidate>,
            Vec<(&'static str, usize)>,
            Option<Refusal>,
        );
        let table: Vec<Row> = vec![
            // No limit: nothing to do, however many.
            (9, 0, OnLimit::Evict, two(), vec![], None),
            (9, 0, OnLimit::Reject, two(), vec![], None),
            // Under the limit.
            (2, 3, OnLimit::Evict, two(), vec![], None),
            (2, 3, OnLimit::Reject, two(), vec![], None),
            // At the limit: one goes, the least recently active.
            (2, 2, OnLimit::Evict, two(), vec![("old", 2)], None),
            // Over the limit (it was lowered): as many as it takes.
            (
                3,
                2,
                OnLimit::Evict,
                two(),
                vec![("old", 3), ("new", 2)],
                None,
            ),
            // More over the limit than there are candidates.
            (
                3,
                1,
                OnLimit::Evict,
                two(),
                vec![("old", 3), ("new", 2)],
                Some(Refusal::NothingToEvict),
            ),
            (
                1,
                1,
                OnLimit::Evict,
                vec![],
                vec![],
                Some(Refusal::NothingToEvict),
            ),
            // Rejecting stops nothing.
            (
                2,
                2,
                OnLimit::Reject,
                two(),
                vec![],
                Some(Refusal::Rejected { active_for_user: 2 }),
            ),
        ];
        for (count, max, on_limit, candidates, expected, refused) in table {
            let plan = plan(count, max, on_limit, candidates);
            assert_eq!(
                (evicted(&plan), plan.refused),
                (expected, refused),
                "{count} active, max {max}, {on_limit:?}"
            );
        }
    }

    #[test]
    fn a_gauge_and_a_published_activity_become_candidates() {
        let gauge = ConversationGauge::default();
        gauge.publish(Status::Waiting, 2, std::time::Instant::now());
        let local = Candidate::local(Arc::from("c1"), &gauge);
        assert_eq!((local.running, local.attached), (true, true));
        assert_eq!(local.node, None);
        gauge.publish(Status::Idle, 0, std::time::Instant::now());
        let idle = Candidate::local(Arc::from("c1"), &gauge);
        assert_eq!(idle.class_name(), "idle_detached");
        let remote = Candidate::from(Activity {
            conversation: "c2".into(),
            node: "n2".into(),
            incarnation: "i2".into(),
            running: true,
            attached: false,
            last_activity_us: 7,
        });
        assert_eq!(remote, {
            let mut r = c("c2", true, false, 7);
            r.node = Some("n2".into());
            r
        });
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

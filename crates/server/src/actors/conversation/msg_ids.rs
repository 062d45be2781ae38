//! The `client_msg_id` ledger of one conversation: the window of the most
//! recent ids (`conversations.client_msg_id_window`), each with the seq of
//! its `user_message`, so that a message sent again within the window is
//! answered as a duplicate instead of recorded twice (protocol §5.3). An id
//! older than the window is forgotten, here and in the store (which prunes
//! the ids below the window's first seq with the append that moved it), so
//! both hold at most the window, whatever the traffic.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// The most recent ids, oldest first. Boxed and made at the first id:
/// most conversations' clients send none, and every conversation's state
/// holds a ledger.
#[derive(Debug, Default)]
pub(super) struct MsgIdLedger(Option<Box<Ids>>);

#[derive(Debug, Default)]
struct Ids {
    by_id: HashMap<Arc<str>, u64>,
    /// The same ids in seq order, to forget the oldest first.
    order: VecDeque<(Arc<str>, u64)>,
}

impl MsgIdLedger {
    /// The ledger of a reactivated conversation: the stored ids (oldest
    /// first), the newest `window` of them.
    pub(super) fn restored(ids: Vec<(String, u64)>, window: usize) -> MsgIdLedger {
        let mut ledger = MsgIdLedger::default();
        for (id, seq) in ids {
            ledger.insert(id, seq, window);
        }
        ledger
    }

    /// The seq of the message that used `id`, if it is in the window.
    pub(super) fn get(&self, id: &str) -> Option<u64> {
        self.0.as_ref()?.by_id.get(id).copied()
    }

    /// Records `id` as the message at `seq` (newer than every id held) and
    /// forgets the oldest beyond `window` (a reload applies at the next
    /// message). Returns the window's new first seq when ids were
    /// forgotten: the store forgets those before it.
    pub(super) fn insert(&mut self, id: String, seq: u64, window: usize) -> Option<u64> {
        let ids = self.0.get_or_insert_default();
        let id: Arc<str> = Arc::from(id);
        ids.by_id.insert(id.clone(), seq);
        ids.order.push_back((id, seq));
        let mut forgot = false;
        while ids.order.len() > window.max(1) {
            if let Some((old, old_seq)) = ids.order.pop_front() {
                // Unless the id came back since, with a newer message.
                if ids.by_id.get(&old) == Some(&old_seq) {
                    ids.by_id.remove(&old);
                }
                forgot = true;
            }
        }
        forgot.then(|| ids.order.front().map_or(seq, |(_, first)| *first))
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |ids| ids.order.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_ids_of_the_window() {
        let mut ledger = MsgIdLedger::default();
        assert_eq!(ledger.insert("a".into(), 3, 2), None);
        assert_eq!(ledger.insert("b".into(), 5, 2), None);
        assert_eq!(ledger.insert("c".into(), 9, 2), Some(5));
        assert_eq!(ledger.get("a"), None, "older than the window: forgotten");
        assert_eq!((ledger.get("b"), ledger.get("c")), (Some(5), Some(9)));
        // A smaller window applies at the next id.
        assert_eq!(ledger.insert("d".into(), 12, 1), Some(12));
        assert_eq!(ledger.len(), 1);
        assert_eq!(ledger.get("d"), Some(12));
    }

    #[test]
    fn an_id_that_comes_back_is_remembered_with_its_new_message() {
        let mut ledger = MsgIdLedger::default();
        ledger.insert("a".into(), 1, 3);
        ledger.insert("b".into(), 2, 3);
        // A store may list an id twice (its old message and a new one).
        ledger.insert("a".into(), 5, 3);
        assert_eq!(ledger.insert("c".into(), 6, 3), Some(2));
        assert_eq!(ledger.get("a"), Some(5), "the old entry left, not the new");
    }

    #[test]
    fn a_restored_ledger_holds_at_most_the_window() {
        let stored = (1..=10).map(|s| (format!("m{s}"), s)).collect();
        let ledger = MsgIdLedger::restored(stored, 4);
        assert_eq!(ledger.len(), 4);
        assert_eq!(ledger.get("m6"), None);
        assert_eq!(ledger.get("m7"), Some(7));
    }
}

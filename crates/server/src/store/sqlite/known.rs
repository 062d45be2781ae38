//! What the writer remembers of the conversations it committed lately: each
//! one's head and the row fields only the row records. An append must follow
//! the stored head, and the row is rewritten only when those fields change;
//! reading both back for every conversation of every group was a tenth of
//! the server's CPU at 1,000 conversations streaming. The writer is the only
//! writer of the database (the store lock keeps other processes out), so
//! what it committed is what is stored. Entries change only after a commit
//! succeeds; a conversation not remembered is read from the database.

use super::*;

/// Conversations remembered at most; beyond, the memory is started over
/// (about 100 bytes each, table included, so a few MB at most).
const KNOWN_MAX: usize = 16_384;

/// The conversations row's fields that only the row records, held
/// compactly: one is remembered for every conversation written lately.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct RowFields {
    /// `None`: the row holds a status this version does not know (it is
    /// rewritten at the next append).
    pub(super) status: Option<Status>,
    /// Shared with the conversation's state: while a turn runs, every
    /// append carries the same id, so comparing is comparing pointers
    /// (the text compare touched two cold allocations per append).
    pub(super) current_turn_id: Option<Arc<str>>,
    pub(super) last_turn_message_seq: u64,
}

impl RowFields {
    pub(super) fn of(state: &ConversationState) -> RowFields {
        RowFields {
            status: Some(state.status),
            current_turn_id: state.current_turn_id.clone(),
            last_turn_message_seq: state.last_turn_message_seq,
        }
    }

    pub(super) fn matches(&self, state: &ConversationState) -> bool {
        let same_turn = match (&self.current_turn_id, &state.current_turn_id) {
            (Some(ours), Some(theirs)) => Arc::ptr_eq(ours, theirs) || ours == theirs,
            (None, None) => true,
            _ => false,
        };
        self.status == Some(state.status)
            && same_turn
            && self.last_turn_message_seq == state.last_turn_message_seq
    }
}

/// A conversation as committed.
pub(super) struct Known {
    pub(super) head: u64,
    pub(super) fields: RowFields,
}

/// How one conversation stands after a committed group.
pub(super) struct Settled<'g> {
    pub(super) id: &'g Arc<str>,
    pub(super) head: u64,
    /// `None`: the fields are the remembered ones, unchanged.
    pub(super) fields: Option<RowFields>,
}

#[derive(Default)]
pub(super) struct KnownRows {
    /// Keyed by the appends' own ids: a lookup with the same id compares
    /// bytes it has just hashed, not a copy elsewhere in memory. A
    /// conversation activated again brings another id of the same text;
    /// the first one stays the key, which costs only that saving.
    rows: HashMap<Arc<str>, Known>,
}

impl KnownRows {
    pub(super) fn get(&self, id: &str) -> Option<&Known> {
        self.rows.get(id)
    }

    /// Records a committed group: the conversations it deleted, then how
    /// each one it wrote stands.
    pub(super) fn settle<'g>(
        &mut self,
        deleted: impl IntoIterator<Item = &'g str>,
        settled: impl IntoIterator<Item = Settled<'g>>,
    ) {
        for id in deleted {
            self.rows.remove(id);
        }
        for Settled { id, head, fields } in settled {
            match (self.rows.get_mut(&**id), fields) {
                (Some(known), None) => known.head = head,
                (Some(known), Some(fields)) => {
                    known.head = head;
                    known.fields = fields;
                }
                (None, Some(fields)) => {
                    if self.rows.len() >= KNOWN_MAX {
                        self.rows.clear();
                    }
                    self.rows.insert(Arc::clone(id), Known { head, fields });
                }
                // Unchanged fields come from a remembered entry, so this
                // does not happen; forgetting is always safe.
                (None, None) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(status: &str) -> RowFields {
        RowFields {
            status: Status::parse(status),
            current_turn_id: None,
            last_turn_message_seq: 0,
        }
    }

    fn settled(id: &Arc<str>, head: u64, fields: Option<RowFields>) -> Settled<'_> {
        Settled { id, head, fields }
    }

    #[test]
    fn a_commit_moves_the_head_and_keeps_fields_it_did_not_change() {
        let mut known = KnownRows::default();
        let c1: Arc<str> = Arc::from("c1");
        known.settle([], [settled(&c1, 3, Some(fields("running")))]);
        known.settle([], [settled(&c1, 9, None)]);
        let remembered = known.get("c1").expect("remembered");
        assert_eq!(
            (remembered.head, &remembered.fields),
            (9, &fields("running"))
        );
        known.settle([], [settled(&c1, 10, Some(fields("idle")))]);
        assert_eq!(known.get("c1").map(|k| &k.fields), Some(&fields("idle")));
    }

    #[test]
    fn a_deleted_conversation_is_forgotten_unless_the_group_created_it_again() {
        let mut known = KnownRows::default();
        let (c1, c2): (Arc<str>, Arc<str>) = (Arc::from("c1"), Arc::from("c2"));
        known.settle(
            [],
            [
                settled(&c1, 3, Some(fields("idle"))),
                settled(&c2, 5, Some(fields("idle"))),
            ],
        );
        known.settle(["c1", "c2"], [settled(&c2, 1, Some(fields("running")))]);
        assert!(known.get("c1").is_none());
        assert_eq!(known.get("c2").map(|k| k.head), Some(1));
    }

    #[test]
    fn the_memory_is_bounded() {
        let mut known = KnownRows::default();
        let ids: Vec<Arc<str>> = (0..KNOWN_MAX + 1)
            .map(|i| Arc::from(format!("c{i}")))
            .collect();
        for id in &ids {
            known.settle([], [settled(id, 1, Some(fields("idle")))]);
            assert!(known.rows.len() <= KNOWN_MAX);
        }
        // Started over when full: the newest is there, the oldest is read
        // from the database again.
        assert!(known.get(&ids[KNOWN_MAX]).is_some());
        assert!(known.get(&ids[0]).is_none());
    }
}

//! The replay buffer: the newest committed events of one conversation,
//! kept in memory so that a reconnect or a lagging connection catches up
//! without reading the store. It holds committed events only (the log puts
//! them here on commit), so whatever is served from it may be sent.
//!
//! Bounded twice: by `replay_buffer_events` (read at each commit, so a
//! reload applies at the next one) and by [`REPLAY_BUFFER_MAX_BYTES`],
//! because events can be large and memory must stay bounded per
//! conversation. The bytes counted are all an event held here costs (its
//! frame, its record, their allocations and its slot), so that the bound is
//! the memory's, not only the JSON's; frames written during a burst share
//! blocks (`frame_arena`), which hold at most two blocks per conversation
//! beyond that count: the one being filled, and the oldest, part of whose
//! frames it let go. A range it no longer holds is read
//! from the store.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::event::EventRecord;

/// Most bytes one conversation's replay buffer holds (see
/// [`ReplayBuffer::cost`]), whatever `replay_buffer_events` says.
pub const REPLAY_BUFFER_MAX_BYTES: usize = 8 * 1024 * 1024;

/// The last committed events, oldest first, contiguous in seq.
#[derive(Debug, Default)]
pub(super) struct ReplayBuffer {
    events: VecDeque<Arc<EventRecord>>,
    bytes: usize,
}

impl ReplayBuffer {
    pub(super) fn len(&self) -> usize {
        self.events.len()
    }

    /// The bytes the events held cost.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// What holding `record` here costs: the record (frame included) and
    /// its slot in the queue.
    pub(super) fn cost(record: &EventRecord) -> usize {
        record.held_bytes() + size_of::<Arc<EventRecord>>()
    }

    /// Adds a committed event (the next in seq) and drops the oldest ones
    /// beyond `cap` events or the byte bound. The newest event is kept
    /// even when it alone is over the byte bound.
    pub(super) fn push(&mut self, record: Arc<EventRecord>, cap: usize) {
        self.bytes += Self::cost(&record);
        self.events.push_back(record);
        while self.events.len() > cap
            || (self.bytes > REPLAY_BUFFER_MAX_BYTES && self.events.len() > 1)
        {
            if let Some(old) = self.events.pop_front() {
                self.bytes -= Self::cost(&old);
            }
        }
    }

    /// Replaces the content with the newest part of `tail` (stored events,
    /// oldest first) that fits the byte bound (at least its last event).
    pub(super) fn refill(&mut self, tail: Vec<Arc<EventRecord>>) {
        self.events.clear();
        self.bytes = 0;
        for record in tail.into_iter().rev() {
            let cost = Self::cost(&record);
            if self.bytes + cost > REPLAY_BUFFER_MAX_BYTES && !self.events.is_empty() {
                break;
            }
            self.bytes += cost;
            self.events.push_front(record);
        }
    }

    /// The events from `from` on, if the buffer holds that range (`None`:
    /// it starts later, so the range comes from the store). A `from` past
    /// `head` (the committed head) needs nothing: an empty range.
    pub(super) fn since(&self, from: u64, head: u64) -> Option<Vec<Arc<EventRecord>>> {
        let start = match self.events.front() {
            Some(first) if first.seq <= from => first.seq,
            _ if from > head => from,
            _ => return None,
        };
        let skip = usize::try_from(from - start).unwrap_or(usize::MAX);
        Some(self.events.iter().skip(skip).cloned().collect())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::event::EventData;

    /// An event of about `size` bytes of text at `seq`.
    pub(in super::super) fn record(seq: u64, size: usize) -> Arc<EventRecord> {
        Arc::new(EventRecord::new(
            "c_test",
            seq,
            &EventData::TextDelta {
                turn_id: "t_1".into(),
                text: "x".repeat(size),
            },
        ))
    }

    fn seqs(events: &[Arc<EventRecord>]) -> Vec<u64> {
        events.iter().map(|r| r.seq).collect()
    }

    fn filled(seqs: std::ops::RangeInclusive<u64>, cap: usize) -> ReplayBuffer {
        let mut buffer = ReplayBuffer::default();
        for seq in seqs {
            buffer.push(record(seq, 10), cap);
        }
        buffer
    }

    #[test]
    fn keeps_the_newest_events_up_to_the_cap() {
        let buffer = filled(1..=5, 3);
        assert_eq!(buffer.len(), 3);
        assert_eq!(seqs(&buffer.since(3, 5).unwrap_or_default()), [3, 4, 5]);
        let held: usize = (3..=5).map(|s| ReplayBuffer::cost(&record(s, 10))).sum();
        assert_eq!(buffer.bytes(), held);
        // Everything a small event holds is counted, not only its frame.
        let small = record(1, 10);
        assert!(ReplayBuffer::cost(&small) >= small.frame.len() + size_of::<EventRecord>());
    }

    #[test]
    fn is_bounded_in_bytes_but_keeps_the_newest_event() {
        let mut buffer = ReplayBuffer::default();
        let big = REPLAY_BUFFER_MAX_BYTES / 2;
        for seq in 1..=3 {
            buffer.push(record(seq, big), 100);
        }
        assert_eq!(buffer.len(), 1, "two halves and a frame header do not fit");
        assert!(buffer.bytes() <= REPLAY_BUFFER_MAX_BYTES);
        buffer.push(record(4, REPLAY_BUFFER_MAX_BYTES), 100);
        assert_eq!(buffer.len(), 1);
        assert_eq!(seqs(&buffer.since(4, 4).unwrap_or_default()), [4]);
    }

    #[test]
    fn serves_a_range_only_when_it_holds_its_start() {
        let buffer = filled(4..=6, 10);
        // (from, head) → what is served, `None` meaning "read the store".
        let cases: [(u64, u64, Option<Vec<u64>>); 5] = [
            (4, 6, Some(vec![4, 5, 6])),
            (6, 6, Some(vec![6])),
            (7, 6, Some(vec![])),
            (3, 6, None),
            (1, 6, None),
        ];
        for (from, head, want) in cases {
            let got = buffer.since(from, head).map(|events| seqs(&events));
            assert_eq!(got, want, "from {from}");
        }
        let empty = ReplayBuffer::default();
        assert_eq!(empty.since(1, 0).map(|e| e.len()), Some(0));
        assert_eq!(empty.since(1, 3).map(|e| e.len()), None);
    }

    #[test]
    fn a_refill_keeps_the_newest_part_that_fits() {
        let mut buffer = filled(1..=3, 10);
        buffer.refill((5..=8).map(|s| record(s, 10)).collect());
        assert_eq!(seqs(&buffer.since(5, 8).unwrap_or_default()), [5, 6, 7, 8]);
        let big = REPLAY_BUFFER_MAX_BYTES / 2;
        buffer.refill((1..=3).map(|s| record(s, big)).collect());
        assert_eq!(buffer.len(), 1);
        assert_eq!(seqs(&buffer.since(3, 3).unwrap_or_default()), [3]);
        buffer.refill(Vec::new());
        assert_eq!((buffer.len(), buffer.bytes()), (0, 0));
    }
}

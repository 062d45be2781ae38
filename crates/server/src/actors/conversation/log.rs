//! The conversation's log as its actor keeps it: seq assignment, the batch
//! waiting to be written, the writes in flight, the committed head, the
//! replay buffer, and the replies that wait for a commit. Pure state and
//! its transitions; the actor does the I/O (hands a [`Write`] to the store,
//! sends what a commit releases).
//!
//! Write before send: an event or a reply naming a seq leaves the log
//! only through [`Log::commit`], once the store has the seq; the replay
//! buffer holds committed events only. Seq is assigned here only, and is
//! contiguous: a failed write discards everything not committed (none of it
//! was sent) and seq goes on from the committed head, so a seq a client saw
//! is never assigned twice. Each discard starts a new epoch; a write's
//! outcome names its epoch, and one from before a discard changes nothing.

use std::collections::VecDeque;
use std::sync::Arc;

use super::replay_buffer::ReplayBuffer;
use crate::actors::connection::ConnId;
use crate::event::{EventData, EventRecord};
use crate::frame_arena::FrameArena;
use crate::protocol::{ReqId, ServerFrame};
use crate::store::NewConversation;

/// A conversation whose last batch held at least this many events streams
/// in bursts: it writes its frames into blocks ([`FrameArena`]). One with
/// fewer gives each frame an allocation of its own (and keeps its block
/// for its next burst).
const BURST_EVENTS: usize = 16;

/// A reply that must wait until the event it names is committed.
#[derive(Debug)]
pub(super) struct DeferredReply {
    pub seq: u64,
    pub conn: ConnId,
    pub req: Option<ReqId>,
    pub frame: ServerFrame,
}

/// What one append to the store carries, taken from the batch.
#[derive(Debug)]
pub(super) struct Write {
    /// In seq order, contiguous with what was handed to the store before.
    pub events: Vec<Arc<EventRecord>>,
    /// The last seq of `events`.
    pub upto: u64,
    /// Agent credits the events hold, given back on the outcome.
    pub credits: usize,
    pub client_msg_ids: Vec<(String, u64)>,
    pub forget_client_msg_ids_before: u64,
    /// The conversation's creation, with its first events.
    pub create: Option<NewConversation>,
    /// The epoch the write belongs to.
    pub epoch: u64,
}

/// What a commit released: both may be sent now.
#[derive(Debug, Default)]
pub(super) struct Released {
    /// The events newly committed, in seq order.
    pub events: Vec<Arc<EventRecord>>,
    /// The replies whose seq is now committed, in the order they came.
    pub replies: Vec<DeferredReply>,
}

/// What a discard dropped that its holders must hear about.
#[derive(Debug, Default)]
pub(super) struct Discarded {
    /// Agent credits of the batch (those of the writes come back with
    /// their outcomes).
    pub credits: usize,
    /// Replies that waited on a discarded event: they cannot be given.
    pub replies: Vec<DeferredReply>,
}

/// The batch assigned but not yet handed to the store.
#[derive(Debug, Default)]
struct Batch {
    events: Vec<Arc<EventRecord>>,
    credits: usize,
    client_msg_ids: Vec<(String, u64)>,
    /// Ids of messages before this seq left the window (0: none did).
    forget_client_msg_ids_before: u64,
    /// Boxed: set only until the first write, and every log holds a batch.
    create: Option<Box<NewConversation>>,
}

#[derive(Debug)]
pub(super) struct Log {
    conversation: Arc<str>,
    /// The next seq to assign.
    next_seq: u64,
    /// Every seq up to this one is durable and may be sent.
    committed: u64,
    batch: Batch,
    /// How many events the last batch held: the next one's first append
    /// makes room for as many, instead of growing from one by doubling
    /// (each step a copy). An idle log holds no room at all.
    last_batch_len: usize,
    /// Handed to the store, not yet committed, in seq order.
    in_flight: VecDeque<Arc<EventRecord>>,
    buffer: ReplayBuffer,
    /// Where a burst's frames are written.
    frames: FrameArena,
    waiting: VecDeque<DeferredReply>,
    epoch: u64,
}

impl Log {
    /// The log of a conversation with nothing committed yet. Its buffer
    /// starts empty and grows with the events it keeps: an idle
    /// conversation does not pay for `replay_buffer_events` slots.
    pub(super) fn new(conversation: Arc<str>) -> Log {
        Log {
            conversation,
            next_seq: 1,
            committed: 0,
            batch: Batch::default(),
            last_batch_len: 0,
            in_flight: VecDeque::new(),
            buffer: ReplayBuffer::default(),
            frames: FrameArena::default(),
            waiting: VecDeque::new(),
            epoch: 0,
        }
    }

    /// The committed head: every seq up to it may be sent.
    pub(super) fn committed(&self) -> u64 {
        self.committed
    }

    /// The last seq assigned (committed or not).
    pub(super) fn last_assigned(&self) -> u64 {
        self.next_seq - 1
    }

    pub(super) fn buffer(&self) -> &ReplayBuffer {
        &self.buffer
    }

    /// Events assigned and not yet handed to the store.
    pub(super) fn batch_len(&self) -> usize {
        self.batch.events.len()
    }

    /// The current epoch (see [`Log::discard`]).
    pub(super) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Replies wait for a commit.
    pub(super) fn has_waiting_replies(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Nothing handed to the store waits for its outcome.
    pub(super) fn nothing_in_flight(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// The next write creates the conversation.
    pub(super) fn create(&mut self, conversation: NewConversation) {
        self.batch.create = Some(Box::new(conversation));
    }

    /// Assigns the next seq to an event (serialized here, once) and adds
    /// it to the batch.
    pub(super) fn append(&mut self, data: &EventData) -> Arc<EventRecord> {
        let record = Arc::new(if self.last_batch_len >= BURST_EVENTS {
            EventRecord::new_in(&mut self.frames, &self.conversation, self.next_seq, data)
        } else {
            EventRecord::new(&self.conversation, self.next_seq, data)
        });
        self.next_seq += 1;
        if self.batch.events.capacity() == 0 {
            self.batch.events.reserve(self.last_batch_len);
        }
        self.batch.events.push(record.clone());
        record
    }

    /// An agent credit goes with the batch, given back on its outcome.
    pub(super) fn add_credit(&mut self) {
        self.batch.credits += 1;
    }

    /// The batch records that `client_msg_id` is the message at `seq`,
    /// and that the ids before `forget_before` left the window.
    pub(super) fn add_client_msg_id(
        &mut self,
        client_msg_id: String,
        seq: u64,
        forget_before: Option<u64>,
    ) {
        self.batch.client_msg_ids.push((client_msg_id, seq));
        if let Some(before) = forget_before {
            let forget = &mut self.batch.forget_client_msg_ids_before;
            *forget = (*forget).max(before);
        }
    }

    /// Takes the batch to hand to the store (`None`: it is empty). Its
    /// events are in flight until the outcome.
    pub(super) fn take_batch(&mut self) -> Option<Write> {
        if self.batch.events.is_empty() {
            return None;
        }
        let Batch {
            events,
            credits,
            client_msg_ids,
            forget_client_msg_ids_before,
            create,
        } = std::mem::take(&mut self.batch);
        self.last_batch_len = events.len();
        self.in_flight.extend(events.iter().cloned());
        Some(Write {
            upto: self.last_assigned(),
            events,
            credits,
            client_msg_ids,
            forget_client_msg_ids_before,
            create: create.map(|c| *c),
            epoch: self.epoch,
        })
    }

    /// Whether a write's outcome still matters: one made before a discard
    /// concerns events nobody will be sent.
    pub(super) fn is_current(&self, epoch: u64) -> bool {
        epoch == self.epoch
    }

    /// The store committed everything up to `upto` (of the current epoch):
    /// those events move into the replay buffer (at most `buffer_cap`
    /// events), and they and the replies waiting on them are released.
    pub(super) fn commit(&mut self, upto: u64, buffer_cap: usize) -> Released {
        let mut events = Vec::with_capacity(self.releasing(upto).len());
        let replies = self.release(upto, buffer_cap, |record| events.push(record.clone()));
        Released { events, replies }
    }

    /// [`Log::commit`] of events someone else sent already (the fanout):
    /// they only move into the replay buffer, and the replies waiting on
    /// them are released. Nothing is gathered for the caller to send.
    pub(super) fn commit_sent(&mut self, upto: u64, buffer_cap: usize) -> Vec<DeferredReply> {
        self.release(upto, buffer_cap, |_| {})
    }

    /// The events in flight that a commit up to `upto` releases.
    pub(super) fn releasing(
        &self,
        upto: u64,
    ) -> std::collections::vec_deque::Iter<'_, Arc<EventRecord>> {
        // In flight is in seq order: the released events are a prefix.
        let releasing = self.in_flight.partition_point(|record| record.seq <= upto);
        self.in_flight.range(..releasing)
    }

    fn release(
        &mut self,
        upto: u64,
        buffer_cap: usize,
        mut each: impl FnMut(&Arc<EventRecord>),
    ) -> Vec<DeferredReply> {
        let releasing = self.releasing(upto).len();
        for record in self.in_flight.drain(..releasing) {
            each(&record);
            self.buffer.push(record, buffer_cap);
        }
        self.committed = self.committed.max(upto);
        let mut replies = Vec::new();
        while let Some(reply) = self.waiting.pop_front() {
            if reply.seq > self.committed {
                self.waiting.push_front(reply);
                break;
            }
            replies.push(reply);
        }
        replies
    }

    /// Holds `reply` until its seq is committed; gives it back when it
    /// already is, to be sent now.
    pub(super) fn reply_when_committed(&mut self, reply: DeferredReply) -> Option<DeferredReply> {
        if reply.seq <= self.committed {
            return Some(reply);
        }
        self.waiting.push_back(reply);
        None
    }

    /// A write failed (or was fenced): drops everything not committed,
    /// in flight or batched, starts a new epoch, and rewinds seq to the
    /// committed head.
    pub(super) fn discard(&mut self) -> Discarded {
        self.epoch += 1;
        self.in_flight.clear();
        let batch = std::mem::take(&mut self.batch);
        self.next_seq = self.committed + 1;
        Discarded {
            credits: batch.credits,
            replies: std::mem::take(&mut self.waiting).into(),
        }
    }

    /// Goes on from the store's committed state: head `head_seq`, whose
    /// last events are `tail` (oldest first). The buffer is refilled from
    /// `tail` when the head moved, since the store may hold events whose
    /// commit was never seen here. Returns the head as it was.
    pub(super) fn reset_to(&mut self, head_seq: u64, tail: Vec<Arc<EventRecord>>) -> u64 {
        let previous = self.committed;
        if head_seq != previous {
            self.buffer.refill(tail);
        }
        self.committed = head_seq;
        self.next_seq = head_seq + 1;
        previous
    }
}

#[cfg(test)]
mod tests {
    use super::super::replay_buffer::tests::record;
    use super::*;
    use crate::frame_arena::follows;

    fn log() -> Log {
        Log::new(Arc::from("c_test"))
    }

    fn delta(text: &str) -> EventData {
        EventData::TextDelta {
            turn_id: "t_1".into(),
            text: text.into(),
        }
    }

    /// Appends `n` events; returns their seqs.
    fn append(log: &mut Log, n: usize) -> Vec<u64> {
        (0..n).map(|_| log.append(&delta("x")).seq).collect()
    }

    /// Appends `n` events and commits them with a buffer of `cap`.
    fn append_committed(log: &mut Log, n: usize, cap: usize) {
        append(log, n);
        if let Some(write) = log.take_batch() {
            log.commit(write.upto, cap);
        }
    }

    fn ack(seq: u64) -> DeferredReply {
        DeferredReply {
            seq,
            conn: 1,
            req: None,
            frame: ServerFrame::Ack {
                req: None,
                conversation_id: "c_test".into(),
                seq: Some(seq),
                duplicate: None,
            },
        }
    }

    fn seqs(events: &[Arc<EventRecord>]) -> Vec<u64> {
        events.iter().map(|r| r.seq).collect()
    }

    fn reply_seqs(replies: &[DeferredReply]) -> Vec<u64> {
        replies.iter().map(|r| r.seq).collect()
    }

    #[test]
    fn seq_is_assigned_in_order_and_batched_until_taken() {
        let mut log = log();
        assert_eq!(append(&mut log, 3), [1, 2, 3]);
        assert_eq!((log.batch_len(), log.committed()), (3, 0));
        assert!(log.nothing_in_flight());
        let write = log.take_batch().expect("a batch");
        assert_eq!(seqs(&write.events), [1, 2, 3]);
        assert_eq!((write.upto, write.epoch), (3, 0));
        assert_eq!(log.batch_len(), 0);
        assert!(!log.nothing_in_flight());
        assert!(log.take_batch().is_none(), "an empty batch is no write");
    }

    #[test]
    fn an_idle_batch_holds_no_room_and_the_next_gets_the_last_ones() {
        let mut log = log();
        append(&mut log, 50);
        let write = log.take_batch().expect("a batch");
        assert_eq!(log.batch.events.capacity(), 0, "idle: no room held");
        append(&mut log, 1);
        assert!(
            log.batch.events.capacity() >= 50,
            "the first append makes room for a batch like the last"
        );
        let released = log.commit(write.upto, 16);
        assert_eq!(seqs(&released.events), (1..=50).collect::<Vec<_>>());
        assert_eq!(
            released.events.capacity(),
            50,
            "released events are counted before they are moved"
        );
        let rest = log.take_batch().expect("a batch");
        assert_eq!(seqs(&log.commit(rest.upto, 16).events), [51]);
        append(&mut log, 1);
        assert!(log.batch.events.capacity() < 50, "and shrinks with it");
    }

    #[test]
    fn frames_share_a_block_only_after_a_burst_and_the_next_burst_goes_on_in_it() {
        /// Whether each record's frame starts where the one before ended.
        fn adjacent(records: &[Arc<EventRecord>]) -> Vec<bool> {
            records
                .windows(2)
                .map(|w| follows(&w[0].frame, &w[1].frame))
                .collect()
        }
        let mut log = log();
        let burst = |log: &mut Log, n: usize| -> Vec<Arc<EventRecord>> {
            let records = (0..n).map(|_| log.append(&delta("x"))).collect();
            log.take_batch();
            records
        };
        let first = burst(&mut log, BURST_EVENTS);
        assert!(
            !adjacent(&first).contains(&true),
            "a first batch: one allocation each"
        );
        let during = burst(&mut log, 4);
        assert_eq!(adjacent(&during), [true; 3], "after a burst: one block");
        let after = burst(&mut log, 4);
        assert!(
            !adjacent(&after).contains(&true),
            "after a lull: one allocation each"
        );
        let again = burst(&mut log, BURST_EVENTS);
        let next = burst(&mut log, 1);
        assert!(
            follows(&during[3].frame, &next[0].frame),
            "the next burst goes on in the same block"
        );
        assert!(
            !adjacent(&again).contains(&true),
            "a burst's first batch: one allocation each"
        );
        assert!(during
            .iter()
            .all(|r| r.data() == r#"{"turn_id":"t_1","text":"x"}"#));
    }

    #[test]
    fn the_batch_carries_its_credits_ids_and_creation() {
        let mut log = log();
        log.create(NewConversation {
            user: "u".into(),
            title: "t".into(),
            created_at: "now".into(),
            close_delay: None,
        });
        let seq = log.append(&delta("hi")).seq;
        log.add_client_msg_id("m1".into(), seq, None);
        log.add_credit();
        log.add_credit();
        let write = log.take_batch().expect("a batch");
        assert_eq!(write.credits, 2);
        assert_eq!(write.client_msg_ids, [("m1".to_owned(), 1)]);
        assert!(write.create.is_some());
        append(&mut log, 1);
        let next = log.take_batch().expect("a batch");
        assert_eq!((next.credits, next.create.is_none()), (0, true));
        assert!(next.client_msg_ids.is_empty());
    }

    #[test]
    fn a_commit_sent_elsewhere_fills_the_buffer_and_releases_only_replies() {
        let mut log = log();
        append(&mut log, 3);
        assert_eq!(log.reply_when_committed(ack(2)).map(|r| r.seq), None);
        assert_eq!(log.reply_when_committed(ack(3)).map(|r| r.seq), None);
        let write = log.take_batch().expect("a batch");
        assert_eq!(
            log.releasing(2).map(|r| r.seq).collect::<Vec<_>>(),
            [1, 2],
            "what a commit up to 2 releases"
        );
        let replies = log.commit_sent(2, 16);
        assert_eq!(reply_seqs(&replies), [2]);
        assert_eq!((log.committed(), log.buffer().len()), (2, 2));
        assert_eq!(
            seqs(&log.buffer().since(1, log.committed()).unwrap_or_default()),
            [1, 2]
        );
        // The rest, committed the usual way, follows in the buffer.
        let released = log.commit(write.upto, 16);
        assert_eq!(seqs(&released.events), [3]);
        assert_eq!(reply_seqs(&released.replies), [3]);
        assert_eq!(log.buffer().len(), 3);
    }

    #[test]
    fn nothing_is_released_before_its_commit() {
        let mut log = log();
        append(&mut log, 2);
        assert_eq!(log.reply_when_committed(ack(2)).map(|r| r.seq), None);
        let first = log.take_batch().expect("a batch");
        append(&mut log, 2);
        assert_eq!(log.reply_when_committed(ack(4)).map(|r| r.seq), None);
        let second = log.take_batch().expect("a batch");
        assert_eq!((first.upto, second.upto), (2, 4));
        assert_eq!(
            log.buffer().len(),
            0,
            "the buffer holds committed events only"
        );

        let released = log.commit(first.upto, 16);
        assert_eq!(seqs(&released.events), [1, 2]);
        assert_eq!(reply_seqs(&released.replies), [2]);
        assert_eq!((log.committed(), log.buffer().len()), (2, 2));
        assert!(!log.nothing_in_flight());

        let released = log.commit(second.upto, 16);
        assert_eq!(seqs(&released.events), [3, 4]);
        assert_eq!(reply_seqs(&released.replies), [4]);
        assert_eq!(log.committed(), 4);
        assert!(log.nothing_in_flight());
        assert_eq!(
            log.reply_when_committed(ack(3)).map(|r| r.seq),
            Some(3),
            "a reply naming a committed seq goes at once"
        );
    }

    #[test]
    fn a_commit_fills_the_buffer_up_to_its_cap() {
        let mut log = log();
        append_committed(&mut log, 5, 3);
        assert_eq!(log.buffer().len(), 3);
        assert_eq!(
            seqs(&log.buffer().since(3, log.committed()).unwrap_or_default()),
            [3, 4, 5]
        );
    }

    #[test]
    fn a_failed_write_discards_what_is_uncommitted_and_rewinds_seq() {
        let mut log = log();
        append_committed(&mut log, 2, 16);
        append(&mut log, 2);
        log.reply_when_committed(ack(3));
        log.add_credit();
        let failed = log.take_batch().expect("a batch");
        append(&mut log, 1);
        log.add_credit();
        log.reply_when_committed(ack(5));

        let discarded = log.discard();
        assert_eq!(
            discarded.credits, 1,
            "the batch's credit; the write's comes with its outcome"
        );
        assert_eq!(reply_seqs(&discarded.replies), [3, 5]);
        assert!(!log.is_current(failed.epoch));
        assert!(log.nothing_in_flight());
        assert_eq!((log.batch_len(), log.committed()), (0, 2));
        assert_eq!(
            append(&mut log, 1),
            [3],
            "seq goes on from the committed head (3 was never sent)"
        );
        let retry = log.take_batch().expect("a batch");
        assert!(log.is_current(retry.epoch));
        assert_eq!(seqs(&log.commit(retry.upto, 16).events), [3]);
    }

    #[test]
    fn a_fenced_write_releases_nothing_from_the_writes_behind_it() {
        // Cluster mode: the writer merged two appends; the fence refuses
        // the first, and the outcome of the second arrives afterwards.
        let mut log = log();
        append(&mut log, 1);
        let fenced = log.take_batch().expect("a batch");
        append(&mut log, 1);
        let behind = log.take_batch().expect("a batch");
        log.discard();
        assert!(!log.is_current(fenced.epoch));
        assert!(!log.is_current(behind.epoch));
        assert_eq!((log.committed(), log.last_assigned()), (0, 0));
        let released = log.commit(0, 16);
        assert!(released.events.is_empty() && released.replies.is_empty());
        assert_eq!(log.buffer().len(), 0);
    }

    #[test]
    fn going_on_from_the_store_takes_its_head_and_tail() {
        // (head seen committed here, head in the store) → (seq assigned
        // next, whether the buffer was refilled from the store's tail).
        let cases = [(3, 3, 4, false), (3, 5, 6, true), (0, 4, 5, true)];
        for (seen, stored, next, refilled) in cases {
            let mut log = log();
            append_committed(&mut log, seen as usize, 16);
            append(&mut log, 1);
            log.discard();
            let tail = (1..=stored).map(|s| record(s, 1)).collect();
            assert_eq!(log.reset_to(stored, tail), seen);
            assert_eq!(log.committed(), stored);
            assert_eq!(
                append(&mut log, 1),
                [next],
                "after {seen}, store at {stored}"
            );
            let buffered = log.buffer().len() as u64;
            assert_eq!(buffered == stored && buffered != seen, refilled);
        }
    }
}

//! The live fanout of a running turn: the live attachments' queues, shared
//! between the conversation actor and the store's commit callback, so that
//! a commit sends its events to them at once instead of as a message that
//! wakes the actor (which, streaming, was half of the actor's messages).
//!
//! Who owns what: the actor decides who is live and keeps its log; the
//! fanout holds, under one lock, the live connections' queues and how far
//! the commit path has sent (`sent`). The commit path sends only the write
//! that directly follows `sent` in the log's current epoch, and only while
//! the fanout is open; anything else (a failure, a write that follows one
//! the actor has not taken in yet, a closed fanout) is left to the actor as
//! before, through its `Committed` message. So every connection is sent
//! each committed seq once, in order, by whichever of the two got there
//! first, and never a seq before its commit.
//!
//! The actor takes in what the commit path sent (its log's committed head,
//! the replay buffer, the replies that waited) before it handles any
//! message, and asks to be woken by the next commit when something waits on
//! it (a batch, a reply, a creator). A connection joins only under the lock
//! and only when the actor has taken in everything sent, so it is never
//! between a replay and the live stream; it leaves under the lock too, so
//! nothing is sent to it after a detach or while it catches up.
//!
//! The fanout exists only while a turn runs (idle conversations do not pay
//! for it); it is closed when the turn ends, the conversation stops, or a
//! write fails, after which every outcome goes through the actor again.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::actors::connection::ConnId;
use crate::actors::outbound::{Outbound, QueueError};
use crate::event::EventRecord;

/// See the module's documentation.
pub(super) struct Fanout {
    live: Mutex<Live>,
}

struct Live {
    conns: Vec<(ConnId, Outbound)>,
    /// Every committed event up to this seq was sent to `conns` (as they
    /// were then).
    sent: u64,
    /// The log's epoch: a write of another one is not sent here.
    epoch: u64,
    /// The actor wants to hear of the next commit.
    wake: bool,
    /// Closed: the commit path sends nothing more.
    closed: bool,
    /// Connections the commit path took out of `conns`.
    dropped: Vec<Dropped>,
}

/// A connection the commit path could not send to, taken out of the live
/// ones for the actor to deal with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Dropped {
    pub conn: ConnId,
    /// The first seq it was not sent.
    pub from: u64,
    /// Its connection is gone (else its queue was full: it fell behind).
    pub gone: bool,
}

/// What the commit path did since the actor last looked.
#[derive(Debug, Default)]
pub(super) struct News {
    /// The commit path's head: committed and sent to the live connections.
    pub sent: u64,
    pub dropped: Vec<Dropped>,
}

/// The outcome of a commit offered to the fanout.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Commit {
    /// Sent to the live connections; `wake`: the actor must hear of it.
    Sent { wake: bool },
    /// Not this fanout's to send: the actor handles the commit.
    Declined,
}

impl Fanout {
    /// A fanout whose live connections have been sent everything up to
    /// `committed`, in the log's `epoch`.
    pub(super) fn new(conns: Vec<(ConnId, Outbound)>, committed: u64, epoch: u64) -> Arc<Fanout> {
        Arc::new(Fanout {
            live: Mutex::new(Live {
                conns,
                sent: committed,
                epoch,
                wake: false,
                closed: false,
                dropped: Vec::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Live> {
        // Nothing a client or peer controls can panic under this lock; if
        // something did, the state is still a valid one to go on from.
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The store committed `events` (the write of `epoch` ending at `upto`):
    /// sends them if that write directly follows what was sent.
    pub(super) fn on_commit(&self, epoch: u64, events: &[Arc<EventRecord>], upto: u64) -> Commit {
        let mut live = self.lock();
        let follows = events.first().map(|e| e.seq) == Some(live.sent + 1);
        if live.closed || live.epoch != epoch || !follows {
            return Commit::Declined;
        }
        live.send(events, upto);
        Commit::Sent {
            wake: live.wake || !live.dropped.is_empty(),
        }
    }

    /// The actor sends a commit the commit path declined: the events not
    /// yet sent go to the live connections.
    pub(super) fn send_now(&self, events: &[Arc<EventRecord>], upto: u64) -> Vec<Dropped> {
        let mut live = self.lock();
        let from = live.sent;
        let unsent = events.iter().position(|e| e.seq > from);
        if let Some(first) = unsent {
            live.send(&events[first..], upto);
        }
        live.sent = live.sent.max(upto);
        std::mem::take(&mut live.dropped)
    }

    /// What the commit path did since the last look.
    pub(super) fn news(&self) -> News {
        let mut live = self.lock();
        News {
            sent: live.sent,
            dropped: std::mem::take(&mut live.dropped),
        }
    }

    /// Closes the fanout: from now on the actor handles every commit.
    /// Returns what the commit path did before.
    pub(super) fn close(&self) -> News {
        let mut live = self.lock();
        live.closed = true;
        live.conns = Vec::new();
        News {
            sent: live.sent,
            dropped: std::mem::take(&mut live.dropped),
        }
    }

    /// Makes `conn` live, if the actor's committed head is the commit
    /// path's (else a commit came between: the caller catches it up first).
    pub(super) fn join(&self, conn: ConnId, outbound: &Outbound, committed: u64) -> bool {
        let mut live = self.lock();
        if live.sent != committed {
            return false;
        }
        live.conns.retain(|(id, _)| *id != conn);
        live.conns.push((conn, outbound.clone()));
        true
    }

    /// Nothing more is sent to `conn` (it detached, or catches up).
    pub(super) fn leave(&self, conn: ConnId) {
        let mut live = self.lock();
        live.conns.retain(|(id, _)| *id != conn);
        live.dropped.retain(|d| d.conn != conn);
    }

    /// Whether the actor is woken by the next commit. Returns whether a
    /// commit beyond `committed` was sent without waking it (then it looks
    /// now).
    pub(super) fn wake_on_commit(&self, wake: bool, committed: u64) -> bool {
        let mut live = self.lock();
        live.wake = wake;
        wake && live.sent > committed
    }
}

impl Live {
    fn send(&mut self, events: &[Arc<EventRecord>], upto: u64) {
        let Live { conns, dropped, .. } = self;
        conns.retain(
            |(conn, outbound)| match send_events(*conn, outbound, events) {
                Some(d) => {
                    dropped.push(d);
                    false
                }
                None => true,
            },
        );
        self.sent = upto;
    }
}

/// Queues `events` for one live connection, in order; stops at the first
/// it cannot take (the fanout's and the actor's sends alike).
pub(super) fn send_events(
    conn: ConnId,
    outbound: &Outbound,
    events: &[Arc<EventRecord>],
) -> Option<Dropped> {
    events.iter().find_map(|event| {
        outbound
            .try_send(event.frame.clone())
            .err()
            .map(|e| Dropped {
                conn,
                from: event.seq,
                gone: e == QueueError::Closed,
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actors::outbound::{self, OutboundReceiver};
    use crate::event::EventData;

    fn record(seq: u64) -> Arc<EventRecord> {
        Arc::new(EventRecord::new(
            "c_test",
            seq,
            &EventData::TextDelta {
                turn_id: "t_1".into(),
                text: format!("e{seq}"),
            },
        ))
    }

    fn records(seqs: std::ops::RangeInclusive<u64>) -> Vec<Arc<EventRecord>> {
        seqs.map(record).collect()
    }

    fn queue(limit: usize) -> (Outbound, OutboundReceiver) {
        outbound::channel(limit, std::time::Duration::from_secs(10))
    }

    fn received(rx: &mut OutboundReceiver) -> Vec<u64> {
        let mut seqs = Vec::new();
        while let Ok(frame) = rx.rx.try_recv() {
            let value: serde_json::Value = serde_json::from_str(frame.as_str()).expect("json");
            seqs.push(value["seq"].as_u64().expect("seq"));
        }
        seqs
    }

    #[test]
    fn a_commit_that_follows_what_was_sent_goes_to_every_live_connection() {
        let (a, mut ra) = queue(64);
        let (b, mut rb) = queue(64);
        let fanout = Fanout::new(vec![(1, a), (2, b)], 3, 0);
        assert_eq!(
            fanout.on_commit(0, &records(4..=5), 5),
            Commit::Sent { wake: false }
        );
        assert_eq!(received(&mut ra), [4, 5]);
        assert_eq!(received(&mut rb), [4, 5]);
        assert_eq!(fanout.news().sent, 5);
    }

    #[test]
    fn a_commit_with_a_gap_another_epoch_or_after_close_is_left_to_the_actor() {
        let (a, mut ra) = queue(64);
        let fanout = Fanout::new(vec![(1, a)], 3, 2);
        assert_eq!(fanout.on_commit(2, &records(5..=6), 6), Commit::Declined);
        assert_eq!(fanout.on_commit(1, &records(4..=4), 4), Commit::Declined);
        assert!(received(&mut ra).is_empty());
        // The actor sends the write before the gap itself; then the next
        // one follows again.
        assert!(fanout.send_now(&records(2..=4), 4).is_empty());
        assert_eq!(received(&mut ra), [4], "what was sent is not sent again");
        assert_eq!(
            fanout.on_commit(2, &records(5..=6), 6),
            Commit::Sent { wake: false }
        );
        assert_eq!(received(&mut ra), [5, 6]);
        let news = fanout.close();
        assert_eq!(news.sent, 6);
        assert_eq!(fanout.on_commit(2, &records(7..=7), 7), Commit::Declined);
        assert!(received(&mut ra).is_empty());
    }

    #[test]
    fn a_full_or_closed_connection_is_taken_out_and_the_actor_woken() {
        let (full, mut rfull) = queue(1);
        let (gone, rgone) = queue(64);
        let (fine, mut rfine) = queue(64);
        drop(rgone);
        let fanout = Fanout::new(vec![(1, full), (2, gone), (3, fine)], 0, 0);
        assert_eq!(
            fanout.on_commit(0, &records(1..=3), 3),
            Commit::Sent { wake: true }
        );
        assert_eq!(received(&mut rfine), [1, 2, 3]);
        let limit_one: Vec<u64> = received(&mut rfull);
        let news = fanout.news();
        assert_eq!(news.sent, 3);
        let first_unsent = limit_one.last().map_or(1, |seq| seq + 1);
        assert_eq!(
            news.dropped,
            [
                Dropped {
                    conn: 1,
                    from: first_unsent,
                    gone: false
                },
                Dropped {
                    conn: 2,
                    from: 1,
                    gone: true
                }
            ]
        );
        // Taken out: the next commit goes to the one left only.
        assert_eq!(
            fanout.on_commit(0, &records(4..=4), 4),
            Commit::Sent { wake: false }
        );
        assert_eq!(received(&mut rfine), [4]);
        assert!(received(&mut rfull).is_empty());
    }

    #[test]
    fn a_connection_joins_only_when_the_actor_has_taken_in_every_commit() {
        let (a, mut ra) = queue(64);
        let (b, mut rb) = queue(64);
        let fanout = Fanout::new(vec![(1, a)], 0, 0);
        assert!(fanout.on_commit(0, &records(1..=2), 2) != Commit::Declined);
        assert!(!fanout.join(2, &b, 0), "seq 1 and 2 were sent since");
        assert!(fanout.join(2, &b, 2));
        fanout.on_commit(0, &records(3..=3), 3);
        assert_eq!(received(&mut ra), [1, 2, 3]);
        assert_eq!(received(&mut rb), [3]);
        fanout.leave(2);
        fanout.on_commit(0, &records(4..=4), 4);
        assert!(received(&mut rb).is_empty(), "nothing after it left");
    }

    #[test]
    fn the_actor_is_woken_when_it_asks_and_told_when_it_missed_a_commit() {
        let (a, _ra) = queue(64);
        let fanout = Fanout::new(vec![(1, a)], 0, 0);
        assert!(!fanout.wake_on_commit(true, 0));
        assert_eq!(
            fanout.on_commit(0, &records(1..=1), 1),
            Commit::Sent { wake: true }
        );
        assert!(!fanout.wake_on_commit(false, 0), "not asked: not missed");
        fanout.on_commit(0, &records(2..=2), 2);
        assert!(fanout.wake_on_commit(true, 1), "seq 2 came meanwhile");
        assert!(!fanout.wake_on_commit(true, 2));
    }
}

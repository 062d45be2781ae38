//! What one soak client checks of its conversation's stream, across every
//! reconnect: each seq the one after the last (nothing lost, nothing
//! doubled), and each seq it is sent again after a resume the same event as
//! the first time (kind, `ts`, `data`), so that a seq is never reused for
//! something else.
//!
//! A resume attaches a few seqs below the last one seen on purpose: those
//! come again from the server's buffer or store and are compared with what
//! was kept of them, a window of the last [`KEPT`] events.

use std::collections::VecDeque;

use serde_json::Value;

/// Events kept per conversation to compare when they come again.
pub const KEPT: usize = 64;

/// One event as first seen.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub kind: String,
    pub ts: String,
    pub data: Value,
}

/// What an event's seq means for the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The next one; `skipped` seqs before it never came (a gap).
    New { skipped: u64 },
    /// A seq asked for again by a resume: the same event as before or not.
    Again { same: bool },
    /// A seq at or below the last one, not asked for again.
    Duplicate,
}

#[derive(Debug, Default)]
pub struct StreamCheck {
    last: u64,
    kept: VecDeque<(u64, Seen)>,
    /// After a resume from below the last seq: the next seq expected again
    /// and the last one.
    again: Option<(u64, u64)>,
}

impl StreamCheck {
    /// A stream whose seqs up to `last` came before any check (`create`).
    pub fn starting_after(last: u64) -> StreamCheck {
        StreamCheck {
            last,
            ..StreamCheck::default()
        }
    }

    pub fn last(&self) -> u64 {
        self.last
    }

    /// Whether every seq asked for again has come.
    pub fn rechecked_all(&self) -> bool {
        self.again.is_none()
    }

    /// The `last_seq` to attach with: up to `overlap` seqs below the last
    /// one seen, as far as they are kept, which the server must send again.
    /// What an earlier resume asked for again and did not get is asked for
    /// again (its connection went away before).
    pub fn resume_from(&mut self, overlap: u64) -> u64 {
        let oldest_kept = self.kept.front().map_or(self.last, |(seq, _)| seq - 1);
        let from = self.last.saturating_sub(overlap).max(oldest_kept);
        self.again = (from < self.last).then_some((from + 1, self.last));
        from
    }

    /// The seqs asked for again and not seen, forgotten.
    fn take_missing(&mut self) -> u64 {
        self.again
            .take()
            .map_or(0, |(next, until)| until.saturating_sub(next) + 1)
    }

    /// The server's head at an attach is below the last seq seen: that
    /// many seqs a client saw are not in the store.
    pub fn behind(&self, head: u64) -> u64 {
        self.last.saturating_sub(head)
    }

    pub fn see(&mut self, seq: u64, event: Seen) -> Verdict {
        if seq <= self.last {
            if let Some((next, until)) = self.again {
                if seq == next {
                    self.again = (next < until).then_some((next + 1, until));
                    let before = self.kept.iter().find(|(s, _)| *s == seq).map(|(_, e)| e);
                    return Verdict::Again {
                        same: before.is_none_or(|b| *b == event),
                    };
                }
            }
            return Verdict::Duplicate;
        }
        // A new seq while some were still expected again: the replay
        // skipped them; counted as skipped.
        let missing = self.take_missing();
        let skipped = seq - self.last - 1 + missing;
        self.last = seq;
        if self.kept.len() == KEPT {
            self.kept.pop_front();
        }
        self.kept.push_back((seq, event));
        Verdict::New { skipped }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(text: &str) -> Seen {
        Seen {
            kind: "text_delta".into(),
            ts: "2026-12-01T00:00:00.000Z".into(),
            data: serde_json::json!({ "text": text }),
        }
    }

    #[test]
    fn contiguous_gaps_and_duplicates() {
        let mut c = StreamCheck::starting_after(2);
        assert_eq!(c.see(3, ev("a")), Verdict::New { skipped: 0 });
        assert_eq!(c.see(3, ev("a")), Verdict::Duplicate);
        assert_eq!(c.see(6, ev("b")), Verdict::New { skipped: 2 });
        assert_eq!(c.last(), 6);
    }

    #[test]
    fn a_resume_compares_what_comes_again() {
        let mut c = StreamCheck::starting_after(0);
        for (seq, t) in [(1, "a"), (2, "b"), (3, "c")] {
            c.see(seq, ev(t));
        }
        assert_eq!(c.resume_from(2), 1);
        assert_eq!(c.see(2, ev("b")), Verdict::Again { same: true });
        assert_eq!(c.see(3, ev("other")), Verdict::Again { same: false });
        assert!(c.rechecked_all());
        assert_eq!(c.see(4, ev("d")), Verdict::New { skipped: 0 });
        // Only what is kept is asked for again.
        let mut fresh = StreamCheck::starting_after(10);
        fresh.see(11, ev("x"));
        assert_eq!(fresh.resume_from(5), 10);
    }

    #[test]
    fn a_replay_that_skips_what_was_seen_is_a_loss() {
        let mut c = StreamCheck::starting_after(0);
        for seq in 1..=5 {
            c.see(seq, ev("t"));
        }
        assert_eq!(c.resume_from(3), 2);
        assert_eq!(c.see(3, ev("t")), Verdict::Again { same: true });
        // 4 and 5 never came again.
        assert_eq!(c.see(6, ev("t")), Verdict::New { skipped: 2 });
        // A connection lost before the recheck ended asks again.
        assert_eq!(c.resume_from(2), 4);
        assert!(!c.rechecked_all());
        assert_eq!(c.resume_from(2), 4);
        assert_eq!(c.behind(3), 3);
    }
}

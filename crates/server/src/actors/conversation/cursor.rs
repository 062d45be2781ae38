//! An attachment's cursor over the log: what its connection has been sent.
//! It is `Live` (sent each event as it commits) or catching up, served by
//! a replay round that reads the buffer or the store at the socket's pace.
//! Rounds are numbered, so that the end of a round that was since replaced
//! (the connection fell behind again, or attached again) changes nothing.

/// Numbers catch-up rounds, across all attachments of a conversation.
#[derive(Debug, Default)]
pub(super) struct Rounds {
    last: u64,
}

impl Rounds {
    pub(super) fn next(&mut self) -> u64 {
        self.last += 1;
        self.last
    }
}

/// Where one attachment stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Cursor {
    phase: Phase,
    /// The round that serves it while it catches up (0: none yet).
    round: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    CatchingUp,
    Live,
}

/// What to do when a catch-up round reaches the head it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AfterRound {
    /// A replaced round's end: nothing.
    Stale,
    /// Nothing was committed meanwhile: the cursor is live.
    Live,
    /// More was committed meanwhile: another round, from this seq.
    CatchUpFrom(u64),
}

impl Cursor {
    /// A new attachment's cursor, about to catch up from
    /// [`attach_from`].
    pub(super) fn attaching() -> Cursor {
        Cursor {
            phase: Phase::CatchingUp,
            round: 0,
        }
    }

    pub(super) fn is_live(&self) -> bool {
        self.phase == Phase::Live
    }

    /// A new catch-up round serves the cursor; the one before (if any) is
    /// stale from now on.
    pub(super) fn catch_up(&mut self, round: u64) {
        self.phase = Phase::CatchingUp;
        self.round = round;
    }

    /// Round `round` sent everything before `next_seq`; `committed` is the
    /// head now.
    pub(super) fn round_ended(&mut self, round: u64, next_seq: u64, committed: u64) -> AfterRound {
        if self.phase != Phase::CatchingUp || self.round != round {
            return AfterRound::Stale;
        }
        if next_seq > committed {
            self.phase = Phase::Live;
            AfterRound::Live
        } else {
            AfterRound::CatchUpFrom(next_seq)
        }
    }
}

/// The first seq an attachment that saw up to `last_seq` is sent: a
/// `last_seq` beyond the head (a client ahead of a store that lost a
/// write it never confirmed) counts as the head.
pub(super) fn attach_from(last_seq: u64, committed: u64) -> u64 {
    last_seq.min(committed) + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_ends_live_or_again_from_where_it_stopped() {
        // (next seq the round reached, committed head now) → what follows.
        let cases = [
            (6, 5, AfterRound::Live),
            (1, 0, AfterRound::Live),
            (5, 5, AfterRound::CatchUpFrom(5)),
            (3, 9, AfterRound::CatchUpFrom(3)),
        ];
        for (next_seq, committed, want) in cases {
            let mut cursor = Cursor::attaching();
            cursor.catch_up(7);
            assert_eq!(cursor.round_ended(7, next_seq, committed), want);
            assert_eq!(cursor.is_live(), want == AfterRound::Live);
        }
    }

    /// A new attachment's cursor, served by its first round.
    fn attached(rounds: &mut Rounds) -> (Cursor, u64) {
        let mut cursor = Cursor::attaching();
        let round = rounds.next();
        cursor.catch_up(round);
        (cursor, round)
    }

    #[test]
    fn only_the_current_round_counts() {
        let mut rounds = Rounds::default();
        let (mut cursor, first) = attached(&mut rounds);
        let second = rounds.next();
        cursor.catch_up(second);
        assert_ne!(first, second);
        assert_eq!(cursor.round_ended(first, 10, 5), AfterRound::Stale);
        assert!(!cursor.is_live());
        assert_eq!(cursor.round_ended(second, 10, 5), AfterRound::Live);
        assert_eq!(
            cursor.round_ended(second, 10, 5),
            AfterRound::Stale,
            "a live cursor has no round to end"
        );
    }

    #[test]
    fn falling_behind_makes_a_live_cursor_catch_up() {
        let mut rounds = Rounds::default();
        let (mut cursor, round) = attached(&mut rounds);
        assert_eq!(cursor.round_ended(round, 4, 3), AfterRound::Live);
        let again = rounds.next();
        cursor.catch_up(again);
        assert!(!cursor.is_live());
        assert_eq!(cursor.round_ended(again, 6, 5), AfterRound::Live);
    }

    #[test]
    fn an_attach_starts_after_what_the_client_saw_but_not_past_the_head() {
        assert_eq!(attach_from(0, 0), 1);
        assert_eq!(attach_from(0, 5), 1);
        assert_eq!(attach_from(3, 5), 4);
        assert_eq!(attach_from(5, 5), 6);
        assert_eq!(attach_from(9, 5), 6);
    }
}

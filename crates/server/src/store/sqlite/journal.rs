//! The journal: where a commit writes its short runs, and the fold that
//! moves them into `event_runs`.
//!
//! Why: `event_runs` is indexed by conversation and seq. Paced traffic (many
//! conversations, a few events each per second) commits about one event per
//! conversation, so a commit that held one event of each of a thousand
//! conversations dirtied a thousand pages of that index: a page of WAL, and
//! of checkpoint copying, per event. The journal has no index, so a commit's
//! inserts all land on its last pages whichever conversations they are for.
//! (A long run of a conversation with nothing in the journal, as a burst
//! commits, goes to `event_runs` directly: see [`DIRECT_RUN_EVENTS`].)
//! The writer folds the journal once it holds [`FOLD_EVENTS`] events or
//! [`FOLD_BYTES`] bytes of them, or its oldest run is [`FOLD_AFTER`] old: the journal's runs of each conversation become
//! one run of `event_runs` (at most `RUN_MAX_EVENTS` events), so a
//! conversation's index page is written once per fold rather than once per
//! commit.
//!
//! A fold ([`Fold`]) works in steps between groups of appends, so that
//! appends never wait for more than one step: it reads the journal up to
//! the row that was last when it started, [`STEP_READS`] runs at a time,
//! then inserts the merged runs of [`STEP_CONVERSATIONS`] conversations per
//! transaction, then deletes the rows it read, [`STEP_DELETES`] at a time.
//! A row of the journal is a commit: the runs of each conversation it
//! journaled (see `runs::JournalRow`).
//!
//! So, in every committed state, each conversation's history is a prefix
//! in `event_runs` and a suffix in the journal, which may overlap (rows
//! already folded and not yet deleted, or left so by a fold that failed
//! half way): every seq of the journal above the runs' last is in the
//! journal only, in whole rows. Readers take the runs, then the journal's
//! events above the runs' last seq. Journal rows are in commit order, which
//! is each conversation's seq order. A crash leaves the journal as it was
//! at the last commit; opening the store folds it.

use std::time::Instant;

use super::runs::{
    insert_encoded, journal_entries, journal_needle, journal_text, EncodedRun, JournalRow,
    RunTable, RUN_MAX_EVENTS,
};
use super::*;

/// The age of the journal's oldest run at which the writer folds it. A
/// fold costs about the same whatever it holds (a run and an index page per
/// conversation in it, and the checkpoint's copy of that page), so folding
/// less often costs less: with 10,000 conversations at 2 events/s each, a
/// fold a second wrote a page for every two events, most of the 4.4 KB the
/// store wrote to disk per event (BENCHMARKS.md, "In the steady state:
/// the folds and the disk writes").
/// It is done in paced steps, so how often does not change how long an
/// append waits.
pub(super) const FOLD_AFTER: Duration = Duration::from_secs(3);

/// Events in the journal past which the writer folds it at once: bounds
/// what a reader scans (the journal has no index) and what a fold holds in
/// memory, under heavy load.
pub(super) const FOLD_EVENTS: usize = 32_768;

/// Bytes of encoded events in the journal past which the writer folds it
/// at once: a fold holds what it moves in memory, and events can be large
/// (a tool's output, a long answer: up to the frame limit each), so their
/// count alone does not bound it. Above what 32,768 demo tokens take
/// (about 6.5 MB), so that for small events the count decides.
pub(super) const FOLD_BYTES: usize = 8 << 20;

/// How long a fold rests after each step, in multiples of the step's own
/// time: a fold takes at most a quarter of the writer's time, unless the
/// journal fills up again before it ends ([`JournalFill::is_behind`]).
///
/// Why: a fold of paced traffic is a burst of work (an index page per
/// conversation: 140 to 250 ms for 10,000 conversations once their runs
/// outgrow the page cache), and the writer is otherwise idle most of the
/// time, so an unpaced fold took a whole core at once, and the checkpoint
/// then copied all its pages at once. Spread over four times as long, the
/// same work fits beside the conversations' tasks. Measured together with
/// the three-second fold (same section of BENCHMARKS.md).
pub(super) const FOLD_REST_PER_BUSY: u32 = 3;

/// A commit's run of at least this many events of a conversation that has
/// nothing in the journal goes to `event_runs` directly: its index page is
/// already shared by that many events, and the journal would only write
/// them twice.
pub(super) const DIRECT_RUN_EVENTS: usize = 8;

/// What the writer knows of the journal, from its own commits: how much it
/// holds, since when, and which conversations have rows in it.
#[derive(Debug, Default)]
pub(super) struct JournalFill {
    /// Events committed into the journal since the last fold started (an
    /// estimate after a delete, which takes a conversation's rows without
    /// counting them).
    events: usize,
    /// Their encoded bytes (the same estimate).
    bytes: usize,
    /// When the oldest of them was committed.
    since: Option<Instant>,
    /// Conversations with rows committed since the last fold started.
    written: HashSet<Arc<str>>,
    /// Conversations with rows the fold in progress moves.
    folding: HashSet<Arc<str>>,
}

impl JournalFill {
    /// Where a commit puts its run of `events` events of `id`: a
    /// conversation with rows in the journal keeps adding to it, so that
    /// every seq in the journal stays above those of its runs.
    pub(super) fn table_for(&self, id: &str, events: usize) -> RunTable {
        if events >= DIRECT_RUN_EVENTS && !self.written.contains(id) && !self.folding.contains(id) {
            RunTable::Runs
        } else {
            RunTable::Journal
        }
    }

    /// A commit wrote `events` of `id`, `bytes` encoded, into the journal.
    pub(super) fn added(&mut self, id: &Arc<str>, events: usize, bytes: usize, now: Instant) {
        self.events += events;
        self.bytes += bytes;
        self.since.get_or_insert(now);
        if !self.written.contains(&**id) {
            self.written.insert(Arc::clone(id));
        }
    }

    /// A fold read the journal: what it holds is the fold's to move.
    pub(super) fn fold_started(&mut self) {
        self.events = 0;
        self.bytes = 0;
        self.since = None;
        let written = std::mem::take(&mut self.written);
        self.folding.extend(written);
    }

    /// The fold moved its rows and deleted them from the journal.
    pub(super) fn fold_finished(&mut self) {
        self.folding.clear();
    }

    /// A fold failed: its rows are still in the journal, and the next try
    /// waits the usual delay.
    pub(super) fn fold_failed(&mut self, now: Instant) {
        self.written.extend(self.folding.drain());
        self.since = Some(self.since.map_or(now, |since| since.max(now)));
    }

    /// Everything was folded at once ([`fold_now`]).
    pub(super) fn all_folded(&mut self) {
        *self = JournalFill::default();
    }

    /// A deleted conversation has no rows left anywhere.
    pub(super) fn forget(&mut self, id: &str) {
        self.written.remove(id);
        self.folding.remove(id);
    }

    /// Whether `id` has rows in the journal, as far as this writer's
    /// commits tell.
    pub(super) fn holds(&self, id: &str) -> bool {
        self.written.contains(id) || self.folding.contains(id)
    }

    /// The conversations written since the last fold began.
    pub(super) fn written(&self) -> impl Iterator<Item = &Arc<str>> {
        self.written.iter()
    }

    /// When the next fold is due (`None`: nothing new in the journal).
    pub(super) fn due_at(&self) -> Option<Instant> {
        let since = self.since?;
        if self.is_behind() {
            return Some(since);
        }
        Some(since + FOLD_AFTER)
    }

    /// Whether the journal holds enough to fold at once: the next fold is
    /// due now, and a fold in progress is behind (the journal filled up
    /// again meanwhile) and no longer rests between its steps.
    pub(super) fn is_behind(&self) -> bool {
        self.events >= FOLD_EVENTS || self.bytes >= FOLD_BYTES
    }

    /// Whether a fold is due at `now` (the writer asks `due_at`, through
    /// `Writer::next_fold_step_at`).
    #[cfg(test)]
    pub(super) fn is_due(&self, now: Instant) -> bool {
        self.due_at().is_some_and(|at| at <= now)
    }
}

/// Which conversations may have rows in the journal, as readers can tell:
/// a read of a conversation with none skips the journal, which it would
/// otherwise scan whole (it has no index).
///
/// The writer marks a conversation before the commit that writes its first
/// journal rows, and, once a fold's deletes are committed, narrows the set
/// to the conversations written since the fold began and bumps `epoch`. A
/// reader notes the epoch, then takes its snapshot (its read transaction's
/// first read), then asks: a conversation not marked has no rows in that
/// snapshot, unless the set was narrowed in between (the epoch moved), when
/// the snapshot may predate the deletes and the reader scans.
#[derive(Debug, Default)]
pub(super) struct JournalMembers {
    inner: std::sync::Mutex<Members>,
}

#[derive(Debug, Default)]
struct Members {
    ids: HashSet<Arc<str>>,
    epoch: u64,
    /// Every conversation may have rows ([`JournalMembers::anyone`]).
    all: bool,
}

impl JournalMembers {
    /// For readers of a store written by another connection (the tests
    /// that write rows themselves): everyone may have rows.
    #[cfg(test)]
    pub(super) fn anyone() -> JournalMembers {
        JournalMembers {
            inner: std::sync::Mutex::new(Members {
                all: true,
                ..Members::default()
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Members> {
        // A panic while holding it leaves a set that is still a superset.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Before a commit writes journal rows of `id`.
    pub(super) fn mark(&self, id: &Arc<str>) {
        let mut members = self.lock();
        if !members.ids.contains(&**id) {
            members.ids.insert(Arc::clone(id));
        }
    }

    /// After a commit deleted journal rows: only `still` may have some.
    pub(super) fn narrow_to<'a>(&self, still: impl IntoIterator<Item = &'a Arc<str>>) {
        let mut members = self.lock();
        members.ids = still.into_iter().cloned().collect();
        members.epoch += 1;
    }

    /// Noted before a read transaction takes its snapshot.
    pub(super) fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// Asked after the snapshot is taken, with the epoch noted before it:
    /// whether the journal in that snapshot may hold rows of `id`.
    pub(super) fn may_hold(&self, id: &str, epoch: u64) -> bool {
        let members = self.lock();
        members.all || members.epoch != epoch || members.ids.contains(id)
    }
}

/// Opens a read transaction on `conn` and says whether its snapshot may
/// hold journal rows of `id` (see [`JournalMembers`]).
pub(super) fn begin_read<'c>(
    conn: &'c mut Connection,
    members: &JournalMembers,
    id: &str,
) -> Result<(rusqlite::Transaction<'c>, bool), StoreError> {
    let epoch = members.epoch();
    let tx = conn.transaction()?;
    // SQLite takes the snapshot at the transaction's first read, not at
    // its BEGIN.
    tx.prepare_cached("SELECT 1 FROM conversations WHERE id = ?1")?
        .query_row([id], |_| Ok(()))
        .optional()?;
    let journal = members.may_hold(id, epoch);
    Ok((tx, journal))
}

/// Conversations whose runs one fold step inserts: with one index page
/// per conversation, what bounds a step's transaction (about 5 ms for 64
/// runs of a few events here).
pub(super) const STEP_CONVERSATIONS: usize = 64;

/// Runs one fold step reads, at least (whole commits: a paced commit
/// holds a dozen, a step is about 2 ms of the writer's time).
const STEP_READS: usize = 2048;

/// Journal rows one fold step deletes.
const STEP_DELETES: i64 = 8192;

/// A fold in progress: it reads the journal's rows up to the last one there
/// was when it started, then inserts their merged runs, then deletes them,
/// a step at a time.
pub(super) struct Fold {
    /// The last journal row when it started: the rows up to it are its own.
    upto: i64,
    /// Rows read up to here (`None`: all are read).
    read_upto: Option<i64>,
    /// Rows deleted up to here.
    deleted_upto: i64,
    /// Skip rows already in `event_runs`.
    skip_folded: bool,
    /// Each conversation's merged runs, in the order the conversations
    /// first appear; once all are read, the ones not yet inserted, in
    /// reverse (steps take them from the end).
    runs: Vec<(String, Vec<EncodedRun>)>,
    /// Where a conversation is in `runs` while reading, and its runs' last
    /// seq when `skip_folded`.
    at: HashMap<String, (usize, u64)>,
    /// Events it moves.
    pub(super) events: usize,
    /// Time spent in its steps (appends waited meanwhile).
    pub(super) busy: Duration,
    /// When it may take its next step (see [`FOLD_REST_PER_BUSY`]).
    resume_at: Instant,
}

impl Fold {
    /// A fold of the journal as it is now; `None` when it is empty. Rows
    /// that are already in `event_runs` (left by a fold that did not
    /// finish) are skipped when `skip_folded`, which costs an index lookup
    /// per conversation.
    pub(super) fn start(conn: &Connection, skip_folded: bool) -> Result<Option<Fold>, StoreError> {
        let upto: Option<i64> = conn
            .prepare_cached("SELECT max(id) FROM event_journal")?
            .query_row([], |row| row.get(0))?;
        Ok(upto.map(|upto| Fold {
            upto,
            read_upto: Some(0),
            deleted_upto: 0,
            skip_folded,
            runs: Vec::new(),
            at: HashMap::new(),
            events: 0,
            busy: Duration::ZERO,
            resume_at: Instant::now(),
        }))
    }

    /// One step: the next rows read (without a transaction: the rows up to
    /// `upto` change only by deletion), or, in a transaction of its own,
    /// the runs of the next few conversations inserted, or, once all are
    /// in, the next rows deleted. Returns whether the fold is done.
    pub(super) fn step(&mut self, conn: &Connection) -> Result<bool, StoreError> {
        let started = Instant::now();
        let done = if let Some(after) = self.read_upto {
            self.read(conn, after).map(|()| false)
        } else {
            conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
            let done = self.write(conn).and_then(|done| {
                conn.prepare_cached("COMMIT")?.execute([])?;
                Ok(done)
            });
            if done.is_err() {
                rollback(conn);
            }
            done
        };
        let took = started.elapsed();
        self.busy += took;
        self.resume_at = Instant::now() + took * FOLD_REST_PER_BUSY;
        done
    }

    /// When it may take its next step.
    pub(super) fn resume_at(&self) -> Instant {
        self.resume_at
    }

    /// Reads the rows after `after`, merging each conversation's
    /// consecutive runs.
    fn read(&mut self, conn: &Connection, after: i64) -> Result<(), StoreError> {
        let mut stmt = conn.prepare_cached(
            "SELECT id, runs, events FROM event_journal WHERE id > ?1 AND id <= ?2 ORDER BY id",
        )?;
        let mut found = stmt.query(params![after, self.upto])?;
        let mut read = 0;
        let mut last = after;
        let mut all_read = true;
        while let Some(row) = found.next()? {
            if read >= STEP_READS {
                all_read = false;
                break;
            }
            last = row.get(0)?;
            let events = journal_text(last, row.get_ref(2)?.as_blob()?)?;
            let entries = journal_entries(last, row.get_ref(1)?.as_blob()?)?;
            read += entries.len();
            for entry in entries {
                let id = &*entry.0;
                let (slot, folded_upto) = match self.at.get(id) {
                    Some(&known) => known,
                    None => {
                        let folded_upto = if self.skip_folded {
                            runs_head(conn, id)?
                        } else {
                            0
                        };
                        let known = (self.runs.len(), folded_upto);
                        self.at.insert(id.to_owned(), known);
                        self.runs.push((id.to_owned(), Vec::new()));
                        known
                    }
                };
                // Borrowed from the row: most pieces are merged into a run
                // already held, so only a new run copies its text.
                let piece = Piece {
                    first_seq: entry.1,
                    last_seq: entry.2,
                    n: entry.3,
                    min_ts: &entry.4,
                    max_ts: &entry.5,
                    json: entry.events_in(events)?,
                };
                if piece.last_seq <= folded_upto {
                    continue;
                }
                self.events += piece.n;
                let (id, merged) = &mut self.runs[slot];
                match merged.last_mut() {
                    Some(run)
                        if run.n + piece.n <= RUN_MAX_EVENTS
                            && run.last_seq + 1 == piece.first_seq =>
                    {
                        merge(id, run, &piece)?;
                    }
                    _ => merged.push(piece.to_owned_run()),
                }
            }
        }
        if all_read {
            self.read_upto = None;
            self.at = HashMap::new();
            self.runs.reverse();
        } else {
            self.read_upto = Some(last);
        }
        Ok(())
    }

    fn write(&mut self, conn: &Connection) -> Result<bool, StoreError> {
        if !self.runs.is_empty() {
            let from = self.runs.len().saturating_sub(STEP_CONVERSATIONS);
            for (id, runs) in self.runs[from..].iter().rev() {
                for run in runs {
                    insert_encoded(conn, id, run)?;
                }
            }
            // Only once committed would be right, but a step that fails
            // ends the fold: what it inserted is rolled back, and the next
            // fold reads the rows again.
            self.runs.truncate(from);
            return Ok(false);
        }
        let to = self
            .upto
            .min(self.deleted_upto.saturating_add(STEP_DELETES));
        conn.prepare_cached("DELETE FROM event_journal WHERE id <= ?1")?
            .execute([to])?;
        self.deleted_upto = to;
        Ok(to >= self.upto)
    }

    /// A conversation was deleted: its runs must not come back.
    pub(super) fn forget(&mut self, id: &str) {
        for (run_id, runs) in &mut self.runs {
            if run_id == id {
                runs.clear();
            }
        }
    }
}

/// A run of one conversation as read from the journal.
pub(super) struct JournalRun {
    pub(super) last_seq: u64,
    pub(super) max_ts: String,
    /// Its events' JSON array (empty when they were not asked for).
    pub(super) json: String,
}

/// The runs the journal holds of `id` whose last seq is above `above`, in
/// commit order (which is seq order); `events`: whether their events are
/// wanted, or only their heads (then no events are read). In the caller's
/// read transaction.
pub(super) fn runs_of(
    conn: &Connection,
    id: &str,
    above: u64,
    events: bool,
) -> Result<Vec<JournalRun>, StoreError> {
    let mut found = Vec::new();
    for_each_commit_holding(conn, id, |_, entries, row| {
        let blob = if events {
            row.get_ref(2)?.as_blob()?
        } else {
            &[]
        };
        for entry in entries.iter().filter(|e| *e.0 == *id && e.2 > above) {
            found.push(JournalRun {
                last_seq: entry.2,
                max_ts: entry.5.clone().into_owned(),
                json: if events {
                    entry.events(blob)?.to_owned()
                } else {
                    String::new()
                },
            });
        }
        Ok(())
    })?;
    Ok(found)
}

/// Calls `each` with every commit of the journal that holds runs of `id`,
/// in commit order: its row id, its index's entries, and the row (whose
/// `events`, column 2, SQLite reads only if `each` asks for it). A commit
/// holds runs of `id` only if its index contains the id as the writer
/// writes it ([`journal_needle`]), so the others are not parsed.
fn for_each_commit_holding(
    conn: &Connection,
    id: &str,
    mut each: impl FnMut(i64, &[JournalEntry<'_>], &rusqlite::Row<'_>) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let needle = journal_needle(id)?;
    let needle = memchr::memmem::Finder::new(&needle);
    let mut stmt = conn.prepare_cached("SELECT id, runs, events FROM event_journal ORDER BY id")?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let runs = row.get_ref(1)?.as_blob()?;
        if needle.find(runs).is_none() {
            continue;
        }
        let row_id: i64 = row.get(0)?;
        let entries = journal_entries(row_id, runs)?;
        if entries.iter().any(|entry| *entry.0 == *id) {
            each(row_id, &entries, row)?;
        }
    }
    Ok(())
}

/// Each conversation's newest seq in the journal, with its time: what
/// summaries of many conversations take from it. It parses every commit's
/// `runs`, but reads no events.
pub(super) fn heads(conn: &Connection) -> Result<HashMap<String, (u64, String)>, StoreError> {
    let mut stmt = conn.prepare_cached("SELECT id, runs FROM event_journal ORDER BY id")?;
    let mut rows = stmt.query([])?;
    let mut heads: HashMap<String, (u64, String)> = HashMap::new();
    while let Some(row) = rows.next()? {
        for entry in journal_entries(row.get(0)?, row.get_ref(1)?.as_blob()?)? {
            // Commit order is each conversation's seq order.
            let head = (entry.2, entry.5.into_owned());
            match heads.get_mut(&*entry.0) {
                Some(known) => *known = head,
                None => {
                    heads.insert(entry.0.into_owned(), head);
                }
            }
        }
    }
    Ok(heads)
}

/// Takes a deleted conversation's runs out of the journal: each commit
/// that holds some is written again
/// without them, or deleted when it held only theirs. It reads the whole
/// journal (about a second of commits); deletes are rare.
pub(super) fn delete_runs_of(conn: &Connection, id: &str) -> Result<(), StoreError> {
    let mut rewritten = Vec::new();
    for_each_commit_holding(conn, id, |row_id, entries, row| {
        let events = row.get_ref(2)?.as_blob()?;
        let mut kept = JournalRow::default();
        for entry in entries.iter().filter(|entry| *entry.0 != *id) {
            kept.add_entry(entry, entry.events(events)?)?;
        }
        rewritten.push((row_id, kept));
        Ok(())
    })?;
    for (row_id, kept) in rewritten {
        kept.replace(conn, row_id)?;
    }
    Ok(())
}

/// The last seq of a conversation's runs in `event_runs` (0 for none).
pub(super) fn runs_head(conn: &Connection, id: &str) -> Result<u64, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT coalesce(max(last_seq), 0) FROM event_runs WHERE conversation_id = ?1",
        )?
        .query_row([id], |row| row.get(0))?)
}

/// A journal row's run as read, borrowing the row's text.
struct Piece<'r> {
    first_seq: u64,
    last_seq: u64,
    n: usize,
    min_ts: &'r str,
    max_ts: &'r str,
    json: &'r str,
}

impl Piece<'_> {
    fn to_owned_run(&self) -> EncodedRun {
        EncodedRun {
            first_seq: self.first_seq,
            last_seq: self.last_seq,
            n: self.n,
            min_ts: self.min_ts.to_owned(),
            max_ts: self.max_ts.to_owned(),
            json: self.json.to_owned(),
        }
    }
}

/// Appends `next`'s events to `run` (the run it follows): the two JSON
/// arrays become one without decoding either.
fn merge(id: &str, run: &mut EncodedRun, next: &Piece<'_>) -> Result<(), StoreError> {
    let inner = next
        .json
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .filter(|s| !s.is_empty());
    let (Some(inner), Some(']')) = (inner, run.json.pop()) else {
        return Err(StoreError::Backend(format!(
            "conversation {id}: a journal run (seq {} to {}) is not readable",
            next.first_seq, next.last_seq
        )));
    };
    run.json.push(',');
    run.json.push_str(inner);
    run.json.push(']');
    run.last_seq = next.last_seq;
    run.n += next.n;
    if next.min_ts < run.min_ts.as_str() {
        next.min_ts.clone_into(&mut run.min_ts);
    }
    if next.max_ts > run.max_ts.as_str() {
        next.max_ts.clone_into(&mut run.max_ts);
    }
    Ok(())
}

/// A whole fold at once, step after step: at open (a crash may have left a
/// journal, and a fold half done), when the writer closes, and before a
/// prune looks at the newest runs. Returns the events moved.
pub(super) fn fold_now(conn: &Connection) -> Result<usize, StoreError> {
    let Some(mut fold) = Fold::start(conn, true)? else {
        return Ok(0);
    };
    while !fold.step(conn)? {}
    Ok(fold.events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_look_in_the_journal_for_marked_conversations_and_after_a_narrowing() {
        let members = JournalMembers::default();
        let before = members.epoch();
        assert!(!members.may_hold("a", before));
        members.mark(&"a".into());
        assert!(members.may_hold("a", before));
        assert!(!members.may_hold("b", before));

        // A fold deleted "a"'s rows; "b" was written meanwhile. A reader
        // that noted the epoch before the narrowing looks for anyone.
        members.narrow_to([&"b".into()]);
        assert!(members.may_hold("a", before));
        let after = members.epoch();
        assert_ne!(after, before);
        assert!(!members.may_hold("a", after));
        assert!(members.may_hold("b", after));

        assert!(JournalMembers::anyone().may_hold("a", 0));
    }

    #[test]
    fn a_conversation_keeps_to_the_journal_until_its_rows_are_folded() {
        let now = Instant::now();
        let mut fill = JournalFill::default();
        assert_eq!(fill.due_at(), None);
        assert_eq!(fill.table_for("a", DIRECT_RUN_EVENTS), RunTable::Runs);
        assert_eq!(
            fill.table_for("a", DIRECT_RUN_EVENTS - 1),
            RunTable::Journal
        );

        fill.added(&"a".into(), 1, 200, now);
        assert_eq!(fill.table_for("a", 100), RunTable::Journal);
        assert_eq!(fill.table_for("b", 100), RunTable::Runs);
        assert!(!fill.is_due(now + FOLD_AFTER / 2));
        assert!(fill.is_due(now + FOLD_AFTER));

        // While a fold moves its rows, and after the fold failed, "a" is
        // still in the journal.
        fill.fold_started();
        assert_eq!(fill.due_at(), None);
        assert_eq!(fill.table_for("a", 100), RunTable::Journal);
        let later = now + FOLD_AFTER;
        fill.fold_failed(later);
        assert_eq!(fill.table_for("a", 100), RunTable::Journal);
        assert!(!fill.is_due(later + FOLD_AFTER / 2));
        assert!(fill.is_due(later + FOLD_AFTER));

        fill.fold_started();
        fill.added(&"b".into(), 1, 200, later);
        fill.fold_finished();
        assert_eq!(fill.table_for("a", 100), RunTable::Runs);
        assert_eq!(fill.table_for("b", 100), RunTable::Journal);

        // A full journal is due at once, by its events or by their bytes;
        // a deleted conversation has no rows left.
        assert!(!fill.is_behind());
        fill.added(&"b".into(), FOLD_EVENTS, FOLD_EVENTS * 200, later);
        assert!(fill.is_due(later));
        // The same fill tells a fold in progress that it is behind: it
        // no longer rests between its steps.
        assert!(fill.is_behind());
        fill.fold_started();
        fill.added(&"b".into(), 8, FOLD_BYTES - 1, later);
        assert!(!fill.is_due(later));
        fill.added(&"b".into(), 1, 1, later);
        assert!(fill.is_due(later));
        fill.forget("b");
        assert_eq!(fill.table_for("b", 100), RunTable::Runs);
    }
}

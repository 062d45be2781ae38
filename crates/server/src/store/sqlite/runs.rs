//! Event runs: the events of one conversation committed together, kept as
//! one row of `event_runs` whose `events` column is a JSON array of
//! `[seq, ts, kind, data]` (`data` the event's own JSON). One row per
//! conversation per commit, instead of one per event, is what keeps the
//! B-tree and WAL work of a commit per conversation rather than per event.
//!
//! A commit writes its runs into the journal (`journal.rs`), all of them in
//! one row ([`JournalRow`]), which the writer later folds into
//! `event_runs`; the readers here read both, the journal (its runs of the
//! conversation, see `journal::runs_of`) after `event_runs` (every seq in
//! the journal is above those of the conversation's runs), inside the
//! caller's read transaction.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::*;
use crate::event::push_json_str;

/// Most events in one run: a long burst becomes several runs, so that a
/// read from a seq decodes at most this many events it does not need.
pub(super) const RUN_MAX_EVENTS: usize = 256;

/// One event as written into a run.
#[derive(Clone, Copy)]
pub(super) struct RunEvent<'e> {
    pub(super) seq: u64,
    pub(super) ts: &'e str,
    pub(super) kind: &'e str,
    /// The event's data, JSON text.
    pub(super) data: &'e str,
}

impl<'e> From<&'e EventRecord> for RunEvent<'e> {
    fn from(record: &'e EventRecord) -> Self {
        RunEvent {
            seq: record.seq,
            ts: record.ts(),
            kind: &record.kind,
            data: record.data(),
        }
    }
}

/// An encoded run and what its row says of it.
pub(super) struct EncodedRun {
    pub(super) first_seq: u64,
    pub(super) last_seq: u64,
    pub(super) n: usize,
    pub(super) min_ts: String,
    pub(super) max_ts: String,
    pub(super) json: String,
}

/// Encodes events given in seq order; `None` for none.
pub(super) fn encode<'e>(events: impl IntoIterator<Item = RunEvent<'e>>) -> Option<EncodedRun> {
    let mut json = String::new();
    let head = encode_into(&mut json, events)?;
    Some(EncodedRun {
        first_seq: head.first_seq,
        last_seq: head.last_seq,
        n: head.n,
        min_ts: head.min_ts.to_owned(),
        max_ts: head.max_ts.to_owned(),
        json,
    })
}

/// What a run's row says of its events, borrowing their times.
pub(super) struct RunHead<'e> {
    pub(super) first_seq: u64,
    pub(super) last_seq: u64,
    pub(super) n: usize,
    pub(super) min_ts: &'e str,
    pub(super) max_ts: &'e str,
}

/// Encodes events given in seq order as a run's JSON array at the end of
/// `out`; `None` (and `out` as it was) for none.
fn encode_into<'e>(
    out: &mut String,
    events: impl IntoIterator<Item = RunEvent<'e>>,
) -> Option<RunHead<'e>> {
    let mut events = events.into_iter();
    let first = events.next()?;
    let mut head = RunHead {
        first_seq: first.seq,
        last_seq: first.seq,
        n: 0,
        min_ts: first.ts,
        max_ts: first.ts,
    };
    out.reserve(64 + first.data.len());
    out.push('[');
    for ev in std::iter::once(first).chain(events) {
        if head.n > 0 {
            out.push(',');
        }
        head.min_ts = head.min_ts.min(ev.ts);
        head.max_ts = head.max_ts.max(ev.ts);
        head.last_seq = ev.seq;
        head.n += 1;
        out.push('[');
        push_number(out, ev.seq);
        out.push(',');
        push_json_str(out, ev.ts);
        out.push(',');
        push_json_str(out, ev.kind);
        out.push(',');
        out.push_str(ev.data);
        out.push(']');
    }
    out.push(']');
    Some(head)
}

/// One commit's row of the journal, as it is built: the runs of every
/// conversation the commit journals (see `EVENT_JOURNAL` for the columns).
/// One row per commit rather than one per run: SQLite's cost is mostly per
/// row, and a paced commit holds one short run of each of many
/// conversations.
#[derive(Default)]
pub(super) struct JournalRow {
    /// The index: one [`JournalEntry`] per run, each in postcard's
    /// encoding, one after another.
    runs: Vec<u8>,
    events: String,
    count: usize,
}

impl JournalRow {
    /// Adds the run of `events` (given in seq order) of `conversation_id`.
    pub(super) fn add<'e>(
        &mut self,
        conversation_id: &str,
        events: impl IntoIterator<Item = RunEvent<'e>>,
    ) -> Result<(), StoreError> {
        let start = self.events.len();
        let Some(head) = encode_into(&mut self.events, events) else {
            return Ok(());
        };
        self.push_entry(conversation_id, &head, start)
    }

    /// Adds a run read from another journal row: `entry`, whose events are
    /// `json`.
    pub(super) fn add_entry(
        &mut self,
        entry: &JournalEntry<'_>,
        json: &str,
    ) -> Result<(), StoreError> {
        let start = self.events.len();
        self.events.push_str(json);
        let head = RunHead {
            first_seq: entry.1,
            last_seq: entry.2,
            n: entry.3,
            min_ts: &entry.4,
            max_ts: &entry.5,
        };
        self.push_entry(&entry.0, &head, start)
    }

    /// Says in `runs` that the run of `conversation_id` is what `events`
    /// holds from `start` on.
    fn push_entry(
        &mut self,
        conversation_id: &str,
        head: &RunHead<'_>,
        start: usize,
    ) -> Result<(), StoreError> {
        let entry = JournalEntry(
            Cow::Borrowed(conversation_id),
            head.first_seq,
            head.last_seq,
            head.n,
            Cow::Borrowed(head.min_ts),
            Cow::Borrowed(head.max_ts),
            start,
            self.events.len() - start,
        );
        let before = self.runs.len();
        if let Err(e) = postcard::to_io(&entry, &mut self.runs) {
            // Writing into a Vec does not fail; were it to, the row must
            // not keep half an entry.
            self.runs.truncate(before);
            self.events.truncate(start);
            return Err(StoreError::Backend(format!(
                "conversation {conversation_id}: a journal entry could not be encoded: {e}"
            )));
        }
        self.count += 1;
        Ok(())
    }

    /// Inserts the row (nothing when it holds no run).
    pub(super) fn insert(&mut self, conn: &Connection) -> Result<(), StoreError> {
        if self.count == 0 {
            return Ok(());
        }
        conn.prepare_cached("INSERT INTO event_journal (runs, events) VALUES (?1, ?2)")?
            .execute(params![self.runs, self.events.as_bytes()])?;
        Ok(())
    }

    /// Bytes of encoded events the row holds so far.
    pub(super) fn event_bytes(&self) -> usize {
        self.events.len()
    }

    /// Empties the row, keeping its buffers unless a large group grew
    /// them past what a usual one needs.
    pub(super) fn clear(&mut self) {
        const KEPT_BYTES: usize = 1 << 20;
        if self.events.capacity() > KEPT_BYTES || self.runs.capacity() > KEPT_BYTES {
            *self = JournalRow::default();
        } else {
            self.runs.clear();
            self.events.clear();
            self.count = 0;
        }
    }

    /// Writes the row in place of row `row_id` (deletes that row when this
    /// one holds no run).
    pub(super) fn replace(self, conn: &Connection, row_id: i64) -> Result<(), StoreError> {
        if self.count == 0 {
            conn.prepare_cached("DELETE FROM event_journal WHERE id = ?1")?
                .execute([row_id])?;
            return Ok(());
        }
        conn.prepare_cached("UPDATE event_journal SET runs = ?2, events = ?3 WHERE id = ?1")?
            .execute(params![row_id, self.runs, self.events.as_bytes()])?;
        Ok(())
    }
}

/// One entry of a journal row's `runs`: the run's conversation, first and
/// last seq, number of events, oldest and newest time, and where its JSON
/// array is in the row's `events` (start and length in bytes). Read
/// borrowing the row's bytes.
#[derive(Serialize, Deserialize)]
pub(super) struct JournalEntry<'a>(
    #[serde(borrow)] pub(super) Cow<'a, str>,
    pub(super) u64,
    pub(super) u64,
    pub(super) usize,
    #[serde(borrow)] pub(super) Cow<'a, str>,
    #[serde(borrow)] pub(super) Cow<'a, str>,
    pub(super) usize,
    pub(super) usize,
);

impl JournalEntry<'_> {
    /// The run's JSON array: its slice of the row's `events`.
    pub(super) fn events<'e>(&self, events: &'e [u8]) -> Result<&'e str, StoreError> {
        self.range()
            .and_then(|range| events.get(range))
            .and_then(|bytes| std::str::from_utf8(bytes).ok())
            .ok_or_else(|| self.unreadable())
    }

    /// The same, from the row's `events` already checked as text (see
    /// [`journal_text`]): what a reader of every run of a row takes, as
    /// checking a row's text at once costs less than checking each run's
    /// (the fold's instructions fell by about 115 per event, callgrind).
    pub(super) fn events_in<'e>(&self, events: &'e str) -> Result<&'e str, StoreError> {
        self.range()
            .and_then(|range| events.get(range))
            .ok_or_else(|| self.unreadable())
    }

    fn range(&self) -> Option<std::ops::Range<usize>> {
        let (start, len) = (self.6, self.7);
        Some(start..start.checked_add(len)?)
    }

    fn unreadable(&self) -> StoreError {
        StoreError::Backend(format!(
            "conversation {}: a journal run (seq {} to {}) is not readable",
            self.0, self.1, self.2
        ))
    }
}

/// A journal row's `events` as text, checked once for all its runs.
pub(super) fn journal_text(row_id: i64, events: &[u8]) -> Result<&str, StoreError> {
    std::str::from_utf8(events).map_err(|e| {
        StoreError::Backend(format!(
            "journal row {row_id}: its events are not readable: {e}"
        ))
    })
}

/// Decodes a journal row's `runs` column.
///
/// Why binary: the fold reads every row, and paced traffic journals about
/// one run per event; parsing an entry as JSON took about 2,400
/// instructions, 8 % of what the server spends per event there, and
/// decoding it here about 800 (half of them the UTF-8 checks of its
/// strings).
pub(super) fn journal_entries(
    row_id: i64,
    mut runs: &[u8],
) -> Result<Vec<JournalEntry<'_>>, StoreError> {
    // An entry takes about 90 bytes (an id and two times, with numbers):
    // room for all of them at once, rather than growing four or five
    // times for a commit of a dozen.
    let mut entries = Vec::with_capacity(runs.len() / 64 + 1);
    while !runs.is_empty() {
        let (entry, rest) = postcard::take_from_bytes(runs).map_err(|e| {
            StoreError::Backend(format!(
                "journal row {row_id}: its runs are not readable: {e}"
            ))
        })?;
        entries.push(entry);
        runs = rest;
    }
    Ok(entries)
}

/// `id` as a journal row's `runs` holds it (its length, then its bytes):
/// a row holds runs of the conversation only if its `runs` contains this,
/// which lets readers skip the others without decoding them.
pub(super) fn journal_needle(id: &str) -> Result<Vec<u8>, StoreError> {
    postcard::to_allocvec(id).map_err(|e| {
        StoreError::Backend(format!(
            "conversation {id}: its id could not be encoded: {e}"
        ))
    })
}

/// Writes `n` in decimal. Every event and every run entry writes a few:
/// through `write!` each was a pass through the formatting machinery,
/// about 300 instructions, most of a journal entry's cost.
fn push_number(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

/// Where a run is inserted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RunTable {
    /// `event_runs`, indexed by conversation and seq.
    Runs,
    /// `event_journal`, in commit order, without an index (see
    /// [`JournalRow`]).
    Journal,
}

/// Inserts one run (nothing for no events); into the journal, as a row of
/// its own.
pub(super) fn insert_run<'e>(
    conn: &Connection,
    table: RunTable,
    conversation_id: &str,
    events: impl IntoIterator<Item = RunEvent<'e>>,
) -> Result<(), StoreError> {
    match table {
        RunTable::Runs => {
            let Some(run) = encode(events) else {
                return Ok(());
            };
            insert_encoded(conn, conversation_id, &run)
        }
        RunTable::Journal => {
            let mut row = JournalRow::default();
            row.add(conversation_id, events)?;
            row.insert(conn)
        }
    }
}

/// Inserts a run already encoded into `event_runs`.
pub(super) fn insert_encoded(
    conn: &Connection,
    conversation_id: &str,
    run: &EncodedRun,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO event_runs (conversation_id, first_seq, last_seq, n, min_ts, max_ts, \
         events) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        conversation_id,
        clamp_i64(run.first_seq),
        clamp_i64(run.last_seq),
        run.n as i64,
        run.min_ts,
        run.max_ts,
        run.json,
    ])?;
    Ok(())
}

/// One event as read back from a run, borrowing the row's text where it
/// has no escapes.
#[derive(Deserialize)]
pub(super) struct StoredEvent<'a>(
    u64,
    #[serde(borrow)] Cow<'a, str>,
    #[serde(borrow)] Cow<'a, str>,
    #[serde(borrow)] &'a RawValue,
);

impl StoredEvent<'_> {
    pub(super) fn seq(&self) -> u64 {
        self.0
    }

    pub(super) fn ts(&self) -> &str {
        &self.1
    }

    pub(super) fn kind(&self) -> &str {
        &self.2
    }

    pub(super) fn data(&self) -> &str {
        self.3.get()
    }

    pub(super) fn to_record(&self, conversation_id: &str) -> Arc<EventRecord> {
        Arc::new(EventRecord::from_parts(
            conversation_id,
            self.0,
            &self.1,
            intern_kind(&self.2),
            self.3.get(),
        ))
    }
}

/// Decodes a run's `events` column.
pub(super) fn decode<'a>(
    conversation_id: &str,
    json: &'a str,
) -> Result<Vec<StoredEvent<'a>>, StoreError> {
    serde_json::from_str(json).map_err(|e| {
        StoreError::Backend(format!(
            "conversation {conversation_id}: a stored event run is not readable: {e}"
        ))
    })
}

/// Events with seq > `after` that `keep` accepts, oldest first, at most
/// `limit`, read run by run from the first run that holds one: those of
/// `event_runs`, then the journal's above them (a fold may have copied
/// journal rows into runs and not yet deleted them, see `journal.rs`). The
/// caller holds a read transaction, so that a fold between the reads cannot
/// hide or double a run. `journal`: whether the journal may hold runs of
/// the conversation (else it is not read).
pub(super) fn events_after(
    conn: &Connection,
    id: &str,
    after: u64,
    limit: usize,
    journal: bool,
    mut keep: impl FnMut(&StoredEvent<'_>) -> bool,
) -> Result<Vec<Arc<EventRecord>>, StoreError> {
    let mut out = Vec::new();
    if limit == 0 {
        return Ok(out);
    }
    let journal_after = if journal {
        Some(after.max(super::journal::runs_head(conn, id)?))
    } else {
        None
    };
    let mut take = |json: &str, after: u64, out: &mut Vec<Arc<EventRecord>>| {
        for ev in decode(id, json)? {
            if ev.seq() > after && keep(&ev) {
                out.push(ev.to_record(id));
                if out.len() >= limit {
                    return Ok::<bool, StoreError>(true);
                }
            }
        }
        Ok(false)
    };
    let mut stmt = conn.prepare_cached(
        "SELECT events FROM event_runs WHERE conversation_id = ?1 AND last_seq > ?2 \
         ORDER BY last_seq",
    )?;
    let mut rows = stmt.query(params![id, clamp_i64(after)])?;
    while let Some(row) = rows.next()? {
        if take(row.get_ref(0)?.as_str()?, after, &mut out)? {
            return Ok(out);
        }
    }
    if let Some(after) = journal_after {
        for run in super::journal::runs_of(conn, id, after, true)? {
            if take(&run.json, after, &mut out)? {
                break;
            }
        }
    }
    Ok(out)
}

/// The last `n` events, oldest first: newest first from the journal (those
/// above the runs; not when `journal` says it holds none of them), then
/// from `event_runs` (within the caller's read transaction).
pub(super) fn tail(
    conn: &Connection,
    id: &str,
    n: usize,
    journal: bool,
) -> Result<Vec<Arc<EventRecord>>, StoreError> {
    let mut out: Vec<Arc<EventRecord>> = Vec::new();
    // Takes the run's events above `above`, newest first; whether `out`
    // is full.
    let take = |json: &str, above: u64, out: &mut Vec<Arc<EventRecord>>| {
        for ev in decode(id, json)?.iter().rev().filter(|ev| ev.seq() > above) {
            if out.len() >= n {
                return Ok::<bool, StoreError>(true);
            }
            out.push(ev.to_record(id));
        }
        Ok(out.len() >= n)
    };
    'read: {
        if n == 0 {
            break 'read;
        }
        if journal {
            let runs_head = super::journal::runs_head(conn, id)?;
            for run in super::journal::runs_of(conn, id, runs_head, true)?
                .iter()
                .rev()
            {
                if take(&run.json, runs_head, &mut out)? {
                    break 'read;
                }
            }
        }
        let mut stmt = conn.prepare_cached(
            "SELECT events FROM event_runs WHERE conversation_id = ?1 ORDER BY last_seq DESC",
        )?;
        let mut rows = stmt.query([id])?;
        while let Some(row) = rows.next()? {
            if take(row.get_ref(0)?.as_str()?, 0, &mut out)? {
                break 'read;
            }
        }
    }
    out.reverse();
    Ok(out)
}

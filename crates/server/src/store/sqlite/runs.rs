//! Event runs: the events of one conversation committed together, kept as
//! one row of `event_runs` whose `events` column is a JSON array of
//! `[seq, ts, kind, data]` (`data` the event's own JSON). One row per
//! conversation per commit, instead of one per event, is what keeps the
//! B-tree and WAL work of a commit per conversation rather than per event.
//!
//! A commit writes its runs into the journal (`journal.rs`), which the
//! writer later folds into `event_runs`; the readers here read both, the
//! journal after `event_runs` (every seq in the journal is above those of
//! the conversation's runs), inside the caller's read transaction.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::*;

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
    let mut events = events.into_iter();
    let first = events.next()?;
    let mut run = EncodedRun {
        first_seq: first.seq,
        last_seq: first.seq,
        n: 0,
        min_ts: String::new(),
        max_ts: String::new(),
        json: String::with_capacity(64 + first.data.len()),
    };
    let (mut min_ts, mut max_ts) = (first.ts, first.ts);
    run.json.push('[');
    for ev in std::iter::once(first).chain(events) {
        if run.n > 0 {
            run.json.push(',');
        }
        min_ts = min_ts.min(ev.ts);
        max_ts = max_ts.max(ev.ts);
        run.last_seq = ev.seq;
        run.n += 1;
        // Writing into a String cannot fail.
        let _ = write!(run.json, "[{},", ev.seq);
        push_json_str(&mut run.json, ev.ts);
        run.json.push(',');
        push_json_str(&mut run.json, ev.kind);
        run.json.push(',');
        run.json.push_str(ev.data);
        run.json.push(']');
    }
    run.json.push(']');
    min_ts.clone_into(&mut run.min_ts);
    max_ts.clone_into(&mut run.max_ts);
    Some(run)
}

/// Writes `s` as a JSON string. A ts and a kind never need escaping, so
/// the common case is copied without the allocation a serializer makes.
fn push_json_str(out: &mut String, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else if let Ok(quoted) = serde_json::to_string(s) {
        // A str serializes into a String without failing.
        out.push_str(&quoted);
    }
}

/// Where a run is inserted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RunTable {
    /// `event_runs`, indexed by conversation and seq.
    Runs,
    /// `event_journal`, in commit order, without an index.
    Journal,
}

impl RunTable {
    fn insert_sql(self) -> &'static str {
        match self {
            RunTable::Runs => {
                "INSERT INTO event_runs (conversation_id, first_seq, last_seq, n, min_ts, max_ts, \
                 events) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
            }
            RunTable::Journal => {
                "INSERT INTO event_journal (conversation_id, first_seq, last_seq, n, min_ts, \
                 max_ts, events) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
            }
        }
    }
}

/// Inserts one run (nothing for no events).
pub(super) fn insert_run<'e>(
    conn: &Connection,
    table: RunTable,
    conversation_id: &str,
    events: impl IntoIterator<Item = RunEvent<'e>>,
) -> Result<(), StoreError> {
    let Some(run) = encode(events) else {
        return Ok(());
    };
    insert_encoded(conn, table, conversation_id, &run)
}

/// Inserts a run already encoded.
pub(super) fn insert_encoded(
    conn: &Connection,
    table: RunTable,
    conversation_id: &str,
    run: &EncodedRun,
) -> Result<(), StoreError> {
    conn.prepare_cached(table.insert_sql())?.execute(params![
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
/// hide or double a run. `journal`: whether the journal may hold rows of
/// the conversation (else it is not scanned).
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
    for (sql, after) in [
        (
            "SELECT events FROM event_runs WHERE conversation_id = ?1 AND last_seq > ?2 \
             ORDER BY last_seq",
            Some(after),
        ),
        (
            "SELECT events FROM event_journal WHERE conversation_id = ?1 AND last_seq > ?2 \
             ORDER BY id",
            journal_after,
        ),
    ] {
        let Some(after) = after else {
            continue;
        };
        let mut stmt = conn.prepare_cached(sql)?;
        let mut rows = stmt.query(params![id, clamp_i64(after)])?;
        while let Some(row) = rows.next()? {
            let json = row.get_ref(0)?.as_str()?;
            for ev in decode(id, json)? {
                if ev.seq() > after && keep(&ev) {
                    out.push(ev.to_record(id));
                    if out.len() >= limit {
                        return Ok(out);
                    }
                }
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
    if n > 0 {
        let runs_head = if journal {
            Some(super::journal::runs_head(conn, id)?)
        } else {
            None
        };
        'tables: for (sql, above) in [
            (
                "SELECT events FROM event_journal WHERE conversation_id = ?1 AND last_seq > ?2 \
                 ORDER BY id DESC",
                runs_head,
            ),
            (
                "SELECT events FROM event_runs WHERE conversation_id = ?1 AND last_seq > ?2 \
                 ORDER BY last_seq DESC",
                Some(0),
            ),
        ] {
            let Some(above) = above else {
                continue;
            };
            let mut stmt = conn.prepare_cached(sql)?;
            let mut rows = stmt.query(params![id, clamp_i64(above)])?;
            while let Some(row) = rows.next()? {
                let json = row.get_ref(0)?.as_str()?;
                for ev in decode(id, json)?.iter().rev().filter(|ev| ev.seq() > above) {
                    out.push(ev.to_record(id));
                    if out.len() >= n {
                        break 'tables;
                    }
                }
            }
        }
    }
    out.reverse();
    Ok(out)
}

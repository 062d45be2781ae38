//! The database's format version (`PRAGMA user_version`) and the steps that
//! bring a store written by an earlier release up to it, run by the writer
//! connection at open, each in its own transaction with the version it
//! reaches, so that a store is either before or after a step.
//!
//! - 0: linger 0.1.0, the release before versions (one row per event in
//!   `events`, indexed by `ts`).
//! - 1: `client_msgs` has an index on `(conversation_id, seq)`: the
//!   `client_msg_id` window is read newest first and pruned below its first
//!   seq without scanning a conversation's ids.
//! - 2: the events of one conversation committed together are one row of
//!   `event_runs` (see `runs.rs`); `events` and its `ts` index are gone; the
//!   conversations row is written only when a field only it records
//!   changes (see [`META_SELECT`]).
//! - 3: commits write their runs into `event_journal`, which the writer
//!   folds into `event_runs` (see `journal.rs`).
//! - 4: a commit's runs are one row of the journal (see `JournalRow`),
//!   not one row each; the row's index of its runs is JSON text.
//! - 5: the journal row's index is binary (postcard), which the fold
//!   decodes in about a third of the instructions (see
//!   `runs::journal_entries`).
//!
//! A new store is created at the latest version directly.

use std::time::Instant;

use serde_json::value::RawValue;

use super::runs::{insert_run, JournalEntry, JournalRow, RunEvent, RunTable, RUN_MAX_EVENTS};
use super::*;

/// The version this release writes.
pub(super) const VERSION: i64 = 5;

/// One step, from the version before it to the next.
type Step = fn(&Connection) -> Result<(), StoreError>;

/// The steps, the first from version 0 to 1.
const STEPS: [Step; VERSION as usize] = [
    client_msgs_by_seq,
    events_into_runs,
    journal,
    journal_per_commit,
    journal_index_in_binary,
];

/// Brings the database at `conn` to [`VERSION`]: creates the tables of a new
/// one, migrates one written by an earlier release, and refuses one written
/// by a newer release, which this one cannot read.
pub(super) fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let found: i64 = conn.pragma_query_value(None, "user_version", |row| row.get(0))?;
    if found > VERSION {
        return Err(StoreError::Backend(format!(
            "the store's format is version {found}, written by a newer linger; \
             this one reads up to version {VERSION}"
        )));
    }
    if found == 0 && !has_table(conn, "conversations")? {
        let tx = conn.transaction()?;
        tx.execute_batch(SCHEMA)?;
        tx.execute_batch(EVENT_RUNS)?;
        tx.execute_batch(EVENT_JOURNAL)?;
        tx.pragma_update(None, "user_version", VERSION)?;
        tx.commit()?;
        return Ok(());
    }
    for (to, step) in (1..).zip(STEPS).skip(usize::try_from(found).unwrap_or(0)) {
        let started = Instant::now();
        tracing::info!(from = to - 1, to, "store: upgrading the store's format");
        let tx = conn.transaction()?;
        step(&tx)?;
        tx.pragma_update(None, "user_version", to)?;
        tx.commit()?;
        tracing::info!(
            version = to,
            took_ms = started.elapsed().as_millis() as u64,
            "store: format upgraded"
        );
    }
    Ok(())
}

fn has_table(conn: &Connection, name: &str) -> Result<bool, StoreError> {
    Ok(conn
        .prepare("SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = ?1")?
        .exists([name])?)
}

/// 0 to 1.
fn client_msgs_by_seq(tx: &Connection) -> Result<(), StoreError> {
    tx.execute_batch(
        "CREATE INDEX IF NOT EXISTS client_msgs_by_seq ON client_msgs (conversation_id, seq);",
    )?;
    Ok(())
}

/// 1 to 2: every conversation's events, in seq order, become runs of at
/// most [`RUN_MAX_EVENTS`] consecutive events; then `events` (and its `ts`
/// index) is dropped. The conversations rows stay: their head is exact.
fn events_into_runs(tx: &Connection) -> Result<(), StoreError> {
    tx.execute_batch(EVENT_RUNS)?;
    let total: u64 = tx.query_row("SELECT count(*) FROM events", [], |row| row.get(0))?;
    tracing::info!(events = total, "store: gathering the events into runs");
    let mut read = tx.prepare(
        "SELECT conversation_id, seq, ts, kind, data FROM events ORDER BY conversation_id, seq",
    )?;
    let mut rows = read.query([])?;
    // (seq, ts, kind, data) of the run being gathered, of `run_id`.
    let mut run: Vec<(u64, String, String, String)> = Vec::with_capacity(RUN_MAX_EVENTS);
    let mut run_id = String::new();
    let flush = |run_id: &str, run: &[(u64, String, String, String)]| {
        insert_run(
            tx,
            RunTable::Runs,
            run_id,
            run.iter().map(|(seq, ts, kind, data)| RunEvent {
                seq: *seq,
                ts,
                kind,
                data,
            }),
        )
    };
    while let Some(row) = rows.next()? {
        let id = row.get_ref(0)?.as_str()?;
        let seq: u64 = row.get(1)?;
        let follows = run.last().is_some_and(|last| last.0 + 1 == seq);
        if !run.is_empty() && (id != run_id || !follows || run.len() >= RUN_MAX_EVENTS) {
            flush(&run_id, &run)?;
            run.clear();
        }
        if run.is_empty() {
            id.clone_into(&mut run_id);
        }
        let data: String = row.get(4)?;
        // A run embeds data as JSON: check, rather than write a run that
        // can never be read back.
        if serde_json::from_str::<&RawValue>(&data).is_err() {
            return Err(StoreError::Backend(format!(
                "upgrading the store: conversation {run_id}: event {seq} has data that is \
                 not JSON"
            )));
        }
        run.push((seq, row.get(2)?, row.get(3)?, data));
    }
    if !run.is_empty() {
        flush(&run_id, &run)?;
    }
    drop(rows);
    drop(read);
    tx.execute_batch("DROP TABLE events;")?;
    Ok(())
}

/// 2 to 3: the journal, empty.
pub(super) fn journal(tx: &Connection) -> Result<(), StoreError> {
    tx.execute_batch(
        "CREATE TABLE event_journal (
            id              INTEGER PRIMARY KEY,
            conversation_id TEXT NOT NULL,
            first_seq       INTEGER NOT NULL,
            last_seq        INTEGER NOT NULL,
            n               INTEGER NOT NULL,
            min_ts          TEXT NOT NULL,
            max_ts          TEXT NOT NULL,
            events          TEXT NOT NULL
        );",
    )?;
    Ok(())
}

/// The journal of format 4: as format 5's, but `runs` is a JSON array of
/// the entries (see `EVENT_JOURNAL`).
pub(super) const EVENT_JOURNAL_4: &str = "
CREATE TABLE event_journal (
    id     INTEGER PRIMARY KEY,
    runs   TEXT NOT NULL,
    events BLOB NOT NULL
);
";

/// 3 to 4: the journal of one row per commit. What a crash left in the
/// journal of format 3 (a run per row) is carried over, a row of one run
/// each, in its order, written as format 4 writes them; the next step
/// carries them on, and opening the store then folds them.
fn journal_per_commit(tx: &Connection) -> Result<(), StoreError> {
    let columns = "conversation_id, first_seq, last_seq, n, min_ts, max_ts, events";
    carry_journal_over(tx, 3, EVENT_JOURNAL_4, columns, |row| {
        let events = row.get_ref(6)?.as_str()?;
        let entry = JournalEntry(
            row.get_ref(0)?.as_str()?.into(),
            row.get(1)?,
            row.get(2)?,
            row.get(3)?,
            row.get_ref(4)?.as_str()?.into(),
            row.get_ref(5)?.as_str()?.into(),
            0,
            events.len(),
        );
        let runs = serde_json::to_string(&[entry])
            .map_err(|e| StoreError::Backend(format!("upgrading the store's journal: {e}")))?;
        tx.prepare_cached("INSERT INTO event_journal (runs, events) VALUES (?1, ?2)")?
            .execute(params![runs, events.as_bytes()])?;
        Ok(1)
    })
}

/// 4 to 5: the journal's index in binary. What a crash left in the journal
/// is carried over, row by row in its order, each with the same runs
/// written as the writer writes them; opening the store then folds them.
fn journal_index_in_binary(tx: &Connection) -> Result<(), StoreError> {
    carry_journal_over(tx, 4, EVENT_JOURNAL, "id, runs, events", |row| {
        let row_id: i64 = row.get(0)?;
        let entries: Vec<JournalEntry<'_>> = serde_json::from_str(row.get_ref(1)?.as_str()?)
            .map_err(|e| {
                StoreError::Backend(format!(
                    "upgrading the store: journal row {row_id}: its runs are not readable: {e}"
                ))
            })?;
        let events = row.get_ref(2)?.as_blob()?;
        let mut commit = JournalRow::default();
        for entry in &entries {
            commit.add_entry(entry, entry.events(events)?)?;
        }
        commit.insert(tx)?;
        Ok(entries.len() as u64)
    })
}

/// Replaces the journal of format `from` by an empty one made by `create`,
/// then calls `carry` with each of the old journal's rows (`columns`), in
/// their order, to write its runs into the new one (it returns how many).
fn carry_journal_over(
    tx: &Connection,
    from: i64,
    create: &str,
    columns: &str,
    mut carry: impl FnMut(&rusqlite::Row<'_>) -> Result<u64, StoreError>,
) -> Result<(), StoreError> {
    let old = format!("event_journal_{from}");
    tx.execute_batch(&format!("ALTER TABLE event_journal RENAME TO {old};"))?;
    tx.execute_batch(create)?;
    let mut read = tx.prepare(&format!("SELECT {columns} FROM {old} ORDER BY id"))?;
    let mut rows = read.query([])?;
    let mut carried = 0_u64;
    while let Some(row) = rows.next()? {
        carried += carry(row)?;
    }
    drop(rows);
    drop(read);
    if carried > 0 {
        tracing::info!(
            runs = carried,
            "store: the journal left by the last run is carried over"
        );
    }
    tx.execute_batch(&format!("DROP TABLE {old};"))?;
    Ok(())
}

/// The tables of a store of version 0, exactly as linger 0.1.0 created them:
/// what the migration tests build their stores with.
#[cfg(test)]
pub(super) const V0_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS conversations (
    id                    TEXT PRIMARY KEY NOT NULL,
    user                  TEXT NOT NULL,
    title                 TEXT NOT NULL,
    status                TEXT NOT NULL,
    created_at            TEXT NOT NULL,
    last_activity_at      TEXT NOT NULL,
    head_seq              INTEGER NOT NULL,
    close_delay_ms        INTEGER,
    observers             TEXT NOT NULL DEFAULT '[]',
    current_turn_id       TEXT,
    last_turn_message_seq INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS conversations_by_user ON conversations (user);
CREATE TABLE IF NOT EXISTS events (
    conversation_id TEXT NOT NULL,
    seq             INTEGER NOT NULL,
    ts              TEXT NOT NULL,
    kind            TEXT NOT NULL,
    data            TEXT NOT NULL,
    PRIMARY KEY (conversation_id, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_by_ts ON events (ts);
CREATE TABLE IF NOT EXISTS client_msgs (
    conversation_id TEXT NOT NULL,
    client_msg_id   TEXT NOT NULL,
    seq             INTEGER NOT NULL,
    PRIMARY KEY (conversation_id, client_msg_id)
) WITHOUT ROWID;
";

/// The store's format version.
#[cfg(test)]
pub(super) fn version(conn: &Connection) -> i64 {
    conn.pragma_query_value(None, "user_version", |row| row.get(0))
        .unwrap_or(-1)
}

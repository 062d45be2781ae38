//! The database's format, its version (`PRAGMA user_version`) and the
//! migration of a store written by an earlier version.
//!
//! Versions:
//!
//! - **1** (`user_version` 0, linger before the version was recorded): one
//!   row per event in `events`, with an index on `ts`; the conversations row
//!   rewritten by every append; every `client_msg_id` ever seen.
//! - **2**: a conversation's events committed together are one row of
//!   `event_runs` (at most [`RUN_MAX_EVENTS`]), found by the run's last seq;
//!   no per-event index; the conversations row is written when its status,
//!   turn or last started message changes (its `head_seq` and
//!   `last_activity_at` may then trail the runs, which have the latest);
//!   `client_msgs` keeps the last [`CLIENT_MSG_ID_WINDOW`] ids per
//!   conversation.
//!
//! A store of a newer version than this build knows is refused, never
//! guessed at.

use super::*;
use serde_json::value::RawValue;

use crate::store::CLIENT_MSG_ID_WINDOW;

/// The version this build writes.
pub(super) const SCHEMA_VERSION: i64 = 2;

const CONVERSATIONS: &str = "
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
-- On `user` alone: an index that held last_activity_at would be rewritten by
-- nearly every commit, and one user's rows are few enough to sort.
CREATE INDEX IF NOT EXISTS conversations_by_user ON conversations (user);
CREATE TABLE IF NOT EXISTS client_msgs (
    conversation_id TEXT NOT NULL,
    client_msg_id   TEXT NOT NULL,
    seq             INTEGER NOT NULL,
    PRIMARY KEY (conversation_id, client_msg_id)
) WITHOUT ROWID;
";

/// What version 2 adds to the tables it shares with version 1.
const V2_ADDITIONS: &str = "
-- A run: events of one conversation committed together, as a JSON array of
-- [seq, ts, kind, data]. A rowid table (runs are large, and new ones go to
-- its end); the index finds the run holding a seq in O(log n). `min_ts` and
-- `max_ts` let retention prune whole runs without a per-event index.
CREATE TABLE IF NOT EXISTS event_runs (
    conversation_id TEXT NOT NULL,
    first_seq       INTEGER NOT NULL,
    last_seq        INTEGER NOT NULL,
    n               INTEGER NOT NULL,
    min_ts          TEXT NOT NULL,
    max_ts          TEXT NOT NULL,
    events          TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS event_runs_by_seq ON event_runs (conversation_id, last_seq);
-- To prune the client_msg_id window by age.
CREATE INDEX IF NOT EXISTS client_msgs_by_seq ON client_msgs (conversation_id, seq);
";

/// Brings the database to [`SCHEMA_VERSION`]: creates a new one, migrates
/// an older one, refuses a newer one.
pub(super) fn prepare(conn: &mut Connection, path: &Path) -> Result<(), StoreError> {
    let version: i64 = conn.pragma_query_value(None, "user_version", |row| row.get(0))?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::Backend(format!(
            "{}: the store has format version {version}, written by a newer linger; \
             this build reads versions up to {SCHEMA_VERSION}. Run the newer linger, \
             or point store.path elsewhere",
            path.display()
        )));
    }
    if version == SCHEMA_VERSION {
        return Ok(());
    }
    let tx = conn.transaction()?;
    if version == 0 && has_table(&tx, "events")? {
        tracing::info!(path = %path.display(), "store: migrating from format version 1 to 2");
        migrate_from_v1(&tx)?;
    } else {
        tx.execute_batch(CONVERSATIONS)?;
        tx.execute_batch(V2_ADDITIONS)?;
    }
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
    tx.commit()?;
    Ok(())
}

fn has_table(conn: &Connection, name: &str) -> Result<bool, StoreError> {
    Ok(conn
        .prepare("SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = ?1")?
        .exists([name])?)
}

/// Version 1 to 2, in the caller's transaction: events become runs of at
/// most [`RUN_MAX_EVENTS`] consecutive events, the `client_msgs` window is
/// applied, the conversations rows stay as they are (their head is exact).
fn migrate_from_v1(tx: &Connection) -> Result<(), StoreError> {
    tx.execute_batch(CONVERSATIONS)?;
    tx.execute_batch(V2_ADDITIONS)?;
    {
        let mut read = tx.prepare(
            "SELECT conversation_id, seq, ts, kind, data FROM events \
             ORDER BY conversation_id, seq",
        )?;
        let mut rows = read.query([])?;
        // (seq, ts, kind, data) of the run being gathered.
        let mut run: Vec<(u64, String, String, String)> = Vec::with_capacity(RUN_MAX_EVENTS);
        let mut run_id = String::new();
        let flush = |run_id: &str, run: &[(u64, String, String, String)]| {
            insert_run(
                tx,
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
            // A run holds data as JSON; the store only ever wrote JSON there.
            if serde_json::from_str::<&RawValue>(&data).is_err() {
                return Err(StoreError::Backend(format!(
                    "migration: conversation {run_id}: event {seq} has data that is not JSON"
                )));
            }
            run.push((seq, row.get(2)?, row.get(3)?, data));
        }
        if !run.is_empty() {
            flush(&run_id, &run)?;
        }
    }
    tx.execute_batch("DROP TABLE events;")?;
    tx.execute(
        "DELETE FROM client_msgs WHERE (conversation_id, client_msg_id) IN ( \
           SELECT conversation_id, client_msg_id FROM ( \
             SELECT conversation_id, client_msg_id, row_number() OVER \
               (PARTITION BY conversation_id ORDER BY seq DESC) AS newest \
             FROM client_msgs) \
           WHERE newest > ?1)",
        [CLIENT_MSG_ID_WINDOW as i64],
    )?;
    Ok(())
}

/// The format-1 schema, exactly as the release before versions created
/// it: what the migration tests build their stores with.
#[cfg(test)]
pub(super) const V1_SCHEMA: &str = "
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

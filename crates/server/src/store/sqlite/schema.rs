//! The database's shape: the tables, and how their rows become linger's
//! types (summaries, events) and back.

use super::*;

/// The tables of the format this release writes ([`migrate::VERSION`]), as
/// a new store is created with.
pub(super) const SCHEMA: &str = "
CREATE TABLE conversations (
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
CREATE INDEX conversations_by_user ON conversations (user);
CREATE TABLE client_msgs (
    conversation_id TEXT NOT NULL,
    client_msg_id   TEXT NOT NULL,
    seq             INTEGER NOT NULL,
    PRIMARY KEY (conversation_id, client_msg_id)
) WITHOUT ROWID;
CREATE INDEX client_msgs_by_seq ON client_msgs (conversation_id, seq);
";

/// The event runs (format 2, see `runs.rs`), created by a new store and by
/// the migration to format 2 alike.
pub(super) const EVENT_RUNS: &str = "
-- A run: events of one conversation committed together, as a JSON array of
-- [seq, ts, kind, data]. A rowid table (runs are large, and new ones go to
-- its end); the one index finds the run holding a seq in O(log n). `min_ts`
-- and `max_ts` let retention prune whole runs without a per-event index.
CREATE TABLE event_runs (
    conversation_id TEXT NOT NULL,
    first_seq       INTEGER NOT NULL,
    last_seq        INTEGER NOT NULL,
    n               INTEGER NOT NULL,
    min_ts          TEXT NOT NULL,
    max_ts          TEXT NOT NULL,
    events          TEXT NOT NULL
);
CREATE UNIQUE INDEX event_runs_by_seq ON event_runs (conversation_id, last_seq);
";

/// The journal (format 5, see `journal.rs`), created by a new store and by
/// the migration to format 5 alike.
pub(super) const EVENT_JOURNAL: &str = "
-- One row per commit that journaled runs, in commit order. `runs` is the
-- index: one entry per run, one after another, each a postcard-encoded
-- tuple (conversation_id, first_seq, last_seq, n, min_ts, max_ts, start,
-- len): strings as a varint length and their UTF-8 bytes, integers as
-- varints. The run's JSON array (as in event_runs.events) is the `len`
-- bytes of `events` from byte `start`. No index on the table: a commit
-- writes its last page, whichever conversations it holds, and a reader
-- scans it whole (it holds about a second of events; the writer folds it
-- into event_runs).
CREATE TABLE event_journal (
    id     INTEGER PRIMARY KEY,
    runs   BLOB NOT NULL,
    events BLOB NOT NULL
);
";

/// A conversations row as its readers see it. The row is written when a
/// field only it records changes (status, turn, last started message), so
/// its `head_seq` and `last_activity_at` may trail the events appended
/// since: those two come from the newest run of `event_runs` when it is
/// newer, and then from the journal's newest run when that is newer still
/// ([`RawMeta::with_journal_head`]). The columns are in
/// [`RawMeta::from_row`]'s order.
pub(super) const META_SELECT: &str = "SELECT c.id, c.user, c.title, c.status, c.created_at, \
     CASE WHEN r.last_seq > c.head_seq THEN r.max_ts ELSE c.last_activity_at END AS activity, \
     max(c.head_seq, coalesce(r.last_seq, 0)), c.close_delay_ms, c.observers, \
     c.current_turn_id, c.last_turn_message_seq \
     FROM conversations c LEFT JOIN event_runs r ON r.conversation_id = c.id \
     AND r.last_seq = (SELECT max(last_seq) FROM event_runs WHERE conversation_id = c.id)";

/// A conversations row as stored, before the checks that turn it into a
/// [`ConversationMeta`] (a row-mapping closure can only return SQLite errors).
pub(super) struct RawMeta {
    pub(super) id: String,
    pub(super) user: String,
    pub(super) title: String,
    pub(super) status: String,
    pub(super) created_at: String,
    pub(super) last_activity_at: String,
    pub(super) head_seq: u64,
    pub(super) close_delay_ms: Option<u64>,
    pub(super) observers: String,
    pub(super) current_turn_id: Option<String>,
    pub(super) last_turn_message_seq: u64,
}

impl RawMeta {
    pub(super) fn from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<RawMeta> {
        Ok(RawMeta {
            id: row.get(0)?,
            user: row.get(1)?,
            title: row.get(2)?,
            status: row.get(3)?,
            created_at: row.get(4)?,
            last_activity_at: row.get(5)?,
            head_seq: row.get(6)?,
            close_delay_ms: row.get(7)?,
            observers: row.get(8)?,
            current_turn_id: row.get(9)?,
            last_turn_message_seq: row.get(10)?,
        })
    }

    /// The summary once the journal's newest run of the conversation,
    /// `(last_seq, max_ts)`, is taken into account.
    pub(super) fn with_journal_head(mut self, head: Option<(u64, String)>) -> RawMeta {
        if let Some((last_seq, max_ts)) = head {
            if last_seq > self.head_seq {
                self.head_seq = last_seq;
                self.last_activity_at = max_ts;
            }
        }
        self
    }

    pub(super) fn into_meta(self) -> Result<ConversationMeta, StoreError> {
        let status = Status::parse(&self.status).ok_or_else(|| {
            StoreError::Backend(format!(
                "conversation {}: unknown status {:?}",
                self.id, self.status
            ))
        })?;
        let observers = parse_observers(&self.id, &self.observers)?;
        Ok(ConversationMeta {
            status,
            observers,
            close_delay: self.close_delay_ms.map(Duration::from_millis),
            id: self.id,
            user: self.user,
            title: self.title,
            created_at: self.created_at,
            last_activity_at: self.last_activity_at,
            head_seq: self.head_seq,
            current_turn_id: self.current_turn_id,
            last_turn_message_seq: self.last_turn_message_seq,
        })
    }
}

pub(super) fn parse_observers(id: &str, json: &str) -> Result<Vec<String>, StoreError> {
    serde_json::from_str(json)
        .map_err(|e| StoreError::Backend(format!("conversation {id}: observers: {e}")))
}

/// The `text` of a `user_message` event's data.
pub(super) fn message_text(data: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct UserMessage {
        text: String,
    }
    serde_json::from_str::<UserMessage>(data)
        .ok()
        .map(|m| m.text)
}

/// SQLite integers are signed; seqs and limits never come near the top.
pub(super) fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

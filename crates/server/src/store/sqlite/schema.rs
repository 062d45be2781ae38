//! The database's shape: the tables, and how their rows become linger's
//! types (summaries, events) and back.

use super::*;

pub(super) const SCHEMA: &str = "
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

pub(super) const META_COLUMNS: &str =
    "id, user, title, status, created_at, last_activity_at, head_seq, \
     close_delay_ms, observers, current_turn_id, last_turn_message_seq";

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

pub(super) fn event_from_row(
    id: &str,
    row: &rusqlite::Row<'_>,
) -> rusqlite::Result<Arc<EventRecord>> {
    let seq: u64 = row.get(0)?;
    let ts: String = row.get(1)?;
    let kind = intern_kind(row.get_ref(2)?.as_str()?);
    let data: String = row.get(3)?;
    Ok(Arc::new(EventRecord::from_parts(id, seq, ts, kind, data)))
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

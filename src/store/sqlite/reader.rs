//! Read-only connections: the small pool reads run on, and the queries
//! behind `get`, `list`, `events`, `snapshot` and `unfinished`.

use super::*;

pub(super) fn open_reader(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.set_prepared_statement_cache_capacity(32);
    Ok(conn)
}

pub(super) struct Readers {
    pub(super) path: PathBuf,
    pub(super) idle: Mutex<Vec<Connection>>,
}

impl Readers {
    pub(super) fn with<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let idle = self.idle.lock().expect("reader pool poisoned").pop();
        let mut conn = match idle {
            Some(conn) => conn,
            None => open_reader(&self.path)?,
        };
        let result = f(&mut conn);
        let mut idle = self.idle.lock().expect("reader pool poisoned");
        if idle.len() < MAX_IDLE_READERS {
            idle.push(conn);
        }
        result
    }
}

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
    /// The latest run's last seq and ts, if any run is stored.
    pub(super) run_last_seq: Option<u64>,
    pub(super) run_max_ts: Option<String>,
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
            run_last_seq: row.get(11)?,
            run_max_ts: row.get(12)?,
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
        // The row is written when its status or turn changes; appends in
        // between only add runs, which then hold the head.
        let (head_seq, last_activity_at) = match (self.run_last_seq, self.run_max_ts) {
            (Some(seq), Some(ts)) if seq > self.head_seq => (seq, ts),
            _ => (self.head_seq, self.last_activity_at),
        };
        Ok(ConversationMeta {
            status,
            observers,
            close_delay: self.close_delay_ms.map(Duration::from_millis),
            id: self.id,
            user: self.user,
            title: self.title,
            created_at: self.created_at,
            last_activity_at,
            head_seq,
            current_turn_id: self.current_turn_id,
            last_turn_message_seq: self.last_turn_message_seq,
        })
    }
}

pub(super) fn get_meta(
    conn: &Connection,
    id: &str,
) -> Result<Option<ConversationMeta>, StoreError> {
    let raw = conn
        .prepare_cached(&format!("{META_SELECT} WHERE c.id = ?1"))?
        .query_row([id], RawMeta::from_row)
        .optional()?;
    raw.map(RawMeta::into_meta).transpose()
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

/// Shares one allocation per known kind among all events read back, instead
/// of one per event.
pub(super) fn intern_kind(kind: &str) -> Arc<str> {
    static KINDS: OnceLock<Vec<Arc<str>>> = OnceLock::new();
    let kinds = KINDS.get_or_init(|| {
        [
            "conversation_created",
            "agent_started",
            "user_message",
            "turn_started",
            "text_delta",
            "assistant_message",
            "tool_call",
            "tool_result",
            "turn_finished",
            "agent_stopped",
        ]
        .into_iter()
        .map(Arc::from)
        .collect()
    });
    kinds
        .iter()
        .find(|k| &***k == kind)
        .cloned()
        .unwrap_or_else(|| Arc::from(kind))
}

/// SQLite integers are signed; seqs and limits never come near the top.
pub(super) fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

pub(super) fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<Joined, StoreError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(|h| Joined(Some(h)))
        .map_err(|e| StoreError::Backend(format!("spawn {name}: {e}")))
}

/// Joins a store thread when the store is dropped, so that a reopened store
/// sees everything the old one had queued.
pub(super) struct Joined(Option<JoinHandle<()>>);

impl Drop for Joined {
    fn drop(&mut self) {
        let Some(handle) = self.0.take() else {
            return;
        };
        // The last handle may be dropped by a callback, on the writer
        // itself: joining there would deadlock, and the writer ends anyway.
        if handle.thread().id() == std::thread::current().id() {
            return;
        }
        if handle.join().is_err() {
            tracing::error!("store: a store thread panicked");
        }
    }
}

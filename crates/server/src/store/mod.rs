//! History storage. The [`Store`] trait is what the rest of linger sees; the
//! embedded SQLite store ([`sqlite::SqliteStore`]) is its default. Appends go
//! through one writer that commits in groups and calls back once an append is
//! durable, so that conversation actors never wait on disk (write before send).

pub mod lock;
pub mod memory;
pub mod sqlite;

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::event::EventRecord;
use crate::protocol::Status;

/// A conversation's workspace: `store.path/workspaces/<id>`, made at
/// creation, kept across stops and restarts, removed by delete.
pub fn workspace_dir(store_path: &Path, conversation_id: &str) -> PathBuf {
    store_path.join("workspaces").join(conversation_id)
}

/// A conversation's stored summary and the state needed to reactivate it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConversationMeta {
    pub id: String,
    pub user: String,
    pub title: String,
    pub status: Status,
    /// RFC 3339 (as events' `ts`).
    pub created_at: String,
    pub last_activity_at: String,
    pub head_seq: u64,
    /// The conversation's own `close_delay` from `create`, if any.
    pub close_delay: Option<Duration>,
    pub observers: Vec<String>,
    /// The turn that was running or waiting when this state was written.
    pub current_turn_id: Option<String>,
    /// `message_seq` of the last turn started: user messages after it are
    /// still queued.
    pub last_turn_message_seq: u64,
}

/// State written with every append, so that the stored row always matches
/// the events committed with it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConversationState {
    pub status: Status,
    pub head_seq: u64,
    /// `None`: the time of the append's last event (see
    /// [`AppendBatch::last_activity_at`]). The conversation actor's appends
    /// all carry events; copying that time out of each cost an allocation
    /// per append, for a value the embedded store writes only when the
    /// conversation's row changes.
    pub last_activity_at: Option<String>,
    /// Shared with the conversation's turn: no copy per append.
    pub current_turn_id: Option<Arc<str>>,
    pub last_turn_message_seq: u64,
}

/// A new conversation's fixed fields, written by its first append.
#[derive(Debug, Clone, PartialEq)]
pub struct NewConversation {
    pub user: String,
    pub title: String,
    pub created_at: String,
    pub close_delay: Option<Duration>,
}

/// One append: events (in seq order, contiguous with what is stored), the
/// conversation's state after them, and the `client_msg_id`s they used.
#[derive(Debug, Clone)]
pub struct AppendBatch {
    pub conversation_id: Arc<str>,
    pub create: Option<NewConversation>,
    pub events: Vec<Arc<EventRecord>>,
    pub state: ConversationState,
    pub client_msg_ids: Vec<(String, u64)>,
    /// The `client_msg_id`s of messages before this seq left the
    /// conversation's window (`conversations.client_msg_id_window`): the
    /// store forgets them with this append (0: nothing to forget).
    pub forget_client_msg_ids_before: u64,
}

impl AppendBatch {
    /// The conversation's last activity as of this append: the state's, or
    /// else its last event's time, or else now.
    pub fn last_activity_at(&self) -> Cow<'_, str> {
        match (&self.state.last_activity_at, self.events.last()) {
            (Some(at), _) => Cow::Borrowed(at),
            (None, Some(event)) => Cow::Borrowed(event.ts()),
            (None, None) => Cow::Owned(crate::event::now_rfc3339()),
        }
    }
}

/// A queued user message found when reactivating a conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuedMessage {
    pub seq: u64,
    pub text: String,
}

/// Everything needed to bring a stopped conversation back.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub meta: ConversationMeta,
    /// The last events (at most the requested number), oldest first.
    pub tail: Vec<Arc<EventRecord>>,
    /// User messages recorded after the last turn started, oldest first.
    pub queued: Vec<QueuedMessage>,
    /// The newest `client_msg_id`s recorded (at most the number asked
    /// for), with the seq of their `user_message`, oldest first.
    pub client_msg_ids: Vec<(String, u64)>,
}

/// Called once the append is durable (or failed), with the append's own
/// events, so that whoever sends them on needs no copy of their list. The
/// store's other appends wait for it (callbacks run one after the other,
/// in commit order), so it must only hand the result on (send a message,
/// queue frames), never block.
pub type CommitCallback =
    Box<dyn FnOnce(Result<(), StoreError>, &[Arc<EventRecord>]) + Send + 'static>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store cannot write now (disk full, I/O error, locked, corrupt,
    /// read-only; in cluster mode NATS unreachable or without quorum):
    /// nothing was recorded; retrying later may work. Protocol error
    /// `store_unavailable`.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A request the store refuses whatever its health (an append that does
    /// not follow the stored head, say): a bug, not an outage.
    #[error("store: {0}")]
    Backend(String),
    #[error("store: the writer has stopped")]
    Closed,
    #[error("store: conversation {0} not found")]
    NotFound(String),
    /// Cluster mode: another node owns the conversation now; this node's
    /// append was refused and it must stop the conversation.
    #[error("store: conversation {conversation} is owned by another node (term {term} is stale)")]
    Fenced { conversation: String, term: u64 },
}

impl StoreError {
    /// Whether this is the store being unable to write, rather than a
    /// request it refused.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Closed)
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode as C;
        match e.sqlite_error_code() {
            Some(
                C::DiskFull
                | C::SystemIoFailure
                | C::DatabaseBusy
                | C::DatabaseLocked
                | C::DatabaseCorrupt
                | C::NotADatabase
                | C::ReadOnly
                | C::CannotOpen
                | C::OutOfMemory
                | C::FileLockingProtocolFailed,
            ) => StoreError::Unavailable(e.to_string()),
            _ => StoreError::Backend(e.to_string()),
        }
    }
}

impl From<rusqlite::types::FromSqlError> for StoreError {
    fn from(e: rusqlite::types::FromSqlError) -> Self {
        StoreError::Backend(e.to_string())
    }
}

/// Whether the store can write, as its last writes found: `/healthz`
/// answers 503 with the reason while it cannot. The writer records every
/// commit's outcome; a failing store is probed until a write works again.
#[derive(Debug, Default)]
pub struct StoreHealth {
    failing: std::sync::Mutex<Option<String>>,
    is_failing: std::sync::atomic::AtomicBool,
}

impl StoreHealth {
    /// Records the outcome of a write.
    pub fn record(&self, result: Result<(), &StoreError>) {
        use std::sync::atomic::Ordering;
        match result {
            Ok(()) => {
                if self.is_failing.swap(false, Ordering::Relaxed) {
                    if let Ok(mut failing) = self.failing.lock() {
                        *failing = None;
                    }
                    tracing::info!("store: writes work again");
                    crate::metrics::store_available(true);
                }
            }
            Err(e) if e.is_unavailable() => {
                if let Ok(mut failing) = self.failing.lock() {
                    *failing = Some(e.to_string());
                }
                if !self.is_failing.swap(true, Ordering::Relaxed) {
                    tracing::error!(error = %e, "store: writes fail; requests that need one get store_unavailable");
                    crate::metrics::store_available(false);
                }
            }
            Err(_) => {}
        }
    }

    /// `Err(reason)` while writes fail.
    pub fn check(&self) -> Result<(), String> {
        if !self.is_failing.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        match self.failing.lock() {
            Ok(failing) => failing.clone().map_or(Ok(()), Err),
            Err(_) => Err("store health unknown".into()),
        }
    }
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Queues an append; `done` is called once it is committed. Appends of
    /// one conversation are committed in the order they were queued.
    fn append(&self, batch: AppendBatch, done: CommitCallback);

    /// Waits until everything queued before this call is committed.
    async fn flush(&self) -> Result<(), StoreError>;

    /// A conversation's summary.
    async fn get(&self, id: &str) -> Result<Option<ConversationMeta>, StoreError>;

    /// Conversations of one user (or every user's, for `None`), newest
    /// activity first.
    async fn list(&self, user: Option<&str>) -> Result<Vec<ConversationMeta>, StoreError>;

    /// Stored events with seq > `after`, oldest first, at most `limit`.
    async fn events(
        &self,
        id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Arc<EventRecord>>, StoreError>;

    /// Everything needed to reactivate a conversation, with the last
    /// `tail` events and the newest `client_msg_ids` ids.
    async fn snapshot(
        &self,
        id: &str,
        tail: usize,
        client_msg_ids: usize,
    ) -> Result<Option<Snapshot>, StoreError>;

    /// Conversations not stored as `stopped`: on start-up, these were
    /// active when the server last stopped.
    async fn unfinished(&self) -> Result<Vec<ConversationMeta>, StoreError>;

    /// Deletes a conversation's history (ordered after queued appends).
    /// Returns whether it existed.
    async fn delete(&self, id: &str) -> Result<bool, StoreError>;

    /// Lets `user` attach to the conversation in observe mode.
    async fn add_observer(&self, id: &str, user: &str) -> Result<(), StoreError>;

    /// Deletes events older than `before`; returns how many.
    async fn prune(&self, before: SystemTime) -> Result<u64, StoreError>;

    /// `Err(reason)` while the store cannot write (see [`StoreHealth`]).
    fn health(&self) -> Result<(), String>;

    /// Makes one small write, in queue order with the appends, to learn
    /// whether writes work again; the outcome updates [`Store::health`].
    async fn probe(&self) -> Result<(), StoreError>;
}

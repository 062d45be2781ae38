//! History storage. The [`Store`] trait is what the rest of linger sees; the
//! embedded SQLite store ([`sqlite::SqliteStore`]) is its default. Appends go
//! through one writer that commits in groups and calls back once an append is
//! durable, so that conversation actors never wait on disk (write before send).

pub mod sqlite;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::event::EventRecord;
use crate::protocol::Status;

/// How many of a conversation's most recent `client_msg_id`s are kept (and
/// loaded on activation) for idempotency: a `message` that repeats an id
/// older than the last this many is taken as new. The store prunes older ids
/// as new ones are recorded, so the ledger stays bounded however long the
/// conversation lives.
pub const CLIENT_MSG_ID_WINDOW: usize = 1000;

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
    pub last_activity_at: String,
    pub current_turn_id: Option<String>,
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
    /// The last [`CLIENT_MSG_ID_WINDOW`] `client_msg_id`s seen, with the seq
    /// of their `user_message`, oldest first.
    pub client_msg_ids: Vec<(String, u64)>,
}

/// Called once the append is durable (or failed); runs on the writer, so it
/// must only hand the result on (send a message), never block.
pub type CommitCallback = Box<dyn FnOnce(Result<(), StoreError>) + Send + 'static>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Backend(String),
    #[error("store: the writer has stopped")]
    Closed,
    #[error("store: conversation {0} not found")]
    NotFound(String),
}

impl From<rusqlite::types::FromSqlError> for StoreError {
    fn from(e: rusqlite::types::FromSqlError) -> Self {
        StoreError::Backend(e.to_string())
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        StoreError::Backend(e.to_string())
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
    /// `tail` events.
    async fn snapshot(&self, id: &str, tail: usize) -> Result<Option<Snapshot>, StoreError>;

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
}

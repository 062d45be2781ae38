//! The embedded SQLite history store: one database file (`linger.db`, WAL
//! mode) holding every conversation's summary row, its events (in runs: the
//! events of one conversation committed together are one row) and the
//! `client_msg_id`s it has seen.
//!
//! It owns three things:
//!
//! - **the writer**, one OS thread that owns the only write connection. Every
//!   change (append, delete, add observer, prune) reaches it over a channel,
//!   so changes are applied in the order they were queued, and it commits in
//!   groups: it blocks for one command, takes everything else already queued,
//!   runs the lot in one transaction and only then calls back. A burst of
//!   token deltas thus costs a few commits, and a callback never fires for
//!   data a reader could not yet see.
//! - **the checkpointer**, a second thread that copies the WAL into the
//!   database file, so that the copy and its fsyncs do not hold appends back
//!   (SQLite would otherwise do it inside a commit, every 4 MB of WAL).
//! - **a small pool of read-only connections** used from
//!   `spawn_blocking`, at most `MAX_READS_AT_ONCE` reads at a time. WAL
//!   lets them read while the writer commits, and each
//!   read starts a fresh snapshot, so it sees every commit whose callback has
//!   fired.
//!
//! Durability is WAL with `synchronous = NORMAL`: a commit is in the WAL file
//! (in the OS page cache) before its callback runs, which survives a SIGKILL
//! of the process; only a power loss can take the last commits back.
//!
//! Files: `schema.rs` (tables, rows to types), `migrate.rs` (the format
//! version and the steps from earlier ones), `connections.rs` (opening
//! connections, the read pool), `runs.rs` (events in runs: encoding,
//! reading), `journal.rs` (where commits write their runs, and the fold
//! into `event_runs`), `queries.rs` (reads), `writer.rs` (the writer thread
//! and the writes), `known.rs` (what the writer remembers of what it
//! committed), `checkpoint.rs`, `threads.rs`.
//!
//! The store checks what it is given: an append whose events do not follow
//! the stored `head_seq` one by one, that creates an existing conversation or
//! appends to a missing one fails (alone: the rest of its group commits).

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod answers;
mod checkpoint;
mod connections;
mod journal;
mod known;
mod migrate;
mod queries;
mod runs;
mod schema;
#[cfg(test)]
mod tests;
mod threads;
mod writer;

use async_trait::async_trait;
// The writer's maps are keyed by conversation id and looked up several
// times per append; std's SipHash was a visible share of the writer's
// time. The ids are the server's own, named by its clients only for
// conversations that exist, so a fast hash with a per-process seed is
// enough.
use foldhash::{HashMap, HashMapExt, HashSet};
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use tokio::sync::oneshot;

use super::{
    AppendBatch, CommitCallback, ConversationMeta, ConversationState, QueuedMessage, Snapshot,
    Store, StoreError, StoreHealth,
};
use crate::event::{intern_kind, EventRecord};
use crate::protocol::Status;
use answers::Answers;
use checkpoint::*;
use connections::*;
use journal::{Fold, JournalFill, JournalMembers};
use known::*;
use runs::*;
use schema::*;
use threads::*;
use writer::*;

/// Most commands one transaction takes. Large enough that a burst is a
/// handful of commits, small enough that the first callbacks of a group are
/// not held back for long.
const MAX_GROUP: usize = 4096;

/// Runs a prune looks at per transaction: a first prune of a large history
/// runs as many small steps between groups of appends, instead of one long
/// transaction that would hold every append back.
const PRUNE_CHUNK: i64 = 256;

/// Idle read connections kept for reuse; up to [`MAX_READS_AT_ONCE`] may
/// be open while busy.
const MAX_IDLE_READERS: usize = 4;

/// Reads that run at once, each on a connection of its own; the others
/// wait their turn. Without a bound a burst of reads (clients resuming
/// from further back than the buffers hold, activations) opened a
/// connection per read, each with its file handles and a page cache of
/// up to 2 MB, up to the runtime's 512 blocking threads. Reads take
/// milliseconds and WAL lets them run beside the writer, so a few at a
/// time keep the cores busy.
const MAX_READS_AT_ONCE: usize = 8;

/// How often the checkpointer copies the WAL into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(200);

/// Checkpointer rounds without a commit after which the WAL file is
/// truncated (it is reused, not shrunk, while appends come).
const TRUNCATE_WHEN_IDLE_FOR: u32 = 10;

/// WAL size (in 4 KiB frames, as SQLite's own default) past which the writer
/// is asked to let the WAL start over from its beginning.
const RESTART_WAL_FRAMES: i64 = 1000;

/// Frames left uncopied that the writer may copy itself on restart, and the
/// passes the checkpointer makes to get there.
const FEW_FRAMES: i64 = 128;
const CATCH_UP_PASSES: usize = 8;

/// Groups the writer may run back to back, with a restart wanted, before it
/// stops waiting for an idle moment: under sustained load the WAL would
/// otherwise grow without bound.
const RESTART_WITHIN_GROUPS: u32 = 256;

/// The embedded store. Cheap to share behind an `Arc`; dropping the last
/// handle lets the writer finish what is queued and close the database.
pub struct SqliteStore {
    // The senders are declared before the threads so that they are dropped
    // first: closing its channel is what tells a thread to finish.
    // Boxed: the channel allocates its slots in blocks of 31 and zeroes
    // each block, so a command held inline (an append is about 250 bytes)
    // made every 31st send a large zeroed allocation.
    tx: Sender<Box<Command>>,
    _stop_checkpointer: Sender<()>,
    readers: Arc<Readers>,
    commits: Arc<AtomicU64>,
    health: Arc<StoreHealth>,
    /// Which conversations the journal may hold rows of (`journal.rs`).
    members: Arc<JournalMembers>,
    path: PathBuf,
    _writer: Joined,
    _checkpointer: Joined,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .field("commits", &self.commits())
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) `dir/linger.db` and starts the writer.
    pub fn open(dir: &Path) -> Result<SqliteStore, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError::Backend(format!("create {}: {e}", dir.display())))?;
        let path = dir.join("linger.db");
        let conn = open_writer(&path)?;
        // What a crash left in the journal, before any reader scans it.
        let moved = journal::fold_now(&conn)?;
        if moved > 0 {
            tracing::info!(
                events = moved,
                "store: folded the journal left by the last run"
            );
        }
        let checkpoint_conn = open_checkpointer(&path)?;
        let restart_wanted = Arc::new(AtomicBool::new(false));
        let commits = Arc::new(AtomicU64::new(0));
        let (stop_checkpointer, stop_rx) = mpsc::channel();
        let checkpointer = Checkpointer {
            conn: checkpoint_conn,
            stop: stop_rx,
            restart_wanted: restart_wanted.clone(),
            commits: commits.clone(),
        };
        let checkpointer = spawn("linger-store-checkpoint", move || checkpointer.run())?;

        let (tx, rx) = mpsc::channel();
        let health = Arc::new(StoreHealth::default());
        // The journal was folded above: nobody has rows in it.
        let members = Arc::new(JournalMembers::default());
        let writer = Writer {
            health: health.clone(),
            conn,
            rx,
            commits: commits.clone(),
            prunes: VecDeque::new(),
            restart_wanted,
            busy_groups: 0,
            known: KnownRows::default(),
            journal: JournalFill::default(),
            fold: None,
            fold_left_overlap: false,
            members: members.clone(),
            journal_row: JournalRow::default(),
            last_group_at: None,
            wrote_since_release: false,
            answers: Answers::start(),
        };
        let writer = spawn("linger-store-writer", move || writer.run())?;
        Ok(SqliteStore {
            tx,
            health,
            _stop_checkpointer: stop_checkpointer,
            readers: Arc::new(Readers::new(path.clone())),
            commits,
            members,
            path,
            _writer: writer,
            _checkpointer: checkpointer,
        })
    }

    /// Transactions committed so far (for metrics, and to see grouping).
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn send(&self, cmd: Command) {
        // A send only fails once the writer thread is gone; the command comes
        // back so that its caller still hears about it.
        if let Err(mpsc::SendError(cmd)) = self.tx.send(Box::new(cmd)) {
            (*cmd).fail(StoreError::Closed);
        }
    }

    async fn request<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Command,
    ) -> Result<T, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.send(make(reply));
        rx.await.unwrap_or(Err(StoreError::Closed))
    }

    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        self.readers.read(f).await
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn append(&self, batch: AppendBatch, done: CommitCallback) {
        self.send(Command::Append { batch, done });
    }

    async fn flush(&self) -> Result<(), StoreError> {
        self.request(|reply| Command::Flush { reply }).await
    }

    fn health(&self) -> Result<(), String> {
        self.health.check()
    }

    async fn probe(&self) -> Result<(), StoreError> {
        self.request(|reply| Command::Probe { reply }).await
    }

    async fn get(&self, id: &str) -> Result<Option<ConversationMeta>, StoreError> {
        let id = id.to_owned();
        let members = self.members.clone();
        self.read(move |conn| queries::meta(conn, &members, &id))
            .await
    }

    async fn list(&self, user: Option<&str>) -> Result<Vec<ConversationMeta>, StoreError> {
        let user = user.map(str::to_owned);
        self.read(move |conn| queries::list(conn, user.as_deref()))
            .await
    }

    async fn events(
        &self,
        id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Arc<EventRecord>>, StoreError> {
        let id = id.to_owned();
        let members = self.members.clone();
        self.read(move |conn| queries::events(conn, &members, &id, after, limit))
            .await
    }

    async fn snapshot(
        &self,
        id: &str,
        tail: usize,
        client_msg_ids: usize,
    ) -> Result<Option<Snapshot>, StoreError> {
        let id = id.to_owned();
        let members = self.members.clone();
        self.read(move |conn| queries::snapshot(conn, &members, &id, tail, client_msg_ids))
            .await
    }

    async fn unfinished(&self) -> Result<Vec<ConversationMeta>, StoreError> {
        self.read(|conn| queries::unfinished(conn)).await
    }

    async fn delete(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_owned();
        self.request(|reply| Command::Delete { id, reply }).await
    }

    async fn add_observer(&self, id: &str, user: &str) -> Result<(), StoreError> {
        let (id, user) = (id.to_owned(), user.to_owned());
        self.request(|reply| Command::AddObserver { id, user, reply })
            .await
    }

    async fn prune(&self, before: SystemTime) -> Result<u64, StoreError> {
        // humantime formats neither times before 1970 (nothing is older) nor
        // after 9999 (everything is older).
        if before <= UNIX_EPOCH {
            return Ok(0);
        }
        let latest = UNIX_EPOCH + Duration::from_secs(253_402_300_799);
        let cutoff = humantime::format_rfc3339_millis(before.min(latest)).to_string();
        self.request(|reply| Command::Prune { cutoff, reply }).await
    }
}

// ---------------------------------------------------------------------------
// The writer

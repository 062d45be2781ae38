//! The embedded SQLite history store: one database file (`linger.db`, WAL
//! mode) holding every conversation's summary row, its events and the
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
//!   `spawn_blocking`. WAL lets them read while the writer commits, and each
//!   read starts a fresh snapshot, so it sees every commit whose callback has
//!   fired.
//!
//! Durability is WAL with `synchronous = NORMAL`: a commit is in the WAL file
//! (in the OS page cache) before its callback runs, which survives a SIGKILL
//! of the process; only a power loss can take the last commits back.
//!
//! The store checks what it is given: an append whose events do not follow
//! the stored `head_seq` one by one, that creates an existing conversation or
//! appends to a missing one fails (alone: the rest of its group commits).

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use tokio::sync::oneshot;

use super::{
    AppendBatch, CommitCallback, ConversationMeta, ConversationState, QueuedMessage, Snapshot,
    Store, StoreError,
};
use crate::event::EventRecord;
use crate::protocol::Status;

/// Most commands one transaction takes. Large enough that a burst is a
/// handful of commits, small enough that the first callbacks of a group are
/// not held back for long.
const MAX_GROUP: usize = 4096;

/// Events a prune deletes per transaction: a first prune of a large history
/// runs as many small steps between groups of appends, instead of one long
/// transaction that would hold every append back.
const PRUNE_CHUNK: i64 = 2000;

/// Idle read connections kept for reuse; more may be open while busy.
const MAX_IDLE_READERS: usize = 4;

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

const SCHEMA: &str = "
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

const META_COLUMNS: &str = "id, user, title, status, created_at, last_activity_at, head_seq, \
     close_delay_ms, observers, current_turn_id, last_turn_message_seq";

/// The embedded store. Cheap to share behind an `Arc`; dropping the last
/// handle lets the writer finish what is queued and close the database.
pub struct SqliteStore {
    // The senders are declared before the threads so that they are dropped
    // first: closing its channel is what tells a thread to finish.
    tx: Sender<Command>,
    _stop_checkpointer: Sender<()>,
    readers: Arc<Readers>,
    commits: Arc<AtomicU64>,
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
        let writer = Writer {
            conn,
            rx,
            commits: commits.clone(),
            prunes: VecDeque::new(),
            restart_wanted,
            busy_groups: 0,
        };
        let writer = spawn("linger-store-writer", move || writer.run())?;
        Ok(SqliteStore {
            tx,
            _stop_checkpointer: stop_checkpointer,
            readers: Arc::new(Readers {
                path: path.clone(),
                idle: Mutex::new(Vec::new()),
            }),
            commits,
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
        if let Err(mpsc::SendError(cmd)) = self.tx.send(cmd) {
            cmd.fail(StoreError::Closed);
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
        let readers = self.readers.clone();
        tokio::task::spawn_blocking(move || readers.with(f))
            .await
            .map_err(|e| StoreError::Backend(format!("read task: {e}")))?
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

    async fn get(&self, id: &str) -> Result<Option<ConversationMeta>, StoreError> {
        let id = id.to_owned();
        self.read(move |conn| get_meta(conn, &id)).await
    }

    async fn list(&self, user: Option<&str>) -> Result<Vec<ConversationMeta>, StoreError> {
        let user = user.map(str::to_owned);
        self.read(move |conn| {
            let rows = match &user {
                Some(user) => {
                    let mut stmt = conn.prepare_cached(&format!(
                        "SELECT {META_COLUMNS} FROM conversations WHERE user = ?1 \
                         ORDER BY last_activity_at DESC, id"
                    ))?;
                    let rows = stmt.query_map([user], RawMeta::from_row)?;
                    rows.collect::<Result<Vec<_>, _>>()?
                }
                None => {
                    let mut stmt = conn.prepare_cached(&format!(
                        "SELECT {META_COLUMNS} FROM conversations \
                         ORDER BY last_activity_at DESC, id"
                    ))?;
                    let rows = stmt.query_map([], RawMeta::from_row)?;
                    rows.collect::<Result<Vec<_>, _>>()?
                }
            };
            rows.into_iter().map(RawMeta::into_meta).collect()
        })
        .await
    }

    async fn events(
        &self,
        id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Arc<EventRecord>>, StoreError> {
        let id = id.to_owned();
        self.read(move |conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT seq, ts, kind, data FROM events \
                 WHERE conversation_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3",
            )?;
            let rows = stmt.query_map(
                params![id, clamp_i64(after), clamp_i64(limit as u64)],
                |row| event_from_row(&id, row),
            )?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
        .await
    }

    async fn snapshot(&self, id: &str, tail: usize) -> Result<Option<Snapshot>, StoreError> {
        let id = id.to_owned();
        self.read(move |conn| {
            // One read transaction, so that the row, the tail and the queue
            // are of the same commit.
            let tx = conn.transaction()?;
            let Some(meta) = get_meta(&tx, &id)? else {
                return Ok(None);
            };
            let mut tail_events = {
                let mut stmt = tx.prepare_cached(
                    "SELECT seq, ts, kind, data FROM events \
                     WHERE conversation_id = ?1 ORDER BY seq DESC LIMIT ?2",
                )?;
                let rows = stmt.query_map(params![id, clamp_i64(tail as u64)], |row| {
                    event_from_row(&id, row)
                })?;
                rows.collect::<Result<Vec<_>, _>>()?
            };
            tail_events.reverse();
            let queued = {
                let mut stmt = tx.prepare_cached(
                    "SELECT seq, data FROM events WHERE conversation_id = ?1 AND seq > ?2 \
                     AND kind = 'user_message' ORDER BY seq",
                )?;
                let rows = stmt
                    .query_map(params![id, clamp_i64(meta.last_turn_message_seq)], |row| {
                        Ok((row.get::<_, u64>(0)?, row.get::<_, String>(1)?))
                    })?;
                let rows = rows.collect::<Result<Vec<_>, _>>()?;
                rows.into_iter()
                    .map(|(seq, data)| {
                        Ok(QueuedMessage {
                            seq,
                            text: message_text(&data).ok_or_else(|| {
                                StoreError::Backend(format!(
                                    "conversation {id}: user_message {seq} has no text"
                                ))
                            })?,
                        })
                    })
                    .collect::<Result<Vec<_>, StoreError>>()?
            };
            let client_msg_ids = {
                let mut stmt = tx.prepare_cached(
                    "SELECT client_msg_id, seq FROM client_msgs \
                     WHERE conversation_id = ?1 ORDER BY seq",
                )?;
                let rows = stmt.query_map([&id], |row| Ok((row.get(0)?, row.get(1)?)))?;
                rows.collect::<Result<Vec<_>, _>>()?
            };
            Ok(Some(Snapshot {
                meta,
                tail: tail_events,
                queued,
                client_msg_ids,
            }))
        })
        .await
    }

    async fn unfinished(&self) -> Result<Vec<ConversationMeta>, StoreError> {
        self.read(|conn| {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {META_COLUMNS} FROM conversations WHERE status != 'stopped' \
                 ORDER BY last_activity_at DESC, id"
            ))?;
            let rows = stmt.query_map([], RawMeta::from_row)?;
            let rows = rows.collect::<Result<Vec<_>, _>>()?;
            rows.into_iter().map(RawMeta::into_meta).collect()
        })
        .await
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

enum Command {
    Append {
        batch: AppendBatch,
        done: CommitCallback,
    },
    Delete {
        id: String,
        reply: oneshot::Sender<Result<bool, StoreError>>,
    },
    AddObserver {
        id: String,
        user: String,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    Flush {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    Prune {
        cutoff: String,
        reply: oneshot::Sender<Result<u64, StoreError>>,
    },
}

/// What a command produced inside the transaction, handed out after commit.
enum Done {
    Unit,
    Existed(bool),
}

impl Command {
    fn fail(self, e: StoreError) {
        self.finish(Err(e));
    }

    /// Hands the result to whoever waits. Callbacks are the caller's code:
    /// one that panics must not take the writer (and every other
    /// conversation's durability) down with it.
    fn finish(self, result: Result<Done, StoreError>) {
        match self {
            Command::Append { done, .. } => {
                let r = result.map(|_| ());
                if catch_unwind(AssertUnwindSafe(|| done(r))).is_err() {
                    tracing::error!("store: an append callback panicked");
                }
            }
            Command::Delete { reply, .. } => {
                let _ = reply.send(result.map(|d| matches!(d, Done::Existed(true))));
            }
            Command::AddObserver { reply, .. } | Command::Flush { reply } => {
                let _ = reply.send(result.map(|_| ()));
            }
            Command::Prune { reply, .. } => {
                let _ = reply.send(result.map(|_| 0));
            }
        }
    }
}

/// A prune in progress: it deletes one chunk per transaction until a chunk
/// comes back short.
struct PruneJob {
    cutoff: String,
    deleted: u64,
    reply: oneshot::Sender<Result<u64, StoreError>>,
}

struct Writer {
    conn: Connection,
    rx: Receiver<Command>,
    commits: Arc<AtomicU64>,
    prunes: VecDeque<PruneJob>,
    /// Set by the checkpointer, see [`Writer::restart_wal`].
    restart_wanted: Arc<AtomicBool>,
    /// Groups run since a restart was wanted without an idle moment.
    busy_groups: u32,
}

impl Writer {
    fn run(mut self) {
        let mut group: Vec<Command> = Vec::with_capacity(MAX_GROUP);
        loop {
            let first = match self.rx.try_recv() {
                Ok(cmd) => Some(cmd),
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty) => {
                    // Idle: the moment for housekeeping that would otherwise
                    // delay a waiting append.
                    if self.restart_wanted.load(Ordering::Relaxed) {
                        self.restart_wal();
                    }
                    // With a prune pending there is work to do even when
                    // nothing is queued, so only block when there is none.
                    if self.prunes.is_empty() {
                        match self.rx.recv() {
                            Ok(cmd) => Some(cmd),
                            Err(_) => break,
                        }
                    } else {
                        None
                    }
                }
            };
            if let Some(cmd) = first {
                self.take(cmd, &mut group);
            }
            while group.len() < MAX_GROUP {
                match self.rx.try_recv() {
                    Ok(cmd) => self.take(cmd, &mut group),
                    Err(_) => break,
                }
            }
            if group.is_empty() && self.prunes.is_empty() {
                continue;
            }
            self.run_group(&mut group);
            if self.restart_wanted.load(Ordering::Relaxed) {
                self.busy_groups += 1;
                if self.busy_groups >= RESTART_WITHIN_GROUPS {
                    self.restart_wal();
                }
            }
        }
        // Every sender is gone and the queue is empty; nobody is left to
        // await a pending prune, but answer anyway.
        for job in self.prunes.drain(..) {
            let _ = job.reply.send(Err(StoreError::Closed));
        }
    }

    fn take(&mut self, cmd: Command, group: &mut Vec<Command>) {
        match cmd {
            // Prunes do not join the group: they run as chunks, one per
            // transaction, alongside whatever else is queued.
            Command::Prune { cutoff, reply } => self.prunes.push_back(PruneJob {
                cutoff,
                deleted: 0,
                reply,
            }),
            cmd => group.push(cmd),
        }
    }

    /// Runs one group in one transaction and then answers every command in
    /// it. Fast path: no savepoints. If any command fails, the transaction is
    /// rolled back and replayed with a savepoint per command, so that one bad
    /// append fails alone.
    fn run_group(&mut self, group: &mut Vec<Command>) {
        let prune_cutoff = self.prunes.front().map(|j| j.cutoff.clone());
        let mut results: Vec<Result<Done, StoreError>> = Vec::with_capacity(group.len());
        let mut pruned: Option<Result<i64, StoreError>> = None;
        let started = std::time::Instant::now();

        let outcome = self.transaction(
            group,
            prune_cutoff.as_deref(),
            false,
            &mut results,
            &mut pruned,
        );
        let outcome = match outcome {
            Ok(true) => Ok(()),
            Ok(false) => {
                results.clear();
                pruned = None;
                self.transaction(
                    group,
                    prune_cutoff.as_deref(),
                    true,
                    &mut results,
                    &mut pruned,
                )
                .map(|_| ())
            }
            Err(e) => Err(e),
        };

        match outcome {
            Ok(()) => {
                self.commits.fetch_add(1, Ordering::Relaxed);
                crate::metrics::store_commit(started.elapsed(), group.len());
                for (cmd, result) in group.drain(..).zip(results) {
                    cmd.finish(result);
                }
                if let Some(result) = pruned {
                    self.prune_progress(result);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, commands = group.len(), "store: commit failed");
                for cmd in group.drain(..) {
                    cmd.fail(e.clone());
                }
                if prune_cutoff.is_some() {
                    self.prune_progress(Err(e));
                }
            }
        }
    }

    /// One attempt at the group's transaction. `Ok(false)`: some command
    /// failed on the fast path and the transaction was rolled back.
    fn transaction(
        &mut self,
        group: &[Command],
        prune_cutoff: Option<&str>,
        savepoints: bool,
        results: &mut Vec<Result<Done, StoreError>>,
        pruned: &mut Option<Result<i64, StoreError>>,
    ) -> Result<bool, StoreError> {
        let conn = &self.conn;
        let mut touched = Touched::default();
        // `?` below: the transaction is lost, every command of the group fails.
        conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        for cmd in group {
            let result = if savepoints {
                isolated(conn, |conn| apply(conn, cmd, &mut touched))
                    .inspect_err(|_| rollback(conn))?
            } else {
                apply(conn, cmd, &mut touched)
            };
            if result.is_err() && !savepoints {
                rollback(conn);
                return Ok(false);
            }
            results.push(result);
        }
        if let Some(cutoff) = prune_cutoff {
            let result = if savepoints {
                isolated(conn, |conn| prune_chunk(conn, cutoff)).inspect_err(|_| rollback(conn))?
            } else {
                prune_chunk(conn, cutoff)
            };
            if result.is_err() && !savepoints {
                rollback(conn);
                return Ok(false);
            }
            *pruned = Some(result);
        }
        let committed = touched
            .write(conn)
            .and_then(|()| Ok(conn.prepare_cached("COMMIT")?.execute([])?));
        if let Err(e) = committed {
            rollback(conn);
            return if savepoints { Err(e) } else { Ok(false) };
        }
        Ok(true)
    }

    /// The checkpointer copies the WAL into the database in the background,
    /// but SQLite only starts the WAL over from its beginning when a write
    /// transaction begins with every frame copied, which never happens while
    /// appends keep coming. So once the WAL is large, the writer copies the
    /// few frames left itself (two short fsyncs) at an idle moment, and its
    /// next transaction restarts the WAL.
    fn restart_wal(&mut self) {
        self.restart_wanted.store(false, Ordering::Relaxed);
        self.busy_groups = 0;
        if let Err(e) = checkpoint(&self.conn) {
            tracing::warn!(error = %e, "store: checkpoint failed");
        }
    }

    fn prune_progress(&mut self, result: Result<i64, StoreError>) {
        let Some(job) = self.prunes.front_mut() else {
            return;
        };
        match result {
            Ok(n) => {
                job.deleted += n.max(0) as u64;
                if n < PRUNE_CHUNK {
                    if let Some(job) = self.prunes.pop_front() {
                        let _ = job.reply.send(Ok(job.deleted));
                    }
                }
            }
            Err(e) => {
                if let Some(job) = self.prunes.pop_front() {
                    let _ = job.reply.send(Err(e));
                }
            }
        }
    }
}

fn rollback(conn: &Connection) {
    if !conn.is_autocommit() {
        if let Err(e) = conn.execute_batch("ROLLBACK") {
            tracing::error!(error = %e, "store: rollback failed");
        }
    }
}

/// Runs `f` inside a savepoint, undoing its partial work if it fails. The
/// outer error means the whole transaction is lost: some errors (I/O, disk
/// full) make SQLite roll it all back, and the commands after this one must
/// not then run, each committing on its own.
fn isolated<T>(
    conn: &Connection,
    f: impl FnOnce(&Connection) -> Result<T, StoreError>,
) -> Result<Result<T, StoreError>, StoreError> {
    conn.prepare_cached("SAVEPOINT cmd")?.execute([])?;
    let result = f(conn);
    if conn.is_autocommit() {
        return Err(match result {
            Err(e) => e,
            Ok(_) => StoreError::Backend("the transaction was rolled back".into()),
        });
    }
    if result.is_err() {
        conn.prepare_cached("ROLLBACK TO cmd")?.execute([])?;
    }
    conn.prepare_cached("RELEASE cmd")?.execute([])?;
    Ok(result)
}

/// The conversations a group has appended to, so that each one's row is
/// written once per transaction (with the state of its last append) rather
/// than once per append: under a burst, most of a group's appends are to the
/// same few conversations.
#[derive(Default)]
struct Touched<'a> {
    rows: HashMap<&'a str, TouchedRow<'a>>,
}

struct TouchedRow<'a> {
    /// The head as of this point of the transaction.
    head: u64,
    /// State still to be written to the row, if any.
    pending: Option<&'a ConversationState>,
}

impl<'a> Touched<'a> {
    /// The head stored for `id` as of this point of the transaction.
    fn head(&mut self, conn: &Connection, id: &'a str) -> Result<u64, StoreError> {
        if let Some(row) = self.rows.get(id) {
            return Ok(row.head);
        }
        let stored: Option<u64> = conn
            .prepare_cached("SELECT head_seq FROM conversations WHERE id = ?1")?
            .query_row([id], |row| row.get(0))
            .optional()?;
        let head = stored.ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
        self.rows.insert(
            id,
            TouchedRow {
                head,
                pending: None,
            },
        );
        Ok(head)
    }

    fn write(&self, conn: &Connection) -> Result<(), StoreError> {
        for (id, row) in &self.rows {
            let Some(state) = row.pending else { continue };
            conn.prepare_cached(
                "UPDATE conversations SET status = ?2, head_seq = ?3, last_activity_at = ?4, \
                 current_turn_id = ?5, last_turn_message_seq = ?6 WHERE id = ?1",
            )?
            .execute(params![
                id,
                state.status.as_str(),
                clamp_i64(state.head_seq),
                state.last_activity_at,
                state.current_turn_id,
                clamp_i64(state.last_turn_message_seq),
            ])?;
        }
        Ok(())
    }
}

// `touched` is only changed once a command has fully succeeded, so that a
// command rolled back to its savepoint leaves it as it was.
fn apply<'a>(
    conn: &Connection,
    cmd: &'a Command,
    touched: &mut Touched<'a>,
) -> Result<Done, StoreError> {
    match cmd {
        Command::Append { batch, .. } => append(conn, batch, touched).map(|()| Done::Unit),
        Command::Delete { id, .. } => {
            let existed = delete(conn, id)?;
            touched.rows.remove(id.as_str());
            Ok(Done::Existed(existed))
        }
        Command::AddObserver { id, user, .. } => add_observer(conn, id, user).map(|()| Done::Unit),
        Command::Flush { .. } => Ok(Done::Unit),
        // Never in a group (see `Writer::take`).
        Command::Prune { .. } => Ok(Done::Unit),
    }
}

fn append<'a>(
    conn: &Connection,
    batch: &'a AppendBatch,
    touched: &mut Touched<'a>,
) -> Result<(), StoreError> {
    let id: &str = &batch.conversation_id;
    let state = &batch.state;
    let base = check_contiguous(batch)?;
    match &batch.create {
        Some(new) => {
            let close_delay_ms = new
                .close_delay
                .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            conn.prepare_cached(
                "INSERT INTO conversations (id, user, title, status, created_at, \
                 last_activity_at, head_seq, close_delay_ms, observers, current_turn_id, \
                 last_turn_message_seq) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, '[]', ?9, ?10)",
            )?
            .execute(params![
                id,
                new.user,
                new.title,
                state.status.as_str(),
                new.created_at,
                state.last_activity_at,
                clamp_i64(state.head_seq),
                close_delay_ms,
                state.current_turn_id,
                clamp_i64(state.last_turn_message_seq),
            ])?;
        }
        None => {
            // Refuse a batch that would leave a gap in the history or
            // overlap what is stored.
            let head = touched.head(conn, id)?;
            if head != base {
                return Err(StoreError::Backend(format!(
                    "conversation {id}: stored head_seq is {head}, the append follows {base}"
                )));
            }
        }
    }
    if !batch.events.is_empty() {
        let mut stmt = conn.prepare_cached(
            "INSERT INTO events (conversation_id, seq, ts, kind, data) VALUES (?1, ?2, ?3, ?4, ?5)",
        )?;
        for ev in &batch.events {
            stmt.execute(params![id, clamp_i64(ev.seq), ev.ts, &*ev.kind, ev.data])?;
        }
    }
    if !batch.client_msg_ids.is_empty() {
        let mut stmt = conn.prepare_cached(
            "INSERT INTO client_msgs (conversation_id, client_msg_id, seq) VALUES (?1, ?2, ?3)",
        )?;
        for (client_msg_id, seq) in &batch.client_msg_ids {
            stmt.execute(params![id, client_msg_id, clamp_i64(*seq)])?;
        }
    }
    let pending = if batch.create.is_some() {
        None // written by the insert
    } else {
        Some(state)
    };
    touched.rows.insert(
        id,
        TouchedRow {
            head: state.head_seq,
            pending,
        },
    );
    Ok(())
}

/// Checks that the batch's events are `base+1 ..= state.head_seq` and
/// returns `base`, the head the store must hold before this batch.
fn check_contiguous(batch: &AppendBatch) -> Result<u64, StoreError> {
    let id = &batch.conversation_id;
    let n = batch.events.len() as u64;
    let head = batch.state.head_seq;
    let bad = |why: String| StoreError::Backend(format!("conversation {id}: bad append: {why}"));
    let Some(base) = head.checked_sub(n) else {
        return Err(bad(format!("{n} events but head_seq {head}")));
    };
    for (i, ev) in batch.events.iter().enumerate() {
        let want = base + 1 + i as u64;
        if ev.seq != want {
            return Err(bad(format!(
                "event seq {} where {want} was expected (head_seq {head})",
                ev.seq
            )));
        }
    }
    if batch.create.is_some() && base != 0 {
        return Err(bad(format!(
            "a new conversation starts at seq 1, not {}",
            base + 1
        )));
    }
    Ok(base)
}

fn delete(conn: &Connection, id: &str) -> Result<bool, StoreError> {
    conn.prepare_cached("DELETE FROM events WHERE conversation_id = ?1")?
        .execute([id])?;
    conn.prepare_cached("DELETE FROM client_msgs WHERE conversation_id = ?1")?
        .execute([id])?;
    let rows = conn
        .prepare_cached("DELETE FROM conversations WHERE id = ?1")?
        .execute([id])?;
    Ok(rows > 0)
}

fn add_observer(conn: &Connection, id: &str, user: &str) -> Result<(), StoreError> {
    let observers: Option<String> = conn
        .prepare_cached("SELECT observers FROM conversations WHERE id = ?1")?
        .query_row([id], |row| row.get(0))
        .optional()?;
    let Some(observers) = observers else {
        return Err(StoreError::NotFound(id.to_owned()));
    };
    let mut observers = parse_observers(id, &observers)?;
    if observers.iter().any(|o| o == user) {
        return Ok(());
    }
    observers.push(user.to_owned());
    let json = serde_json::to_string(&observers)
        .map_err(|e| StoreError::Backend(format!("conversation {id}: observers: {e}")))?;
    conn.prepare_cached("UPDATE conversations SET observers = ?2 WHERE id = ?1")?
        .execute(params![id, json])?;
    Ok(())
}

fn prune_chunk(conn: &Connection, cutoff: &str) -> Result<i64, StoreError> {
    let n = conn
        .prepare_cached(
            "DELETE FROM events WHERE (conversation_id, seq) IN \
             (SELECT conversation_id, seq FROM events WHERE ts < ?1 LIMIT ?2)",
        )?
        .execute(params![cutoff, PRUNE_CHUNK])?;
    Ok(n as i64)
}

// ---------------------------------------------------------------------------
// Connections and rows

fn open_writer(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open(path)?;
    let mode: String =
        conn.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Backend(format!(
            "{}: journal_mode is {mode}, WAL is required",
            path.display()
        )));
    }
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    // Checkpoints are the checkpointer's job (see `Checkpointer`).
    conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    // No journal_size_limit: cutting a WAL that grew under load back when
    // it starts over took the writer tens of milliseconds; the checkpointer
    // truncates it once the store is idle instead.
    conn.pragma_update(None, "cache_size", -16 * 1024)?;
    conn.pragma_update(None, "foreign_keys", false)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.set_prepared_statement_cache_capacity(64);
    conn.execute_batch(SCHEMA)?;
    Ok(conn)
}

/// The checkpointer's own connection. No busy timeout: it must never wait
/// on the writer or a reader, only skip a round.
fn open_checkpointer(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open(path)?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.busy_timeout(Duration::ZERO)?;
    Ok(conn)
}

/// Runs a passive checkpoint (never blocks the writer); returns the WAL's
/// size in frames.
fn checkpoint(conn: &Connection) -> Result<i64, StoreError> {
    let log_frames = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| row.get(1))?;
    Ok(log_frames)
}

/// Copies the WAL into the database file off the writer's thread: done by
/// the writer (SQLite's auto-checkpoint), the copy and its two fsyncs held
/// back every append queued meanwhile by tens of milliseconds.
struct Checkpointer {
    conn: Connection,
    stop: Receiver<()>,
    restart_wanted: Arc<AtomicBool>,
    commits: Arc<AtomicU64>,
}

impl Checkpointer {
    fn run(self) {
        let mut seen_commits = self.commits.load(Ordering::Relaxed);
        let mut idle_rounds = 0u32;
        // Nothing is ever sent: the channel closing is the stop signal.
        while let Err(RecvTimeoutError::Timeout) = self.stop.recv_timeout(CHECKPOINT_EVERY) {
            let commits = self.commits.load(Ordering::Relaxed);
            if commits != seen_commits {
                seen_commits = commits;
                idle_rounds = 0;
            } else {
                idle_rounds = idle_rounds.saturating_add(1);
                if idle_rounds != TRUNCATE_WHEN_IDLE_FOR {
                    continue;
                }
            }
            let result = if idle_rounds == TRUNCATE_WHEN_IDLE_FOR {
                self.truncate().map(|done| {
                    if !done {
                        // A reader was in the way: try again next round.
                        idle_rounds -= 1;
                    }
                })
            } else {
                self.pass()
            };
            if let Err(e) = result {
                tracing::warn!(error = %e, "store: checkpoint failed");
            }
        }
    }

    /// Copies everything and truncates the WAL file. This mode holds new
    /// appends back while it runs, hence only when idle, and without
    /// waiting for readers (no busy timeout on this connection): if one is
    /// reading, it returns false and nothing waited.
    fn truncate(&self) -> Result<bool, StoreError> {
        let busy: i64 = self
            .conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |row| row.get(0))?;
        if busy == 0 {
            self.restart_wanted.store(false, Ordering::Relaxed);
        }
        Ok(busy == 0)
    }

    fn pass(&self) -> Result<(), StoreError> {
        let mut frames = checkpoint(&self.conn)?;
        if frames < RESTART_WAL_FRAMES {
            return Ok(());
        }
        // Whatever was appended while that pass ran is left for the writer's
        // restart, on its thread: catch up first so that only a few frames
        // remain.
        for _ in 0..CATCH_UP_PASSES {
            let now = checkpoint(&self.conn)?;
            let appended = now.saturating_sub(frames);
            frames = now;
            if appended <= FEW_FRAMES {
                break;
            }
        }
        self.restart_wanted.store(true, Ordering::Relaxed);
        Ok(())
    }
}

fn open_reader(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.set_prepared_statement_cache_capacity(32);
    Ok(conn)
}

struct Readers {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
}

impl Readers {
    fn with<T>(
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
struct RawMeta {
    id: String,
    user: String,
    title: String,
    status: String,
    created_at: String,
    last_activity_at: String,
    head_seq: u64,
    close_delay_ms: Option<u64>,
    observers: String,
    current_turn_id: Option<String>,
    last_turn_message_seq: u64,
}

impl RawMeta {
    fn from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<RawMeta> {
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

    fn into_meta(self) -> Result<ConversationMeta, StoreError> {
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

fn get_meta(conn: &Connection, id: &str) -> Result<Option<ConversationMeta>, StoreError> {
    let raw = conn
        .prepare_cached(&format!(
            "SELECT {META_COLUMNS} FROM conversations WHERE id = ?1"
        ))?
        .query_row([id], RawMeta::from_row)
        .optional()?;
    raw.map(RawMeta::into_meta).transpose()
}

fn parse_observers(id: &str, json: &str) -> Result<Vec<String>, StoreError> {
    serde_json::from_str(json)
        .map_err(|e| StoreError::Backend(format!("conversation {id}: observers: {e}")))
}

fn event_from_row(id: &str, row: &rusqlite::Row<'_>) -> rusqlite::Result<Arc<EventRecord>> {
    let seq: u64 = row.get(0)?;
    let ts: String = row.get(1)?;
    let kind = intern_kind(row.get_ref(2)?.as_str()?);
    let data: String = row.get(3)?;
    Ok(Arc::new(EventRecord::from_parts(id, seq, ts, kind, data)))
}

/// The `text` of a `user_message` event's data.
fn message_text(data: &str) -> Option<String> {
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
fn intern_kind(kind: &str) -> Arc<str> {
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
fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<Joined, StoreError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(|h| Joined(Some(h)))
        .map_err(|e| StoreError::Backend(format!("spawn {name}: {e}")))
}

/// Joins a store thread when the store is dropped, so that a reopened store
/// sees everything the old one had queued.
struct Joined(Option<JoinHandle<()>>);

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::EventData;
    use crate::store::{ConversationState, NewConversation};

    fn ts(secs: u64) -> String {
        humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_secs(secs)).to_string()
    }

    fn record(id: &str, seq: u64, ts: String, data: &EventData) -> Arc<EventRecord> {
        let json = serde_json::to_string(data).unwrap();
        Arc::new(EventRecord::from_parts(
            id,
            seq,
            ts,
            Arc::from(data.kind()),
            json,
        ))
    }

    fn delta(id: &str, seq: u64, text: &str) -> Arc<EventRecord> {
        record(
            id,
            seq,
            crate::event::now_rfc3339(),
            &EventData::TextDelta {
                turn_id: "t_1".into(),
                text: text.into(),
            },
        )
    }

    fn state(status: Status, head_seq: u64) -> ConversationState {
        ConversationState {
            status,
            head_seq,
            last_activity_at: crate::event::now_rfc3339(),
            current_turn_id: None,
            last_turn_message_seq: 0,
        }
    }

    fn create_batch(id: &str, user: &str) -> AppendBatch {
        let ev = record(
            id,
            1,
            crate::event::now_rfc3339(),
            &EventData::ConversationCreated {
                user: user.into(),
                title: "hello".into(),
            },
        );
        AppendBatch {
            conversation_id: Arc::from(id),
            create: Some(NewConversation {
                user: user.into(),
                title: "hello".into(),
                created_at: ev.ts.clone(),
                close_delay: Some(Duration::from_secs(90)),
            }),
            events: vec![ev],
            state: state(Status::Idle, 1),
            client_msg_ids: vec![],
        }
    }

    fn events_batch(id: &str, events: Vec<Arc<EventRecord>>, st: ConversationState) -> AppendBatch {
        AppendBatch {
            conversation_id: Arc::from(id),
            create: None,
            events,
            state: st,
            client_msg_ids: vec![],
        }
    }

    /// Appends and waits for the callback.
    async fn append(store: &SqliteStore, batch: AppendBatch) -> Result<(), StoreError> {
        let (tx, rx) = oneshot::channel();
        store.append(
            batch,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.await.unwrap()
    }

    #[tokio::test]
    async fn append_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        append(&store, create_batch("c_1", "alice")).await.unwrap();
        let evs = (2..=4).map(|s| delta("c_1", s, "tok")).collect();
        let mut st = state(Status::Running, 4);
        st.current_turn_id = Some("t_1".into());
        append(&store, events_batch("c_1", evs, st.clone()))
            .await
            .unwrap();

        let meta = store.get("c_1").await.unwrap().unwrap();
        assert_eq!(meta.user, "alice");
        assert_eq!(meta.title, "hello");
        assert_eq!(meta.status, Status::Running);
        assert_eq!(meta.head_seq, 4);
        assert_eq!(meta.close_delay, Some(Duration::from_secs(90)));
        assert_eq!(meta.current_turn_id.as_deref(), Some("t_1"));
        assert_eq!(meta.last_activity_at, st.last_activity_at);
        assert!(store.get("c_nope").await.unwrap().is_none());

        let all = store.events("c_1", 0, 100).await.unwrap();
        assert_eq!(all.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3, 4]);
        assert_eq!(&*all[0].kind, "conversation_created");
        assert_eq!(&*all[1].kind, "text_delta");
        let v: serde_json::Value = serde_json::from_str(all[1].frame.as_str()).unwrap();
        assert_eq!(v["conversation_id"], "c_1");
        assert_eq!(v["seq"], 2);
        assert_eq!(v["data"]["text"], "tok");
        let some = store.events("c_1", 1, 2).await.unwrap();
        assert_eq!(some.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3]);
        assert!(store.events("c_1", 4, 10).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn callback_fires_after_commit() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        append(&store, create_batch("c_1", "alice")).await.unwrap();
        // Inside the callback, another connection must already see the
        // events: it could not if the callback ran before the commit.
        let path = store.path().to_owned();
        let (tx, rx) = oneshot::channel();
        let evs = (2..=11).map(|s| delta("c_1", s, "x")).collect();
        store.append(
            events_batch("c_1", evs, state(Status::Running, 11)),
            Box::new(move |r| {
                let conn =
                    Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
                let n: i64 = conn
                    .query_row(
                        "SELECT count(*) FROM events WHERE conversation_id = 'c_1'",
                        [],
                        |row| row.get(0),
                    )
                    .unwrap();
                let _ = tx.send((r, n));
            }),
        );
        let (r, n) = rx.await.unwrap();
        r.unwrap();
        assert_eq!(n, 11);
        assert_eq!(store.events("c_1", 0, 100).await.unwrap().len(), 11);
    }

    #[tokio::test]
    async fn group_commit_groups() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        // Hold the writer inside a callback while the appends queue up, so
        // that the grouping does not depend on how the threads race.
        let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
        store.append(
            create_batch("c_1", "alice"),
            Box::new(move |r| {
                r.unwrap();
                let _ = gate_rx.recv();
            }),
        );
        let before = store.commits();
        let n = 10_000u64;
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        for seq in 2..=n + 1 {
            let done_tx = done_tx.clone();
            store.append(
                events_batch(
                    "c_1",
                    vec![delta("c_1", seq, "tok ")],
                    state(Status::Running, seq),
                ),
                Box::new(move |r| {
                    let _ = done_tx.send(r);
                }),
            );
        }
        gate_tx.send(()).unwrap();
        for _ in 0..n {
            done_rx.recv().await.unwrap().unwrap();
        }
        store.flush().await.unwrap();
        let commits = store.commits() - before;
        assert!(commits <= 5, "{commits} commits for {n} appends");
        assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, n + 1);
        assert_eq!(
            store.events("c_1", 0, usize::MAX).await.unwrap().len() as u64,
            n + 1
        );
    }

    #[tokio::test]
    async fn a_bad_append_fails_alone() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
        store.append(
            create_batch("c_1", "alice"),
            Box::new(move |_| {
                let _ = gate_rx.recv();
            }),
        );
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let cb = |name: &'static str| -> CommitCallback {
            let tx = tx.clone();
            Box::new(move |r| {
                let _ = tx.send((name, r));
            })
        };
        // All of these land in one group.
        store.append(
            events_batch("c_1", vec![delta("c_1", 2, "a")], state(Status::Running, 2)),
            cb("good1"),
        );
        // A gap: seq 4 where 3 is next.
        store.append(
            events_batch("c_1", vec![delta("c_1", 4, "b")], state(Status::Running, 4)),
            cb("gap"),
        );
        store.append(
            events_batch(
                "c_nope",
                vec![delta("c_nope", 2, "b")],
                state(Status::Running, 2),
            ),
            cb("missing"),
        );
        store.append(create_batch("c_1", "alice"), cb("recreate"));
        store.append(
            events_batch("c_1", vec![delta("c_1", 3, "c")], state(Status::Idle, 3)),
            cb("good2"),
        );
        gate_tx.send(()).unwrap();
        let mut got = std::collections::HashMap::new();
        for _ in 0..5 {
            let (name, r) = rx.recv().await.unwrap();
            got.insert(name, r);
        }
        assert!(got["good1"].is_ok());
        assert!(got["good2"].is_ok());
        assert!(matches!(got["gap"], Err(StoreError::Backend(_))));
        assert!(matches!(got["missing"], Err(StoreError::NotFound(_))));
        assert!(matches!(got["recreate"], Err(StoreError::Backend(_))));
        let seqs: Vec<u64> = store
            .events("c_1", 0, 10)
            .await
            .unwrap()
            .iter()
            .map(|e| e.seq)
            .collect();
        assert_eq!(seqs, [1, 2, 3]);
        assert_eq!(
            store.get("c_1").await.unwrap().unwrap().status,
            Status::Idle
        );
        assert!(store.get("c_nope").await.unwrap().is_none());
    }

    #[tokio::test]
    async fn snapshot_has_tail_queue_and_client_msg_ids() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        append(&store, create_batch("c_1", "alice")).await.unwrap();
        let now = crate::event::now_rfc3339;
        let msg = |seq: u64, text: &str, cid: &str| {
            record(
                "c_1",
                seq,
                now(),
                &EventData::UserMessage {
                    text: text.into(),
                    client_msg_id: Some(cid.into()),
                },
            )
        };
        // 2: message m1, 3: turn for it, 4: delta, 5 and 6: two more
        // messages queued behind the running turn.
        let evs = vec![
            msg(2, "first", "m1"),
            record(
                "c_1",
                3,
                now(),
                &EventData::TurnStarted {
                    turn_id: "t_1".into(),
                    message_seq: 2,
                },
            ),
            delta("c_1", 4, "fi"),
            msg(5, "second", "m2"),
            msg(6, "third \"quoted\"", "m3"),
        ];
        let mut st = state(Status::Running, 6);
        st.current_turn_id = Some("t_1".into());
        st.last_turn_message_seq = 2;
        let mut batch = events_batch("c_1", evs, st);
        batch.client_msg_ids = vec![("m1".into(), 2), ("m2".into(), 5), ("m3".into(), 6)];
        append(&store, batch).await.unwrap();

        let snap = store.snapshot("c_1", 3).await.unwrap().unwrap();
        assert_eq!(snap.meta.head_seq, 6);
        assert_eq!(snap.meta.last_turn_message_seq, 2);
        assert_eq!(
            snap.tail.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [4, 5, 6]
        );
        assert_eq!(
            snap.queued,
            [
                QueuedMessage {
                    seq: 5,
                    text: "second".into()
                },
                QueuedMessage {
                    seq: 6,
                    text: "third \"quoted\"".into()
                },
            ]
        );
        assert_eq!(
            snap.client_msg_ids,
            [
                ("m1".to_string(), 2),
                ("m2".to_string(), 5),
                ("m3".to_string(), 6)
            ]
        );
        let all = store.snapshot("c_1", 100).await.unwrap().unwrap();
        assert_eq!(all.tail.len(), 6);
        assert!(store.snapshot("c_nope", 10).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn delete_removes_everything() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        append(&store, create_batch("c_1", "alice")).await.unwrap();
        append(&store, create_batch("c_2", "alice")).await.unwrap();
        let mut batch = events_batch(
            "c_1",
            vec![record(
                "c_1",
                2,
                crate::event::now_rfc3339(),
                &EventData::UserMessage {
                    text: "hi".into(),
                    client_msg_id: Some("m1".into()),
                },
            )],
            state(Status::Idle, 2),
        );
        batch.client_msg_ids = vec![("m1".into(), 2)];
        // Not awaited: the delete must still be ordered after it.
        store.append(batch, Box::new(|r| r.unwrap()));
        assert!(store.delete("c_1").await.unwrap());
        assert!(!store.delete("c_1").await.unwrap());
        assert!(store.get("c_1").await.unwrap().is_none());
        assert!(store.events("c_1", 0, 10).await.unwrap().is_empty());
        assert!(store.snapshot("c_1", 10).await.unwrap().is_none());
        assert_eq!(store.get("c_2").await.unwrap().unwrap().head_seq, 1);
        // The id may be used again from scratch, client_msg_ids included.
        let mut batch = create_batch("c_1", "bob");
        batch.client_msg_ids = vec![("m1".into(), 1)];
        append(&store, batch).await.unwrap();
        // Appending to a deleted conversation is refused.
        assert!(store.delete("c_2").await.unwrap());
        let r = append(
            &store,
            events_batch("c_2", vec![delta("c_2", 2, "x")], state(Status::Idle, 2)),
        )
        .await;
        assert!(matches!(r, Err(StoreError::NotFound(_))));
    }

    #[tokio::test]
    async fn observers() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        store.append(create_batch("c_1", "alice"), Box::new(|r| r.unwrap()));
        store.add_observer("c_1", "bob").await.unwrap();
        store.add_observer("c_1", "carol").await.unwrap();
        store.add_observer("c_1", "bob").await.unwrap();
        assert_eq!(
            store.get("c_1").await.unwrap().unwrap().observers,
            ["bob", "carol"]
        );
        assert!(matches!(
            store.add_observer("c_nope", "bob").await,
            Err(StoreError::NotFound(id)) if id == "c_nope"
        ));
        // Later appends keep the observers.
        append(
            &store,
            events_batch("c_1", vec![delta("c_1", 2, "x")], state(Status::Idle, 2)),
        )
        .await
        .unwrap();
        assert_eq!(
            store.get("c_1").await.unwrap().unwrap().observers,
            ["bob", "carol"]
        );
    }

    #[tokio::test]
    async fn prune_deletes_old_events_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        append(&store, create_batch("c_1", "alice")).await.unwrap();
        // 5,000 old events (more than one prune chunk), then 3 new ones.
        let day = 86_400;
        let old = 1_000 * day;
        let n_old = 5_000u64;
        let mut evs: Vec<_> = (2..n_old + 2)
            .map(|seq| {
                record(
                    "c_1",
                    seq,
                    ts(old + seq),
                    &EventData::TextDelta {
                        turn_id: "t".into(),
                        text: "x".into(),
                    },
                )
            })
            .collect();
        for seq in n_old + 2..n_old + 5 {
            evs.push(delta("c_1", seq, "new"));
        }
        append(
            &store,
            events_batch("c_1", evs, state(Status::Idle, n_old + 4)),
        )
        .await
        .unwrap();
        let before = UNIX_EPOCH + Duration::from_secs(old + 10 * day);
        assert_eq!(store.prune(before).await.unwrap(), n_old);
        let left = store.events("c_1", 0, 100).await.unwrap();
        // seq 1 was written now, so it stays.
        assert_eq!(
            left.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [1, n_old + 2, n_old + 3, n_old + 4]
        );
        assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, n_old + 4);
        assert_eq!(store.prune(before).await.unwrap(), 0);
        assert_eq!(store.prune(UNIX_EPOCH).await.unwrap(), 0);
        // Everything is older than the far future.
        let far = UNIX_EPOCH + Duration::from_secs(400_000 * 365 * day);
        assert_eq!(store.prune(far).await.unwrap(), 4);
    }

    #[tokio::test]
    async fn list_and_unfinished() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        for (id, user) in [("c_a", "alice"), ("c_b", "bob"), ("c_c", "alice")] {
            append(&store, create_batch(id, user)).await.unwrap();
        }
        let at = |id: &str, head: u64, status: Status, secs: u64| {
            let mut st = state(status, head);
            st.last_activity_at = ts(secs);
            events_batch(id, vec![], st)
        };
        append(&store, at("c_a", 1, Status::Stopped, 3_000))
            .await
            .unwrap();
        append(&store, at("c_b", 1, Status::Waiting, 1_000))
            .await
            .unwrap();
        append(&store, at("c_c", 1, Status::Running, 2_000))
            .await
            .unwrap();
        let ids = |v: Vec<ConversationMeta>| v.into_iter().map(|m| m.id).collect::<Vec<_>>();
        assert_eq!(
            ids(store.list(Some("alice")).await.unwrap()),
            ["c_a", "c_c"]
        );
        assert_eq!(ids(store.list(Some("bob")).await.unwrap()), ["c_b"]);
        assert!(store.list(Some("nobody")).await.unwrap().is_empty());
        assert_eq!(ids(store.list(None).await.unwrap()), ["c_a", "c_c", "c_b"]);
        assert_eq!(ids(store.unfinished().await.unwrap()), ["c_c", "c_b"]);
    }

    #[tokio::test]
    async fn data_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = SqliteStore::open(dir.path()).unwrap();
            append(&store, create_batch("c_1", "alice")).await.unwrap();
            store.add_observer("c_1", "bob").await.unwrap();
            let mut st = state(Status::Running, 3);
            st.current_turn_id = Some("t_9".into());
            // Queued, not awaited: dropping the store finishes it.
            store.append(
                events_batch("c_1", vec![delta("c_1", 2, "a"), delta("c_1", 3, "b")], st),
                Box::new(|r| r.unwrap()),
            );
        }
        let store = SqliteStore::open(dir.path()).unwrap();
        let meta = store.get("c_1").await.unwrap().unwrap();
        assert_eq!(meta.head_seq, 3);
        assert_eq!(meta.status, Status::Running);
        assert_eq!(meta.observers, ["bob"]);
        assert_eq!(meta.current_turn_id.as_deref(), Some("t_9"));
        assert_eq!(store.events("c_1", 0, 10).await.unwrap().len(), 3);
        assert_eq!(store.unfinished().await.unwrap().len(), 1);
        // And it goes on from there.
        append(
            &store,
            events_batch("c_1", vec![delta("c_1", 4, "c")], state(Status::Idle, 4)),
        )
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn committed_data_is_on_disk_before_close() {
        // What a SIGKILL leaves: the files as they are while the store runs,
        // never closed. Copy them the moment the callback has fired and open
        // the copy.
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        append(&store, create_batch("c_1", "alice")).await.unwrap();
        let evs = (2..=500).map(|s| delta("c_1", s, "tok")).collect();
        append(
            &store,
            events_batch("c_1", evs, state(Status::Running, 500)),
        )
        .await
        .unwrap();
        let copy = tempfile::tempdir().unwrap();
        for name in ["linger.db", "linger.db-wal"] {
            let from = dir.path().join(name);
            if from.exists() {
                std::fs::copy(&from, copy.path().join(name)).unwrap();
            }
        }
        let recovered = SqliteStore::open(copy.path()).unwrap();
        let meta = recovered.get("c_1").await.unwrap().unwrap();
        assert_eq!(meta.head_seq, 500);
        assert_eq!(recovered.events("c_1", 0, 1000).await.unwrap().len(), 500);
        drop(store);
    }

    #[tokio::test]
    async fn the_wal_is_checkpointed_and_truncated_when_idle() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        append(&store, create_batch("c_1", "alice")).await.unwrap();
        for seq in 2..=200 {
            let evs = vec![delta("c_1", seq, "some text to fill pages with")];
            append(
                &store,
                events_batch("c_1", evs, state(Status::Running, seq)),
            )
            .await
            .unwrap();
        }
        let wal = dir.path().join("linger.db-wal");
        assert!(std::fs::metadata(&wal).unwrap().len() > 0);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::fs::metadata(&wal).unwrap().len() > 0 {
            assert!(std::time::Instant::now() < deadline, "WAL never truncated");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Everything is in the database file now, and still readable.
        assert_eq!(store.events("c_1", 0, 1000).await.unwrap().len(), 200);
        append(
            &store,
            events_batch(
                "c_1",
                vec![delta("c_1", 201, "x")],
                state(Status::Idle, 201),
            ),
        )
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn a_panicking_callback_does_not_stop_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        store.append(create_batch("c_1", "alice"), Box::new(|_| panic!("boom")));
        append(
            &store,
            events_batch("c_1", vec![delta("c_1", 2, "x")], state(Status::Idle, 2)),
        )
        .await
        .unwrap();
        assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, 2);
    }

    #[tokio::test]
    async fn last_handle_dropped_by_a_callback() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open(dir.path()).unwrap());
        // A callback that drops the last handle runs on the writer itself;
        // that must neither deadlock nor lose the callback.
        let (tx, rx) = oneshot::channel();
        let handle = store.clone();
        store.append(
            create_batch("c_1", "alice"),
            Box::new(move |r| {
                drop(handle);
                let _ = tx.send(r);
            }),
        );
        drop(store);
        rx.await.unwrap().unwrap();
    }
}

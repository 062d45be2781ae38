//! linger's append path on fjall (an LSM key-value engine), for the
//! comparison of issue 14: what the SQLite store's writer does, on the other
//! engine, with what the comparison needs and nothing else (no reads but a
//! check, no deletes, prunes, observers or `client_msg_id`s).
//!
//! - **The writer** is one thread fed through a bounded channel. It groups
//!   as linger's does: it blocks for one append, waits out the rest of 1 ms
//!   since the last group started (linger's `GROUP_SPACING`, which is what
//!   makes a paced load a commit per millisecond), takes whatever else is
//!   queued up to 4,096 appends (linger's `MAX_GROUP`), checks each append
//!   follows its conversation's head, and writes the group as ONE fjall
//!   `Batch`.
//! - **The batch** holds, per conversation the group touched, one key per
//!   run of its events (at most 256 events a run, as linger's
//!   `RUN_MAX_EVENTS`) in partition `events`: the conversation id, a 0x00
//!   byte and the run's first seq as a big-endian u64, so that a prefix scan
//!   reads a conversation in seq order; its value is the run encoded exactly
//!   as linger's store encodes it (a JSON array of `[seq,"ts","kind",data]`,
//!   `data` the event's own JSON; [`check_runs`] compares the bytes with a
//!   row SQLite stored). And one key per conversation in partition
//!   `conversations`: its head seq (big-endian u64) and status, standing for
//!   linger's conversations row.
//! - **Durability** as linger's `synchronous = NORMAL` in WAL mode: the
//!   batch is committed, then `Keyspace::persist(PersistMode::Buffer)` hands
//!   fjall's journal to the OS (a write, no fsync) before any append of the
//!   group is called back. (With `manual_journal_persist(true)`, a batch
//!   commit does not persist by itself.)

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fjall::{AbstractTree, Config, Keyspace, PartitionCreateOptions, PartitionHandle, PersistMode};
use linger::event::{intern_kind, EventRecord};
use linger::store::{AppendBatch, CommitCallback, ConversationState, StoreError};
use serde_json::value::RawValue;

/// Most appends one group takes (linger's `MAX_GROUP`).
const MAX_GROUP: usize = 4096;

/// The least time from one group's start to the next's (linger's
/// `GROUP_SPACING`).
const GROUP_SPACING: Duration = Duration::from_millis(1);

/// Most events in one run (linger's `RUN_MAX_EVENTS`).
const RUN_MAX_EVENTS: usize = 256;

/// Appends the channel holds before `append` blocks. Boxed commands, as
/// linger's, so a slot is a pointer.
const QUEUE: usize = 16 * MAX_GROUP;

/// fjall's block cache: linger's writer connection has a 16 MiB page cache
/// (`cache_size = -16384`). fjall's default is 32 MiB.
pub const CACHE_BYTES: u64 = 16 << 20;

/// Each partition's memtable, flushed to a new table file once this full:
/// fjall's default, stated, the same size as SQLite's page cache.
pub const MEMTABLE_BYTES: u32 = 16 << 20;

/// All memtables together, sealed ones waiting for their flush included
/// (fjall's default is 64 MiB): one full memtable of `events` being flushed
/// while the next fills.
pub const WRITE_BUFFER_BYTES: u64 = 32 << 20;

/// How long fjall's background work must have shown no change before
/// [`FjallModel::settle`] takes it as done.
pub const QUIET: Duration = Duration::from_millis(100);

// Boxed on the channel, as linger's; unboxed into a group.
#[allow(clippy::large_enum_variant)]
enum Command {
    Append {
        batch: AppendBatch,
        done: CommitCallback,
    },
    Flush(tokio::sync::oneshot::Sender<()>),
}

pub struct FjallModel {
    tx: Option<SyncSender<Box<Command>>>,
    writer: Option<JoinHandle<()>>,
    commits: Arc<AtomicU64>,
    keyspace: Keyspace,
    events: PartitionHandle,
    conversations: PartitionHandle,
}

impl FjallModel {
    /// Opens a new keyspace at `dir/fjall` and starts the writer.
    pub fn open(dir: &Path) -> FjallModel {
        let keyspace = Config::new(dir.join("fjall"))
            .cache_size(CACHE_BYTES)
            .max_write_buffer_size(WRITE_BUFFER_BYTES)
            .manual_journal_persist(true)
            .open()
            .expect("open the fjall keyspace");
        let options = || PartitionCreateOptions::default().max_memtable_size(MEMTABLE_BYTES);
        let events = keyspace
            .open_partition("events", options())
            .expect("open partition events");
        let conversations = keyspace
            .open_partition("conversations", options())
            .expect("open partition conversations");
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let commits = Arc::new(AtomicU64::new(0));
        let writer = Writer {
            rx,
            keyspace: keyspace.clone(),
            events: events.clone(),
            conversations: conversations.clone(),
            commits: commits.clone(),
            heads: HashMap::new(),
            value: String::new(),
        };
        let writer = std::thread::Builder::new()
            .name("fjall-model-writer".into())
            .spawn(move || writer.run())
            .expect("spawn the fjall writer");
        FjallModel {
            tx: Some(tx),
            writer: Some(writer),
            commits,
            keyspace,
            events,
            conversations,
        }
    }

    /// Queues an append; `done` is called once its group is committed and
    /// its journal written to the OS.
    pub fn append(&self, batch: AppendBatch, done: CommitCallback) {
        self.send(Command::Append { batch, done });
    }

    /// Waits until everything queued before is committed.
    pub async fn flush(&self) {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.send(Command::Flush(reply));
        rx.await.expect("the fjall writer stopped");
    }

    /// Groups committed so far.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    fn send(&self, cmd: Command) {
        let tx = self.tx.as_ref().expect("the fjall writer was stopped");
        if tx.send(Box::new(cmd)).is_err() {
            panic!("the fjall writer stopped");
        }
    }

    /// Stops the writer (everything queued is committed first), makes fjall
    /// flush its active memtables (what the data would force once more
    /// came, and what a restart would otherwise replay from the journal),
    /// and waits until its background work is over: no memtable waiting
    /// for its flush, no compaction running, and neither those nor the
    /// count of table files and finished compactions changing for
    /// [`QUIET`]. fjall has no event to wait on (and its counters are
    /// `doc(hidden)`), hence polling every millisecond. Returns the time
    /// from this call to the last change seen.
    pub fn settle(&mut self) -> Duration {
        let start = Instant::now();
        drop(self.tx.take());
        if let Some(writer) = self.writer.take() {
            writer.join().expect("the fjall writer panicked");
        }
        for partition in [&self.events, &self.conversations] {
            partition.rotate_memtable().expect("rotate a memtable");
        }
        let mut seen = self.background();
        let mut last_change = Instant::now();
        loop {
            std::thread::sleep(Duration::from_millis(1));
            let now = self.background();
            if now != seen || now.busy() {
                seen = now;
                last_change = Instant::now();
            } else if last_change.elapsed() >= QUIET {
                return last_change - start;
            }
        }
    }

    fn background(&self) -> Background {
        let partitions = [&self.events, &self.conversations];
        Background {
            sealed_memtables: partitions
                .iter()
                .map(|p| p.tree.sealed_memtable_count())
                .sum(),
            active_compactions: self.keyspace.active_compactions(),
            compactions_completed: self.keyspace.compactions_completed(),
            flushes_completed: self.keyspace.flushes_completed(),
            tables: partitions.iter().map(|p| p.segment_count()).sum(),
        }
    }

    /// Panics unless conversation `id` is stored as events 1 to `head`, in
    /// runs encoded as linger encodes them, with `head` in its
    /// conversations key.
    pub fn check_history(&self, id: &str, head: u64) {
        let mut prefix = id.as_bytes().to_vec();
        prefix.push(0);
        let runs = self.events.prefix(&prefix).map(|kv| {
            let (key, value) = kv.expect("read a run from fjall");
            let first = key
                .get(prefix.len()..)
                .and_then(|seq| <[u8; 8]>::try_from(seq).ok())
                .map(u64::from_be_bytes)
                .unwrap_or_else(|| panic!("fjall: a key of {id} is not id, 0, seq"));
            let json = String::from_utf8(value.to_vec()).expect("a run is UTF-8");
            (first, json)
        });
        check_runs("fjall", id, head, runs);
        let row = self
            .conversations
            .get(id)
            .expect("read the conversations key")
            .unwrap_or_else(|| panic!("fjall: no conversations key for {id}"));
        let stored = row
            .get(..8)
            .and_then(|seq| <[u8; 8]>::try_from(seq).ok())
            .map(u64::from_be_bytes);
        assert_eq!(
            stored,
            Some(head),
            "fjall: the conversations key of {id} says head {stored:?}, not {head}"
        );
    }
}

/// What fjall's background threads are at.
#[derive(PartialEq, Eq, Debug)]
struct Background {
    sealed_memtables: usize,
    active_compactions: usize,
    compactions_completed: usize,
    flushes_completed: usize,
    tables: usize,
}

impl Background {
    fn busy(&self) -> bool {
        self.sealed_memtables > 0 || self.active_compactions > 0
    }
}

struct Writer {
    rx: Receiver<Box<Command>>,
    keyspace: Keyspace,
    events: PartitionHandle,
    conversations: PartitionHandle,
    commits: Arc<AtomicU64>,
    /// Each conversation's head, as linger's writer remembers it.
    heads: HashMap<Arc<str>, u64>,
    /// The buffer each run is encoded in.
    value: String,
}

impl Writer {
    fn run(mut self) {
        let mut group: Vec<Command> = Vec::with_capacity(MAX_GROUP);
        let mut last_group_at: Option<Instant> = None;
        while let Ok(first) = self.rx.recv() {
            group.push(*first);
            if let Some(last) = last_group_at {
                let wait = (last + GROUP_SPACING).saturating_duration_since(Instant::now());
                if !wait.is_zero() {
                    // Pacing, as linger's writer: the appends of this
                    // millisecond queue meanwhile and go as one commit.
                    std::thread::sleep(wait);
                }
            }
            while group.len() < MAX_GROUP {
                match self.rx.try_recv() {
                    Ok(cmd) => group.push(*cmd),
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            last_group_at = Some(Instant::now());
            self.run_group(&mut group);
        }
    }

    /// Commits one group as one batch, then calls every append back.
    fn run_group(&mut self, group: &mut Vec<Command>) {
        // Per conversation: this group's events in seq order, and the state
        // of its last append.
        let mut touched: HashMap<&str, (Vec<&EventRecord>, &ConversationState)> =
            HashMap::with_capacity(group.len());
        let mut results: Vec<Result<(), StoreError>> = Vec::with_capacity(group.len());
        for cmd in group.iter() {
            let Command::Append { batch, .. } = cmd else {
                results.push(Ok(()));
                continue;
            };
            let result = follow(&mut self.heads, batch);
            if result.is_ok() {
                let entry = touched
                    .entry(&*batch.conversation_id)
                    .or_insert_with(|| (Vec::new(), &batch.state));
                entry.0.extend(batch.events.iter().map(|ev| &**ev));
                entry.1 = &batch.state;
            }
            results.push(result);
        }

        let mut batch = self.keyspace.batch();
        for (id, (events, state)) in &touched {
            for run in events.chunks(RUN_MAX_EVENTS) {
                let mut key = Vec::with_capacity(id.len() + 9);
                key.extend_from_slice(id.as_bytes());
                key.push(0);
                key.extend_from_slice(&run[0].seq.to_be_bytes());
                self.value.clear();
                encode_run(&mut self.value, run);
                batch.insert(&self.events, key, self.value.as_bytes());
            }
            let status = state.status.as_str();
            let mut row = Vec::with_capacity(8 + status.len());
            row.extend_from_slice(&state.head_seq.to_be_bytes());
            row.extend_from_slice(status.as_bytes());
            batch.insert(&self.conversations, id.as_bytes(), row);
        }
        let committed = batch
            .commit()
            .and_then(|()| self.keyspace.persist(PersistMode::Buffer))
            .map_err(|e| StoreError::Unavailable(format!("fjall: {e}")));
        drop(touched);
        if committed.is_ok() {
            self.commits.fetch_add(1, Ordering::Relaxed);
        }
        for (cmd, result) in group.drain(..).zip(results) {
            let result = committed.clone().and(result);
            match cmd {
                Command::Append { done, batch } => done(result, &batch.events),
                Command::Flush(reply) => {
                    result.expect("fjall commit");
                    let _ = reply.send(());
                }
            }
        }
    }
}

/// Checks that `batch` follows its conversation's head (or creates it at
/// seq 1) and moves the head, as linger's writer does.
fn follow(heads: &mut HashMap<Arc<str>, u64>, batch: &AppendBatch) -> Result<(), StoreError> {
    let id = &batch.conversation_id;
    let head = batch.state.head_seq;
    let bad = |why: String| StoreError::Backend(format!("conversation {id}: bad append: {why}"));
    let base = head
        .checked_sub(batch.events.len() as u64)
        .ok_or_else(|| bad(format!("{} events but head_seq {head}", batch.events.len())))?;
    for (i, ev) in batch.events.iter().enumerate() {
        if ev.seq != base + 1 + i as u64 {
            return Err(bad(format!("event seq {} out of order", ev.seq)));
        }
    }
    match (batch.create.is_some(), heads.get_mut(&**id)) {
        (true, Some(_)) => Err(bad("it exists".into())),
        (true, None) if base != 0 => Err(bad(format!("created at seq {}", base + 1))),
        (true, None) => {
            heads.insert(id.clone(), head);
            Ok(())
        }
        (false, None) => Err(StoreError::NotFound(id.to_string())),
        (false, Some(stored)) if *stored != base => Err(bad(format!(
            "stored head_seq is {stored}, the append follows {base}"
        ))),
        (false, Some(stored)) => {
            *stored = head;
            Ok(())
        }
    }
}

/// Encodes `events` (in seq order) at the end of `out` as linger's store
/// encodes a run: `[[seq,"ts","kind",data],...]`.
pub fn encode_run(out: &mut String, events: &[&EventRecord]) {
    out.push('[');
    for (i, ev) in events.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Writing into a String cannot fail.
        let _ = write!(out, "[{},", ev.seq);
        push_json_str(out, ev.ts());
        out.push(',');
        push_json_str(out, &ev.kind);
        out.push(',');
        out.push_str(ev.data());
        out.push(']');
    }
    out.push(']');
}

/// `s` as a JSON string.
fn push_json_str(out: &mut String, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        out.push_str(&serde_json::to_string(s).expect("a str serializes"));
    }
}

/// Panics unless `runs` (first seq and JSON text, in seq order) of
/// conversation `id`, as `engine` stored them, hold events 1 to `head`,
/// each run starting at its first seq, and each run's text is what
/// [`encode_run`] makes of its events.
pub fn check_runs(engine: &str, id: &str, head: u64, runs: impl Iterator<Item = (u64, String)>) {
    let mut next = 1u64;
    let mut encoded = String::new();
    for (first, json) in runs {
        let events: Vec<(u64, String, String, Box<RawValue>)> = serde_json::from_str(&json)
            .unwrap_or_else(|e| panic!("{engine}: a run of {id} is not a run: {e}"));
        assert_eq!(
            first, next,
            "{engine}: conversation {id}: a run starts at seq {first} where {next} was expected"
        );
        let records: Vec<EventRecord> = events
            .iter()
            .map(|(seq, ts, kind, data)| {
                assert_eq!(
                    *seq, next,
                    "{engine}: conversation {id}: seq {seq} where {next} was expected"
                );
                next += 1;
                EventRecord::from_parts(id, *seq, ts, intern_kind(kind), data.get())
            })
            .collect();
        encoded.clear();
        encode_run(&mut encoded, &records.iter().collect::<Vec<_>>());
        assert!(
            encoded == json,
            "{engine}: conversation {id}: the run at seq {first} is not encoded as the \
             bench encodes it:\n stored:  {json}\n encoded: {encoded}"
        );
    }
    assert_eq!(
        next - 1,
        head,
        "{engine}: conversation {id} holds seqs 1 to {}, not 1 to {head}",
        next - 1
    );
}

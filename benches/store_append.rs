//! What the SQLite store costs the write-before-send path, and what an LSM
//! engine, fjall, would cost in its place (issue 14): every scenario runs
//! once per engine, through the same code, and the rows say which.
//!
//! - `sqlite`: linger's store (`SqliteStore`, through the `Store` trait),
//!   which groups appends by itself.
//! - `fjall`: the same append path on fjall 2 (`store_append/fjall_model.rs`
//!   says what it writes): a writer thread that groups as linger's does (at
//!   most 4,096 appends, groups at least 1 ms apart), writes each group as
//!   one fjall batch (a key per conversation run, its value the run encoded
//!   byte for byte as linger encodes it, and a key per conversation touched
//!   in a `conversations` partition), hands its journal to the OS (no
//!   fsync, as SQLite's `synchronous = NORMAL` in WAL mode) and calls back.
//!   fjall's defaults, but for a 16 MiB block cache (linger's writer has a
//!   16 MiB page cache), 16 MiB memtables and a 32 MiB write buffer. At the
//!   end, a conversation's events are read back and checked (seqs 1 to N,
//!   in runs encoded as linger encodes them); SQLite's are checked the same
//!   way, read from `linger.db`.
//!
//! The scenarios, appends of ~60-byte `text_delta` events, one event each:
//!
//! (a) burst: 100 conversations × 2,000 appends, queued as fast as one task
//!     can (fjall's channel holds 65,536: past that the task waits for
//!     room); events/s until the last callback, and how many commits that
//!     took.
//! (b) steady: a paced offered load over 100 conversations (10 appends
//!     every 1 ms = 10,000 events/s, and 50,000 events/s for headroom), for
//!     5 s; the time from `append()` to its callback, which is what
//!     write-before-send adds to every event.
//! (c) saturated: 100 conversations × 20,000 appends (2,000,000 events),
//!     each conversation with at most 6 appends not yet called back: the
//!     next event of a conversation is appended as soon as one of its own
//!     is committed, so events come as fast as the engine takes them and a
//!     commit holds at most 6 events per conversation (600), as under the
//!     server's saturated benchmark (~5 per conversation per commit). The
//!     engine's writer groups them as it does.
//! (d) paced: 1,000 conversations at 20 events/s each: 20 appends every
//!     1 ms, each of a different conversation (20,000 events/s), for 10 s;
//!     latency as in (b).
//!
//! Columns: `ev/commit` is the grouping achieved; `B/event` the bytes the
//! process wrote (WAL or journal, checkpoints, flushes, compactions) per
//! event, i.e. the write amplification; `cpu us/ev` the process's CPU time
//! per event (in the steady, saturated and paced rows this includes
//! building the events; the cost of that is printed under the table). These
//! two are measured at the last callback, when the engine may still owe
//! work for what it took. So the next columns measure again once that work
//! is done: `settle` is the time it took after the last callback, `B/ev
//! +bg` and `cpu +bg` the two figures over the whole run including it, and
//! `disk B/ev` what the store's files then take on disk (their allocated
//! blocks). SQLite settles by being closed (`flush()`, then dropping the
//! store: its writer folds the journal into `event_runs`, and the last
//! connection to close checkpoints the WAL into `linger.db`): the public
//! API has no way to wait for the checkpointer while the store stays open.
//! fjall settles by a forced flush of its active memtables, then waiting
//! until no memtable waits for its flush and no compaction runs, with
//! nothing changing for 100 ms (fjall has no event to wait on: this polls
//! its counters every 1 ms; the 100 ms are not in `settle`). Latency and
//! events/s depend on what else the machine runs; the CPU and bytes per
//! event do not.
//!
//! Run with `cargo bench --bench store_append`. Words after `--` pick the
//! scenarios whose `<engine> <scenario>` contains one of them: `burst`,
//! `steady10000`, `steady50000`, `saturated`, `paced`, an engine (`sqlite`,
//! `fjall`), or both in one quoted word (`"fjall saturated"`).
//! `LINGER_BENCH_SCALE=0.05` scales every count and duration by that
//! factor (a quick check that the scenarios work; its figures are not
//! comparable with a full run's). The stores go to a temporary directory,
//! or under `$LINGER_BENCH_DIR` when set (to measure a particular disk).

#[path = "store_append/fjall_model.rs"]
mod fjall_model;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fjall_model::FjallModel;
use linger::event::{EventData, EventRecord, StartReason};
use linger::protocol::Status;
use linger::store::sqlite::SqliteStore;
use linger::store::{AppendBatch, CommitCallback, ConversationState, NewConversation, Store};

const CONVERSATIONS: usize = 100;
const PER_CONVERSATION: u64 = 2_000;

/// The saturated scenario: events per conversation, and appends a
/// conversation may have waiting for their callback.
const SATURATED_PER_CONVERSATION: u64 = 20_000;
const SATURATED_IN_FLIGHT: u64 = 6;

/// The paced scenario: conversations, events/s in all, and for how long.
const PACED_CONVERSATIONS: usize = 1_000;
const PACED_RATE: u64 = 20_000;
const PACED_FOR: Duration = Duration::from_secs(10);

const STEADY_FOR: Duration = Duration::from_secs(5);

struct Row {
    name: String,
    events: u64,
    secs: f64,
    commits: u64,
    latency: Option<[Duration; 3]>,
    /// At the last callback.
    usage: Usage,
    settled: Settled,
}

impl Row {
    /// The row of a scenario that queues as fast as it can (no latency).
    fn unpaced(
        name: String,
        events: u64,
        secs: f64,
        commits: u64,
        usage: Usage,
        settled: Settled,
    ) -> Row {
        Row {
            name,
            events,
            secs,
            commits,
            latency: None,
            usage,
            settled,
        }
    }
}

/// The run once the engine's background work is done.
struct Settled {
    /// From the last callback until that work was done.
    secs: f64,
    /// Over the whole run, that work included.
    usage: Usage,
    /// The size of the store's files then.
    disk: u64,
}

/// Bytes the process handed to write(2) (from /proc/self/io; Linux, zero
/// elsewhere) and CPU seconds it used (getrusage): the write amplification and the CPU
/// cost per event, which unlike latency do not depend on what else runs on
/// the machine. Both count every thread, the engines' own included.
#[derive(Clone, Copy, Default)]
struct Usage {
    written: u64,
    cpu_secs: f64,
}

impl Usage {
    fn now() -> Usage {
        let written = std::fs::read_to_string("/proc/self/io")
            .ok()
            .and_then(|io| {
                io.lines()
                    .find_map(|l| l.strip_prefix("wchar:"))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0);
        // User and system time of every thread, live or ended, to the
        // microsecond (/proc/self/stat counts 10 ms ticks).
        let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage fills the struct it is given, which is zeroed
        // (a valid rusage) even if it fails.
        let ru = unsafe {
            libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr());
            ru.assume_init()
        };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        let cpu_secs = secs(ru.ru_utime) + secs(ru.ru_stime);
        Usage { written, cpu_secs }
    }

    fn since(self, before: Usage) -> Usage {
        Usage {
            written: self.written.saturating_sub(before.written),
            cpu_secs: self.cpu_secs - before.cpu_secs,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Sqlite,
    Fjall,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Sqlite => "sqlite",
            Kind::Fjall => "fjall",
        }
    }
}

/// One engine's store, opened in a temporary directory.
enum Engine {
    /// `None` once closed by [`Engine::settle`].
    Sqlite(Option<SqliteStore>),
    Fjall(FjallModel),
}

impl Engine {
    fn open(kind: Kind, dir: &Path) -> Engine {
        match kind {
            Kind::Sqlite => Engine::Sqlite(Some(SqliteStore::open(dir).expect("open"))),
            Kind::Fjall => Engine::Fjall(FjallModel::open(dir)),
        }
    }

    fn sqlite(&self) -> &SqliteStore {
        match self {
            Engine::Sqlite(Some(store)) => store,
            _ => panic!("not an open SQLite store"),
        }
    }

    fn append(&self, batch: AppendBatch, done: CommitCallback) {
        match self {
            Engine::Sqlite(_) => self.sqlite().append(batch, done),
            Engine::Fjall(model) => model.append(batch, done),
        }
    }

    async fn flush(&self) {
        match self {
            Engine::Sqlite(_) => self.sqlite().flush().await.expect("flush"),
            Engine::Fjall(model) => model.flush().await,
        }
    }

    fn commits(&self) -> u64 {
        match self {
            Engine::Sqlite(_) => self.sqlite().commits(),
            Engine::Fjall(model) => model.commits(),
        }
    }

    /// Waits for the background work the data written so far forces (see
    /// the module's doc), and returns how long after this call it ended.
    async fn settle(&mut self) -> Duration {
        match self {
            Engine::Sqlite(store) => {
                let start = Instant::now();
                let store = store.take().expect("an open SQLite store");
                store.flush().await.expect("flush");
                // Joins the writer (which folds the journal at close) and
                // the checkpointer; the last connection to close copies
                // the WAL into the database file.
                tokio::task::spawn_blocking(move || drop(store))
                    .await
                    .expect("close the SQLite store");
                start.elapsed()
            }
            Engine::Fjall(model) => tokio::task::block_in_place(|| model.settle()),
        }
    }

    /// Panics unless conversation `id` is stored as events 1 to `head`.
    fn check_history(&self, dir: &Path, id: &str, head: u64) {
        match self {
            Engine::Sqlite(_) => {
                // Closed: everything is in `event_runs` now.
                let conn = rusqlite::Connection::open(dir.join("linger.db")).expect("open");
                let mut runs = conn
                    .prepare(
                        "SELECT first_seq, events FROM event_runs WHERE conversation_id = ?1 \
                         ORDER BY first_seq",
                    )
                    .expect("query event_runs");
                let runs = runs
                    .query_map([id], |row| Ok((row.get::<_, u64>(0)?, row.get(1)?)))
                    .expect("read event_runs")
                    .map(|run| run.expect("read a run"));
                fjall_model::check_runs("sqlite", id, head, runs);
            }
            Engine::Fjall(model) => model.check_history(id, head),
        }
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    // `cargo bench --bench store_append -- steady` runs only the scenarios
    // whose `<engine> <scenario>` contains one of the words given.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wanted = |name: &str| only.is_empty() || only.iter().any(|w| name.contains(w.as_str()));
    let scale: f64 = std::env::var("LINGER_BENCH_SCALE")
        .ok()
        .map(|s| s.parse().expect("LINGER_BENCH_SCALE is a number"))
        .unwrap_or(1.0);
    assert!(scale > 0.0, "LINGER_BENCH_SCALE must be above 0");
    let count = |n: u64| ((n as f64 * scale).round() as u64).max(1);
    let time = |d: Duration| d.mul_f64(scale).max(Duration::from_millis(10));
    let engines = [Kind::Sqlite, Kind::Fjall];
    let (rows, built_live) = runtime.block_on(async {
        let mut rows = Vec::new();
        let mut built_live = false;
        for kind in engines {
            if wanted(&format!("{} burst", kind.name())) {
                rows.push(burst(kind, count(PER_CONVERSATION)).await);
            }
        }
        for rate in [10_000, 50_000] {
            for kind in engines {
                if wanted(&format!("{} steady{rate}", kind.name())) {
                    let name = format!("{} steady {rate} ev/s", kind.name());
                    rows.push(paced(kind, name, rate, CONVERSATIONS, time(STEADY_FOR)).await);
                    built_live = true;
                }
            }
        }
        for kind in engines {
            if wanted(&format!("{} saturated", kind.name())) {
                rows.push(saturated(kind, count(SATURATED_PER_CONVERSATION)).await);
                built_live = true;
            }
        }
        for kind in engines {
            if wanted(&format!("{} paced", kind.name())) {
                let per_conversation = PACED_RATE / PACED_CONVERSATIONS as u64;
                let name = format!(
                    "{} paced {PACED_CONVERSATIONS}x{per_conversation}/s",
                    kind.name()
                );
                let duration = time(PACED_FOR);
                rows.push(paced(kind, name, PACED_RATE, PACED_CONVERSATIONS, duration).await);
                built_live = true;
            }
        }
        (rows, built_live)
    });
    print_table(&rows);
    if built_live {
        let per_event = build_cost(200_000);
        println!(
            "Building an event and its append costs {per_event:.2} us of CPU: part of cpu us/ev \
             in the steady, saturated and paced rows (the burst rows build theirs first)."
        );
    }
    if scale != 1.0 {
        println!("LINGER_BENCH_SCALE={scale}: a short run, not comparable with a full one.");
    }
}

fn temp_dir() -> tempfile::TempDir {
    match std::env::var_os("LINGER_BENCH_DIR") {
        Some(dir) => tempfile::tempdir_in(dir).expect("temp dir"),
        None => tempfile::tempdir().expect("temp dir"),
    }
}

/// The files under `dir`: how many, and the bytes they occupy on disk
/// (allocated blocks: fjall's journal is a sparse 32 MiB file).
fn disk_usage(dir: &Path) -> (usize, u64) {
    let mut files = 0;
    let mut bytes = 0;
    for entry in std::fs::read_dir(dir).expect("read the store's directory") {
        let entry = entry.expect("read the store's directory");
        let meta = entry.metadata().expect("stat a store file");
        if meta.is_dir() {
            let (f, b) = disk_usage(&entry.path());
            files += f;
            bytes += b;
        } else {
            files += 1;
            bytes += std::os::unix::fs::MetadataExt::blocks(&meta) * 512;
        }
    }
    (files, bytes)
}

fn conversation_id(i: usize) -> Arc<str> {
    Arc::from(format!("c_01JBENCH{i:017}"))
}

fn delta(id: &str, seq: u64) -> Arc<EventRecord> {
    // {"turn_id":"t_01JBENCH0000000001","text":"tok123456 and more "}: ~60 bytes.
    let data = EventData::TextDelta {
        turn_id: "t_01JBENCH0000000001".into(),
        text: format!("tok{seq:06} and more "),
    };
    Arc::new(EventRecord::new(id, seq, &data))
}

fn batch(id: &Arc<str>, ev: Arc<EventRecord>) -> AppendBatch {
    AppendBatch {
        conversation_id: id.clone(),
        create: None,
        state: ConversationState {
            status: Status::Running,
            head_seq: ev.seq,
            last_activity_at: None,
            current_turn_id: Some("t_01JBENCH0000000001".into()),
            last_turn_message_seq: 2,
        },
        events: vec![ev],
        client_msg_ids: Vec::new(),
        forget_client_msg_ids_before: 0,
    }
}

/// Opens `kind`'s store in a new temporary directory, creates
/// `conversations` conversations (seq 1 and 2) and waits until they are
/// stored.
async fn open_with(kind: Kind, conversations: usize) -> (tempfile::TempDir, Engine, Vec<Arc<str>>) {
    let dir = temp_dir();
    let engine = Engine::open(kind, dir.path());
    let ids: Vec<Arc<str>> = (0..conversations).map(conversation_id).collect();
    for id in &ids {
        let created = EventRecord::new(
            id,
            1,
            &EventData::ConversationCreated {
                user: "bench".into(),
                title: "bench".into(),
            },
        );
        let started = EventRecord::new(
            id,
            2,
            &EventData::AgentStarted {
                reason: StartReason::Created,
            },
        );
        engine.append(
            AppendBatch {
                conversation_id: id.clone(),
                create: Some(NewConversation {
                    user: "bench".into(),
                    title: "bench".into(),
                    created_at: created.ts().to_owned(),
                    close_delay: None,
                }),
                state: ConversationState {
                    status: Status::Idle,
                    head_seq: 2,
                    last_activity_at: None,
                    current_turn_id: None,
                    last_turn_message_seq: 0,
                },
                events: vec![Arc::new(created), Arc::new(started)],
                client_msg_ids: Vec::new(),
                forget_client_msg_ids_before: 0,
            },
            Box::new(|r, _| r.expect("create")),
        );
    }
    engine.flush().await;
    (dir, engine, ids)
}

/// After the last callback (`usage`, since `before`): waits for the
/// engine's background work, measures again, checks the first
/// conversation's history (`head` its last seq) and closes the store.
async fn settle(
    mut engine: Engine,
    dir: tempfile::TempDir,
    before: Usage,
    first: &str,
    head: u64,
) -> Settled {
    let took = engine.settle().await;
    let usage = Usage::now().since(before);
    let (files, disk) = disk_usage(dir.path());
    eprintln!(
        "  settled {:.1} ms after the last callback: {files} files, {:.1} MiB",
        took.as_secs_f64() * 1e3,
        disk as f64 / (1 << 20) as f64
    );
    engine.check_history(dir.path(), first, head);
    drop(engine);
    Settled {
        secs: took.as_secs_f64(),
        usage,
        disk,
    }
}

async fn burst(kind: Kind, per_conversation: u64) -> Row {
    let (dir, engine, ids) = open_with(kind, CONVERSATIONS).await;

    // Built up front: this measures the store, not event serialization.
    let mut batches = Vec::with_capacity(CONVERSATIONS * per_conversation as usize);
    for n in 0..per_conversation {
        for id in &ids {
            batches.push(batch(id, delta(id, n + 3)));
        }
    }
    let total = batches.len() as u64;
    let done = Arc::new(AtomicU64::new(0));
    let all_done = Arc::new(tokio::sync::Notify::new());
    let commits_before = engine.commits();
    let before = Usage::now();

    let start = Instant::now();
    for b in batches {
        let done = done.clone();
        let all_done = all_done.clone();
        engine.append(
            b,
            Box::new(move |r, _| {
                r.expect("append");
                if done.fetch_add(1, Ordering::Relaxed) + 1 == total {
                    all_done.notify_one();
                }
            }),
        );
    }
    let queued = start.elapsed();
    all_done.notified().await;
    let secs = start.elapsed().as_secs_f64();
    let usage = Usage::now().since(before);
    let name = format!("{} burst {CONVERSATIONS}x{per_conversation}", kind.name());
    eprintln!(
        "{name}: queued {total} appends in {:.1} ms, all committed after {:.1} ms",
        queued.as_secs_f64() * 1e3,
        secs * 1e3
    );
    let commits = engine.commits() - commits_before;
    let settled = settle(engine, dir, before, &ids[0], per_conversation + 2).await;
    Row::unpaced(name, total, secs, commits, usage, settled)
}

async fn saturated(kind: Kind, per_conversation: u64) -> Row {
    let (dir, engine, ids) = open_with(kind, CONVERSATIONS).await;
    let total = per_conversation * ids.len() as u64;
    // Each callback says whose append it was.
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let mut heads = vec![2u64; ids.len()];
    let mut append_next = |i: usize| {
        heads[i] += 1;
        let done = done_tx.clone();
        engine.append(
            batch(&ids[i], delta(&ids[i], heads[i])),
            Box::new(move |r, _| {
                r.expect("append");
                let _ = done.send(i);
            }),
        );
    };
    let commits_before = engine.commits();
    let before = Usage::now();

    let start = Instant::now();
    let mut appended = vec![0u64; ids.len()];
    for _ in 0..SATURATED_IN_FLIGHT.min(per_conversation) {
        for (i, n) in appended.iter_mut().enumerate() {
            append_next(i);
            *n += 1;
        }
    }
    for _ in 0..total {
        let i = done_rx.recv().await.expect("callbacks");
        if appended[i] < per_conversation {
            append_next(i);
            appended[i] += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let usage = Usage::now().since(before);
    let name = format!("{} saturated {}x{per_conversation}", kind.name(), ids.len());
    eprintln!("{name}: all committed after {:.1} ms", secs * 1e3);
    let commits = engine.commits() - commits_before;
    let settled = settle(engine, dir, before, &ids[0], per_conversation + 2).await;
    Row::unpaced(name, total, secs, commits, usage, settled)
}

/// `rate` events/s over `conversations` conversations (in turn), appended
/// every 1 ms for `duration`, each event built as a conversation actor
/// would, at append.
async fn paced(
    kind: Kind,
    name: String,
    rate: u64,
    conversations: usize,
    duration: Duration,
) -> Row {
    let (dir, engine, ids) = open_with(kind, conversations).await;

    let per_tick = (rate / 1000).max(1);
    let ticks = duration.as_millis() as u64;
    let total = per_tick * ticks;
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(total as usize)));
    let mut heads = vec![2u64; ids.len()];
    let mut next = 0usize;
    let commits_before = engine.commits();
    let before = Usage::now();

    let mut interval = tokio::time::interval(Duration::from_millis(1));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let start = Instant::now();
    for _ in 0..ticks {
        interval.tick().await;
        for _ in 0..per_tick {
            heads[next] += 1;
            let ev = delta(&ids[next], heads[next]);
            let b = batch(&ids[next], ev);
            next = (next + 1) % ids.len();
            let latencies = latencies.clone();
            let t0 = Instant::now();
            engine.append(
                b,
                Box::new(move |r, _| {
                    let elapsed = t0.elapsed();
                    r.expect("append");
                    latencies.lock().expect("latencies").push(elapsed);
                }),
            );
        }
    }
    engine.flush().await;
    let secs = start.elapsed().as_secs_f64();
    let usage = Usage::now().since(before);
    let mut lat = std::mem::take(&mut *latencies.lock().expect("latencies"));
    assert_eq!(lat.len() as u64, total);
    lat.sort_unstable();
    let pick = |q: f64| lat[((lat.len() - 1) as f64 * q).round() as usize];
    eprintln!("{name}: all committed after {:.1} ms", secs * 1e3);
    let commits = engine.commits() - commits_before;
    Row {
        name,
        events: total,
        secs,
        commits,
        latency: Some([pick(0.5), pick(0.99), pick(1.0)]),
        usage,
        settled: settle(engine, dir, before, &ids[0], heads[0]).await,
    }
}

/// The CPU time, in microseconds, of building one event and its append as
/// the steady, saturated and paced scenarios do while measured (and of
/// dropping them).
fn build_cost(events: u64) -> f64 {
    let ids: Vec<Arc<str>> = (0..CONVERSATIONS).map(conversation_id).collect();
    let before = Usage::now();
    for n in 0..events {
        let id = &ids[n as usize % ids.len()];
        std::hint::black_box(batch(id, delta(id, n + 3)));
    }
    Usage::now().since(before).cpu_secs * 1e6 / events as f64
}

fn print_table(rows: &[Row]) {
    println!(
        "{:<26} {:>7} {:>6} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>8} {:>9}",
        "scenario",
        "events",
        "secs",
        "events/s",
        "commits",
        "ev/commit",
        "p50",
        "p99",
        "max",
        "B/event",
        "cpu us/ev",
        "settle",
        "B/ev +bg",
        "cpu +bg",
        "disk B/ev",
    );
    for r in rows {
        let ms = |d: Duration| format!("{:.3}ms", d.as_secs_f64() * 1e3);
        let (p50, p99, max) = match r.latency {
            Some([a, b, c]) => (ms(a), ms(b), ms(c)),
            None => ("-".into(), "-".into(), "-".into()),
        };
        let per_event = |usage: Usage| {
            (
                usage.written as f64 / r.events as f64,
                usage.cpu_secs * 1e6 / r.events as f64,
            )
        };
        let (written, cpu) = per_event(r.usage);
        let (written_bg, cpu_bg) = per_event(r.settled.usage);
        println!(
            "{:<26} {:>7} {:>6.2} {:>9.0} {:>7} {:>9.1} {:>9} {:>9} {:>9} {:>9.0} {:>9.1} {:>6.2}s {:>9.0} {:>8.1} {:>9.0}",
            r.name,
            r.events,
            r.secs,
            r.events as f64 / r.secs,
            r.commits,
            r.events as f64 / r.commits.max(1) as f64,
            p50,
            p99,
            max,
            written,
            cpu,
            r.settled.secs,
            written_bg,
            cpu_bg,
            r.settled.disk as f64 / r.events as f64,
        );
    }
}

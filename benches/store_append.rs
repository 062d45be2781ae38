//! What the SQLite store costs the write-before-send path.
//!
//! (a) burst: 100 conversations × 2,000 single-event appends of ~60-byte
//!     `text_delta` events, queued as fast as one task can; events/s until the
//!     last callback, and how many commits that took.
//! (b) steady: a paced offered load (10 appends every 1 ms = 10,000 events/s,
//!     and 50,000 events/s for headroom); the time from `append()` to its
//!     callback, which is what write-before-send adds to every event.
//!
//! Columns: `ev/commit` is the grouping achieved; `B/event` the bytes the
//! process wrote (WAL and checkpoints) per event, i.e. the write
//! amplification; `cpu us/ev` the process's CPU time per event (in the steady
//! rows this includes building the events). Latency depends on what else the
//! machine runs; these two do not.
//!
//! Run with `cargo bench --bench store_append` (`-- burst` or
//! `-- steady10000` for one scenario). The database goes to a
//! temporary directory, or under `$LINGER_BENCH_DIR` when set (to measure a
//! particular disk).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use linger::event::{now_rfc3339, EventData, EventRecord, StartReason};
use linger::protocol::Status;
use linger::store::sqlite::SqliteStore;
use linger::store::{AppendBatch, ConversationState, NewConversation, Store};

const CONVERSATIONS: usize = 100;
const PER_CONVERSATION: u64 = 2_000;

struct Row {
    name: String,
    events: u64,
    secs: f64,
    commits: u64,
    latency: Option<[Duration; 3]>,
    usage: Usage,
}

/// Bytes the process handed to write(2) and CPU seconds it used, from
/// /proc/self (Linux; zero elsewhere): the write amplification and the CPU
/// cost per event, which unlike latency do not depend on what else runs on
/// the machine.
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
        // Fields 14 and 15 of /proc/self/stat: utime and stime, in ticks
        // (100 per second on Linux).
        let cpu_secs = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| {
                let rest = stat.rsplit_once(')')?.1;
                let f: Vec<&str> = rest.split_whitespace().collect();
                let ticks: u64 =
                    f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
                Some(ticks as f64 / 100.0)
            })
            .unwrap_or(0.0);
        Usage { written, cpu_secs }
    }

    fn since(self, before: Usage) -> Usage {
        Usage {
            written: self.written.saturating_sub(before.written),
            cpu_secs: self.cpu_secs - before.cpu_secs,
        }
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    // `cargo bench --bench store_append -- steady` runs only the scenarios
    // whose name contains one of the words given.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wanted = |name: &str| only.is_empty() || only.iter().any(|w| name.contains(w.as_str()));
    let rows = runtime.block_on(async {
        let mut rows = Vec::new();
        if wanted("burst") {
            rows.push(burst().await);
        }
        for rate in [10_000, 50_000] {
            if wanted(&format!("steady{rate}")) {
                rows.push(steady(rate, Duration::from_secs(5)).await);
            }
        }
        rows
    });
    print_table(&rows);
}

fn temp_dir() -> tempfile::TempDir {
    match std::env::var_os("LINGER_BENCH_DIR") {
        Some(dir) => tempfile::tempdir_in(dir).expect("temp dir"),
        None => tempfile::tempdir().expect("temp dir"),
    }
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
            last_activity_at: ev.ts().to_owned(),
            current_turn_id: Some("t_01JBENCH0000000001".into()),
            last_turn_message_seq: 2,
        },
        events: vec![ev],
        client_msg_ids: Vec::new(),
        forget_client_msg_ids_before: 0,
    }
}

/// Creates the conversations (seq 1 and 2) and waits until they are stored.
async fn create_all(store: &SqliteStore, ids: &[Arc<str>]) {
    for id in ids {
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
        store.append(
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
                    last_activity_at: now_rfc3339(),
                    current_turn_id: None,
                    last_turn_message_seq: 0,
                },
                events: vec![Arc::new(created), Arc::new(started)],
                client_msg_ids: Vec::new(),
                forget_client_msg_ids_before: 0,
            },
            Box::new(|r| r.expect("create")),
        );
    }
    store.flush().await.expect("flush");
}

async fn burst() -> Row {
    let dir = temp_dir();
    let store = SqliteStore::open(dir.path()).expect("open");
    let ids: Vec<Arc<str>> = (0..CONVERSATIONS).map(conversation_id).collect();
    create_all(&store, &ids).await;

    // Built up front: this measures the store, not event serialization.
    let mut batches = Vec::with_capacity(CONVERSATIONS * PER_CONVERSATION as usize);
    for n in 0..PER_CONVERSATION {
        for id in &ids {
            batches.push(batch(id, delta(id, n + 3)));
        }
    }
    let total = batches.len() as u64;
    let done = Arc::new(AtomicU64::new(0));
    let all_done = Arc::new(tokio::sync::Notify::new());
    let commits_before = store.commits();
    let usage = Usage::now();

    let start = Instant::now();
    for b in batches {
        let done = done.clone();
        let all_done = all_done.clone();
        store.append(
            b,
            Box::new(move |r| {
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
    eprintln!(
        "burst: queued {total} appends in {:.1} ms, all committed after {:.1} ms",
        queued.as_secs_f64() * 1e3,
        secs * 1e3
    );
    Row {
        name: format!("burst {CONVERSATIONS}x{PER_CONVERSATION}"),
        events: total,
        secs,
        commits: store.commits() - commits_before,
        latency: None,
        usage: Usage::now().since(usage),
    }
}

async fn steady(rate: u64, duration: Duration) -> Row {
    let dir = temp_dir();
    let store = Arc::new(SqliteStore::open(dir.path()).expect("open"));
    let ids: Vec<Arc<str>> = (0..CONVERSATIONS).map(conversation_id).collect();
    create_all(&store, &ids).await;

    let per_tick = (rate / 1000).max(1);
    let ticks = duration.as_millis() as u64;
    let total = per_tick * ticks;
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(total as usize)));
    let mut heads = vec![2u64; ids.len()];
    let mut next = 0usize;
    let commits_before = store.commits();
    let usage = Usage::now();

    let mut interval = tokio::time::interval(Duration::from_millis(1));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let start = Instant::now();
    for _ in 0..ticks {
        interval.tick().await;
        for _ in 0..per_tick {
            // Built as a conversation actor would: serialized at append.
            heads[next] += 1;
            let ev = delta(&ids[next], heads[next]);
            let b = batch(&ids[next], ev);
            next = (next + 1) % ids.len();
            let latencies = latencies.clone();
            let t0 = Instant::now();
            store.append(
                b,
                Box::new(move |r| {
                    let elapsed = t0.elapsed();
                    r.expect("append");
                    latencies.lock().expect("latencies").push(elapsed);
                }),
            );
        }
    }
    store.flush().await.expect("flush");
    let secs = start.elapsed().as_secs_f64();
    let usage = Usage::now().since(usage);
    let mut lat = std::mem::take(&mut *latencies.lock().expect("latencies"));
    assert_eq!(lat.len() as u64, total);
    lat.sort_unstable();
    let pick = |q: f64| lat[((lat.len() - 1) as f64 * q).round() as usize];
    Row {
        name: format!("steady {rate} ev/s"),
        events: total,
        secs,
        commits: store.commits() - commits_before,
        latency: Some([pick(0.5), pick(0.99), pick(1.0)]),
        usage,
    }
}

fn print_table(rows: &[Row]) {
    println!(
        "{:<18} {:>7} {:>6} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}",
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
        "cpu us/ev"
    );
    for r in rows {
        let ms = |d: Duration| format!("{:.3}ms", d.as_secs_f64() * 1e3);
        let (p50, p99, max) = match r.latency {
            Some([a, b, c]) => (ms(a), ms(b), ms(c)),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "{:<18} {:>7} {:>6.2} {:>9.0} {:>7} {:>9.1} {:>9} {:>9} {:>9} {:>9.0} {:>8.1}",
            r.name,
            r.events,
            r.secs,
            r.events as f64 / r.secs,
            r.commits,
            r.events as f64 / r.commits.max(1) as f64,
            p50,
            p99,
            max,
            r.usage.written as f64 / r.events as f64,
            r.usage.cpu_secs * 1e6 / r.events as f64,
        );
    }
}

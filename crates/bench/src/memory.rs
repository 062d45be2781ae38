//! Memory under sustained traffic: C conversations, each with its own
//! connection (user `mI`), stream E events in all, as turns of
//! `/stream T 0` one after the other, while the server's resident memory is
//! sampled. Once a conversation has streamed more than `--buffer-events`
//! events (`conversations.replay_buffer_events`) its replay buffer is full;
//! once every one is, memory is bounded by configuration, so RSS must stay
//! flat however many events follow. What it reports: RSS at start, with the
//! conversations set up, when every buffer is full, its peak after that, at
//! the end and idle after the last turn, the growth from full to the end
//! per million events, and RSS per conversation with a full buffer (its
//! connection included). Each sample is printed on stderr as it is taken.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use serde_json::json;
use tokio::sync::{mpsc, watch, Semaphore};

use super::client::{parse, Client};
use super::{collect_ready, join_all, progress, Aim, Common, Measure, ProcStats, Report, Target};

#[derive(Args, Debug, Clone)]
pub struct MemoryArgs {
    /// Conversations, each with its own connection and user.
    #[arg(long, short = 'c', default_value_t = 1000)]
    pub conversations: usize,
    /// Events streamed in all, shared evenly by the conversations.
    #[arg(long, short = 'e', default_value_t = 10_000_000)]
    pub events: u64,
    /// Tokens per turn (`/stream T 0`).
    #[arg(long, short = 't', default_value_t = 1000)]
    pub tokens: u64,
    /// The server's `conversations.replay_buffer_events`: a conversation's
    /// buffer is full past this many events.
    #[arg(long, default_value_t = 2000)]
    pub buffer_events: u64,
    /// Seconds between two samples of the server's RSS.
    #[arg(long, default_value_t = 5.0)]
    pub sample: f64,
    /// Seconds to let the server settle before reading its idle memory.
    #[arg(long, default_value_t = 2.0)]
    pub settle: f64,
}

/// How long one frame of a running turn may take.
const FRAME_WAIT: Duration = Duration::from_secs(60);

/// One reading: when, how many events were delivered by then, how many
/// conversations had a full buffer, and the server's RSS.
#[derive(Debug, Clone, Copy)]
struct Sample {
    secs: f64,
    events: u64,
    full: usize,
    rss_kib: u64,
}

/// What the streams share with the sampler.
#[derive(Default)]
struct Progress {
    events: AtomicU64,
    full: AtomicUsize,
}

pub async fn run(common: &Common, args: &MemoryArgs) -> anyhow::Result<Report> {
    let params = json!({
        "conversations": args.conversations,
        "events": args.events,
        "tokens_per_turn": args.tokens,
        "buffer_events": args.buffer_events,
        "sample_s": args.sample,
    });
    // Memory of the server is the point: the relay holds none, so it is
    // not run.
    let linger_only = Common {
        no_relay: true,
        ..common.clone()
    };
    let runs = super::against_each(&linger_only, &[], |target| async move {
        let measures = run_one(&target, common, args).await?;
        Ok((target, measures))
    })
    .await?;
    Ok(Report {
        scenario: "memory".into(),
        params,
        runs,
    })
}

async fn run_one(
    target: &Target,
    common: &Common,
    args: &MemoryArgs,
) -> anyhow::Result<Vec<Measure>> {
    let Some(pid) = target.pid else {
        bail!("the memory scenario reads the server's memory: give --server-pid or --spawn");
    };
    let rss = move || ProcStats::read(pid).map_or(0, |s| s.rss_kib);
    let settle = Duration::from_secs_f64(args.settle);
    let n = args.conversations.max(1);
    let quota = args.events.div_ceil(n as u64);
    tokio::time::sleep(settle).await;
    let at_start = rss();

    let shared = Arc::new(Progress::default());
    let (ready_tx, mut ready_rx) = mpsc::unbounded_channel();
    let (go_tx, go_rx) = watch::channel(false);
    let connecting = Arc::new(Semaphore::new(common.connect_concurrency.max(1)));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let stream = Stream {
            url: target.url.clone(),
            user: format!("m{i}"),
            quota,
            tokens: args.tokens,
            buffer_events: args.buffer_events,
        };
        tasks.push(tokio::spawn(stream.run(
            connecting.clone(),
            ready_tx.clone(),
            go_rx.clone(),
            shared.clone(),
        )));
    }
    drop(ready_tx);
    let within = Duration::from_secs(60) + Duration::from_millis(10 * n as u64);
    let (ready, error) =
        collect_ready(&mut ready_rx, n, within, &progress(n as u64, "setting up")).await;
    if let Some(e) = &error {
        eprintln!(
            "{} of {n} conversations failed to set up; first: {e}",
            n - ready
        );
    }
    if ready == 0 {
        bail!("no conversation could be set up");
    }
    tokio::time::sleep(settle).await;
    let set_up = rss();

    let start = Instant::now();
    let _ = go_tx.send(true);
    let every = Duration::from_secs_f64(args.sample.max(0.1));
    let mut samples = Vec::new();
    let mut ticker = tokio::time::interval(every);
    let mut joined = Box::pin(join_all(tasks, Duration::from_secs(24 * 3600)));
    let (results, lost) = loop {
        tokio::select! {
            done = &mut joined => break done,
            _ = ticker.tick() => {
                let s = Sample {
                    secs: start.elapsed().as_secs_f64(),
                    events: shared.events.load(Ordering::Relaxed),
                    full: shared.full.load(Ordering::Relaxed),
                    rss_kib: rss(),
                };
                eprintln!(
                    "memory: {:>7.1} s {:>10} events {:>5}/{ready} buffers full  RSS {:>8.1} MiB",
                    s.secs, s.events, s.full, s.rss_kib as f64 / 1024.0
                );
                samples.push(s);
            }
        }
    };
    let secs = start.elapsed().as_secs_f64().max(1e-3);
    let at_end = rss();
    tokio::time::sleep(settle).await;
    let idle = rss();
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    if let Some(e) = failed.first() {
        eprintln!("{} streams failed; first: {e}", failed.len());
    }
    if lost > 0 {
        eprintln!("{lost} streams did not end and were aborted");
    }
    let events = shared.events.load(Ordering::Relaxed);

    let full_from = samples.iter().position(|s| s.full >= ready);
    let after_full = full_from.map_or(&[][..], |i| &samples[i..]);
    let mib = |kib: u64| kib as f64 / 1024.0;
    let mut m = vec![
        Measure::new("conversations streaming", "", ready as f64).aim(Aim::AtLeast(n as f64)),
        Measure::new("streams failed", "", (failed.len() + lost) as f64).aim(Aim::AtMost(0.0)),
        Measure::new("events delivered", "", events as f64),
        Measure::new("delivered", "events/s", events as f64 / secs),
        Measure::new("RSS at start", "MiB", mib(at_start)),
        Measure::new(
            "RSS set up (connections, conversations)",
            "MiB",
            mib(set_up),
        ),
    ];
    if let (Some(first), Some(last)) = (after_full.first(), after_full.last()) {
        let peak = after_full.iter().map(|s| s.rss_kib).max().unwrap_or(0);
        m.extend([
            Measure::new("events when every buffer was full", "", first.events as f64),
            Measure::new("RSS when every buffer was full", "MiB", mib(first.rss_kib)),
            Measure::new("RSS peak after", "MiB", mib(peak)),
        ]);
        // Flat: what the second half of the traffic added, once the
        // connections' queues have had the first half to reach their size.
        let half = events / 2;
        if let Some(mid) = after_full.iter().find(|s| s.events >= half) {
            let millions = last.events.saturating_sub(mid.events) as f64 / 1e6;
            m.extend([
                Measure::new("RSS at half the events", "MiB", mib(mid.rss_kib)),
                Measure::new(
                    "RSS growth over the second half, per million events",
                    "MiB",
                    (mib(last.rss_kib) - mib(mid.rss_kib)) / millions.max(1e-9),
                ),
            ]);
        }
    } else {
        eprintln!("the buffers never were all full: stream more events per conversation");
    }
    m.extend([
        Measure::new("RSS at the end", "MiB", mib(at_end)),
        Measure::new("RSS idle after", "MiB", mib(idle)),
        Measure::new(
            "RSS per conversation with a full buffer",
            "KiB",
            (idle as f64 - at_start as f64) / ready as f64,
        ),
    ]);
    Ok(m)
}

/// One conversation's share of the traffic.
struct Stream {
    url: String,
    user: String,
    /// Events it streams (its seq when it stops asking for turns).
    quota: u64,
    tokens: u64,
    buffer_events: u64,
}

impl Stream {
    async fn run(
        self,
        connecting: Arc<Semaphore>,
        ready: mpsc::UnboundedSender<Result<(), String>>,
        mut go: watch::Receiver<bool>,
        shared: Arc<Progress>,
    ) -> Result<(), String> {
        let set_up = async {
            let _permit = connecting.acquire().await?;
            let mut client = Client::connect(&self.url, &self.user).await?;
            let (id, head) = client.create(super::SETUP_TIMEOUT).await?;
            anyhow::Ok((client, id, head))
        };
        let (mut client, id, mut seq) = match set_up.await {
            Ok(ok) => {
                let _ = ready.send(Ok(()));
                ok
            }
            Err(e) => {
                let e = format!("{}: {e:#}", self.user);
                let _ = ready.send(Err(e.clone()));
                return Err(e);
            }
        };
        if go.wait_for(|go| *go).await.is_err() {
            return Ok(());
        }
        let turn = format!("/stream {} 0", self.tokens);
        let mut full = false;
        while seq < self.quota {
            client
                .message(&id, &turn)
                .await
                .map_err(|e| format!("{}: {e:#}", self.user))?;
            // Bounded: a turn is its tokens and a few more events, and the
            // frames around them are few.
            let mut finished = false;
            for _ in 0..(self.tokens + 64) * 2 {
                let text = client
                    .recv(FRAME_WAIT)
                    .await
                    .map_err(|e| format!("{}: {e:#}", self.user))?;
                let frame = parse(text.as_str()).map_err(|e| format!("{e:#}"))?;
                if frame.ty == "error" {
                    return Err(format!("{}: {}", self.user, text.as_str()));
                }
                if !frame.is_event() {
                    continue;
                }
                seq = frame.seq.unwrap_or(seq);
                shared.events.fetch_add(1, Ordering::Relaxed);
                if !full && seq > self.buffer_events {
                    full = true;
                    shared.full.fetch_add(1, Ordering::Relaxed);
                }
                if frame.kind_is("turn_finished") {
                    finished = true;
                    break;
                }
            }
            if !finished {
                return Err(format!("{}: no turn_finished", self.user));
            }
        }
        client.close().await;
        Ok(())
    }
}

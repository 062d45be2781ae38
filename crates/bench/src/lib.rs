//! `linger bench`: a load generator that drives a running server over real
//! websockets on loopback and reports what it delivers and what it costs.
//!
//! Scenarios, one file each:
//! - [`streaming`]: C conversations × T tokens at R per second each.
//! - [`storm`]: N clients drop at once mid-stream and resume at once.
//! - [`idle`]: K idle active conversations, each with a connection: RSS.
//! - [`memory`]: C conversations stream E events in all while RSS is
//!   sampled: flat once every replay buffer is full (linger only; not part
//!   of `all`, it runs for minutes).
//! - [`replay`]: attach latency of a replay from the buffer and the store.
//! - [`compact`]: what a fresh client is sent when it opens a long
//!   conversation, full and compact (protocol §11); linger only.
//! - [`cluster`]: three nodes on a NATS JetStream cluster: streaming across
//!   nodes, and the takeover of a killed node's conversations
//!   ([`takeover`]); it spawns everything itself ([`nats`] for the NATS
//!   servers), and is not part of `all` (it needs `nats-server`).
//! - [`soak`]: minutes or hours of steady load with reconnect churn (and
//!   with `--faults` SIGKILLs and a full disk), sampled every few seconds
//!   into a JSON file and an SVG chart; not part of `all` (it is long).
//!
//! With `--spawn` every scenario runs against a fresh `linger serve` (the
//! executable this runs in, temporary store) and then against the `relay`
//! executable beside it (the ceiling: same websocket stack, no actors, no
//! store), and every figure is
//! printed with its ratio to the relay's. Without `--spawn` it drives the
//! server at `--url`, and reads CPU and memory of `--server-pid` if given.
//!
//! Every wait is bounded in time and every loop in count: the bench stops
//! by itself, with an error naming what did not arrive.
//!
//! A crate of its own (`linger-bench`) so that the server library does not
//! carry the load generator's dependencies; it speaks to servers over
//! websockets and REST only, and does not use the server library.

mod client;
mod cluster;
mod compact;
mod idle;
mod memory;
mod nats;
mod replay;
mod report;
mod soak;
mod storm;
mod streaming;
mod takeover;
mod target;

use std::time::Duration;

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub use report::{Aim, Measure, Report};
pub use target::{ProcStats, Server, Target};

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub scenario: Scenario,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Args, Debug, Clone)]
pub struct Common {
    /// Spawn the servers: `linger serve` (this binary) with a fresh
    /// temporary store on a free loopback port, then the `relay` binary (the
    /// ceiling), once per scenario; figures come with their ratio to the
    /// relay's.
    #[arg(long, global = true)]
    pub spawn: bool,
    /// With --spawn: skip the relay (no ratios).
    #[arg(long, global = true)]
    pub no_relay: bool,
    /// The websocket endpoint of a running server (without --spawn).
    #[arg(long, global = true, default_value = "ws://127.0.0.1:7420/v1/ws")]
    pub url: String,
    /// The running server's pid, for its CPU time and RSS (/proc).
    #[arg(long, global = true)]
    pub server_pid: Option<u32>,
    /// Print the report as JSON on stdout instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
    /// Connections being set up at once (the storm's reconnect ignores it).
    #[arg(long, global = true, default_value_t = 256)]
    pub connect_concurrency: usize,
    /// Extra `KEY=VALUE` config overrides for the spawned linger, as
    /// `LINGER__SECTION__KEY` environment variables
    /// (e.g. `conversations.replay_buffer_events=100`).
    #[arg(long = "set", global = true, value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

#[derive(Subcommand, Debug, Clone)]
pub enum Scenario {
    /// C conversations × T tokens at rate R each: delivered events/s,
    /// end-to-end latency, server CPU per 100,000 events, peak RSS.
    Streaming(streaming::StreamingArgs),
    /// N clients drop at once mid-stream and resume at once: time until all
    /// have caught up, gaps and duplicates.
    Storm(storm::StormArgs),
    /// K idle active conversations, each with an attached connection: RSS
    /// per connection and per conversation.
    Idle(idle::IdleArgs),
    /// C conversations stream E events in all (turns of `/stream T 0`)
    /// while the server's RSS is sampled: RSS once every replay buffer is
    /// full, its growth after that per million events, RSS per
    /// conversation with a full buffer (linger only).
    Memory(memory::MemoryArgs),
    /// Attach latency of a 2,000-event replay from the buffer and the store.
    Replay(replay::ReplayArgs),
    /// A fresh client opens a conversation of 300 finished turns of 500
    /// tokens and a running one: bytes and time to first text and to the
    /// whole history, full and compact (linger only).
    Compact(compact::CompactArgs),
    /// Three nodes sharing a 3-server NATS JetStream, all spawned: streaming
    /// with each conversation created on one node and streamed through
    /// another (beside one linger and the relay), then SIGKILL of a node
    /// owning N conversations: time until each is recorded node_lost and
    /// reattachable on a survivor.
    Cluster(cluster::ClusterArgs),
    /// Steady load for --minutes with reconnect churn (and with --faults a
    /// SIGKILL and restart every --kill-every and one full disk): RSS, CPU,
    /// p99 and events/s every few seconds into --out (JSON) and a chart
    /// beside it (SVG); fails if any client saw a seq lost, doubled or
    /// renumbered.
    Soak(soak::SoakArgs),
    /// Every scenario with the parameters of BENCHMARKS.md.
    All,
}

/// Runs `linger bench`.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let common = args.common;
    if !common.spawn && !common.url.starts_with("ws://127.0.0.1:") {
        anyhow::bail!("the bench drives loopback servers only: --url ws://127.0.0.1:PORT/v1/ws");
    }
    raise_fd_limit();
    let scenarios = match args.scenario {
        Scenario::All => vec![
            Scenario::Streaming(streaming::StreamingArgs::paced()),
            Scenario::Streaming(streaming::StreamingArgs::saturate()),
            Scenario::Streaming(streaming::StreamingArgs::many()),
            Scenario::Storm(storm::StormArgs::default_args()),
            Scenario::Idle(idle::IdleArgs::default_args()),
            Scenario::Replay(replay::ReplayArgs::default_args()),
            Scenario::Compact(compact::CompactArgs::default_args()),
        ],
        one => vec![one],
    };
    let mut reports = Vec::new();
    for scenario in scenarios {
        let these = match scenario {
            Scenario::Streaming(a) => vec![streaming::run(&common, &a).await?],
            Scenario::Storm(a) => vec![storm::run(&common, &a).await?],
            Scenario::Idle(a) => vec![idle::run(&common, &a).await?],
            Scenario::Memory(a) => vec![memory::run(&common, &a).await?],
            Scenario::Replay(a) => vec![replay::run(&common, &a).await?],
            Scenario::Compact(a) => vec![compact::run(&common, &a).await?],
            Scenario::Cluster(a) => cluster::run(&common, &a).await?,
            Scenario::Soak(a) => vec![soak::run(&common, &a).await?],
            Scenario::All => unreachable!("expanded above"),
        };
        for report in these {
            if !common.json {
                println!("{}", report.table());
            }
            reports.push(report);
        }
    }
    if common.json {
        let all: Vec<_> = reports.iter().map(Report::json).collect();
        let out = if all.len() == 1 {
            all.into_iter().next().unwrap_or_default()
        } else {
            serde_json::Value::Array(all)
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(())
}

/// Runs `one` against each server of this invocation (linger, then the
/// relay when spawning), each started fresh and stopped after.
pub(crate) async fn against_each<F, Fut>(
    common: &Common,
    linger_overrides: &[(&str, String)],
    mut one: F,
) -> anyhow::Result<Vec<(Server, Vec<Measure>)>>
where
    F: FnMut(Target) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(Target, Vec<Measure>)>>,
{
    let mut servers = vec![Server::Linger];
    if common.spawn && !common.no_relay {
        servers.push(Server::Relay);
    }
    let mut out = Vec::new();
    for server in servers {
        let target = if common.spawn {
            Target::spawn(server, common, linger_overrides).await?
        } else {
            Target::external(&common.url, common.server_pid)
        };
        eprintln!("── {} at {}", target.label(), target.url);
        let (target, measures) = one(target).await?;
        target.stop().await;
        out.push((server, measures));
    }
    Ok(out)
}

/// Raises the soft limit on open files to the hard limit: each connection
/// is a descriptor on both sides (`ulimit -n 65536` does the same by hand).
fn raise_fd_limit() {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => {
            if n < 10_200 {
                eprintln!(
                    "note: open files limited to {n}; 10,000 connections need about 10,100 \
                     per process (raise with `ulimit -n 65536` as root)"
                );
            }
        }
        Err(e) => eprintln!("note: cannot raise the open files limit: {e}"),
    }
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub(crate) fn progress(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr_with_hz(4));
    let style = ProgressStyle::with_template(
        "{prefix:>12} [{bar:30}] {human_pos}/{human_len} {per_sec:>12} {elapsed}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(what.to_owned());
    bar
}

/// Percentile of a histogram of microseconds, in milliseconds.
pub(crate) fn ms(h: &hdrhistogram::Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// A new histogram of microseconds, 1 µs to 10 min, 3 significant digits.
pub(crate) fn histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

/// Waits for all tasks, at most `within`; aborts the rest and counts them.
pub(crate) async fn join_all<T: Send + 'static>(
    tasks: Vec<tokio::task::JoinHandle<T>>,
    within: Duration,
) -> (Vec<T>, usize) {
    let deadline = tokio::time::Instant::now() + within;
    let mut done = Vec::with_capacity(tasks.len());
    let mut lost = 0;
    for task in tasks {
        let abort = task.abort_handle();
        match tokio::time::timeout_at(deadline, task).await {
            Ok(Ok(value)) => done.push(value),
            Ok(Err(_)) => lost += 1,
            Err(_) => {
                abort.abort();
                lost += 1;
            }
        }
    }
    (done, lost)
}

/// How long setting up one client (connect, create) may take.
pub(crate) const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Collects `n` readiness reports (or fewer, by `within`): how many clients
/// are ready, and the first error of those that are not.
pub(crate) async fn collect_ready(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Result<(), String>>,
    n: usize,
    within: Duration,
    bar: &ProgressBar,
) -> (usize, Option<String>) {
    let deadline = tokio::time::Instant::now() + within;
    let (mut ok, mut first_error) = (0, None);
    for _ in 0..n {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(Ok(()))) => ok += 1,
            Ok(Some(Err(e))) => {
                first_error.get_or_insert(e);
            }
            Ok(None) | Err(_) => break,
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    (ok, first_error)
}

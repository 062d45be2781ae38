//! Streaming: C conversations, each with its own connection (user `uI`),
//! each asking the demo agent for `/stream T MS` at the same moment. What it
//! reports: delivered events/s, end-to-end latency (the event's `ts` to its
//! receipt), the server's CPU seconds per 100,000 events and peak RSS.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use indicatif::ProgressBar;
use serde_json::json;
use tokio::sync::{mpsc, watch, Semaphore};

use super::client::{parse, Client, Latencies, SeqCheck};
use super::{
    collect_ready, join_all, ms, progress, Aim, Common, Measure, ProcStats, Report, Target,
};

#[derive(Args, Debug, Clone)]
pub struct StreamingArgs {
    /// Conversations, each with its own connection and user.
    #[arg(long, short = 'c', default_value_t = 1000)]
    pub conversations: usize,
    /// Tokens per conversation (`/stream T MS`).
    #[arg(long, short = 't', default_value_t = 200)]
    pub tokens: u64,
    /// Tokens per second per conversation; 0 streams as fast as the server
    /// takes them (`/stream T 0`).
    #[arg(long, short = 'r', default_value_t = 20.0)]
    pub rate: f64,
    /// Start every stream at the same instant: their tokens then come in
    /// bursts of C events every interval. By default the starts are spread
    /// evenly over one interval, so the offered load is a steady C × R
    /// events/s.
    #[arg(long)]
    pub burst: bool,
}

impl StreamingArgs {
    /// 20,000 events/s offered: the latency aim.
    pub fn paced() -> StreamingArgs {
        StreamingArgs {
            conversations: 1000,
            tokens: 200,
            rate: 20.0,
            burst: false,
        }
    }

    /// As fast as it goes: the throughput and CPU aims.
    pub fn saturate() -> StreamingArgs {
        StreamingArgs {
            conversations: 100,
            tokens: 2000,
            rate: 0.0,
            burst: false,
        }
    }

    /// 10,000 connections, each on its own conversation.
    pub fn many() -> StreamingArgs {
        StreamingArgs {
            conversations: 10_000,
            tokens: 20,
            rate: 2.0,
            burst: false,
        }
    }

    fn interval_ms(&self) -> u64 {
        if self.rate > 0.0 {
            (1000.0 / self.rate).round() as u64
        } else {
            0
        }
    }
}

/// What one conversation saw.
#[derive(Default)]
struct Outcome {
    events: u64,
    seq: SeqCheck,
    finished: Option<Instant>,
    error: Option<String>,
}

pub async fn run(common: &Common, args: &StreamingArgs) -> anyhow::Result<Report> {
    let params = json!({
        "conversations": args.conversations,
        "tokens": args.tokens,
        "rate_per_conversation": args.rate,
        "interval_ms": args.interval_ms(),
        "burst": args.burst,
        "offered_events_per_s": args.conversations as f64 * args.rate,
    });
    let runs = super::against_each(common, &[], |target| async move {
        let measures = run_one(&target, common, args).await?;
        Ok((target, measures))
    })
    .await?;
    Ok(Report {
        scenario: "streaming".into(),
        params,
        runs,
    })
}

async fn run_one(
    target: &Target,
    common: &Common,
    args: &StreamingArgs,
) -> anyhow::Result<Vec<Measure>> {
    let n = args.conversations;
    let text = format!("/stream {} {}", args.tokens, args.interval_ms());
    let (ready_tx, mut ready_rx) = mpsc::unbounded_channel();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let (phase_tx, phase_rx) = watch::channel(0u8);
    let connecting = Arc::new(Semaphore::new(common.connect_concurrency.max(1)));
    let latencies = Latencies::new();
    let expected_events = (args.tokens + 4) * n as u64;
    let events_bar = progress(expected_events, "events");
    events_bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    // Each frame may take this long; the whole stream the time it should
    // take three times over, plus a minute.
    let frame_wait = Duration::from_millis((args.interval_ms() * 5).max(15_000));
    let stream_secs = args.tokens as f64 * args.interval_ms() as f64 / 1000.0;
    let stream_deadline = Duration::from_secs_f64(stream_secs * 3.0 + 60.0 + n as f64 * 0.002);

    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let offset = if args.burst {
            Duration::ZERO
        } else {
            Duration::from_millis(args.interval_ms()) * i as u32 / n as u32
        };
        let job = Job {
            url: target.url.clone(),
            user: format!("u{i}"),
            text: text.clone(),
            tokens: args.tokens,
            frame_wait,
            offset,
        };
        tasks.push(tokio::spawn(job.run(
            connecting.clone(),
            ready_tx.clone(),
            done_tx.clone(),
            phase_rx.clone(),
            latencies.clone(),
            events_bar.clone(),
        )));
    }
    drop((ready_tx, done_tx));

    let setup_bar = progress(n as u64, "connecting");
    let setup_within = Duration::from_secs(60) + Duration::from_millis(10 * n as u64);
    let (ready, setup_error) = collect_ready(&mut ready_rx, n, setup_within, &setup_bar).await;
    if ready == 0 {
        let _ = phase_tx.send(2);
        bail!(
            "no conversation could be set up: {}",
            setup_error.unwrap_or_default()
        );
    }
    if let Some(e) = &setup_error {
        eprintln!(
            "{} of {n} conversations failed to set up; first: {e}",
            n - ready
        );
    }

    // Everyone streams from here.
    events_bar.set_draw_target(indicatif::ProgressDrawTarget::stderr_with_hz(4));
    events_bar.set_length((args.tokens + 4) * ready as u64);
    events_bar.reset_elapsed();
    let server_before = target.stats();
    let me_before = ProcStats::me();
    let start = Instant::now();
    let _ = phase_tx.send(1);

    let deadline = tokio::time::Instant::now() + stream_deadline;
    let mut outcomes = Vec::with_capacity(ready);
    for _ in 0..ready {
        match tokio::time::timeout_at(deadline, done_rx.recv()).await {
            Ok(Some(outcome)) => outcomes.push(outcome),
            Ok(None) | Err(_) => break,
        }
    }
    let server_after = target.stats();
    let me_after = ProcStats::me();
    events_bar.finish_and_clear();
    let _ = phase_tx.send(2);
    let (_, lost) = join_all(tasks, Duration::from_secs(30)).await;
    if lost > 0 {
        eprintln!("{lost} client tasks did not end in time and were aborted");
    }

    let end = outcomes
        .iter()
        .filter_map(|o| o.finished)
        .max()
        .unwrap_or_else(Instant::now);
    let secs = end.duration_since(start).as_secs_f64().max(1e-3);
    let events: u64 = outcomes.iter().map(|o| o.events).sum();
    let gaps: u64 = outcomes.iter().map(|o| o.seq.gaps).sum();
    let duplicates: u64 = outcomes.iter().map(|o| o.seq.duplicates).sum();
    let finished = outcomes.iter().filter(|o| o.finished.is_some()).count();
    if let Some(e) = outcomes.iter().find_map(|o| o.error.as_ref()) {
        eprintln!(
            "{} of {ready} streams did not finish; first: {e}",
            ready - finished
        );
    }
    let h = latencies.snapshot();
    let per_100k = |before: Option<ProcStats>, after: Option<ProcStats>| {
        let (b, a) = (before?, after?);
        Some((a.cpu_secs - b.cpu_secs) / events.max(1) as f64 * 100_000.0)
    };

    let mut m = vec![
        Measure::new("conversations streaming", "", ready as f64).aim(Aim::AtLeast(n as f64)),
        Measure::new("streams finished", "", finished as f64).aim(Aim::AtLeast(ready as f64)),
        Measure::new("events delivered", "", events as f64),
        Measure::new("delivered", "events/s", events as f64 / secs).aim(Aim::RatioAtLeast(0.5)),
        Measure::new("latency p50", "ms", ms(&h, 0.5)),
        Measure::new("latency p99", "ms", ms(&h, 0.99)).aim(Aim::AtMost(50.0)),
        Measure::new("latency max", "ms", ms(&h, 1.0)),
        Measure::new("gaps", "", gaps as f64).aim(Aim::AtMost(0.0)),
        Measure::new("duplicates", "", duplicates as f64).aim(Aim::AtMost(0.0)),
    ];
    if let Some(cpu) = per_100k(server_before, server_after) {
        m.push(Measure::new("server CPU per 100k events", "s", cpu).aim(Aim::RatioAtMost(2.0)));
    }
    if let Some(after) = server_after {
        m.push(Measure::new(
            "server peak RSS",
            "MiB",
            after.hwm_kib as f64 / 1024.0,
        ));
    }
    if let Some(cpu) = per_100k(me_before, me_after) {
        m.push(Measure::new("generator CPU per 100k events", "s", cpu));
    }
    Ok(m)
}

struct Job {
    url: String,
    user: String,
    text: String,
    tokens: u64,
    frame_wait: Duration,
    /// How long after the start this conversation starts streaming.
    offset: Duration,
}

impl Job {
    async fn run(
        self,
        connecting: Arc<Semaphore>,
        ready: mpsc::UnboundedSender<Result<(), String>>,
        done: mpsc::UnboundedSender<Outcome>,
        mut phase: watch::Receiver<u8>,
        latencies: Latencies,
        bar: ProgressBar,
    ) {
        let setup = async {
            let _permit = connecting.acquire().await?;
            let mut client = Client::connect(&self.url, &self.user).await?;
            let (id, head) = client.create(super::SETUP_TIMEOUT).await?;
            anyhow::Ok((client, id, head))
        };
        let (mut client, id, head) = match setup.await {
            Ok(ok) => {
                let _ = ready.send(Ok(()));
                ok
            }
            Err(e) => {
                let _ = ready.send(Err(format!("{e:#}")));
                return;
            }
        };
        if phase.wait_for(|p| *p >= 1).await.is_err() || *phase.borrow() >= 2 {
            return;
        }
        let mut outcome = Outcome {
            seq: SeqCheck::starting_after(head),
            ..Outcome::default()
        };
        if let Err(e) = self
            .stream(&mut client, &id, &mut outcome, &latencies, &bar)
            .await
        {
            outcome.error = Some(format!("{}: {e:#}", self.user));
        }
        let _ = done.send(outcome);
        // Hold the connection until every stream is measured.
        let _ = phase.wait_for(|p| *p >= 2).await;
        client.close().await;
    }

    async fn stream(
        &self,
        client: &mut Client,
        id: &str,
        outcome: &mut Outcome,
        latencies: &Latencies,
        bar: &ProgressBar,
    ) -> anyhow::Result<()> {
        let mut local = latencies.local();
        tokio::time::sleep(self.offset).await;
        client.message(id, &self.text).await?;
        let mut unreported = 0;
        // user_message, turn_started, T deltas, assistant_message,
        // turn_finished, and the ack: bounded with room to spare.
        for _ in 0..self.tokens + 64 {
            let text = client.recv(self.frame_wait).await?;
            let frame = parse(text.as_str())?;
            if frame.ty == "error" {
                bail!("error frame: {}", text.as_str());
            }
            if !frame.is_event() {
                continue;
            }
            if let Some(seq) = frame.seq {
                outcome.seq.see(seq);
            }
            if let Some(us) = frame.latency_us() {
                local.record(us);
            }
            outcome.events += 1;
            unreported += 1;
            if unreported == 64 {
                bar.inc(unreported);
                unreported = 0;
            }
            if frame.kind_is("turn_finished") {
                outcome.finished = Some(Instant::now());
                bar.inc(unreported);
                return Ok(());
            }
        }
        bail!("no turn_finished after {} frames", self.tokens + 64)
    }
}

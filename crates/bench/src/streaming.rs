//! Streaming: C conversations, each with its own connection (user `uI`),
//! each asking the demo agent for `/stream T MS`, their starts spread over
//! one token interval (or, with `--turns K`, K turns back to back, their
//! starts spread over one turn). What it reports: delivered events/s,
//! end-to-end latency (the event's `ts` to its receipt), the server's CPU
//! seconds per 100,000 events and peak RSS.
//!
//! The same machinery drives a cluster ([`Placement`]): conversations spread
//! over several servers, each created on one and streamed through another.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use indicatif::ProgressBar;
use serde_json::json;
use tokio::sync::{mpsc, watch, Semaphore};

use super::client::{parse, AttachAnswer, Client, Latencies, SeqCheck};
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
    /// Turns per conversation, back to back (the next message is sent when
    /// a turn finishes). With more than one, the starts are spread over one
    /// whole turn instead of one interval, so turns start and end evenly
    /// (as they do in a service where conversations come and go) instead of
    /// all within one interval; latency then counts only the events
    /// received while every conversation streams (from one turn after the
    /// start, when the last has started, to `turns` turns after it, when
    /// the first finishes).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub turns: u64,
}

impl StreamingArgs {
    /// 20,000 events/s offered: the latency aim.
    pub fn paced() -> StreamingArgs {
        StreamingArgs {
            conversations: 1000,
            tokens: 200,
            rate: 20.0,
            burst: false,
            turns: 1,
        }
    }

    /// As fast as it goes: the throughput and CPU aims.
    pub fn saturate() -> StreamingArgs {
        StreamingArgs {
            conversations: 100,
            tokens: 2000,
            rate: 0.0,
            burst: false,
            turns: 1,
        }
    }

    /// 10,000 connections, each on its own conversation.
    pub fn many() -> StreamingArgs {
        StreamingArgs {
            conversations: 10_000,
            tokens: 20,
            rate: 2.0,
            burst: false,
            turns: 1,
        }
    }

    /// How long one turn streams.
    fn turn(&self) -> Duration {
        Duration::from_millis(self.interval_ms()) * self.tokens as u32
    }

    /// When latency is counted, from the start: while every conversation
    /// streams, with `--turns` above 1; always otherwise.
    fn latency_window(&self) -> Option<(Duration, Duration)> {
        (self.turns > 1 && !self.burst).then(|| (self.turn(), self.turn() * self.turns as u32))
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
    /// `detached {reason: "moved"}` received (and attached again).
    moved: u64,
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
        "turns": args.turns,
        "latency_window_s": args.latency_window().map(|(from, to)| [from.as_secs_f64(), to.as_secs_f64()]),
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

/// Where a run's conversations live and whose costs count.
pub(crate) struct Placement {
    /// The servers' websocket URLs: conversation `i` is created on
    /// `urls[i % len]`.
    pub urls: Vec<String>,
    /// With more than one server: conversation `i` is streamed (`attach`,
    /// `message`, events) through `urls[(i + 1) % len]` by a second
    /// connection of the same user, the one that created it having closed.
    pub across: bool,
    /// The servers' processes: their CPU and peak RSS are summed.
    pub pids: Vec<u32>,
    /// Other processes whose CPU per event and peak RSS are reported under
    /// their own name (the cluster's NATS servers).
    pub helpers: Vec<(&'static str, Vec<u32>)>,
}

impl Placement {
    pub fn single(target: &Target) -> Placement {
        Placement {
            urls: vec![target.url.clone()],
            across: false,
            pids: target.pid.into_iter().collect(),
            helpers: Vec::new(),
        }
    }

    /// (create on, stream through) for conversation `i`.
    fn urls_of(&self, i: usize) -> (Option<String>, String) {
        let k = self.urls.len().max(1);
        if self.across && k > 1 {
            (
                Some(self.urls[i % k].clone()),
                self.urls[(i + 1) % k].clone(),
            )
        } else {
            (None, self.urls[i % k].clone())
        }
    }
}

pub(crate) async fn run_one(
    target: &Target,
    common: &Common,
    args: &StreamingArgs,
) -> anyhow::Result<Vec<Measure>> {
    run_on(&Placement::single(target), common, args).await
}

pub(crate) async fn run_on(
    placement: &Placement,
    common: &Common,
    args: &StreamingArgs,
) -> anyhow::Result<Vec<Measure>> {
    if placement.urls.is_empty() {
        bail!("no server to stream from");
    }
    let n = args.conversations;
    let text = format!("/stream {} {}", args.tokens, args.interval_ms());
    let (ready_tx, mut ready_rx) = mpsc::unbounded_channel();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let (phase_tx, phase_rx) = watch::channel(0u8);
    let connecting = Arc::new(Semaphore::new(common.connect_concurrency.max(1)));
    let latencies = Latencies::new();
    let events_per_conversation = (args.tokens + 4) * args.turns;
    let expected_events = events_per_conversation * n as u64;
    let events_bar = progress(expected_events, "events");
    events_bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    // Each frame may take this long; the whole stream the time it should
    // take three times over, plus a minute.
    let frame_wait = Duration::from_millis((args.interval_ms() * 5).max(15_000));
    let stream_secs = (args.turns + 1) as f64 * args.turn().as_secs_f64();
    let stream_deadline = Duration::from_secs_f64(stream_secs * 3.0 + 60.0 + n as f64 * 0.002);

    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let spread = if args.turns > 1 {
            args.turn()
        } else {
            Duration::from_millis(args.interval_ms())
        };
        let offset = if args.burst {
            Duration::ZERO
        } else {
            spread * i as u32 / n as u32
        };
        let (create_on, url) = placement.urls_of(i);
        let job = Job {
            url,
            create_on,
            user: format!("u{i}"),
            text: text.clone(),
            tokens: args.tokens,
            turns: args.turns,
            latency_window: args.latency_window(),
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
    events_bar.set_length(events_per_conversation * ready as u64);
    events_bar.reset_elapsed();
    let server_before = ProcStats::summed(&placement.pids);
    let helpers_before: Vec<Option<ProcStats>> = placement
        .helpers
        .iter()
        .map(|(_, p)| ProcStats::summed(p))
        .collect();
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
    let server_after = ProcStats::summed(&placement.pids);
    let helpers_after: Vec<Option<ProcStats>> = placement
        .helpers
        .iter()
        .map(|(_, p)| ProcStats::summed(p))
        .collect();
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
    let moved: u64 = outcomes.iter().map(|o| o.moved).sum();
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
        Measure::new("delivered", "events/s", events as f64 / secs).aim(Aim::RatioAtLeast(0.6)),
        Measure::new("latency p50", "ms", ms(&h, 0.5)),
        Measure::new("latency p99", "ms", ms(&h, 0.99)).aim(Aim::AtMost(50.0)),
        Measure::new("latency max", "ms", ms(&h, 1.0)),
        Measure::new("gaps", "", gaps as f64).aim(Aim::AtMost(0.0)),
        Measure::new("duplicates", "", duplicates as f64).aim(Aim::AtMost(0.0)),
        Measure::new("detached moved, attached again", "", moved as f64).aim(Aim::AtMost(0.0)),
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
    for (((name, _), before), after) in placement
        .helpers
        .iter()
        .zip(helpers_before)
        .zip(helpers_after)
    {
        if let Some(cpu) = per_100k(before, after) {
            m.push(Measure::new(
                format!("{name} CPU per 100k events"),
                "s",
                cpu,
            ));
        }
        if let Some(after) = after {
            m.push(Measure::new(
                format!("{name} peak RSS"),
                "MiB",
                after.hwm_kib as f64 / 1024.0,
            ));
        }
    }
    if let Some(cpu) = per_100k(me_before, me_after) {
        m.push(Measure::new("generator CPU per 100k events", "s", cpu));
    }
    Ok(m)
}

struct Job {
    /// Where it streams.
    url: String,
    /// Where it creates the conversation, when not where it streams.
    create_on: Option<String>,
    user: String,
    text: String,
    tokens: u64,
    turns: u64,
    /// See [`StreamingArgs::latency_window`].
    latency_window: Option<(Duration, Duration)>,
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
            let Some(create_on) = &self.create_on else {
                let mut client = Client::connect(&self.url, &self.user).await?;
                let (id, head) = client.create(super::SETUP_TIMEOUT).await?;
                return anyhow::Ok((client, id, head));
            };
            // Created on one server (which runs it), streamed through
            // another: the creating connection goes away, as a client
            // moving to another node would.
            let mut creator = Client::connect(create_on, &self.user).await?;
            let (id, head) = creator.create(super::SETUP_TIMEOUT).await?;
            creator.close().await;
            let mut client = Client::connect(&self.url, &self.user).await?;
            match client
                .attach_answer(&id, head, super::SETUP_TIMEOUT)
                .await?
            {
                AttachAnswer::Attached => Ok((client, id, head)),
                AttachAnswer::Refused(frame) => bail!("attach refused: {frame}"),
            }
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
        // Every stream is told to start at the same moment (give or take
        // the scheduling of this task).
        let start = Instant::now();
        let counted = |now: Instant| {
            self.latency_window.is_none_or(|(from, to)| {
                let since = now.duration_since(start);
                since >= from && since < to
            })
        };
        tokio::time::sleep(self.offset).await;
        let mut unreported = 0;
        for _ in 0..self.turns {
            client.message(id, &self.text).await?;
            // user_message, turn_started, T deltas, assistant_message,
            // turn_finished, the ack, and a few moves: bounded with room to
            // spare.
            let bound = self.tokens + 64 + 4 * MAX_MOVES;
            let mut finished = false;
            for _ in 0..bound {
                let text = client.recv(self.frame_wait).await?;
                let frame = parse(text.as_str())?;
                if frame.ty == "detached" && outcome.moved < MAX_MOVES && is_moved(text.as_str()) {
                    // Cluster mode: the conversation's owner changed
                    // (protocol §10.2); attach again through the same node
                    // and resume after the last seq seen, as a client must.
                    outcome.moved += 1;
                    match client
                        .attach_answer(id, outcome.seq.last, self.frame_wait)
                        .await?
                    {
                        AttachAnswer::Attached => continue,
                        AttachAnswer::Refused(frame) => {
                            bail!("attach after a move refused: {frame}")
                        }
                    }
                }
                if frame.ty == "error" || frame.ty == "detached" {
                    bail!("{} frame: {}", frame.ty, text.as_str());
                }
                if !frame.is_event() {
                    continue;
                }
                if let Some(seq) = frame.seq {
                    outcome.seq.see(seq);
                }
                if let Some(us) = frame.latency_us() {
                    if counted(Instant::now()) {
                        local.record(us);
                    }
                }
                outcome.events += 1;
                unreported += 1;
                if unreported == 64 {
                    bar.inc(unreported);
                    unreported = 0;
                }
                if frame.kind_is("turn_finished") {
                    finished = true;
                    break;
                }
            }
            if !finished {
                bail!("no turn_finished after {bound} frames");
            }
        }
        outcome.finished = Some(Instant::now());
        bar.inc(unreported);
        Ok(())
    }
}

/// Most `detached moved` one stream resumes from.
const MAX_MOVES: u64 = 8;

/// Whether a `detached` frame says `moved`.
fn is_moved(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text).is_ok_and(|v| v["reason"] == "moved")
}

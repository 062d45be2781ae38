//! Takeover (part of the cluster scenario): node 0 of a fresh 3-node
//! cluster owns N conversations, each created through it by its own user
//! (`t0`, `t1`, …) and running a long demo turn (`/stream 100000 MS`:
//! still streaming when the node dies) unless `--turn-interval-ms 0` leaves
//! them idle; the creating connections close, the turns go on detached.
//! One `lease_ttl` after the last creation (every lease renewed since),
//! node 0 is SIGKILLed. For each conversation, on surviving node
//! `1 + i % 2`:
//!
//! - **node_lost recorded**: the `ts` of its `agent_stopped {reason:
//!   "node_lost"}` event minus the wall-clock time of the kill (the event
//!   is stamped when the new owner assigns its seq; millisecond
//!   resolution). Found by polling `GET /v1/conversations/{id}/events
//!   ?after=SEQ` (SEQ: the last event already seen).
//! - **node_lost seen**: when that poll first returned it (adds the poll
//!   interval and the queueing of polls).
//! - **reattachable**: when an `attach` on the surviving node first got
//!   `attached`. Attempts start once node_lost has been seen: no node can
//!   activate a dead node's conversation before closing it node_lost
//!   (ARCHITECTURE.md, "Claiming"), so earlier attempts could only be
//!   refused, and would load the nodes doing the takeover. An upper bound:
//!   it includes the wait for the history poll (its interval, and the
//!   queue of polls when the survivors are slow to answer); the time the
//!   successful attach itself took is reported beside it.
//!
//! Also reported: the CPU the nodes and the NATS servers spend while the
//! N conversations sit on node 0 before the kill (lease renewals, and the
//! turns' events), and what the survivors and NATS spend after it.
//!
//! The polling is bounded: at most `--poll-concurrency` history requests
//! and as many attaches in flight, one conversation's history polled at
//! most every `--poll-interval-ms`, every request with a timeout, and all
//! of it ends at `--takeover-wait` after the kill.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{anyhow, bail, Context};
use clap::Args;
use indicatif::ProgressBar;
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::client::{parse, AttachAnswer, Client};
use super::cluster::Cluster;
use super::{histogram, join_all, ms, progress, Aim, Common, Measure, ProcStats, Report, Server};

/// Deltas of the turn each conversation runs: far more than the run lasts.
const TURN_TOKENS: u64 = 100_000;
/// One history request or attach attempt may take this long.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a refused attach before the next attempt.
const ATTACH_RETRY: Duration = Duration::from_millis(250);
/// Most events one history request asks for.
const PAGE: usize = 1000;

#[derive(Args, Debug, Clone)]
pub struct TakeoverArgs {
    /// Conversations the killed node owns.
    #[arg(long, default_value_t = 1000)]
    pub takeover_conversations: usize,
    /// Milliseconds between the deltas of the turn each of them runs when
    /// the node is killed (`/stream 100000 MS`); 0 leaves them idle.
    #[arg(long, default_value_t = 1000)]
    pub turn_interval_ms: u64,
    /// History requests in flight at once after the kill (and as many
    /// attaches).
    #[arg(long, default_value_t = 8)]
    pub poll_concurrency: usize,
    /// Least time between two history requests for one conversation.
    #[arg(long, default_value_t = 1000)]
    pub poll_interval_ms: u64,
    /// Seconds after the kill after which the bench stops waiting.
    #[arg(long, default_value_t = 120.0)]
    pub takeover_wait: f64,
}

/// One conversation of the killed node, ready to be followed.
struct Conv {
    user: String,
    id: String,
    /// The last seq seen before the kill.
    last: u64,
    /// The REST base of the survivor that follows it.
    base: String,
    survivor_url: String,
}

/// What following one conversation after the kill found.
#[derive(Default)]
struct Followed {
    recorded: Option<Duration>,
    seen: Option<Duration>,
    reattached: Option<Duration>,
    /// How long the attach that got `attached` took.
    attach_took: Option<Duration>,
    interrupted: bool,
    polls: u64,
    poll_errors: u64,
    attaches: u64,
    error: Option<String>,
}

/// What every follower shares.
struct Ctx {
    http: reqwest::Client,
    kill_at: tokio::time::Instant,
    kill_wall: SystemTime,
    deadline: tokio::time::Instant,
    polls: Semaphore,
    attaches: Semaphore,
    interval: Duration,
    bar: ProgressBar,
}

pub async fn run(
    common: &Common,
    args: &TakeoverArgs,
    cluster: &mut Cluster,
) -> anyhow::Result<Report> {
    let n = args.takeover_conversations;
    let lease_ttl = cluster.lease_ttl;
    let bound = lease_ttl + Duration::from_secs(5);
    let turns = args.turn_interval_ms > 0;
    let params = json!({
        "conversations": n,
        "turn": if turns {
            Value::from(format!("/stream {TURN_TOKENS} {}", args.turn_interval_ms))
        } else {
            Value::from("idle")
        },
        "lease_ttl": humantime::format_duration(lease_ttl).to_string(),
        "bound": humantime::format_duration(bound).to_string(),
        "poll_concurrency": args.poll_concurrency,
        "poll_interval_ms": args.poll_interval_ms,
        "nodes": cluster.nodes.len(),
    });
    if cluster.nodes.len() < 2 {
        bail!("a takeover needs two nodes at least");
    }

    // Set-up: every conversation created and its turn started on node 0,
    // a connection of its user open on the survivor that will follow it.
    let victim_url = cluster.nodes[0].url.clone();
    let survivors: Vec<(String, String)> = cluster.nodes[1..]
        .iter()
        .map(|t| (t.url.clone(), t.http_base()))
        .collect();
    let text = turns.then(|| format!("/stream {TURN_TOKENS} {}", args.turn_interval_ms));
    let connecting = Arc::new(Semaphore::new(common.connect_concurrency.max(1)));
    let bar = progress(n as u64, "creating");
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let (survivor_url, base) = survivors[i % survivors.len()].clone();
        let (victim_url, text, connecting, bar) = (
            victim_url.clone(),
            text.clone(),
            connecting.clone(),
            bar.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let set_up = async {
                let _permit = connecting.acquire().await?;
                set_up(format!("t{i}"), &victim_url, survivor_url, base, text).await
            };
            let conv = set_up.await.map_err(|e| format!("t{i}: {e:#}"));
            bar.inc(1);
            conv
        }));
    }
    let setup_within = Duration::from_secs(60) + Duration::from_millis(20 * n as u64);
    let (set, lost) = join_all(tasks, setup_within).await;
    bar.finish_and_clear();
    let mut convs = Vec::with_capacity(n);
    let mut first_error = None;
    for conv in set {
        match conv {
            Ok(c) => convs.push(c),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    let ready = convs.len();
    if ready < n {
        eprintln!(
            "{} of {n} conversations failed to set up ({lost} timed out after {setup_within:?}); \
             first: {}",
            n - ready,
            first_error.unwrap_or_default()
        );
    }
    if ready == 0 {
        bail!("no conversation could be set up on the node to kill");
    }

    // Let every lease be renewed at least twice (and measure what the
    // cluster spends meanwhile), then kill their owner.
    let (nodes_idle, nats_idle) = (cluster.node_pids(), cluster.nats.pids());
    let settle_before = (
        ProcStats::summed(&nodes_idle),
        ProcStats::summed(&nats_idle),
    );
    tokio::time::sleep(lease_ttl).await;
    let settle_after = (
        ProcStats::summed(&nodes_idle),
        ProcStats::summed(&nats_idle),
    );
    let kill_wall = SystemTime::now();
    let kill_at = tokio::time::Instant::now();
    cluster.nodes[0]
        .kill()
        .await
        .context("killing the owner node")?;
    eprintln!(
        "── killed node 0 (owner of {ready}); waiting for the takeover, at most {}s",
        args.takeover_wait
    );
    let survivor_pids = cluster.node_pids();
    let nats_pids = cluster.nats.pids();
    let survivors_before = ProcStats::summed(&survivor_pids);
    let nats_before = ProcStats::summed(&nats_pids);

    let ctx = Arc::new(Ctx {
        http: reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .build()?,
        kill_at,
        kill_wall,
        deadline: kill_at + Duration::from_secs_f64(args.takeover_wait),
        polls: Semaphore::new(args.poll_concurrency.max(1)),
        attaches: Semaphore::new(args.poll_concurrency.max(1)),
        interval: Duration::from_millis(args.poll_interval_ms),
        bar: progress(ready as u64, "reattached"),
    });
    let tasks: Vec<_> = convs
        .into_iter()
        .map(|(conv, observer)| tokio::spawn(follow(conv, observer, ctx.clone())))
        .collect();
    let within = Duration::from_secs_f64(args.takeover_wait) + REQUEST_TIMEOUT * 2;
    let (followed, lost) = join_all(tasks, within).await;
    ctx.bar.finish_and_clear();
    let survivors_after = ProcStats::summed(&survivor_pids);
    let nats_after = ProcStats::summed(&nats_pids);
    let window = kill_at.elapsed();
    if lost > 0 {
        eprintln!("{lost} follower tasks did not end in time and were aborted");
    }

    let (mut recorded, mut seen, mut reattached, mut took) =
        (histogram(), histogram(), histogram(), histogram());
    let us = |d: Duration| (d.as_micros() as u64).max(1);
    for f in &followed {
        if let Some(d) = f.recorded {
            recorded.saturating_record(us(d));
        }
        if let Some(d) = f.seen {
            seen.saturating_record(us(d));
        }
        if let Some(d) = f.reattached {
            reattached.saturating_record(us(d));
        }
        if let Some(d) = f.attach_took {
            took.saturating_record(us(d));
        }
    }
    let count = |pred: &dyn Fn(&Followed) -> bool| followed.iter().filter(|f| pred(f)).count();
    let taken_over = count(&|f| f.recorded.is_some());
    let missing = ready - taken_over;
    if let Some(e) = followed.iter().find_map(|f| f.error.as_ref()) {
        eprintln!(
            "{} of {ready} conversations not followed to the end; first: {e}",
            count(&|f| f.reattached.is_none())
        );
    }
    let ready_f = ready as f64;
    let mut m = vec![
        Measure::new("conversations on the killed node", "", ready_f).aim(Aim::AtLeast(n as f64)),
        Measure::new("node_lost recorded", "", taken_over as f64).aim(Aim::AtLeast(ready_f)),
        Measure::new("node_lost recorded p50", "ms", ms(&recorded, 0.5)),
        Measure::new("node_lost recorded p99", "ms", ms(&recorded, 0.99)),
        Measure::new("node_lost recorded max", "ms", ms(&recorded, 1.0)),
        Measure::new(
            "node_lost recorded within bound",
            "",
            count(&|f| f.recorded.is_some_and(|d| d <= bound)) as f64,
        )
        .aim(Aim::AtLeast(ready_f)),
        Measure::new("node_lost seen (REST) p50", "ms", ms(&seen, 0.5)),
        Measure::new("node_lost seen (REST) p99", "ms", ms(&seen, 0.99)),
        Measure::new("node_lost seen (REST) max", "ms", ms(&seen, 1.0)),
        Measure::new("reattached", "", count(&|f| f.reattached.is_some()) as f64)
            .aim(Aim::AtLeast(ready_f)),
        Measure::new("reattachable p50", "ms", ms(&reattached, 0.5)),
        Measure::new("reattachable p99", "ms", ms(&reattached, 0.99)),
        Measure::new("reattachable max", "ms", ms(&reattached, 1.0)),
        Measure::new(
            "reattachable within bound",
            "",
            count(&|f| f.reattached.is_some_and(|d| d <= bound)) as f64,
        )
        .aim(Aim::AtLeast(ready_f)),
        Measure::new("successful attach took p50", "ms", ms(&took, 0.5)),
        Measure::new("successful attach took p99", "ms", ms(&took, 0.99)),
    ];
    if turns {
        m.push(
            Measure::new(
                "turns recorded interrupted",
                "",
                count(&|f| f.interrupted) as f64,
            )
            .aim(Aim::AtLeast(ready_f)),
        );
    }
    m.extend([
        Measure::new("not taken over by the deadline", "", missing as f64).aim(Aim::AtMost(0.0)),
        Measure::new(
            "history requests",
            "",
            followed.iter().map(|f| f.polls).sum::<u64>() as f64,
        ),
        Measure::new(
            "history requests failed",
            "",
            followed.iter().map(|f| f.poll_errors).sum::<u64>() as f64,
        ),
        Measure::new(
            "attach attempts",
            "",
            followed.iter().map(|f| f.attaches).sum::<u64>() as f64,
        ),
        Measure::new("kill to the last follower done", "s", window.as_secs_f64()),
    ]);
    let busy = |before: Option<ProcStats>, after: Option<ProcStats>| {
        let (b, a) = (before?, after?);
        Some((a.cpu_secs - b.cpu_secs) / lease_ttl.as_secs_f64() * 100.0)
    };
    if let Some(cpu) = busy(settle_before.0, settle_after.0) {
        m.push(Measure::new("nodes' CPU before the kill", "%", cpu));
    }
    if let Some(cpu) = busy(settle_before.1, settle_after.1) {
        m.push(Measure::new("NATS CPU before the kill", "%", cpu));
    }
    if let (Some(b), Some(a)) = (survivors_before, survivors_after) {
        m.push(Measure::new(
            "survivors' CPU over that time",
            "s",
            a.cpu_secs - b.cpu_secs,
        ));
    }
    if let (Some(b), Some(a)) = (nats_before, nats_after) {
        m.push(Measure::new(
            "NATS CPU over that time",
            "s",
            a.cpu_secs - b.cpu_secs,
        ));
    }
    Ok(Report {
        scenario: "cluster takeover".into(),
        params,
        runs: vec![(Server::Cluster, m)],
    })
}

/// Creates one conversation on the node to kill (starting its turn when
/// `text` is given) and opens its user's connection to the survivor that
/// follows it.
async fn set_up(
    user: String,
    victim_url: &str,
    survivor_url: String,
    base: String,
    text: Option<String>,
) -> anyhow::Result<(Conv, Client)> {
    let mut client = Client::connect(victim_url, &user).await?;
    let (id, head) = client.create(super::SETUP_TIMEOUT).await?;
    let mut last = head;
    if let Some(text) = text {
        client.message(&id, &text).await?;
        // Until the ack and the turn's start have come.
        let (mut acked, mut started) = (false, false);
        for _ in 0..64 {
            let frame = client.recv(super::SETUP_TIMEOUT).await?;
            let f = parse(frame.as_str())?;
            match f.ty.as_ref() {
                "event" => {
                    last = last.max(f.seq.unwrap_or(0));
                    started |= f.kind_is("turn_started");
                }
                "ack" => acked = true,
                "error" | "detached" => bail!("{} frame: {}", f.ty, frame.as_str()),
                _ => {}
            }
            if acked && started {
                break;
            }
        }
        if !(acked && started) {
            bail!("no ack and turn_started among 64 frames");
        }
    }
    client.close().await;
    let observer = Client::connect(&survivor_url, &user).await?;
    let conv = Conv {
        user,
        id,
        last,
        base,
        survivor_url,
    };
    Ok((conv, observer))
}

/// Polls one conversation's history on its survivor until node_lost shows,
/// then attaches there until `attached`; all by the deadline.
async fn follow(conv: Conv, observer: Client, ctx: Arc<Ctx>) -> Followed {
    let mut out = Followed::default();
    let mut cursor = conv.last;
    let mut next = ctx.kill_at;
    while out.recorded.is_none() {
        if next > ctx.deadline {
            out.error = Some(format!(
                "{}: no node_lost in its history after {:?}",
                conv.id,
                ctx.deadline - ctx.kill_at
            ));
            ctx.bar.inc(1);
            return out;
        }
        tokio::time::sleep_until(next).await;
        next = tokio::time::Instant::now() + ctx.interval;
        out.polls += 1;
        let page = {
            let _permit = ctx.polls.acquire().await;
            history(&ctx.http, &conv, cursor).await
        };
        let events = match page {
            Ok(events) => events,
            Err(e) => {
                out.poll_errors += 1;
                out.error = Some(format!("{}: {e:#}", conv.id));
                continue;
            }
        };
        let full = events.len() >= PAGE;
        for event in &events {
            cursor = cursor.max(event["seq"].as_u64().unwrap_or(0));
            let kind = event["kind"].as_str().unwrap_or("");
            if kind == "turn_finished" && event["data"]["status"] == "interrupted" {
                out.interrupted = true;
            }
            if kind == "agent_stopped" {
                if event["data"]["reason"] != "node_lost" {
                    out.error = Some(format!("{}: stopped otherwise: {event}", conv.id));
                    ctx.bar.inc(1);
                    return out;
                }
                let ts = event["ts"]
                    .as_str()
                    .and_then(|ts| humantime::parse_rfc3339(ts).ok())
                    .unwrap_or_else(SystemTime::now);
                out.recorded = Some(ts.duration_since(ctx.kill_wall).unwrap_or_default());
                out.seen = Some(ctx.kill_at.elapsed());
            }
        }
        if full {
            next = tokio::time::Instant::now();
        }
    }

    let mut observer = Some(observer);
    loop {
        let now = tokio::time::Instant::now();
        if now >= ctx.deadline {
            out.error = Some(format!(
                "{}: not reattachable after {:?}; last: {}",
                conv.id,
                ctx.deadline - ctx.kill_at,
                out.error.take().unwrap_or_default()
            ));
            break;
        }
        let within = REQUEST_TIMEOUT.min(ctx.deadline - now);
        let (attempt, attempt_started) = {
            let _permit = ctx.attaches.acquire().await;
            let started = Instant::now();
            out.attaches += 1;
            (attach(&mut observer, &conv, cursor, within).await, started)
        };
        match attempt {
            Ok(AttachAnswer::Attached) => {
                out.reattached = Some(ctx.kill_at.elapsed());
                out.attach_took = Some(attempt_started.elapsed());
                out.error = None;
                break;
            }
            Ok(AttachAnswer::Refused(frame)) => out.error = Some(frame),
            Err(e) => {
                observer = None;
                out.error = Some(format!("{e:#}"));
            }
        }
        tokio::time::sleep(ATTACH_RETRY).await;
    }
    ctx.bar.inc(1);
    if let Some(client) = observer {
        client.close().await;
    }
    out
}

/// One page of stored events after `after`, from the survivor's REST API.
async fn history(http: &reqwest::Client, conv: &Conv, after: u64) -> anyhow::Result<Vec<Value>> {
    let url = format!(
        "{}/v1/conversations/{}/events?after={after}&limit={PAGE}",
        conv.base, conv.id
    );
    let response = http
        .get(&url)
        .bearer_auth(&conv.user)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = response.status();
    let body = response
        .text()
        .await
        .with_context(|| format!("GET {url}: reading the body"))?;
    if !status.is_success() {
        bail!("GET {url}: {status}: {body}");
    }
    let mut page: Value =
        serde_json::from_str(&body).with_context(|| format!("GET {url}: not JSON: {body}"))?;
    match page["events"].take() {
        Value::Array(events) => Ok(events),
        _ => Err(anyhow!("GET {url}: no `events` array: {body}")),
    }
}

/// One attach attempt through the survivor, (re)connecting first if the
/// last attempt lost the connection.
async fn attach(
    observer: &mut Option<Client>,
    conv: &Conv,
    last_seq: u64,
    within: Duration,
) -> anyhow::Result<AttachAnswer> {
    let started = Instant::now();
    if observer.is_none() {
        *observer = Some(Client::connect(&conv.survivor_url, &conv.user).await?);
    }
    let left = within.saturating_sub(started.elapsed());
    let client = observer.as_mut().ok_or_else(|| anyhow!("no connection"))?;
    client.attach_answer(&conv.id, last_seq, left).await
}

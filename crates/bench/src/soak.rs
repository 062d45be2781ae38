//! Soak: a steady load for minutes or hours, with reconnect churn, and with
//! `--faults` a SIGKILL and restart of the server every few minutes and one
//! full disk. C conversations (each its own user and connection) ask the
//! demo agent for one paced `/stream T MS` turn after another; every few
//! seconds a share of the clients drops its connection and resumes with its
//! last seq. Every client checks its stream across every reconnect
//! ([`check`]): nothing lost, nothing doubled, a seq sent again the same
//! event.
//!
//! Every few seconds a [`sample::Sample`]: server RSS and CPU, delivered
//! events/s, p50 and p99 latency, resumes and errors. At the end the report
//! (with whether memory stayed flat), a JSON file with every sample
//! (`--out`) and a chart beside it ([`chart`], `.svg`). The run fails (an
//! error, a non-zero exit) if any client saw a loss, a duplicate or a
//! renumbered seq, or could not go on.
//!
//! Parts: [`client`] (one conversation's client), [`check`] (its stream
//! check), [`sample`] (counters, samples, memory figures), [`faults`] (kill
//! and restart, disk full) on [`disk`] (the tmpfs), [`chart`] (the SVG).

mod chart;
mod check;
mod client;
mod disk;
mod faults;
mod sample;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch, Notify, Semaphore};
use tokio::time::Instant;

use super::{collect_ready, join_all, ms, progress, Aim, Common, Measure, Report, Server, Target};
use client::{Job, Phase, Timing};
use disk::SmallDisk;
use faults::{DiskFull, Mark, Restart};
use sample::{Count, Sampled, Shared};

#[derive(Args, Debug, Clone)]
pub struct SoakArgs {
    /// How long to stream, in minutes (fractions allowed).
    #[arg(long, default_value_t = 30.0)]
    pub minutes: f64,
    /// How long to stream, in seconds (instead of --minutes).
    #[arg(long)]
    pub seconds: Option<f64>,
    /// Conversations, each with its own connection and user.
    #[arg(long, short = 'c', default_value_t = 300)]
    pub conversations: usize,
    /// Tokens per turn (`/stream T MS`).
    #[arg(long, short = 't', default_value_t = 100)]
    pub tokens: u64,
    /// Milliseconds between tokens.
    #[arg(long, default_value_t = 100)]
    pub interval_ms: u64,
    /// Time between churn rounds.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub churn_every: Duration,
    /// Share of the clients dropped at each churn round (0 for none).
    #[arg(long, default_value_t = 0.05)]
    pub churn_fraction: f64,
    /// How long a dropped client stays away.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    pub away: Duration,
    /// Seqs below its last one a client asks for again at each resume, to
    /// compare them with what it saw.
    #[arg(long, default_value_t = 16)]
    pub overlap: u64,
    /// Time between samples.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub sample_every: Duration,
    /// The JSON file of samples and summary; the chart is written beside it
    /// with the extension `.svg`.
    #[arg(long, default_value = "soak.json")]
    pub out: PathBuf,
    /// Faults: SIGKILL and restart every --kill-every, and one full disk.
    #[arg(long)]
    pub faults: bool,
    /// With --faults: time between SIGKILLs.
    #[arg(long, default_value = "3m", value_parser = humantime::parse_duration)]
    pub kill_every: Duration,
    /// With --faults: when the disk fills, from the start (default: the
    /// middle of the run).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub disk_full_at: Option<Duration>,
    /// With --faults: how long the disk stays full once /healthz says so.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub disk_full_hold: Duration,
    /// With --faults: no full disk (kills only).
    #[arg(long)]
    pub no_disk_full: bool,
    /// With --faults: the size of the tmpfs the store is on, MiB (a limit,
    /// not memory taken; only the disk-full episode shrinks it).
    #[arg(long, default_value_t = 4096)]
    pub disk_mib: u64,
}

impl SoakArgs {
    fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.seconds.unwrap_or(self.minutes * 60.0).max(1.0))
    }

    fn params(&self, disk_full: &Value) -> Value {
        json!({
            "minutes": self.duration().as_secs_f64() / 60.0,
            "conversations": self.conversations,
            "tokens": self.tokens,
            "interval_ms": self.interval_ms,
            "offered_events_per_s": self.conversations as f64 * 1000.0 / self.interval_ms.max(1) as f64,
            "churn": format!("{:.0}% every {}", self.churn_fraction * 100.0,
                humantime::format_duration(self.churn_every)),
            "faults": self.faults,
            "kill_every": self.faults.then(|| humantime::format_duration(self.kill_every).to_string()),
            "disk_full": disk_full,
        })
    }
}

/// No SIGKILL this close to the end: the clients resume before the final
/// check (a quarter of the run for short ones).
const KILL_MARGIN: Duration = Duration::from_secs(30);
/// How long the clients may take to end after the stop (their final check
/// included).
const CLIENTS_END_WITHIN: Duration = Duration::from_secs(120);

/// The shortest stretch whose RSS slope is held to an aim.
const FLAT_OVER: Duration = Duration::from_secs(5 * 60);

/// What a run saw.
struct Outcome {
    shared: Arc<Shared>,
    sampled: Sampled,
    marks: Vec<Mark>,
    restarts: Vec<Restart>,
    disk_full: Option<DiskFull>,
    failed: usize,
    first_failure: Option<String>,
    secs: f64,
    load_before: Option<f64>,
    load_after: Option<f64>,
}

pub async fn run(common: &Common, args: &SoakArgs) -> anyhow::Result<Report> {
    if args.faults && !common.spawn {
        bail!("soak --faults kills and restarts the server: it needs --spawn");
    }
    if args.conversations == 0 {
        bail!("soak needs at least one conversation");
    }
    let mut disk_note = json!(null);
    let disk = if args.faults && !args.no_disk_full {
        match SmallDisk::mount(args.disk_mib << 20) {
            Ok(disk) => Some(disk),
            Err(e) => {
                eprintln!("soak: NO DISK-FULL EPISODE: cannot mount a tmpfs for the store ({e}); the run goes on with the other faults");
                disk_note = json!({ "skipped": e.to_string() });
                None
            }
        }
    } else {
        None
    };
    let store = disk.as_ref().map(|d| d.path().join("store"));
    let mut target = if common.spawn {
        Target::spawn_with_store(Server::Linger, common, &[], store.as_deref()).await?
    } else {
        Target::external(&common.url, common.server_pid)
    };
    eprintln!(
        "── soak of {} at {}: {:.1} minutes",
        target.label(),
        target.url,
        args.duration().as_secs_f64() / 60.0
    );
    let outcome = drive(&mut target, disk.as_ref(), common, args).await;
    // The server first: its store is on the disk.
    target.stop().await;
    drop(disk);
    let outcome = outcome?;

    if let Some(d) = &outcome.disk_full {
        disk_note = serde_json::to_value(d)?;
    }
    let memory = sample::memory(
        &outcome.sampled.samples,
        outcome
            .marks
            .iter()
            .rev()
            .find(|m| m.what == faults::RESTARTED)
            .map_or(0.0, |m| m.t_s),
    );
    let report = Report {
        scenario: "soak".into(),
        params: args.params(&disk_note),
        runs: vec![(Server::Linger, measures(args, &outcome, memory.as_ref()))],
    };
    let svg = args.out.with_extension("svg");
    let title = format!(
        "linger soak: {} conversations, {:.1} min{}",
        args.conversations,
        outcome.secs / 60.0,
        if args.faults {
            ", SIGKILL every ".to_owned() + &humantime::format_duration(args.kill_every).to_string()
        } else {
            String::new()
        }
    );
    chart::write(&svg, &title, &outcome.sampled.samples, &outcome.marks)?;
    write_json(&args.out, &report, &outcome, memory.as_ref(), &disk_note)?;
    eprintln!("wrote {} and {}", args.out.display(), svg.display());

    let c = &outcome.shared.counters;
    let broken = c.get(Count::Gaps)
        + c.get(Count::Duplicates)
        + c.get(Count::Renumbered)
        + c.get(Count::Behind);
    if broken > 0 || outcome.failed > 0 {
        if common.json {
            println!("{}", serde_json::to_string_pretty(&report.json())?);
        } else {
            println!("{}", report.table());
        }
        bail!(
            "the soak failed: {broken} seqs lost, doubled or renumbered, {} clients could not go on{}",
            outcome.failed,
            outcome
                .first_failure
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default()
        );
    }
    Ok(report)
}

async fn drive(
    target: &mut Target,
    disk: Option<&SmallDisk>,
    common: &Common,
    args: &SoakArgs,
) -> anyhow::Result<Outcome> {
    let n = args.conversations;
    let shared = Arc::new(Shared::new(n));
    let (phase_tx, phase_rx) = watch::channel(Phase::Setup);
    let (ready_tx, mut ready_rx) = mpsc::unbounded_channel();
    let connecting = Arc::new(Semaphore::new(common.connect_concurrency.max(1)));
    let churn: Vec<Arc<Notify>> = (0..n).map(|_| Arc::new(Notify::new())).collect();
    let timing = Timing {
        away: args.away,
        overlap: args.overlap,
        resume_within: Duration::from_secs(90),
        silent: Duration::from_secs(60),
        kick_after: Duration::from_millis(args.interval_ms * 5).max(Duration::from_secs(15)),
    };
    let text = format!("/stream {} {}", args.tokens, args.interval_ms);
    let mut tasks = Vec::with_capacity(n);
    for (i, churn) in churn.iter().enumerate() {
        let job = Job {
            index: i,
            url: target.url.clone(),
            user: format!("u{i}"),
            text: text.clone(),
            // Spread over one turn: a steady load, not bursts.
            offset: Duration::from_millis(args.tokens * args.interval_ms) * i as u32 / n as u32,
            churn: churn.clone(),
            shared: shared.clone(),
            timing,
        };
        tasks.push(tokio::spawn(job.run(
            connecting.clone(),
            ready_tx.clone(),
            phase_rx.clone(),
        )));
    }
    drop(ready_tx);
    let bar = progress(n as u64, "connecting");
    let setup_within = Duration::from_secs(60) + Duration::from_millis(10 * n as u64);
    let (ready, setup_error) = collect_ready(&mut ready_rx, n, setup_within, &bar).await;
    if ready < n {
        let _ = phase_tx.send(Phase::Stop);
        join_all(tasks, Duration::from_secs(30)).await;
        bail!(
            "{} of {n} clients failed to set up; first: {}",
            n - ready,
            setup_error.unwrap_or_default()
        );
    }

    let load_before = sample::load_average();
    let (pid_tx, pid_rx) = watch::channel(target.pid);
    let (stop_tx, stop_rx) = watch::channel(false);
    shared.begin();
    let _ = phase_tx.send(Phase::Go);
    let go = Instant::now();
    let sampler = tokio::spawn(sample::sample(
        shared.clone(),
        pid_rx,
        args.sample_every,
        stop_rx.clone(),
    ));
    let churner = tokio::spawn(churn_rounds(
        churn,
        args.churn_every,
        args.churn_fraction,
        stop_rx,
    ));

    let duration = args.duration();
    let end = go + duration;
    let margin = KILL_MARGIN.min(duration / 4);
    let mut next_kill = (args.faults && !args.kill_every.is_zero())
        .then(|| go + args.kill_every)
        .filter(|k| *k + margin <= end);
    let mut disk_at = disk.map(|_| go + args.disk_full_at.unwrap_or(duration / 2));
    let (mut marks, mut restarts, mut disk_full) = (Vec::new(), Vec::new(), None);
    let mut interrupted = false;
    // Bounded: ends at `end`; each fault episode is bounded in time.
    loop {
        let next = [Some(end), next_kill, disk_at]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(end);
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = tokio::signal::ctrl_c() => {
                interrupted = true;
                break;
            }
        }
        let now = Instant::now();
        if now >= end {
            break;
        }
        if let (Some(at), Some(disk)) = (disk_at, disk) {
            if at <= now {
                disk_at = None;
                eprintln!("soak: filling the disk at {:.0} s", shared.elapsed_s());
                let d = faults::disk_full(disk, target, &shared, args.disk_full_hold, &mut marks)
                    .await?;
                eprintln!("soak: disk full: {}", serde_json::to_string(&d)?);
                disk_full = Some(d);
                continue;
            }
        }
        if let Some(at) = next_kill.filter(|k| *k <= now) {
            eprintln!("soak: SIGKILL at {:.0} s", shared.elapsed_s());
            let r = faults::kill_and_restart(target, &shared, &pid_tx, &mut marks).await?;
            eprintln!("soak: restarted: {}", serde_json::to_string(&r)?);
            restarts.push(r);
            next_kill = Some(at + args.kill_every).filter(|k| *k + margin <= end);
        }
    }
    let secs = go.elapsed().as_secs_f64();
    let _ = stop_tx.send(true);
    let _ = phase_tx.send(Phase::Stop);
    let (results, lost) = join_all(tasks, CLIENTS_END_WITHIN).await;
    let _ = churner.await;
    let sampled = sampler.await.context("the sampler")?;
    if interrupted {
        bail!("interrupted (ctrl-c) after {secs:.0} s");
    }
    let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    Ok(Outcome {
        failed: failures.len() + lost,
        first_failure: failures
            .into_iter()
            .next()
            .or_else(|| (lost > 0).then(|| format!("{lost} clients did not end in time"))),
        shared,
        sampled,
        marks,
        restarts,
        disk_full,
        secs,
        load_before,
        load_after: sample::load_average(),
    })
}

/// Every `every`, drops the next `fraction` of the clients, round robin,
/// until `stop`.
async fn churn_rounds(
    clients: Vec<Arc<Notify>>,
    every: Duration,
    fraction: f64,
    mut stop: watch::Receiver<bool>,
) {
    let n = clients.len();
    let per_round = ((n as f64 * fraction).ceil() as usize).min(n);
    if per_round == 0 || every.is_zero() {
        return;
    }
    let mut next = 0;
    // Bounded by the stop signal.
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        for _ in 0..per_round {
            clients[next % n].notify_one();
            next += 1;
        }
    }
}

fn measures(args: &SoakArgs, o: &Outcome, memory: Option<&sample::Memory>) -> Vec<Measure> {
    let c = &o.shared.counters;
    let h = &o.sampled.latency;
    let events = c.get(Count::Events);
    let samples = &o.sampled.samples;
    let cpu: Vec<f64> = samples.iter().filter_map(|s| s.cpu_pct).collect();
    let count = |name: &str, what: Count| Measure::new(name, "", c.get(what) as f64);
    let mut m = vec![
        Measure::new("conversations", "", args.conversations as f64),
        Measure::new("streamed", "min", o.secs / 60.0),
        Measure::new("samples", "", samples.len() as f64),
        count("events delivered", Count::Events),
        Measure::new("delivered", "events/s", events as f64 / o.secs.max(1e-3)),
        count("turns finished", Count::Turns),
        Measure::new("latency p50", "ms", ms(h, 0.5)),
        Measure::new("latency p99", "ms", ms(h, 0.99)),
        Measure::new("latency max", "ms", ms(h, 1.0)),
        Measure::new(
            "worst window p99",
            "ms",
            samples.iter().filter_map(|s| s.p99_ms).fold(0.0, f64::max),
        ),
        count("connections dropped (churn)", Count::Dropped),
        count("connections lost (kills)", Count::Lost),
        count("resumes", Count::Resumes),
        count("seqs sent again and compared", Count::Rechecked),
        count("gaps", Count::Gaps).aim(Aim::AtMost(0.0)),
        count("duplicates", Count::Duplicates).aim(Aim::AtMost(0.0)),
        count("renumbered", Count::Renumbered).aim(Aim::AtMost(0.0)),
        count("seen but above head", Count::Behind).aim(Aim::AtMost(0.0)),
        Measure::new("clients that could not go on", "", o.failed as f64).aim(Aim::AtMost(0.0)),
        count("error frames (not store)", Count::Errors),
        count("store_unavailable frames", Count::StoreErrors),
        count("stalled turns asked again", Count::Stalls),
        Measure::new(
            "server CPU mean",
            "%",
            cpu.iter().sum::<f64>() / cpu.len().max(1) as f64,
        ),
    ];
    if let Some(mem) = memory {
        m.push(Measure::new("RSS, second half start", "MiB", mem.warm_mib));
        m.push(Measure::new("RSS at end", "MiB", mem.end_mib));
        m.push(Measure::new("RSS peak, second half", "MiB", mem.peak_mib));
        let slope = Measure::new("RSS slope, second half", "MiB/min", mem.slope_mib_per_min);
        // Over a few minutes the slope is noise, not a trend.
        m.push(if mem.to_s - mem.from_s >= FLAT_OVER.as_secs_f64() {
            slope.aim(Aim::AtMost(1.0))
        } else {
            slope
        });
    }
    if let Some(load) = o.load_after {
        m.push(Measure::new("load average (1 min) at end", "", load));
    }
    if args.faults {
        let max =
            |f: fn(&Restart) -> Option<f64>| o.restarts.iter().filter_map(f).fold(0.0, f64::max);
        m.push(Measure::new("SIGKILLs", "", o.restarts.len() as f64));
        m.push(Measure::new(
            "restarts serving",
            "",
            o.restarts
                .iter()
                .filter(|r| r.healthy_after_s.is_some())
                .count() as f64,
        ));
        m.push(Measure::new(
            "restart: listening after, max",
            "s",
            max(|r| Some(r.listening_after_s)),
        ));
        m.push(Measure::new(
            "restart: /healthz 200 after, max",
            "s",
            max(|r| r.healthy_after_s),
        ));
        m.push(Measure::new(
            "restart: all clients back after, max",
            "s",
            max(|r| r.all_resumed_after_s),
        ));
        if let Some(d) = &o.disk_full {
            m.push(Measure::new(
                "disk full: store_unavailable frames",
                "",
                d.store_errors as f64,
            ));
            m.push(Measure::new(
                "disk full: /healthz 503 answers",
                "",
                d.healthz_503 as f64,
            ));
            m.push(Measure::new("disk full: full for", "s", d.full_for_s));
            if let Some(s) = d.healthy_after_s {
                m.push(Measure::new("disk freed: /healthz 200 after", "s", s));
            }
            if let Some(s) = d.appends_after_s {
                m.push(Measure::new("disk freed: appends again after", "s", s));
            }
        }
    }
    m
}

fn write_json(
    path: &Path,
    report: &Report,
    o: &Outcome,
    memory: Option<&sample::Memory>,
    disk_full: &Value,
) -> anyhow::Result<()> {
    let out = json!({
        "report": report.json(),
        "counters": o.shared.counters.json(),
        "memory": memory,
        "load_average": { "before": o.load_before, "after": o.load_after },
        "restarts": o.restarts,
        "disk_full": disk_full,
        "marks": o.marks,
        "samples": o.sampled.samples,
        "first_errors": *o.shared.first_errors.lock().unwrap_or_else(|e| e.into_inner()),
    });
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, serde_json::to_string_pretty(&out)?)
        .with_context(|| format!("writing {}", path.display()))
}

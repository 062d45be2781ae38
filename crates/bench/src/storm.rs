//! Reconnect storm: N clients stream, all drop at once mid-stream (their
//! turns keep running), stay away a moment, and all reconnect and resume at
//! once with `attach {last_seq}`. What it reports: the time from the
//! reconnect until every client has caught up with the head it was told in
//! `attached`, and every gap and duplicate seen over the whole run (both
//! must be zero).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use serde_json::json;
use tokio::sync::{mpsc, watch, Semaphore};

use super::client::{parse, Client, SeqCheck};
use super::{
    collect_ready, histogram, join_all, ms, progress, Aim, Common, Measure, Report, Target,
};

#[derive(Args, Debug, Clone)]
pub struct StormArgs {
    /// Clients, each on its own conversation and user.
    #[arg(long, short = 'n', default_value_t = 5000)]
    pub clients: usize,
    /// Tokens each turn streams.
    #[arg(long, short = 't', default_value_t = 50)]
    pub tokens: u64,
    /// Milliseconds between tokens.
    #[arg(long, default_value_t = 200)]
    pub interval_ms: u64,
    /// Seconds of streaming before everyone drops.
    #[arg(long, default_value_t = 3.0)]
    pub drop_after: f64,
    /// Seconds everyone stays away.
    #[arg(long, default_value_t = 1.0)]
    pub away: f64,
}

impl StormArgs {
    pub fn default_args() -> StormArgs {
        StormArgs {
            clients: 5000,
            tokens: 50,
            interval_ms: 200,
            drop_after: 3.0,
            away: 1.0,
        }
    }
}

const GO: u8 = 1;
const DROP: u8 = 2;
const RECONNECT: u8 = 3;
const DONE: u8 = 4;

#[derive(Default)]
struct Outcome {
    seq: SeqCheck,
    /// The turn was still running when the client dropped.
    mid_stream: bool,
    replayed: u64,
    caught_up: Option<Instant>,
    finished: bool,
    error: Option<String>,
}

pub async fn run(common: &Common, args: &StormArgs) -> anyhow::Result<Report> {
    let params = json!({
        "clients": args.clients,
        "tokens": args.tokens,
        "interval_ms": args.interval_ms,
        "drop_after_s": args.drop_after,
        "away_s": args.away,
    });
    let runs = super::against_each(common, &[], |target| async move {
        let measures = run_one(&target, common, args).await?;
        Ok((target, measures))
    })
    .await?;
    Ok(Report {
        scenario: "storm".into(),
        params,
        runs,
    })
}

async fn run_one(
    target: &Target,
    common: &Common,
    args: &StormArgs,
) -> anyhow::Result<Vec<Measure>> {
    let n = args.clients;
    let (ready_tx, mut ready_rx) = mpsc::unbounded_channel();
    let (dropped_tx, mut dropped_rx) = mpsc::unbounded_channel();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let (phase_tx, phase_rx) = watch::channel(0u8);
    let connecting = Arc::new(Semaphore::new(common.connect_concurrency.max(1)));
    let frame_wait = Duration::from_millis((args.interval_ms * 5).max(15_000));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let job = Job {
            url: target.url.clone(),
            user: format!("u{i}"),
            text: format!("/stream {} {}", args.tokens, args.interval_ms),
            tokens: args.tokens,
            frame_wait,
        };
        tasks.push(tokio::spawn(job.run(
            connecting.clone(),
            ready_tx.clone(),
            dropped_tx.clone(),
            done_tx.clone(),
            phase_rx.clone(),
        )));
    }
    drop((ready_tx, dropped_tx, done_tx));
    let setup_within = Duration::from_secs(60) + Duration::from_millis(10 * n as u64);
    let bar = progress(n as u64, "connecting");
    let (ready, setup_error) = collect_ready(&mut ready_rx, n, setup_within, &bar).await;
    if ready < n {
        let _ = phase_tx.send(DONE);
        join_all(tasks, Duration::from_secs(30)).await;
        bail!(
            "{} of {n} clients failed to set up; first: {}",
            n - ready,
            setup_error.unwrap_or_default()
        );
    }

    let _ = phase_tx.send(GO);
    tokio::time::sleep(Duration::from_secs_f64(args.drop_after)).await;
    let _ = phase_tx.send(DROP);
    let bar = progress(n as u64, "dropping");
    // Clients that failed before the drop report no drop: wait for the
    // others only so long.
    let (dropped, _) = collect_ready(&mut dropped_rx, n, Duration::from_secs(10), &bar).await;
    if dropped < n {
        eprintln!("{} of {n} clients failed before the drop", n - dropped);
    }
    tokio::time::sleep(Duration::from_secs_f64(args.away)).await;

    let server_before = target.stats();
    let reconnect_at = Instant::now();
    let _ = phase_tx.send(RECONNECT);
    let stream_left = Duration::from_millis(args.tokens * args.interval_ms);
    let deadline = tokio::time::Instant::now() + stream_left * 2 + Duration::from_secs(60);
    let bar = progress(n as u64, "resuming");
    let mut outcomes = Vec::with_capacity(n);
    for _ in 0..n {
        match tokio::time::timeout_at(deadline, done_rx.recv()).await {
            Ok(Some(outcome)) => outcomes.push(outcome),
            Ok(None) | Err(_) => break,
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let server_after = target.stats();
    let _ = phase_tx.send(DONE);
    let (_, lost) = join_all(tasks, Duration::from_secs(30)).await;
    if lost > 0 {
        eprintln!("{lost} client tasks did not end in time and were aborted");
    }

    let mut catch_up = histogram();
    let mut all_caught_up = Duration::ZERO;
    for o in &outcomes {
        if let Some(t) = o.caught_up {
            let d = t.duration_since(reconnect_at);
            all_caught_up = all_caught_up.max(d);
            catch_up.saturating_record((d.as_micros() as u64).max(1));
        }
    }
    let caught_up = outcomes.iter().filter(|o| o.caught_up.is_some()).count();
    let failed = outcomes.iter().filter(|o| o.error.is_some()).count() + (n - outcomes.len());
    if let Some(e) = outcomes.iter().find_map(|o| o.error.as_ref()) {
        eprintln!("{failed} of {n} clients failed; first: {e}");
    }
    let mut m = vec![
        Measure::new("clients", "", n as f64),
        Measure::new(
            "dropped mid-stream",
            "",
            outcomes.iter().filter(|o| o.mid_stream).count() as f64,
        ),
        Measure::new("resumed and caught up", "", caught_up as f64).aim(Aim::AtLeast(n as f64)),
        Measure::new("all caught up after", "s", all_caught_up.as_secs_f64()).aim(Aim::AtMost(5.0)),
        Measure::new("client catch-up p50", "ms", ms(&catch_up, 0.5)),
        Measure::new("client catch-up p99", "ms", ms(&catch_up, 0.99)),
        Measure::new(
            "events replayed",
            "",
            outcomes.iter().map(|o| o.replayed).sum::<u64>() as f64,
        ),
        Measure::new(
            "turns seen to the end",
            "",
            outcomes.iter().filter(|o| o.finished).count() as f64,
        ),
        Measure::new(
            "gaps",
            "",
            outcomes.iter().map(|o| o.seq.gaps).sum::<u64>() as f64,
        )
        .aim(Aim::AtMost(0.0)),
        Measure::new(
            "duplicates",
            "",
            outcomes.iter().map(|o| o.seq.duplicates).sum::<u64>() as f64,
        )
        .aim(Aim::AtMost(0.0)),
        Measure::new("failed clients", "", failed as f64).aim(Aim::AtMost(0.0)),
    ];
    if let (Some(b), Some(a)) = (server_before, server_after) {
        m.push(Measure::new(
            "server CPU, reconnect to end",
            "s",
            a.cpu_secs - b.cpu_secs,
        ));
        m.push(Measure::new(
            "server peak RSS",
            "MiB",
            a.hwm_kib as f64 / 1024.0,
        ));
    }
    Ok(m)
}

struct Job {
    url: String,
    user: String,
    text: String,
    tokens: u64,
    frame_wait: Duration,
}

impl Job {
    async fn run(
        self,
        connecting: Arc<Semaphore>,
        ready: mpsc::UnboundedSender<Result<(), String>>,
        dropped: mpsc::UnboundedSender<Result<(), String>>,
        done: mpsc::UnboundedSender<Outcome>,
        mut phase: watch::Receiver<u8>,
    ) {
        let Some((client, id, head)) =
            Client::set_up(&self.url, &self.user, &connecting, &ready).await
        else {
            return;
        };
        if phase.wait_for(|p| *p >= GO).await.is_err() || *phase.borrow() >= DONE {
            return;
        }
        let mut outcome = Outcome {
            seq: SeqCheck::starting_after(head),
            ..Outcome::default()
        };
        let result = self
            .storm(client, &id, &mut outcome, &mut phase, &dropped)
            .await;
        let client = match result {
            Ok(client) => Some(client),
            Err(e) => {
                outcome.error = Some(format!("{}: {e:#}", self.user));
                None
            }
        };
        let _ = done.send(outcome);
        // Hold the connection until everyone is measured.
        let _ = phase.wait_for(|p| *p >= DONE).await;
        if let Some(client) = client {
            client.close().await;
        }
    }

    async fn storm(
        &self,
        mut client: Client,
        id: &str,
        outcome: &mut Outcome,
        phase: &mut watch::Receiver<u8>,
        dropped: &mpsc::UnboundedSender<Result<(), String>>,
    ) -> anyhow::Result<Client> {
        let bound = self.tokens + 64;
        client.message(id, &self.text).await?;
        // Stream until told to drop.
        for _ in 0..bound {
            if outcome.finished {
                let _ = phase.wait_for(|p| *p >= DROP).await;
                break;
            }
            let text = tokio::select! {
                _ = phase.wait_for(|p| *p >= DROP) => break,
                text = client.recv(self.frame_wait) => text?,
            };
            let frame = parse(text.as_str())?;
            if frame.ty == "error" {
                bail!("error frame: {}", text.as_str());
            }
            if let (true, Some(seq)) = (frame.is_event(), frame.seq) {
                outcome.seq.see(seq);
                outcome.finished |= frame.kind_is("turn_finished");
            }
        }
        outcome.mid_stream = !outcome.finished;
        client.drop_abruptly();
        let _ = dropped.send(Ok(()));
        if phase.wait_for(|p| *p >= RECONNECT).await.is_err() || *phase.borrow() >= DONE {
            bail!("stopped before the reconnect");
        }

        // Everyone at once: no connect concurrency limit here.
        let last = outcome.seq.last;
        let mut client = Client::connect(&self.url, &self.user).await?;
        client.attach(id, last).await?;
        let mut head = None;
        for _ in 0..bound {
            let text = client.recv(self.frame_wait).await?;
            let frame = parse(text.as_str())?;
            match frame.ty.as_ref() {
                "attached" => {
                    if frame.replay_from != Some(last + 1) {
                        bail!(
                            "attached with replay_from {:?} after seq {last}",
                            frame.replay_from
                        );
                    }
                    let h = frame.head_seq.unwrap_or(0);
                    outcome.replayed = h.saturating_sub(last);
                    head = Some(h);
                }
                "event" => {
                    if head.is_none() {
                        bail!("an event before `attached`");
                    }
                    if let Some(seq) = frame.seq {
                        outcome.seq.see(seq);
                    }
                    outcome.finished |= frame.kind_is("turn_finished");
                }
                "error" => bail!("error frame: {}", text.as_str()),
                _ => {}
            }
            if outcome.caught_up.is_none() && head.is_some_and(|h| outcome.seq.last >= h) {
                outcome.caught_up = Some(Instant::now());
            }
            if outcome.caught_up.is_some() && outcome.finished {
                break;
            }
        }
        Ok(client)
    }
}

//! The faults of `soak --faults`, one episode each, with what clients and
//! `/healthz` showed and how long the server took to serve again: a SIGKILL
//! and restart on the same store and port, and a full disk that is then
//! freed.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tokio::sync::watch;

use super::disk::SmallDisk;
use super::sample::{Count, Shared};
use crate::Target;

/// A moment on the chart.
#[derive(Debug, Clone, Serialize)]
pub struct Mark {
    pub t_s: f64,
    pub what: &'static str,
}

pub const KILLED: &str = "SIGKILL";
pub const RESTARTED: &str = "restarted";
pub const DISK_FULL: &str = "disk full";
pub const DISK_FREED: &str = "disk freed";

pub fn mark(shared: &Shared, what: &'static str) -> Mark {
    Mark {
        t_s: shared.elapsed_s(),
        what,
    }
}

/// One SIGKILL and restart, times from the kill.
#[derive(Debug, Clone, Serialize)]
pub struct Restart {
    pub at_s: f64,
    /// Until the new process said where it listens.
    pub listening_after_s: f64,
    /// Until `/healthz` answered 200.
    pub healthy_after_s: Option<f64>,
    /// Until every client had attached to the new process.
    pub all_resumed_after_s: Option<f64>,
}

/// Tries to restart a killed server this many times.
const RESTART_ATTEMPTS: usize = 5;
/// How long every client may take to attach after a restart.
const RESUME_WITHIN: Duration = Duration::from_secs(120);
/// How long `/healthz` may take to answer 200.
const HEALTHY_WITHIN: Duration = Duration::from_secs(60);

/// SIGKILLs the server and starts it again on the same store and port.
pub async fn kill_and_restart(
    target: &mut Target,
    shared: &Shared,
    pid: &watch::Sender<Option<u32>>,
    marks: &mut Vec<Mark>,
) -> anyhow::Result<Restart> {
    let killed = Instant::now();
    marks.push(mark(shared, KILLED));
    target.kill().await?;
    let _ = pid.send(None);
    // Reaped: whoever is answered `attached` from here is on the new
    // process.
    let dead_us = shared.since_start_us();
    let mut failed = None;
    for _ in 0..RESTART_ATTEMPTS {
        match target.restart().await {
            Ok(()) => {
                failed = None;
                break;
            }
            Err(e) => {
                eprintln!("soak: restart failed, trying again: {e:#}");
                failed = Some(e);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    if let Some(e) = failed {
        return Err(e.context(format!(
            "restarting after SIGKILL ({RESTART_ATTEMPTS} attempts)"
        )));
    }
    let listening_after_s = killed.elapsed().as_secs_f64();
    let _ = pid.send(target.pid);
    marks.push(mark(shared, RESTARTED));
    let healthy_after_s = wait_healthy(target, HEALTHY_WITHIN)
        .await
        .then(|| killed.elapsed().as_secs_f64());
    let resume_deadline = Instant::now() + RESUME_WITHIN;
    let mut all_resumed_after_s = None;
    // Bounded by the deadline.
    while Instant::now() < resume_deadline {
        if shared
            .attached_us
            .iter()
            .all(|at| at.load(Ordering::SeqCst) > dead_us)
        {
            all_resumed_after_s = Some(killed.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Restart {
        at_s: marks
            .iter()
            .rev()
            .find(|m| m.what == KILLED)
            .map_or(0.0, |m| m.t_s),
        listening_after_s,
        healthy_after_s,
        all_resumed_after_s,
    })
}

/// The disk-full episode.
#[derive(Debug, Clone, Serialize)]
pub struct DiskFull {
    pub at_s: f64,
    pub ballast_mib: f64,
    /// From filling until `/healthz` first answered 503.
    pub first_503_after_s: Option<f64>,
    /// `/healthz` polls answered 503.
    pub healthz_503: u64,
    /// `error store_unavailable` frames clients got, filling to recovery.
    pub store_errors: u64,
    /// How long the disk stayed full.
    pub full_for_s: f64,
    /// From freeing until `/healthz` answered 200 again.
    pub healthy_after_s: Option<f64>,
    /// From freeing until a client got a new live event (appends work).
    pub appends_after_s: Option<f64>,
}

/// Headroom the disk is shrunk to before the ballast fills it.
const HEADROOM: u64 = 16 << 20;
/// How long the disk may stay full without `/healthz` saying so.
const NOTICE_WITHIN: Duration = Duration::from_secs(30);
/// How long appends may take to work again once the disk is freed.
const APPENDS_WITHIN: Duration = Duration::from_secs(60);

/// Fills the store's disk, watches `/healthz` until it answers 503 and for
/// `hold` more, frees the disk and waits until appends work again.
pub async fn disk_full(
    disk: &SmallDisk,
    target: &Target,
    shared: &Shared,
    hold: Duration,
    marks: &mut Vec<Mark>,
) -> anyhow::Result<DiskFull> {
    let store_errors_before = shared.counters.get(Count::StoreErrors);
    let filled = Instant::now();
    marks.push(mark(shared, DISK_FULL));
    let at_s = marks.last().map_or(0.0, |m| m.t_s);
    let ballast = disk.fill(HEADROOM).context("filling the disk")?;
    let ballast_mib = ballast.bytes as f64 / (1 << 20) as f64;
    let http = reqwest::Client::new();
    let (mut first_503, mut healthz_503) = (None, 0);
    // Bounded: NOTICE_WITHIN without a 503, or `hold` after the first.
    loop {
        if health(&http, target).await == Some(503) {
            healthz_503 += 1;
            first_503.get_or_insert_with(|| filled.elapsed());
        }
        let done = match first_503 {
            Some(at) => filled.elapsed() >= at + hold,
            None => filled.elapsed() >= NOTICE_WITHIN,
        };
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let freed_us = shared.since_start_us();
    let freed = Instant::now();
    disk.free(ballast).context("freeing the disk")?;
    marks.push(mark(shared, DISK_FREED));
    let healthy_after_s = wait_healthy(target, HEALTHY_WITHIN)
        .await
        .then(|| freed.elapsed().as_secs_f64());
    let mut appends_after_s = None;
    // Bounded by APPENDS_WITHIN.
    while freed.elapsed() < APPENDS_WITHIN {
        if shared.last_live_us.load(Ordering::Relaxed) > freed_us {
            appends_after_s = Some(freed.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(DiskFull {
        at_s,
        ballast_mib,
        first_503_after_s: first_503.map(|d| d.as_secs_f64()),
        healthz_503,
        store_errors: shared.counters.get(Count::StoreErrors) - store_errors_before,
        full_for_s: freed.duration_since(filled).as_secs_f64(),
        healthy_after_s,
        appends_after_s,
    })
}

/// `GET /healthz`'s status (none: no answer within 2 s).
async fn health(http: &reqwest::Client, target: &Target) -> Option<u16> {
    http.get(format!("{}/healthz", target.http_base()))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()
        .map(|r| r.status().as_u16())
}

/// Polls `/healthz` until 200, within `within`.
async fn wait_healthy(target: &Target, within: Duration) -> bool {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + within;
    // Bounded by the deadline.
    while Instant::now() < deadline {
        if health(&http, target).await == Some(200) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

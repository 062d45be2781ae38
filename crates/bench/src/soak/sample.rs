//! The soak's counters, shared by every client, and the sampler that reads
//! them, the server's /proc figures and the latency window every few
//! seconds into a [`Sample`]; and the "memory flat" figures drawn from the
//! samples.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::sync::watch;

use crate::client::Latencies;
use crate::{histogram, ProcStats};

/// What the clients count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Events received, new (replays of seqs not seen before included).
    Events,
    /// Turns seen to their `turn_finished`.
    Turns,
    /// Attaches after a connection went away (churn, a kill, a `detached`).
    Resumes,
    /// Connections dropped on purpose (churn).
    Dropped,
    /// Connections that went away without being dropped (a kill).
    Lost,
    /// `error store_unavailable` frames.
    StoreErrors,
    /// Other `error` frames.
    Errors,
    /// Seqs that never came.
    Gaps,
    /// Seqs that came twice without being asked for again.
    Duplicates,
    /// Seqs that came again with other content.
    Renumbered,
    /// Seqs that came again, asked for, and were compared.
    Rechecked,
    /// Seqs a client saw that were above the head at its next attach.
    Behind,
    /// No frame for a while though a turn was expected: a message sent.
    Stalls,
}

impl Count {
    pub const ALL: [Count; 13] = [
        Count::Events,
        Count::Turns,
        Count::Resumes,
        Count::Dropped,
        Count::Lost,
        Count::StoreErrors,
        Count::Errors,
        Count::Gaps,
        Count::Duplicates,
        Count::Renumbered,
        Count::Rechecked,
        Count::Behind,
        Count::Stalls,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Count::Events => "events",
            Count::Turns => "turns",
            Count::Resumes => "resumes",
            Count::Dropped => "dropped",
            Count::Lost => "lost_connections",
            Count::StoreErrors => "store_unavailable",
            Count::Errors => "errors",
            Count::Gaps => "gaps",
            Count::Duplicates => "duplicates",
            Count::Renumbered => "renumbered",
            Count::Rechecked => "rechecked",
            Count::Behind => "behind_head",
            Count::Stalls => "stalls",
        }
    }
}

/// The counters, one per [`Count`].
#[derive(Default)]
pub struct Counters {
    values: [AtomicU64; Count::ALL.len()],
}

impl Counters {
    pub fn add(&self, count: Count, n: u64) {
        if n > 0 {
            self.values[count as usize].fetch_add(n, Ordering::Relaxed);
        }
    }

    pub fn get(&self, count: Count) -> u64 {
        self.values[count as usize].load(Ordering::Relaxed)
    }

    fn all(&self) -> [u64; Count::ALL.len()] {
        std::array::from_fn(|i| self.values[i].load(Ordering::Relaxed))
    }

    /// Every counter by name.
    pub fn json(&self) -> serde_json::Value {
        Count::ALL
            .iter()
            .map(|c| (c.name().to_owned(), self.get(*c).into()))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

/// What every client shares.
pub struct Shared {
    pub counters: Counters,
    /// Latencies of live events (not replays) since the last sample.
    pub latencies: Latencies,
    /// When the streaming began (set by [`Shared::begin`]).
    start: std::sync::OnceLock<Instant>,
    /// Per client: when it was last answered `attached`, µs since the
    /// start (after a kill, later than the kill: attached to the new
    /// process).
    pub attached_us: Vec<AtomicU64>,
    /// When a live event last arrived, in µs since `start`.
    pub last_live_us: AtomicU64,
    /// The first few errors, for the log.
    pub first_errors: Mutex<Vec<String>>,
}

impl Shared {
    pub fn new(clients: usize) -> Shared {
        Shared {
            counters: Counters::default(),
            latencies: Latencies::new(),
            start: std::sync::OnceLock::new(),
            attached_us: (0..clients).map(|_| AtomicU64::new(0)).collect(),
            last_live_us: AtomicU64::new(0),
            first_errors: Mutex::new(Vec::new()),
        }
    }

    /// Marks the start of the streaming: time 0 of every sample and mark.
    pub fn begin(&self) {
        self.start();
    }

    pub fn start(&self) -> Instant {
        *self.start.get_or_init(Instant::now)
    }

    /// Seconds since the start.
    pub fn elapsed_s(&self) -> f64 {
        self.start().elapsed().as_secs_f64()
    }

    pub fn since_start_us(&self) -> u64 {
        self.start().elapsed().as_micros() as u64
    }

    /// Client `i` was answered `attached` now.
    pub fn attached(&self, i: usize) {
        if let Some(at) = self.attached_us.get(i) {
            at.store(self.since_start_us(), Ordering::SeqCst);
        }
    }

    /// Keeps the first errors, and prints them as they come.
    pub fn note_error(&self, what: String) {
        let mut first = self.first_errors.lock().unwrap_or_else(|e| e.into_inner());
        if first.len() < 10 {
            eprintln!("soak: {what}");
            first.push(what);
        }
    }
}

/// One window of the soak.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// End of the window, seconds from the start.
    pub t_s: f64,
    /// The machine's 1-minute load average at the end of the window.
    pub load1: Option<f64>,
    /// Server RSS at the end of the window (none: the server was down).
    pub rss_mib: Option<f64>,
    /// Server CPU over the window, % of one core (none: it restarted).
    pub cpu_pct: Option<f64>,
    pub events_per_s: f64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub resumes: u64,
    pub store_errors: u64,
    pub errors: u64,
    /// Gaps, duplicates, renumbered and behind-head seqs so far.
    pub violations: u64,
}

/// What the sampler hands back at the end.
pub struct Sampled {
    pub samples: Vec<Sample>,
    /// Every live event's latency over the whole run.
    pub latency: Histogram<u64>,
}

/// Samples every `every` until `stop` turns true; `pid` is the server's
/// current process (none while it is down).
pub async fn sample(
    shared: std::sync::Arc<Shared>,
    pid: watch::Receiver<Option<u32>>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) -> Sampled {
    let mut samples = Vec::new();
    let mut latency = histogram();
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut before = shared.counters.all();
    let mut cpu_before: Option<(u32, f64)> = None;
    let mut at = Instant::now();
    if let Some(p) = *pid.borrow() {
        cpu_before = ProcStats::read(p).map(|s| (p, s.cpu_secs));
    }
    // Bounded by the stop signal, which the run sends by its deadline.
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let now = Instant::now();
        let secs = now.duration_since(at).as_secs_f64().max(1e-3);
        at = now;
        let counts = shared.counters.all();
        let delta = |c: Count| counts[c as usize] - before[c as usize];
        let window = shared.latencies.take();
        let _ = latency.add(&window);
        let current = *pid.borrow();
        // A killed process not yet reaped has no VmRSS: no figure, not 0.
        let stats = current.and_then(ProcStats::read).filter(|s| s.rss_kib > 0);
        let cpu_pct = match (current, stats, cpu_before) {
            (Some(p), Some(s), Some((q, cpu))) if p == q => Some((s.cpu_secs - cpu) / secs * 100.0),
            _ => None,
        };
        cpu_before = current.zip(stats).map(|(p, s)| (p, s.cpu_secs));
        let quantile = |q: f64| (!window.is_empty()).then(|| crate::ms(&window, q));
        samples.push(Sample {
            t_s: shared.elapsed_s(),
            load1: load_average(),
            rss_mib: stats.map(|s| s.rss_kib as f64 / 1024.0),
            cpu_pct,
            events_per_s: delta(Count::Events) as f64 / secs,
            p50_ms: quantile(0.5),
            p99_ms: quantile(0.99),
            resumes: delta(Count::Resumes),
            store_errors: delta(Count::StoreErrors),
            errors: delta(Count::Errors),
            violations: [
                Count::Gaps,
                Count::Duplicates,
                Count::Renumbered,
                Count::Behind,
            ]
            .iter()
            .map(|c| counts[*c as usize])
            .sum(),
        });
        before = counts;
    }
    let _ = latency.add(shared.latencies.take());
    Sampled { samples, latency }
}

/// The 1-minute load average (/proc/loadavg).
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Whether the server's memory stayed flat.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Memory {
    /// RSS once warmed up: the first sample of the measured stretch.
    pub warm_mib: f64,
    pub end_mib: f64,
    pub peak_mib: f64,
    /// Least-squares slope of RSS over the measured stretch.
    pub slope_mib_per_min: f64,
    /// Where the measured stretch starts and ends, seconds from the start.
    pub from_s: f64,
    pub to_s: f64,
}

/// The memory figures over the second half of the last server process's
/// life (a restart starts memory afresh, so only one process is measured;
/// without faults that is the second half of the run).
pub fn memory(samples: &[Sample], last_start_s: f64) -> Option<Memory> {
    let end = samples.last()?.t_s;
    let from = last_start_s + (end - last_start_s) / 2.0;
    let points: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.t_s >= from)
        .filter_map(|s| Some((s.t_s / 60.0, s.rss_mib?)))
        .collect();
    let (first, last) = (points.first()?, points.last()?);
    let n = points.len() as f64;
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    Some(Memory {
        warm_mib: first.1,
        end_mib: last.1,
        peak_mib: points.iter().map(|p| p.1).fold(0.0, f64::max),
        slope_mib_per_min: if sxx > 0.0 { sxy / sxx } else { 0.0 },
        from_s: first.0 * 60.0,
        to_s: last.0 * 60.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t_s: f64, rss: f64) -> Sample {
        Sample {
            t_s,
            load1: None,
            rss_mib: Some(rss),
            cpu_pct: None,
            events_per_s: 0.0,
            p50_ms: None,
            p99_ms: None,
            resumes: 0,
            store_errors: 0,
            errors: 0,
            violations: 0,
        }
    }

    #[test]
    fn the_slope_is_over_the_second_half_of_the_last_process() {
        // Grows 1 MiB a minute in its second half.
        let samples: Vec<Sample> = (0..=20)
            .map(|i| at(i as f64 * 30.0, 100.0 + (i as f64 * 0.5).max(5.0)))
            .collect();
        let m = memory(&samples, 0.0).expect("figures");
        assert!((m.slope_mib_per_min - 1.0).abs() < 1e-9, "{m:?}");
        assert_eq!(m.from_s, 300.0);
        assert_eq!(m.end_mib, 110.0);
        // After a restart at 420 s only its own samples count.
        let m = memory(&samples, 420.0).expect("figures");
        assert_eq!(m.from_s, 510.0);
    }
}

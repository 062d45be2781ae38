//! Prometheus metrics: the names linger exports and the one recorder that
//! renders them at `/metrics`. The README's "Metrics" table describes each;
//! keep it in step.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, gauge, histogram, Counter};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::event::TurnStatus;
use crate::protocol::{Status, StopReason};

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// The buckets of the histograms that count things (appends in a commit,
/// events in a fold): 1 to 65,536 in powers of two.
const COUNT_BUCKETS: [f64; 17] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    16384.0, 32768.0, 65536.0,
];

/// How often the recorder's histograms fold the samples recorded since into
/// their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Installs the process-wide recorder once and returns its handle. Several
/// servers in one process (tests) share it.
pub fn handle() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            // Durations in seconds, except the two histograms that count
            // things: their buckets are powers of two.
            let handle = PrometheusBuilder::new()
                .set_buckets(&[
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 300.0, 1800.0,
                ])
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("linger_store_commit_group_size".into()),
                        &COUNT_BUCKETS[..=12],
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("linger_store_fold_events".into()),
                        &COUNT_BUCKETS,
                    )
                })
                .ok()
                .and_then(|b| b.install_recorder().ok())?;
            start_upkeep(handle.clone());
            Some(handle)
        })
        .clone()
}

/// A histogram keeps every sample recorded until upkeep (or a scrape of
/// `/metrics`) folds them into its buckets: a server nobody scrapes grew by
/// each commit's and each turn's samples, about 2 MB a minute under the
/// soak's load. The recorder installed this way leaves the upkeep to its
/// owner; a thread of its own does it for the process's life.
fn start_upkeep(handle: PrometheusHandle) {
    let started = std::thread::Builder::new()
        .name("linger-metrics".into())
        .spawn(move || loop {
            std::thread::sleep(UPKEEP_EVERY);
            handle.run_upkeep();
        });
    if let Err(e) = started {
        tracing::warn!(error = %e, "metrics: no upkeep thread; histograms grow until /metrics is scraped");
    }
}

/// Renders the text exposition format.
pub fn render() -> String {
    handle().map(|h| h.render()).unwrap_or_default()
}

/// Counts committed events by kind: one counter update per run of the same
/// kind, not one per event (a burst of `text_delta` is one update).
pub fn events_appended<'a>(kinds: impl IntoIterator<Item = &'a str>) {
    let mut run: Option<(&str, u64)> = None;
    for kind in kinds {
        match &mut run {
            Some((current, n)) if *current == kind => *n += 1,
            _ => {
                if let Some((current, n)) = run.replace((kind, 1)) {
                    count_appended(current, n);
                }
            }
        }
    }
    if let Some((kind, n)) = run {
        count_appended(kind, n);
    }
}

fn count_appended(kind: &str, n: u64) {
    // One handle per kind, made once: `counter!` with a label builds its
    // key and looks it up in the registry at each call, which was a few
    // percent of the server's CPU under paced load (one call per commit).
    static APPENDED: OnceLock<Vec<(&'static str, Counter)>> = OnceLock::new();
    let counters = APPENDED.get_or_init(|| {
        // The recorder first, or the handles would be no-ops.
        handle();
        <crate::event::EventKind as strum::VariantNames>::VARIANTS
            .iter()
            .map(|&k| (k, counter!("linger_events_appended_total", "kind" => k)))
            .collect()
    });
    match counters.iter().find(|(k, _)| *k == kind) {
        Some((_, counter)) => counter.increment(n),
        None => counter!("linger_events_appended_total", "kind" => kind.to_owned()).increment(n),
    }
}

pub fn replay(source: &'static str) {
    counter!("linger_replays_total", "source" => source).increment(1);
}

pub fn turn_started() {
    counter!("linger_turns_started_total").increment(1);
}

pub fn turn_finished(status: TurnStatus) {
    counter!("linger_turns_finished_total", "status" => status.as_str()).increment(1);
}

pub fn turn_duration(duration: Duration) {
    histogram!("linger_turn_duration_seconds").record(duration.as_secs_f64());
}

pub fn conversation_stopped(reason: StopReason) {
    counter!("linger_conversations_stopped_total", "reason" => reason.as_str()).increment(1);
}

/// One store transaction: how long it took and how many commands it held.
pub fn store_commit(duration: Duration, commands: usize) {
    histogram!("linger_store_commit_seconds").record(duration.as_secs_f64());
    histogram!("linger_store_commit_group_size").record(commands as f64);
}

/// The writer copied the WAL's last frames itself so that the WAL starts
/// over (appends wait meanwhile).
pub fn store_wal_restart(duration: Duration) {
    histogram!("linger_store_wal_restart_seconds").record(duration.as_secs_f64());
}

/// The store's writer folded journal runs into the indexed runs (appends
/// wait meanwhile).
pub fn store_fold(duration: Duration, events: usize) {
    histogram!("linger_store_fold_seconds").record(duration.as_secs_f64());
    histogram!("linger_store_fold_events").record(events as f64);
}

/// 1 while the store can write, 0 while writes fail.
pub fn store_available(available: bool) {
    gauge!("linger_store_available").set(if available { 1.0 } else { 0.0 });
}

/// An append the store could not write (disk full, I/O error, ...).
pub fn store_append_failed() {
    counter!("linger_store_append_failures_total").increment(1);
}

pub fn active_conversations(status: Status, count: usize) {
    gauge!("linger_active_conversations", "status" => status.as_str()).set(count as f64);
}

pub fn attached_connections(count: usize) {
    gauge!("linger_attached_connections").set(count as f64);
}

pub fn websocket_connections(delta: f64) {
    gauge!("linger_websocket_connections").increment(delta);
}

/// A connection closed with 4008: it read nothing for
/// `limits.slow_consumer_patience`, or its waiting replies filled their share.
pub fn slow_consumer_closed() {
    counter!("linger_slow_consumer_closes_total").increment(1);
}

/// Log lines dropped because stderr took them slower than they came.
pub fn log_lines_dropped(lines: u64) {
    counter!("linger_log_lines_dropped_total").increment(lines);
}

/// A configuration reload, by outcome (`applied`, `partly_applied`,
/// `refused`, `nothing_changed`, `invalid`).
pub fn config_reloaded(outcome: &str) {
    counter!("linger_config_reloads_total", "outcome" => outcome.replace(' ', "_")).increment(1);
}

//! The server's log on stderr, with a level (`log.level`, or the
//! `LINGER_LOG` environment variable, which wins) and a format
//! (`log.format`) that a reload can change while the server runs.
//!
//! The level is an `EnvFilter` behind tracing-subscriber's `reload` layer.
//! The format is two layers, pretty and JSON, both always installed, with
//! a switch choosing which one writes events: each formatter keeps its own
//! rendering of every span's fields (the JSON one panics on a span it never
//! saw), so both must see every span from the start, and swapping one
//! layer for another at a reload would leave the actors' long-lived spans
//! without it.
//!
//! Lines reach stderr through a writer thread (`tracing-appender`'s
//! non-blocking writer, [`QUEUED_LINES`] lines at most waiting): an
//! actor's log line costs its formatting, never a write. Written from the
//! actors' threads, each line waited for stderr's reader: a reader slower
//! than the server (a pipe to a busy collector, a paused terminal) held up
//! every conversation that logged, and one that stopped reading froze
//! them. The thread writes what has queued up in one go. When stderr falls
//! so far behind that the queue is full, lines are dropped rather than
//! waited for: they are counted (`linger_log_lines_dropped_total`) and a
//! warning says how many once the log flows again. What is queued when the process is
//! killed is lost; an orderly exit writes it ([`LogFlush`]).
//!
//! Dependencies that log through the `log` crate (tungstenite, hyper, …)
//! reach this subscriber through tracing-subscriber's bridge, which lets
//! every level through when the filter's maximum cannot be told from the
//! layers (as with the per-format filters here): each `log::trace!` of a
//! websocket frame then went through the subscriber to be refused. So the
//! `log` crate's own maximum follows the filter's, at start and at every
//! reload.

use std::io::{BufWriter, IsTerminal};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tracing_appender::non_blocking::{ErrorCounter, NonBlockingBuilder, WorkerGuard};

use tracing::subscriber::Interest;
use tracing::Metadata;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::{Context, Filter, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter, Layer, Registry};

use crate::config::{LogConfig, LogFormat};

/// The environment variable whose filter, when set, wins over `log.level`.
pub const LEVEL_ENV: &str = "LINGER_LOG";

/// What a reload may change in the process's logging.
pub trait LogControl: Send + Sync {
    /// Why `log.level` cannot change now (an environment variable wins),
    /// if so.
    fn level_locked(&self) -> Option<String>;
    /// Filters events with `level` (already checked by the config).
    fn set_level(&self, level: &str) -> Result<(), String>;
    fn set_format(&self, format: LogFormat);
}

/// The installed logging's switches.
pub struct Logging {
    filter: reload::Handle<EnvFilter, Registry>,
    format: Arc<AtomicU8>,
    /// `LINGER_LOG` was set (and valid) at start.
    level_from_env: bool,
    /// This subscriber is the process's, and so is the `log` crate's
    /// maximum level (not so when embedded in a program that has its own).
    installed: bool,
}

fn format_code(format: LogFormat) -> u8 {
    match format {
        LogFormat::Pretty => 0,
        LogFormat::Json => 1,
    }
}

/// Lets events through to one format's layer only while that format is
/// chosen; spans always, so that both layers know every span.
struct FormatIs {
    chosen: Arc<AtomicU8>,
    mine: u8,
}

impl<S> Filter<S> for FormatIs {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        !meta.is_event() || self.chosen.load(Ordering::Relaxed) == self.mine
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        // Asked again for each event: the choice can change at any time.
        if meta.is_event() {
            Interest::sometimes()
        } else {
            Interest::always()
        }
    }
}

/// The actor runtime's spans (ractor opens two per actor, for the actor's
/// whole life) are never recorded, at any level: they name only its
/// internal actor id, while linger's lines name the conversation and the
/// connection themselves, and recorded they cost about 400 bytes per active
/// conversation and a span entered and left at every poll of every actor.
fn is_runtime_span(meta: &Metadata<'_>) -> bool {
    meta.is_span() && meta.target().starts_with("ractor")
}

/// Lines waiting for stderr at most (a few MB at a few hundred bytes a
/// line): room for the two lines of each of 10,000 turns starting at once,
/// as a burst of them does.
pub const QUEUED_LINES: usize = 16_384;

/// How often dropped lines are looked for, to be counted and warned of.
const DROPS_CHECKED_EVERY: Duration = Duration::from_secs(5);

/// Writes out the queued lines when dropped: hold it until the process
/// exits, and drop it before `std::process::exit`, which skips destructors.
pub struct LogFlush {
    _worker: WorkerGuard,
}

/// Installs the process's logging (once, at start). Inside a tokio
/// runtime, a task counts and reports dropped lines.
pub fn init(config: &LogConfig) -> (Arc<Logging>, LogFlush) {
    let from_env = std::env::var(LEVEL_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .and_then(|v| EnvFilter::builder().parse(v).ok());
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    // Buffered: the writer thread flushes once the queue is empty, so a
    // burst of lines is one write.
    let (writer, worker) = NonBlockingBuilder::default()
        .buffered_lines_limit(QUEUED_LINES)
        .lossy(true)
        .thread_name("linger-log")
        .finish(BufWriter::new(std::io::stderr()));
    let dropped = writer.error_counter();
    let (subscriber, logging) = subscriber(config, from_env, writer, ansi);
    // Only fails when a subscriber is already installed (embedded use):
    // that one stays.
    let mut logging = logging;
    logging.installed = subscriber.try_init().is_ok();
    logging.sync_log_crate();
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(report_drops(dropped));
    }
    (Arc::new(logging), LogFlush { _worker: worker })
}

/// Counts the lines dropped since the last look and, when there are some,
/// says so in the log (while the queue stays full that warning is dropped
/// too, and counted in the next one).
async fn report_drops(dropped: ErrorCounter) {
    let mut reported = 0;
    let mut every = tokio::time::interval(DROPS_CHECKED_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let total = dropped.dropped_lines();
        if total > reported {
            let lines = total - reported;
            reported = total;
            crate::metrics::log_lines_dropped(lines as u64);
            tracing::warn!(
                dropped = lines,
                queued_at_most = QUEUED_LINES,
                "log: lines were dropped, stderr took them slower than they came"
            );
        }
    }
}

/// The most verbose level `filter` lets through, for the `log` crate.
fn log_crate_level(filter: &EnvFilter) -> log::LevelFilter {
    use tracing::level_filters::LevelFilter;
    match filter.max_level_hint() {
        Some(LevelFilter::OFF) => log::LevelFilter::Off,
        Some(LevelFilter::ERROR) => log::LevelFilter::Error,
        Some(LevelFilter::WARN) => log::LevelFilter::Warn,
        Some(LevelFilter::INFO) => log::LevelFilter::Info,
        Some(LevelFilter::DEBUG) => log::LevelFilter::Debug,
        _ => log::LevelFilter::Trace,
    }
}

impl Logging {
    fn sync_log_crate(&self) {
        if self.installed {
            let _ = self
                .filter
                .with_current(|filter| log::set_max_level(log_crate_level(filter)));
        }
    }
}

/// The subscriber writing to `writer`, and its switches. `env_level`, when
/// given, wins over `log.level`.
fn subscriber<W>(
    config: &LogConfig,
    env_level: Option<EnvFilter>,
    writer: W,
    ansi: bool,
) -> (impl tracing::Subscriber + Send + Sync, Logging)
where
    W: for<'w> MakeWriter<'w> + Clone + Send + Sync + 'static,
{
    let level_from_env = env_level.is_some();
    let filter = env_level
        .or_else(|| EnvFilter::builder().parse(&config.level).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let (filter, handle) = reload::Layer::new(filter);
    let chosen = Arc::new(AtomicU8::new(format_code(config.format)));
    let pretty = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(writer.clone())
        .with_filter(FormatIs {
            chosen: chosen.clone(),
            mine: format_code(LogFormat::Pretty),
        });
    let json = tracing_subscriber::fmt::layer()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_writer(writer)
        .with_filter(FormatIs {
            chosen: chosen.clone(),
            mine: format_code(LogFormat::Json),
        });
    let subscriber = tracing_subscriber::registry()
        .with(filter)
        .with(filter_fn(|meta| !is_runtime_span(meta)))
        .with(pretty)
        .with(json);
    let logging = Logging {
        filter: handle,
        format: chosen,
        level_from_env,
        installed: false,
    };
    (subscriber, logging)
}

impl LogControl for Logging {
    fn level_locked(&self) -> Option<String> {
        self.level_from_env.then(|| {
            format!(
                "{LEVEL_ENV} is set in the server's environment and wins over log.level; \
                 unset it to set the level from the configuration"
            )
        })
    }

    fn set_level(&self, level: &str) -> Result<(), String> {
        let filter = EnvFilter::builder()
            .parse(level)
            .map_err(|e| format!("log.level: not a tracing filter: {e}"))?;
        self.filter
            .reload(filter)
            .map_err(|e| format!("log.level: {e}"))?;
        self.sync_log_crate();
        Ok(())
    }

    fn set_format(&self, format: LogFormat) {
        self.format.store(format_code(format), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// A writer into memory, for reading the log back.
    #[derive(Clone, Default)]
    struct Memory(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Memory {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> MakeWriter<'w> for Memory {
        type Writer = Memory;
        fn make_writer(&'w self) -> Memory {
            self.clone()
        }
    }

    #[test]
    fn level_and_format_change_inside_a_span_opened_before() {
        let out = Memory::default();
        let config = LogConfig::default();
        let (subscriber, logging) = subscriber(&config, None, out.clone(), false);
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("actor", id = 7);
            let _inside = span.enter();
            tracing::info!(n = 1, "first");
            logging.set_format(LogFormat::Json);
            tracing::info!(n = 2, "second");
            logging.set_level("warn").unwrap();
            tracing::info!(n = 3, "third");
            tracing::warn!(n = 4, "fourth");
            logging.set_format(LogFormat::Pretty);
            tracing::warn!(n = 5, "fifth");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(
            lines[0].contains("first") && !lines[0].starts_with('{'),
            "{text}"
        );
        let second: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(second["message"], "second");
        assert_eq!(second["spans"][0]["id"], 7, "{text}");
        let fourth: serde_json::Value = serde_json::from_str(lines[2]).unwrap();
        assert_eq!(fourth["message"], "fourth");
        assert!(
            lines[3].contains("fifth") && lines[3].contains("actor{id=7}"),
            "{text}"
        );
        assert!(logging.level_locked().is_none());
    }

    /// The actor runtime's spans are not recorded, at any level; a span of
    /// linger's own is, and a line inside both names only linger's.
    #[test]
    fn the_actor_runtimes_spans_are_not_recorded() {
        let out = Memory::default();
        let (subscriber, _logging) = subscriber(
            &LogConfig::default(),
            Some(EnvFilter::new("trace")),
            out.clone(),
            false,
        );
        tracing::subscriber::with_default(subscriber, || {
            let runtime = tracing::info_span!(target: "ractor::actor", "Actor", id = 1);
            assert!(runtime.is_disabled());
            let _runtime = runtime.enter();
            let own = tracing::info_span!("attach", id = 2);
            assert!(!own.is_disabled());
            let _own = own.enter();
            tracing::info!("inside");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert!(text.contains("attach{id=2}"), "{text}");
        assert!(!text.contains("Actor"), "{text}");
    }

    #[test]
    fn an_environment_level_locks_log_level() {
        let (_, logging) = subscriber(
            &LogConfig::default(),
            Some(EnvFilter::new("debug")),
            Memory::default(),
            false,
        );
        assert!(logging
            .level_locked()
            .is_some_and(|why| why.contains(LEVEL_ENV)));
    }

    #[test]
    fn the_log_crate_gets_the_filters_most_verbose_level() {
        for (filter, level) in [
            ("info", log::LevelFilter::Info),
            ("warn", log::LevelFilter::Warn),
            ("warn,linger=debug", log::LevelFilter::Debug),
            ("info,tungstenite=trace", log::LevelFilter::Trace),
            ("off", log::LevelFilter::Off),
        ] {
            assert_eq!(log_crate_level(&EnvFilter::new(filter)), level, "{filter}");
        }
    }
}

//! The `linger` binary: `linger serve [--config PATH]` (SIGTERM and Ctrl-C
//! stop it gracefully, SIGHUP reloads its configuration), and the terminal
//! client (`new`, `ls`, `send`, `attach`; for admins `ps`, `top`,
//! `reload`; in `src/cli/`), and `linger bench` (the `linger-bench` crate).
//! The server itself is the library `linger` (crates/server).

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use linger::config::Config;
use linger::reload::{ConfigSource, Reloader, Trigger};
use linger::server::{Server, Setup};

mod allocator;
mod cli;

#[derive(Parser)]
#[command(
    name = "linger",
    version,
    about = "Keeps AI-agent conversations alive when their websocket goes away"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// `serve`'s arguments, for `linger` alone (serve is the default).
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// The TOML config file (default: config/linger.toml when present).
    #[arg(long, env = "LINGER_CONFIG")]
    config: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the websocket gateway (the default).
    Serve(ServeArgs),
    /// Create a conversation and print its id.
    New(cli::new::Args),
    /// List your conversations.
    Ls(cli::ls::Args),
    /// Send one message to a conversation (resuming it if stopped).
    Send(cli::send::Args),
    /// Follow a conversation in the terminal and chat; Ctrl-D detaches.
    Attach(cli::attach::Args),
    /// Admins: the conversations active on the server.
    Ps(cli::ps::Args),
    /// Admins: `ps` and the latest supervision decisions, refreshed until q.
    Top(cli::top::Args),
    /// Admins: make the server re-read its configuration (as SIGHUP does).
    Reload(cli::reload::Args),
    /// Drive a server with load over loopback websockets and report
    /// throughput, latency, CPU and memory (see BENCHMARKS.md).
    Bench(linger_bench::BenchArgs),
}

/// Starts listening for a signal (from then on, it no longer has its
/// default effect); says so on stderr when it cannot.
#[cfg(unix)]
fn listen_for(
    kind: tokio::signal::unix::SignalKind,
    name: &str,
) -> Option<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(kind)
        .map_err(|e| eprintln!("linger: cannot listen for {name}: {e}"))
        .ok()
}

/// SIGHUP, listened for from before the server starts (its default
/// action would end the process): each one reloads the configuration.
struct ReloadSignal {
    #[cfg(unix)]
    stream: Option<tokio::signal::unix::Signal>,
}

impl ReloadSignal {
    fn install() -> ReloadSignal {
        #[cfg(unix)]
        {
            let kind = tokio::signal::unix::SignalKind::hangup();
            ReloadSignal {
                stream: listen_for(kind, "SIGHUP"),
            }
        }
        #[cfg(not(unix))]
        ReloadSignal {}
    }

    /// Reloads at each signal, for as long as the process runs. Errors are
    /// logged by the reloader (a bad file changes nothing).
    fn serve(self, reloader: Arc<Reloader>) {
        #[cfg(unix)]
        if let Some(mut stream) = self.stream {
            tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    let _ = reloader.reload(Trigger::Signal).await;
                }
            });
        }
        #[cfg(not(unix))]
        let _ = reloader;
    }
}

/// SIGTERM and Ctrl-C, listened for from before the server starts: a
/// signal that came while it was starting would otherwise kill the process
/// the default way, with no graceful shutdown at all.
struct ShutdownSignals {
    #[cfg(unix)]
    streams: Vec<tokio::signal::unix::Signal>,
}

impl ShutdownSignals {
    fn install() -> ShutdownSignals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::SignalKind;
            let streams = [
                (SignalKind::terminate(), "SIGTERM"),
                (SignalKind::interrupt(), "SIGINT"),
            ]
            .into_iter()
            .filter_map(|(kind, name)| listen_for(kind, name))
            .collect();
            ShutdownSignals { streams }
        }
        #[cfg(not(unix))]
        ShutdownSignals {}
    }

    async fn wait(self) {
        #[cfg(unix)]
        {
            let mut streams = self.streams;
            if streams.is_empty() {
                return std::future::pending().await;
            }
            let any = streams.iter_mut().map(|s| Box::pin(s.recv()));
            futures_util::future::select_all(any).await;
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// A client command's end: its error on stderr and exit status 1.
fn client(result: anyhow::Result<()>) -> anyhow::Result<()> {
    if let Err(e) = result {
        eprintln!("linger: {e:#}");
        std::process::exit(1);
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    allocator::tune();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let config_path = match cli.command {
        Some(Command::Bench(args)) => return linger_bench::run(args).await,
        Some(Command::Serve(args)) => args.config,
        Some(Command::New(args)) => return client(cli::new::run(args).await),
        Some(Command::Ls(args)) => return client(cli::ls::run(args).await),
        Some(Command::Send(args)) => return client(cli::send::run(args).await),
        Some(Command::Attach(args)) => return client(cli::attach::run(args).await),
        Some(Command::Ps(args)) => return client(cli::ps::run(args).await),
        Some(Command::Top(args)) => return client(cli::top::run(args).await),
        Some(Command::Reload(args)) => return client(cli::reload::run(args).await),
        None => cli.serve.config,
    };
    let config = match Config::load(config_path.as_deref()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("linger: bad configuration:\n{e}");
            std::process::exit(2);
        }
    };
    let (logging, log_flush) = linger::logging::init(&config.log);
    let signals = ShutdownSignals::install();
    let reload_signal = ReloadSignal::install();
    let setup = Setup {
        source: ConfigSource::File(config_path),
        logging: Some(logging),
    };
    let server = match Server::start_setup(config, setup, |store| store).await {
        Ok(server) => server,
        Err(e) => {
            // What was logged on the way to the failure comes first.
            drop(log_flush);
            eprintln!("linger: cannot start: {e}");
            std::process::exit(1);
        }
    };
    reload_signal.serve(server.reloader());
    signals.wait().await;
    server.shutdown().await;
    drop(log_flush);
    Ok(())
}

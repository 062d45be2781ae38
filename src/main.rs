//! The `linger` binary: `linger serve [--config PATH]`, and the terminal
//! client (`new`, `ls`, `send`, `attach`, in `src/cli/`).

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use linger::config::{Config, LogFormat};
use linger::server::Server;
use tracing_subscriber::EnvFilter;

mod bench;
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
    /// Drive a server with load over loopback websockets and report
    /// throughput, latency, CPU and memory (see BENCHMARKS.md).
    Bench(bench::BenchArgs),
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_env("LINGER_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Pretty => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init(),
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
            use tokio::signal::unix::{signal, SignalKind};
            let mut streams = Vec::new();
            for (kind, name) in [
                (SignalKind::terminate(), "SIGTERM"),
                (SignalKind::interrupt(), "SIGINT"),
            ] {
                match signal(kind) {
                    Ok(stream) => streams.push(stream),
                    Err(e) => eprintln!("linger: cannot listen for {name}: {e}"),
                }
            }
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let config_path = match cli.command {
        Some(Command::Bench(args)) => return bench::run(args).await,
        Some(Command::Serve(args)) => args.config,
        Some(Command::New(args)) => return client(cli::new::run(args).await),
        Some(Command::Ls(args)) => return client(cli::ls::run(args).await),
        Some(Command::Send(args)) => return client(cli::send::run(args).await),
        Some(Command::Attach(args)) => return client(cli::attach::run(args).await),
        None => cli.serve.config,
    };
    let config = match Config::load(config_path.as_deref()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("linger: bad configuration:\n{e}");
            std::process::exit(2);
        }
    };
    init_logging(config.log.format);
    let signals = ShutdownSignals::install();
    let server = match Server::start(config).await {
        Ok(server) => server,
        Err(e) => {
            eprintln!("linger: cannot start: {e}");
            std::process::exit(1);
        }
    };
    signals.wait().await;
    server.shutdown().await;
    Ok(())
}

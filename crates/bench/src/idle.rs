//! Idle scale: K connections, then one idle conversation created on each
//! (so attached in control mode). What it reports: the server's resident
//! memory per open connection and per idle active conversation (with its
//! attachment and the two events it starts with), from VmRSS after each
//! step settles, and its CPU time while everything sits idle.

use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use clap::Args;
use serde_json::json;
use tokio::sync::{mpsc, watch, Semaphore};

use super::client::Client;
use super::{collect_ready, join_all, progress, Aim, Common, Measure, ProcStats, Report, Target};

#[derive(Args, Debug, Clone)]
pub struct IdleArgs {
    /// Connections, and conversations (one per connection, each its own user).
    #[arg(long, short = 'k', default_value_t = 10_000)]
    pub conversations: usize,
    /// Seconds to let the server settle before reading its memory.
    #[arg(long, default_value_t = 2.0)]
    pub settle: f64,
}

impl IdleArgs {
    pub fn default_args() -> IdleArgs {
        IdleArgs {
            conversations: 10_000,
            settle: 2.0,
        }
    }
}

const CREATE: u8 = 1;
const DONE: u8 = 2;

pub async fn run(common: &Common, args: &IdleArgs) -> anyhow::Result<Report> {
    let params = json!({ "conversations": args.conversations, "settle_s": args.settle });
    let runs = super::against_each(common, &[], |target| async move {
        let measures = run_one(&target, common, args).await?;
        Ok((target, measures))
    })
    .await?;
    Ok(Report {
        scenario: "idle".into(),
        params,
        runs,
    })
}

async fn run_one(
    target: &Target,
    common: &Common,
    args: &IdleArgs,
) -> anyhow::Result<Vec<Measure>> {
    let Some(_) = target.stats() else {
        bail!("the idle scenario reads the server's memory: give --server-pid or --spawn");
    };
    let k = args.conversations;
    let settle = Duration::from_secs_f64(args.settle);
    // Warm up: one conversation streams and goes, so that thread pools,
    // the store and the allocator are past their first use.
    let mut warm = Client::connect(&target.url, "warmup").await?;
    let (id, _) = warm.create(super::SETUP_TIMEOUT).await?;
    warm.message(&id, "/stream 50 0").await?;
    for _ in 0..128 {
        let text = warm.recv(super::SETUP_TIMEOUT).await?;
        if text.as_str().contains(r#""kind":"turn_finished""#) {
            break;
        }
    }
    warm.close().await;
    tokio::time::sleep(settle).await;
    let base = target.stats().unwrap_or_default();

    let (connected_tx, mut connected_rx) = mpsc::unbounded_channel();
    let (created_tx, mut created_rx) = mpsc::unbounded_channel();
    let (phase_tx, phase_rx) = watch::channel(0u8);
    let connecting = Arc::new(Semaphore::new(common.connect_concurrency.max(1)));
    let mut tasks = Vec::with_capacity(k);
    for i in 0..k {
        tasks.push(tokio::spawn(hold(
            target.url.clone(),
            format!("u{i}"),
            connecting.clone(),
            connected_tx.clone(),
            created_tx.clone(),
            phase_rx.clone(),
        )));
    }
    drop((connected_tx, created_tx));
    let within = Duration::from_secs(60) + Duration::from_millis(10 * k as u64);
    let (connected, error) = collect_ready(
        &mut connected_rx,
        k,
        within,
        &progress(k as u64, "connecting"),
    )
    .await;
    if let Some(e) = &error {
        eprintln!("{} of {k} connections failed; first: {e}", k - connected);
    }
    tokio::time::sleep(settle).await;
    let with_connections = target.stats().unwrap_or_default();

    let _ = phase_tx.send(CREATE);
    let (created, error) = collect_ready(
        &mut created_rx,
        connected,
        within,
        &progress(connected as u64, "creating"),
    )
    .await;
    if let Some(e) = &error {
        eprintln!(
            "{} of {connected} creates failed; first: {e}",
            connected - created
        );
    }
    tokio::time::sleep(settle).await;
    let with_conversations = target.stats().unwrap_or_default();
    tokio::time::sleep(settle).await;
    let later = target.stats().unwrap_or_default();
    let _ = phase_tx.send(DONE);
    join_all(tasks, Duration::from_secs(60)).await;

    let kib_each = |after: ProcStats, before: ProcStats, n: usize| {
        (after.rss_kib as f64 - before.rss_kib as f64) / n.max(1) as f64
    };
    Ok(vec![
        Measure::new("connections open", "", connected as f64).aim(Aim::AtLeast(k as f64)),
        Measure::new("idle conversations attached", "", created as f64).aim(Aim::AtLeast(k as f64)),
        Measure::new(
            "RSS at start (warmed up)",
            "MiB",
            base.rss_kib as f64 / 1024.0,
        ),
        Measure::new(
            "RSS per connection",
            "KiB",
            kib_each(with_connections, base, connected),
        )
        .aim(Aim::AtMost(12.0)),
        Measure::new(
            "RSS per idle conversation",
            "KiB",
            kib_each(with_conversations, with_connections, created),
        )
        .aim(Aim::AtMost(10.0)),
        Measure::new(
            "RSS with everything",
            "MiB",
            with_conversations.rss_kib as f64 / 1024.0,
        ),
        Measure::new(
            "CPU while idle",
            "ms/s",
            (later.cpu_secs - with_conversations.cpu_secs) * 1000.0 / settle.as_secs_f64(),
        ),
    ])
}

async fn hold(
    url: String,
    user: String,
    connecting: Arc<Semaphore>,
    connected: mpsc::UnboundedSender<Result<(), String>>,
    created: mpsc::UnboundedSender<Result<(), String>>,
    mut phase: watch::Receiver<u8>,
) {
    let client = async {
        let _permit = connecting.acquire().await?;
        Client::connect(&url, &user).await
    };
    let mut client = match client.await {
        Ok(c) => {
            let _ = connected.send(Ok(()));
            c
        }
        Err(e) => {
            let _ = connected.send(Err(format!("{e:#}")));
            return;
        }
    };
    if phase.wait_for(|p| *p >= CREATE).await.is_err() || *phase.borrow() >= DONE {
        return;
    }
    let create = async {
        let _permit = connecting.acquire().await?;
        client.create(super::SETUP_TIMEOUT).await
    };
    let _ = created.send(
        create
            .await
            .map(|_| ())
            .map_err(|e| format!("{user}: {e:#}")),
    );
    let _ = phase.wait_for(|p| *p >= DONE).await;
    client.close().await;
}

//! Cluster: three `linger serve` nodes (`cluster.mode = "nats"`,
//! `cluster.replicas = 3`, node ids `bench-node-0..2`, temporary store
//! directories, free ports) sharing a 3-server NATS JetStream cluster, all
//! spawned by the bench, whatever `--spawn` says. Two parts, each on a
//! fresh cluster:
//!
//! - **Streaming across nodes**: the streaming scenario with conversation
//!   `i` created on node `i % 3` (which then owns and runs it) and streamed
//!   (`attach`, `message`, every event) through node `(i + 1) % 3` by a
//!   second connection of the same user, so that every frame crosses from
//!   the owner to the socket's node over NATS (`--same-node` streams each
//!   through its owner instead, to isolate that hop). Beside it, in the same
//!   invocation, the same run against a single `linger serve` (SQLite) and
//!   the relay. Server CPU and peak RSS are the three nodes' summed; the
//!   NATS servers' are reported on their own rows.
//! - **Takeover** ([`super::takeover`]): one node owns N conversations and
//!   is killed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde_json::json;

use super::nats::Nats;
use super::streaming::{self, Placement, StreamingArgs};
use super::takeover::{self, TakeoverArgs};
use super::{Aim, Common, Measure, Report, Server, Target};

/// Nodes, and NATS servers (`cluster.replicas` = this).
const NODES: usize = 3;

#[derive(Args, Debug, Clone)]
pub struct ClusterArgs {
    #[command(flatten)]
    pub streaming: StreamingArgs,
    #[command(flatten)]
    pub takeover: TakeoverArgs,
    /// `cluster.lease_ttl` of every node.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    /// The nats-server binary (2.11 or later); by default the one
    /// `scripts/install-nats-server.sh` finds or installs.
    #[arg(long, value_name = "PATH")]
    pub nats_server: Option<PathBuf>,
    /// Stream each conversation through the node that owns it (no
    /// forwarding between nodes): isolates what the forwarding costs.
    #[arg(long)]
    pub same_node: bool,
    /// Run one part only.
    #[arg(long, value_enum)]
    pub only: Option<Part>,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Streaming,
    Takeover,
}

/// A NATS JetStream cluster and the linger nodes sharing it.
pub(crate) struct Cluster {
    pub nats: Nats,
    pub nodes: Vec<Target>,
    pub lease_ttl: Duration,
}

impl Cluster {
    /// Starts 3 NATS servers, waits for JetStream, then starts 3 nodes one
    /// after the other (each waited for until it listens).
    pub async fn start(
        common: &Common,
        nats_bin: &Path,
        lease_ttl: Duration,
    ) -> anyhow::Result<Cluster> {
        let nats = Nats::start(nats_bin, NODES).await?;
        let urls = nats
            .urls()
            .iter()
            .map(|u| format!("{u:?}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Cluster {
            nats,
            nodes: Vec::with_capacity(NODES),
            lease_ttl,
        };
        for i in 0..NODES {
            let overrides = [
                ("cluster.mode", "nats".to_owned()),
                ("cluster.nats_urls", format!("[{urls}]")),
                ("cluster.node_id", format!("bench-node-{i}")),
                ("cluster.replicas", NODES.to_string()),
                (
                    "cluster.lease_ttl",
                    humantime::format_duration(lease_ttl).to_string(),
                ),
            ];
            match Target::spawn(Server::Cluster, common, &overrides).await {
                Ok(node) => cluster.nodes.push(node),
                Err(e) => {
                    cluster.stop().await;
                    return Err(e.context(format!("starting cluster node {i}")));
                }
            }
        }
        let at: Vec<&str> = cluster.nodes.iter().map(|n| n.url.as_str()).collect();
        eprintln!(
            "── cluster: {NODES} nodes at {}, NATS at {}",
            at.join(" "),
            cluster.nats.urls().join(" ")
        );
        Ok(cluster)
    }

    /// The nodes' process ids (the killed one's is gone).
    pub fn node_pids(&self) -> Vec<u32> {
        self.nodes.iter().filter_map(|n| n.pid).collect()
    }

    pub async fn stop(self) {
        for node in self.nodes {
            node.stop().await;
        }
        self.nats.stop().await;
    }
}

/// Runs `linger bench cluster`: one report per part.
pub async fn run(common: &Common, args: &ClusterArgs) -> anyhow::Result<Vec<Report>> {
    let nats_bin = super::nats::locate(args.nats_server.as_deref()).await?;
    let mut reports = Vec::new();
    if args.only != Some(Part::Takeover) {
        reports.push(streaming_across(common, args, &nats_bin).await?);
    }
    if args.only != Some(Part::Streaming) {
        let mut cluster = Cluster::start(common, &nats_bin, args.lease_ttl).await?;
        let report = takeover::run(common, &args.takeover, &mut cluster).await;
        cluster.stop().await;
        reports.push(report?);
    }
    Ok(reports)
}

async fn streaming_across(
    common: &Common,
    args: &ClusterArgs,
    nats_bin: &Path,
) -> anyhow::Result<Report> {
    let s = &args.streaming;
    let offered = s.conversations as f64 * s.rate;
    let params = json!({
        "conversations": s.conversations,
        "tokens": s.tokens,
        "rate_per_conversation": s.rate,
        "burst": s.burst,
        "offered_events_per_s": offered,
        "nodes": NODES,
        "nats_servers": NODES,
        "replicas": NODES,
        "lease_ttl": humantime::format_duration(args.lease_ttl).to_string(),
        "placement": if args.same_node {
            "conversation i created on node i%3 and streamed through it"
        } else {
            "conversation i created on node i%3, streamed through node (i+1)%3"
        },
    });

    let cluster = Cluster::start(common, nats_bin, args.lease_ttl).await?;
    let placement = Placement {
        urls: cluster.nodes.iter().map(|n| n.url.clone()).collect(),
        across: !args.same_node,
        pids: cluster.node_pids(),
        helpers: vec![("NATS", cluster.nats.pids())],
    };
    let measured = streaming::run_on(&placement, common, s).await;
    cluster.stop().await;
    let measures = measured?
        .into_iter()
        .map(|m| cluster_aim(m, offered))
        .collect();

    // The same run against one linger (SQLite) and the relay.
    let spawned = Common {
        spawn: true,
        ..common.clone()
    };
    let spawned = &spawned;
    let others = super::against_each(spawned, &[], |target| async move {
        let measures = streaming::run_one(&target, spawned, s).await?;
        Ok((target, measures))
    })
    .await?;
    let mut runs = vec![(Server::Cluster, measures)];
    runs.extend(others);
    Ok(Report {
        scenario: "cluster streaming".into(),
        params,
        runs,
    })
}

/// The aims a cluster's streaming figures are held to: p99 under 100 ms
/// with the offered load delivered (95 % of it: streams start over one
/// interval and end unevenly); seq checks as ever. The single server's
/// aims against the relay do not apply to three nodes.
fn cluster_aim(m: Measure, offered: f64) -> Measure {
    let aim = match m.name.as_str() {
        "latency p99" => Some(Aim::AtMost(100.0)),
        "delivered" if offered > 0.0 => Some(Aim::AtLeast(offered * 0.95)),
        "delivered" | "server CPU per 100k events" => None,
        _ => m.aim,
    };
    Measure { aim, ..m }
}

//! This node's part in a cluster: the NATS connection, the store over
//! JetStream, its heartbeat and ownership records, and the background work
//! that goes with them (the heartbeat, watching records and other nodes,
//! serving other nodes, closing a lost node's conversations).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use ractor::ActorRef;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::lease::Leases;
use super::liveness::{Departure, Liveness};
use super::ownership::Ownership;
use super::remote::host::Host;
use super::remote::Subjects;
use super::store::NatsStore;
use super::{connect, ClusterError, ClusterOptions};
use crate::actors::supervisor::SupervisorMsg;
use crate::config::{Config, LiveConfig};
use crate::protocol::Status;
use crate::store::Store;

pub struct ClusterNode {
    pub node: String,
    pub client: async_nats::Client,
    pub subjects: Subjects,
    pub store: NatsStore,
    pub ownership: Ownership,
    pub server_version: String,
}

impl ClusterNode {
    /// Connects to NATS (refusing a server older than 2.11) and opens the
    /// stream and buckets. `cluster.node_id`, or a new id when it is empty.
    pub async fn start(config: &Config) -> Result<ClusterNode, ClusterError> {
        let node = if config.cluster.node_id.is_empty() {
            format!("n{}", ulid::Ulid::new().to_string().to_ascii_lowercase())
        } else {
            config.cluster.node_id.clone()
        };
        let options = ClusterOptions::from_config(&config.cluster, config.store.retain);
        let subjects = Subjects::new(&options.prefix);
        let cluster = connect(&config.cluster.nats_urls, options).await?;
        let store = NatsStore::open(&cluster, &node).await?;
        let liveness = Liveness::open(&cluster, &node).await?;
        let leases = Leases::open(&cluster, liveness).await?;
        let ownership = Ownership::new(leases, store.clone(), config.cluster.lease_ttl);
        ownership.announce().await?;
        info!(node = %node, nats = %cluster.server_version, "cluster mode: joined");
        Ok(ClusterNode {
            node,
            client: cluster.client.clone(),
            subjects,
            store,
            ownership,
            server_version: cluster.server_version.clone(),
        })
    }

    /// Starts the background work once the supervisor runs; the handles
    /// are aborted at shutdown.
    pub fn run(
        self: &Arc<Self>,
        supervisor: ActorRef<SupervisorMsg>,
        config: LiveConfig,
        next_connection: Arc<AtomicU64>,
    ) -> Vec<JoinHandle<()>> {
        let (lost_tx, mut lost_rx) = tokio::sync::mpsc::unbounded_channel();
        let keep_alive = tokio::spawn(self.ownership.clone().keep_alive(lost_tx.clone()));
        let records = tokio::spawn(self.ownership.clone().watch_records(lost_tx));
        let sup = supervisor.clone();
        let lost = tokio::spawn(async move {
            while let Some(id) = lost_rx.recv().await {
                let _ = sup.cast(SupervisorMsg::LeaseLost { id });
            }
        });
        let host = Host::new(
            self.client.clone(),
            self.subjects.clone(),
            self.node.clone(),
            supervisor.clone(),
            config.clone(),
            next_connection,
        );
        let serve = tokio::spawn(host.serve());
        let orphans = tokio::spawn(watch_orphans(
            self.clone(),
            supervisor,
            config.get().cluster.lease_ttl,
        ));
        vec![keep_alive, records, lost, serve, orphans]
    }
}

/// Finds conversations whose owner is gone: those of each node whose
/// heartbeat departs, as it happens (spread over the survivors, see
/// [`Ownership::orphans`]), and a scan of every conversation stored as
/// active whose record nobody live holds, at start and then every
/// [`SCAN_EVERY_TTLS`] `lease_ttl`s (departures missed while NATS was
/// unreachable, or before this node started). Each is handed to the
/// supervisor (`Recover`), which claims it; only one node wins.
async fn watch_orphans(node: Arc<ClusterNode>, supervisor: ActorRef<SupervisorMsg>, ttl: Duration) {
    let (departed_tx, mut departed) = tokio::sync::mpsc::unbounded_channel();
    let liveness = node.ownership.leases().liveness().clone();
    let watcher = tokio::spawn(async move {
        loop {
            let error = liveness.watch(&departed_tx).await;
            warn!(error = %error, "watching node heartbeats failed; watching again");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let on_departure = {
        let node = node.clone();
        let supervisor = supervisor.clone();
        tokio::spawn(async move {
            while let Some(departure) = departed.recv().await {
                recover_departed(&node, &supervisor, departure, ttl);
            }
        })
    };
    let mut ticker = tokio::time::interval((ttl * SCAN_EVERY_TTLS).max(Duration::from_secs(5)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if watcher.is_finished() || on_departure.is_finished() {
            return;
        }
        let unfinished = match node.store.unfinished().await {
            Ok(u) => u,
            Err(e) => {
                warn!(error = %e, "scanning for conversations of lost nodes failed");
                continue;
            }
        };
        for meta in unfinished {
            if meta.status == Status::Stopped || node.ownership.owns(&meta.id) {
                continue;
            }
            if let Ok(None) = node.ownership.leases().holder(&meta.id).await {
                let _ = supervisor.cast(SupervisorMsg::Recover { id: meta.id });
            }
        }
    }
}

/// The scan for orphans runs every this many `lease_ttl`s: departures are
/// seen as they happen, so the scan is only the safety net.
const SCAN_EVERY_TTLS: u32 = 6;

/// Hands a departed node's conversations to the supervisor: this node's
/// share at once, the others' after half a `lease_ttl` if still orphaned.
fn recover_departed(
    node: &Arc<ClusterNode>,
    supervisor: &ActorRef<SupervisorMsg>,
    departure: Departure,
    ttl: Duration,
) {
    let (mine, later) = node.ownership.orphans(&departure);
    info!(departed = %departure.node, here = mine.len(), elsewhere = later.len(),
        "a node departed: closing its conversations");
    for id in mine {
        let _ = supervisor.cast(SupervisorMsg::Recover { id });
    }
    if later.is_empty() {
        return;
    }
    let node = node.clone();
    let supervisor = supervisor.clone();
    tokio::spawn(async move {
        tokio::time::sleep(ttl / 2).await;
        for id in node.ownership.still_orphaned(&departure, later) {
            let _ = supervisor.cast(SupervisorMsg::Recover { id });
        }
    });
}

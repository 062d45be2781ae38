//! This node's part in a cluster: the NATS connection, the store over
//! JetStream, its leases, and the background work that goes with them
//! (renewing leases, serving other nodes, closing a lost node's
//! conversations).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use ractor::ActorRef;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::lease::Leases;
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
        let leases = Leases::open(&cluster, &node).await?;
        let ownership = Ownership::new(leases, store.clone(), config.cluster.lease_ttl);
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
        let keep_alive = tokio::spawn(self.ownership.clone().keep_alive(lost_tx));
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
        vec![keep_alive, lost, serve, orphans]
    }
}

/// Finds conversations whose owner is gone: each lease expiry as it
/// happens, and a scan of every conversation stored as active whose lease
/// nobody holds, at start and every `lease_ttl` (expiries missed while
/// NATS was unreachable, or before this node started). Each is handed to
/// the supervisor (`Recover`), which claims it; only one node wins.
async fn watch_orphans(node: Arc<ClusterNode>, supervisor: ActorRef<SupervisorMsg>, ttl: Duration) {
    let watch_node = node.clone();
    let watch_sup = supervisor.clone();
    let watcher = tokio::spawn(async move {
        loop {
            match watch_node.ownership.leases().expiries().await {
                Ok(expiries) => {
                    let mut expiries = std::pin::pin!(expiries);
                    while let Some(id) = expiries.next().await {
                        info!(conversation = %id, "a lease expired: its node may be lost");
                        let _ = watch_sup.cast(SupervisorMsg::Recover { id });
                    }
                }
                Err(e) => warn!(error = %e, "watching lease expiries failed; retrying"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let mut ticker = tokio::time::interval(ttl.max(Duration::from_secs(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if watcher.is_finished() {
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

//! Starting and stopping a server: open the store, recover, spawn the
//! supervisor, serve HTTP, and the graceful shutdown of protocol §6.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::actors::supervision_log::SupervisionLog;
use crate::actors::supervisor::{Supervisor, SupervisorArgs, SupervisorMsg};
use crate::agent::command::CommandAgent;
use crate::agent::demo::DemoAgent;
use crate::agent::Agent;
use crate::cluster::node::ClusterNode;
use crate::config::{AgentKind, ClusterMode, Config, ConfigOwner, LiveConfig};
use crate::gateway::auth::Authenticator;
use crate::gateway::{self, AppState};
use crate::logging::LogControl;
use crate::reload::{ConfigSource, Reloader};
use crate::store::lock::StoreLock;
use crate::store::sqlite::SqliteStore;
use crate::store::Store;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Lock(#[from] crate::store::lock::LockError),
    #[error("store at {path}: {source}")]
    Store {
        path: String,
        source: crate::store::StoreError,
    },
    #[error(
        "cannot listen on {addr}: {source}{hint}",
        hint = listen_hint(.source)
    )]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Agent(String),
    #[error("{0}")]
    Auth(String),
    #[error("supervisor: {0}")]
    Supervisor(String),
    #[error("cluster mode: {0}")]
    Cluster(#[from] crate::cluster::ClusterError),
}

/// What to do about a port that is taken.
fn listen_hint(error: &std::io::Error) -> &'static str {
    if error.kind() == std::io::ErrorKind::AddrInUse {
        "; another program has this port: choose another with server.listen \
         (LINGER__SERVER__LISTEN=127.0.0.1:7421, or port 0 for any free one)"
    } else {
        ""
    }
}

/// Connections the kernel may hold before they are accepted. tokio's
/// default is 1024: when thousands of clients reconnect at once (a network
/// blip), the rest of their SYNs were dropped and retried only after 1, 3
/// and 7 seconds. The kernel caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 8192;

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restart may reuse the port at once.
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// How a server was set up beyond its configuration: what a reload
/// re-reads, and the logging a reload may change.
#[derive(Default)]
pub struct Setup {
    pub source: ConfigSource,
    /// `None`: the embedding program owns logging; `log.*` keys are then
    /// refused at a reload.
    pub logging: Option<Arc<dyn LogControl>>,
}

/// A running server.
pub struct Server {
    pub addr: SocketAddr,
    config: LiveConfig,
    reloader: Arc<Reloader>,
    store: Arc<dyn Store>,
    supervisor: ActorRef<SupervisorMsg>,
    accept_stop: CancellationToken,
    sockets_stop: CancellationToken,
    /// The upgraded sockets' tasks, waited for at shutdown.
    sockets: TaskTracker,
    http: JoinHandle<()>,
    prune: JoinHandle<()>,
    probe: JoinHandle<()>,
    agent: Arc<dyn Agent>,
    /// Cluster mode: lease renewal, serving other nodes, the watch for lost
    /// nodes' conversations; they run until the conversations are stopped.
    cluster_tasks: Vec<JoinHandle<()>>,
    cluster: Option<Arc<ClusterNode>>,
    /// Held until the process exits: the store is this server's alone.
    /// (Cluster mode: none; `store.path` holds only workspaces, which nodes
    /// may share.)
    _lock: Option<StoreLock>,
}

/// Deletes history older than `store.retain`, now and then, in the
/// background. Replays that reach into pruned history say
/// `replay_incomplete`.
async fn prune_loop(store: Arc<dyn Store>, retain: Duration) {
    let every = (retain / 4).clamp(Duration::from_secs(1), Duration::from_secs(3600));
    let mut ticker = tokio::time::interval(every);
    loop {
        ticker.tick().await;
        let Some(before) = std::time::SystemTime::now().checked_sub(retain) else {
            continue;
        };
        match store.prune(before).await {
            Ok(0) => {}
            Ok(deleted) => {
                info!(deleted, retain = %humantime::format_duration(retain), "pruned old history")
            }
            Err(e) => warn!(error = %e, "pruning old history failed"),
        }
    }
}

/// While the store cannot write, probes it now and then so that its health
/// (and `/healthz`) turns good again by itself once space is freed, even if
/// no conversation tries to write.
async fn probe_loop(store: Arc<dyn Store>) {
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if store.health().is_err() {
            let _ = store.probe().await;
        }
    }
}

fn build_agent(config: &Config) -> Result<Arc<dyn Agent>, StartError> {
    match config.agent.kind {
        AgentKind::Demo => Ok(Arc::new(DemoAgent)),
        AgentKind::Command => match CommandAgent::new(config.agent.command.clone()) {
            Ok(agent) => Ok(Arc::new(agent.hide_env(&config.auth.jwt_secret_env))),
            Err(e) => Err(StartError::Agent(e.to_string())),
        },
    }
}

impl Server {
    pub async fn start(config: Config) -> Result<Server, StartError> {
        Server::start_with_store(config, |store| store).await
    }

    /// [`Server::start`] with the opened store wrapped by `wrap` (a test
    /// injects store faults this way).
    pub async fn start_with_store(
        config: Config,
        wrap: impl FnOnce(Arc<dyn Store>) -> Arc<dyn Store>,
    ) -> Result<Server, StartError> {
        Server::start_setup(config, Setup::default(), wrap).await
    }

    /// [`Server::start_with_store`] with what a reload re-reads and may
    /// change (`linger serve`: the config file and the process's logging).
    pub async fn start_setup(
        config: Config,
        setup: Setup,
        wrap: impl FnOnce(Arc<dyn Store>) -> Arc<dyn Store>,
    ) -> Result<Server, StartError> {
        let owner = ConfigOwner::new(config);
        let live = owner.subscribe();
        // The values used once at start; everything read later goes
        // through `live`.
        let config = owner.current();
        // Install the recorder before anything counts.
        crate::metrics::handle();
        let path = config.store.path.clone();
        // The store is ours before anything in it is read or written, and
        // the port before recovery writes a word: a second server on this
        // store, or on a taken port, changes nothing.
        let cluster_mode = config.cluster.mode == ClusterMode::Nats;
        let mut lock = if cluster_mode {
            std::fs::create_dir_all(&path).map_err(|e| StartError::Store {
                path: path.display().to_string(),
                source: crate::store::StoreError::Unavailable(e.to_string()),
            })?;
            None
        } else {
            Some(StoreLock::acquire(&path)?)
        };
        let listener = listen(config.server.listen).map_err(|source| StartError::Listen {
            addr: config.server.listen,
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| StartError::Listen {
            addr: config.server.listen,
            source,
        })?;
        if let Some(lock) = lock.as_mut() {
            if let Err(e) = lock.describe_holder(Some(addr)) {
                warn!(error = %e, lock = %lock.path().display(), "cannot write the store lock's holder");
            }
        }
        let store_err = |source| StartError::Store {
            path: path.display().to_string(),
            source,
        };
        let cluster = if cluster_mode {
            Some(Arc::new(ClusterNode::start(&config).await?))
        } else {
            None
        };
        let store: Arc<dyn Store> = match &cluster {
            // A lost node's conversations are closed by whichever node
            // claims them (`node_lost`), not by a start-up pass here.
            Some(node) => wrap(Arc::new(node.store.clone())),
            None => {
                let store = wrap(Arc::new(SqliteStore::open(&path).map_err(store_err)?));
                let recovered = crate::recovery::recover(&store).await.map_err(store_err)?;
                if recovered > 0 {
                    info!(
                        recovered,
                        "closed conversations interrupted by the last stop"
                    );
                }
                store
            }
        };
        let prune = tokio::spawn(prune_loop(store.clone(), config.store.retain));
        let probe = tokio::spawn(probe_loop(store.clone()));
        let agent = build_agent(&config)?;
        let auth = Authenticator::from_config(&config.auth).map_err(StartError::Auth)?;
        let decisions = Arc::new(SupervisionLog::default());
        let (supervisor, _) = Actor::spawn(
            None,
            Supervisor,
            SupervisorArgs {
                config: live.clone(),
                decisions: decisions.clone(),
                store: store.clone(),
                agent: agent.clone(),
                cluster: cluster.clone(),
            },
        )
        .await
        .map_err(|e| StartError::Supervisor(e.to_string()))?;
        let next_connection = Arc::new(AtomicU64::new(1));
        let cluster_tasks = match &cluster {
            Some(node) => node.run(supervisor.clone(), live.clone(), next_connection.clone()),
            None => Vec::new(),
        };

        let accept_stop = CancellationToken::new();
        let sockets_stop = CancellationToken::new();
        let sockets = TaskTracker::new();
        let reloader = Arc::new(Reloader::new(
            setup.source,
            owner,
            supervisor.clone(),
            decisions.clone(),
            setup.logging,
        ));
        let app = gateway::router(AppState {
            config: live.clone(),
            store: store.clone(),
            supervisor: supervisor.clone(),
            shutdown: sockets_stop.clone(),
            sockets: sockets.clone(),
            next_connection,
            cluster: cluster.clone(),
            connections: Default::default(),
            auth: Arc::new(auth),
            decisions,
            reloader: reloader.clone(),
        });
        let stop = accept_stop.clone();
        let http = tokio::spawn(async move {
            // Events are small frames written one by one: without
            // TCP_NODELAY, Nagle holds each write behind the client's
            // delayed ACK (up to 40 ms on Linux).
            let listener = listener.tap_io(|tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    debug!(error = %e, "cannot set TCP_NODELAY");
                }
            });
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
            if let Err(e) = served {
                warn!(error = %e, "http server failed");
            }
        });
        info!("listening on {addr}");
        Ok(Server {
            addr,
            config: live,
            reloader,
            store,
            supervisor,
            accept_stop,
            sockets_stop,
            sockets,
            http,
            prune,
            probe,
            agent,
            cluster_tasks,
            cluster,
            _lock: lock,
        })
    }

    /// Changes the running configuration (SIGHUP, tests).
    pub fn reloader(&self) -> Arc<Reloader> {
        self.reloader.clone()
    }

    /// Graceful shutdown (protocol §6), bounded by `server.shutdown_grace`.
    pub async fn shutdown(self) {
        let grace = self.config.get().server.shutdown_grace;
        info!(grace = %humantime::format_duration(grace), "shutting down");
        let steps = async {
            // Stop accepting; upgraded websockets are not covered by this.
            self.accept_stop.cancel();
            // Running turns end interrupted, agent_stopped shutdown is
            // recorded and every attached connection gets detached shutdown.
            let stopped = self
                .supervisor
                .call(|reply| SupervisorMsg::Shutdown { reply }, Some(grace))
                .await;
            if !matches!(stopped, Ok(CallResult::Success(()))) {
                warn!("not every conversation stopped in time");
            }
            // Other nodes may claim what ran here at once, not after
            // lease_ttl.
            if let Some(cluster) = &self.cluster {
                cluster.ownership.returned().await;
            }
            // Close every socket with 1001 once what is queued is sent, and
            // wait until each close frame is out (or its client gone):
            // exiting first would cut the sockets without one.
            self.sockets_stop.cancel();
            self.sockets.close();
            let sockets_closed = self.sockets.wait();
            // Agent processes get end of input, then SIGTERM, before we go.
            let drained = async {
                self.agent.drained().await;
                if let Err(e) = self.store.flush().await {
                    warn!(error = %e, "flushing the store failed");
                }
            };
            tokio::join!(sockets_closed, drained);
        };
        if tokio::time::timeout(grace, steps).await.is_err() {
            warn!("shutdown grace ran out");
        }
        self.sockets_stop.cancel();
        self.prune.abort();
        self.probe.abort();
        for task in &self.cluster_tasks {
            task.abort();
        }
        self.supervisor.stop(None);
        let _ = tokio::time::timeout(Duration::from_secs(2), self.http).await;
        info!("shutdown complete");
    }
}

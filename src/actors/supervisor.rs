//! The supervisor: the only place that knows which conversations are active
//! and whose they are. It creates and activates conversations (checking
//! ownership and enforcing the per-user limit first), stops them (idle close,
//! user limit, close, delete, shutdown), and logs every start, stop and
//! failure of its conversation actors as a supervision line; each decision
//! also goes to the in-memory ring operators read ([`SupervisionLog`]).
//!
//! Activating a stopped conversation reads its snapshot in a task that
//! reports back (`Loaded`), so the supervisor never waits on the store.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use serde_json::json;
use tracing::{error, info, warn};

use super::active_view::{self, ActiveConversation};
use super::conversation::{Conversation, ConversationArgs, ConversationMsg, Origin};
use super::eviction::{self, Candidate};
use super::gauge::ConversationGauge;
use super::supervision_log::{NewDecision, SupervisionLog};
use crate::agent::Agent;
use crate::cluster::lease::Activity;
use crate::cluster::node::ClusterNode;
use crate::cluster::ownership::Claim;
use crate::cluster::remote::proxy::{stop_on_owner, ProxyArgs, RemoteConversation};
use crate::cluster::remote::wire::StopKind;
use crate::config::{LiveConfig, OnLimit};
use crate::event::StartReason;
use crate::metrics as m;
use crate::protocol::{ErrorCode, Mode, Status, StopReason};
use crate::store::{workspace_dir, Snapshot, Store, StoreError};

/// Why an activation or creation was refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ActivateError {
    #[error("no such conversation")]
    NotFound,
    #[error("you may attach to this conversation in observe mode only")]
    ObserveOnly,
    #[error("{max} conversations are already active (conversations.max_per_user)")]
    LimitReached { max: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
    /// Cluster mode, for an activation that must be local (a request from
    /// another node): this node does not run the conversation.
    #[error("the conversation runs on another node; attach again")]
    Elsewhere,
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ActivateError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ActivateError::NotFound | ActivateError::Elsewhere => ErrorCode::NotFound,
            ActivateError::ObserveOnly => ErrorCode::ReadOnly,
            ActivateError::LimitReached { .. } => ErrorCode::LimitReached,
            ActivateError::Store(e) if e.is_unavailable() => ErrorCode::StoreUnavailable,
            ActivateError::ShuttingDown | ActivateError::Store(_) | ActivateError::Internal(_) => {
                ErrorCode::Internal
            }
        }
    }
}

/// An active conversation handed to a caller.
#[derive(Clone)]
pub struct Activated {
    pub id: Arc<str>,
    pub actor: ActorRef<ConversationMsg>,
}

/// Creates and activates a conversation for `user`. Its workspace is made
/// here, by the caller's task, so that the supervisor never waits on the
/// file system; a refused creation removes it again.
pub async fn create_conversation(
    supervisor: &ActorRef<SupervisorMsg>,
    store_path: &std::path::Path,
    user: Arc<str>,
    title: String,
    close_delay: Option<Duration>,
    reason: StartReason,
) -> Result<Activated, ActivateError> {
    let id: Arc<str> = Arc::from(format!("c_{}", ulid::Ulid::new()));
    let workspace = workspace_dir(store_path, &id);
    tokio::fs::create_dir_all(&workspace)
        .await
        .map_err(|e| ActivateError::Internal(format!("workspace {}: {e}", workspace.display())))?;
    let result = match supervisor
        .call(
            |reply| SupervisorMsg::Create {
                id,
                user,
                title,
                close_delay,
                reason,
                reply,
            },
            Some(CALL_TIMEOUT),
        )
        .await
    {
        Ok(ractor::rpc::CallResult::Success(result)) => result,
        Ok(_) | Err(_) => Err(ActivateError::ShuttingDown),
    };
    if result.is_err() {
        let _ = tokio::fs::remove_dir(&workspace).await;
    }
    result
}

/// How long a caller waits for the supervisor to create or activate.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

pub type ActivateReply = RpcReplyPort<Result<Activated, ActivateError>>;

/// What an activation found.
pub enum Found {
    /// This node owns the conversation (single mode: always); `others`
    /// are its user's active conversations on other nodes (cluster mode).
    Here {
        snapshot: Box<Snapshot>,
        others: Vec<Activity>,
        /// With `agent.resume_interrupted`: the turn to run again.
        resume: Option<crate::recovery::InterruptedTurn>,
    },
    /// Cluster mode: another node runs it.
    Elsewhere {
        meta: Box<crate::store::ConversationMeta>,
        node: String,
    },
}

/// A creation, as asked.
pub struct Creation {
    id: Arc<str>,
    user: Arc<str>,
    title: String,
    close_delay: Option<Duration>,
    reason: StartReason,
    reply: ActivateReply,
}

pub enum SupervisorMsg {
    /// Made by [`create_conversation`], which has already made its workspace.
    Create {
        id: Arc<str>,
        user: Arc<str>,
        title: String,
        close_delay: Option<Duration>,
        reason: StartReason,
        reply: ActivateReply,
    },
    Activate {
        id: String,
        user: Arc<str>,
        mode: Mode,
        /// Only a conversation this node runs (a request from another
        /// node must not be proxied back).
        local_only: bool,
        reply: ActivateReply,
    },
    Loaded {
        id: Arc<str>,
        result: Result<Option<Found>, StoreError>,
    },
    /// Cluster mode: [`create_conversation`]'s claim on a new id is done.
    Claimed {
        create: Box<Creation>,
        /// The user's active conversations on other nodes.
        result: Result<Vec<Activity>, StoreError>,
    },
    /// Cluster mode: a conversation whose owner may be gone (its lease
    /// expired, or nobody holds it while it is stored as active): claim it
    /// and close it with `node_lost` unless another node does.
    Recover {
        id: String,
    },
    /// The outcome of a `Recover`.
    Recovered {
        id: Arc<str>,
        result: Result<(), StoreError>,
    },
    /// Cluster mode: this node's lease on a conversation was lost.
    LeaseLost {
        id: String,
    },
    /// Stops a conversation if it is active; replies once it has stopped.
    Stop {
        id: String,
        reason: StopReason,
        reply: Option<RpcReplyPort<()>>,
    },
    /// A conversation's idle timer ran out (it checked its own state).
    IdleExpired {
        id: Arc<str>,
        idle_for: Duration,
        close_delay: Duration,
    },
    ObserverAdded {
        id: String,
        user: String,
    },
    /// Deletes a conversation as one operation: activations are refused
    /// from now on, the actor (if any) stops with `deleted`, then its
    /// history and workspace go; replies whether it existed.
    Delete {
        id: String,
        reply: RpcReplyPort<Result<bool, StoreError>>,
    },
    /// The delete task's outcome.
    Deleted {
        id: Arc<str>,
        result: Result<bool, StoreError>,
    },
    /// Stops every conversation with `shutdown`; replies when all are gone.
    Shutdown {
        reply: RpcReplyPort<()>,
    },
    /// Refreshes the gauges of active conversations (sent to itself every
    /// [`METRICS_EVERY`]).
    PublishMetrics,
    /// The running configuration changed (a reload): active conversations
    /// re-arm their rule timers with the new values. Nothing is stopped
    /// now; the per-user limit applies at the next activation.
    ConfigChanged,
    /// Every conversation active on this node, for operators.
    ListActive {
        reply: RpcReplyPort<Vec<ActiveConversation>>,
    },
}

/// How often the supervisor refreshes the active-conversation gauges: by a
/// timer at least this often, and after its messages at most four times as
/// often. Reading every conversation's gauge is O(active conversations), so
/// doing it after every message made a storm of N reconnects O(N²).
pub const METRICS_EVERY: Duration = Duration::from_millis(1000);

pub struct SupervisorArgs {
    /// Read at each decision: a reload applies from the next one on.
    pub config: LiveConfig,
    /// Where decisions are recorded for operators.
    pub decisions: Arc<SupervisionLog>,
    pub store: Arc<dyn Store>,
    pub agent: Arc<dyn Agent>,
    /// Cluster mode: this node's part in the cluster.
    pub cluster: Option<Arc<ClusterNode>>,
}

pub struct Supervisor;

struct Entry {
    user: Arc<str>,
    actor: ActorRef<ConversationMsg>,
    gauge: Arc<ConversationGauge>,
    observers: Vec<String>,
    stopping: Option<StopReason>,
    started: Instant,
}

struct Waiter {
    user: Arc<str>,
    mode: Mode,
    local_only: bool,
    reply: ActivateReply,
}

pub struct State {
    config: LiveConfig,
    decisions: Arc<SupervisionLog>,
    store: Arc<dyn Store>,
    agent: Arc<dyn Agent>,
    active: HashMap<Arc<str>, Entry>,
    by_actor: HashMap<ActorId, Arc<str>>,
    /// Activations waiting for a snapshot read.
    loading: HashMap<Arc<str>, Vec<Waiter>>,
    /// Activations waiting for a stopping conversation to be gone.
    after_stop: HashMap<Arc<str>, Vec<Waiter>>,
    stop_waiters: HashMap<Arc<str>, Vec<RpcReplyPort<()>>>,
    /// Conversations being deleted, with whoever waits for the outcome:
    /// no activation is let through while an id is here.
    deleting: HashMap<Arc<str>, Vec<RpcReplyPort<Result<bool, StoreError>>>>,
    shutdown: Option<Vec<RpcReplyPort<()>>>,
    /// When the gauges were last published.
    metrics_published: Option<Instant>,
    cluster: Option<Arc<ClusterNode>>,
    /// Cluster mode: stand-ins for conversations other nodes run, with
    /// the owner each reaches.
    proxies: HashMap<Arc<str>, (ActorRef<ConversationMsg>, String)>,
    proxy_ids: HashMap<ActorId, Arc<str>>,
    /// Cluster mode: conversations being claimed and closed for a lost
    /// node, with the activations that wait for that.
    recovering: HashMap<Arc<str>, Vec<Waiter>>,
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = State;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<State, ActorProcessingErr> {
        info!("supervisor started");
        myself.send_interval(METRICS_EVERY, || SupervisorMsg::PublishMetrics);
        Ok(State {
            config: args.config,
            decisions: args.decisions,
            store: args.store,
            agent: args.agent,
            active: HashMap::new(),
            by_actor: HashMap::new(),
            loading: HashMap::new(),
            after_stop: HashMap::new(),
            stop_waiters: HashMap::new(),
            deleting: HashMap::new(),
            shutdown: None,
            metrics_published: None,
            cluster: args.cluster,
            proxies: HashMap::new(),
            proxy_ids: HashMap::new(),
            recovering: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        message: SupervisorMsg,
        state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            SupervisorMsg::Create {
                id,
                user,
                title,
                close_delay,
                reason,
                reply,
            } => {
                let create = Box::new(Creation {
                    id,
                    user,
                    title,
                    close_delay,
                    reason,
                    reply,
                });
                match &state.cluster {
                    // The new id is claimed first (lease and fence), in a
                    // task: the supervisor never waits on NATS.
                    Some(cluster) => {
                        let cluster = cluster.clone();
                        let me = myself.clone();
                        tokio::spawn(async move {
                            let result = claim_new(&cluster, &create.id, &create.user).await;
                            let _ = me.cast(SupervisorMsg::Claimed { create, result });
                        });
                    }
                    None => state.create_claimed(&myself, create, Vec::new()).await,
                }
            }
            SupervisorMsg::Claimed { create, result } => match result {
                Ok(others) => state.create_claimed(&myself, create, others).await,
                Err(e) => {
                    let _ = create.reply.send(Err(ActivateError::Store(e)));
                }
            },
            SupervisorMsg::Activate {
                id,
                user,
                mode,
                local_only,
                reply,
            } => state.activate(
                &myself,
                id,
                Waiter {
                    user,
                    mode,
                    local_only,
                    reply,
                },
            ),
            SupervisorMsg::Recover { id } => state.recover(&myself, Arc::from(id)),
            SupervisorMsg::Recovered { id, result } => state.recovered(&myself, id, result),
            SupervisorMsg::LeaseLost { id } => {
                if let Some(entry) = state.active.get_mut(id.as_str()) {
                    entry.stopping.get_or_insert(StopReason::NodeLost);
                    let _ = entry.actor.cast(ConversationMsg::Moved);
                    state.decisions.record(NewDecision {
                        rule: "lease_lost",
                        conversation: Some(&id),
                        user: Some(&entry.user),
                        inputs: json!({}),
                        outcome: "moved",
                    });
                }
            }
            SupervisorMsg::Loaded { id, result } => state.loaded(&myself, id, result).await,
            SupervisorMsg::Stop { id, reason, reply } => {
                let id: Arc<str> = Arc::from(id);
                let elsewhere = match (state.proxies.get(&id), &state.cluster) {
                    (Some((_, owner)), Some(_)) if !state.active.contains_key(&id) => {
                        Some(owner.clone())
                    }
                    _ => None,
                };
                if let (Some(owner), Some(cluster)) = (elsewhere, &state.cluster) {
                    // Run by another node: it stops it there.
                    let kind = match reason {
                        StopReason::Deleted => StopKind::Deleted,
                        _ => StopKind::Closed,
                    };
                    let cluster = cluster.clone();
                    tokio::spawn(async move {
                        stop_on_owner(&cluster.client, &cluster.subjects, &owner, &id, kind).await;
                        if let Some(reply) = reply {
                            let _ = reply.send(());
                        }
                    });
                } else if state.active.contains_key(&id) {
                    if let Some(reply) = reply {
                        state
                            .stop_waiters
                            .entry(id.clone())
                            .or_default()
                            .push(reply);
                    }
                    state.stop(&id, reason, "request", json!({}));
                } else if let Some(reply) = reply {
                    let _ = reply.send(());
                }
            }
            SupervisorMsg::IdleExpired {
                id,
                idle_for,
                close_delay,
            } => {
                if let Some(entry) = state.active.get(&id) {
                    if entry.stopping.is_none()
                        && entry.gauge.attached() == 0
                        && entry.gauge.status() == Status::Idle
                    {
                        let idle_for = humantime::format_duration(round_ms(idle_for));
                        let close_delay = humantime::format_duration(close_delay);
                        info!(conversation = %id, user = %entry.user, rule = "idle_close",
                            reason = "idle", idle_for = %idle_for, close_delay = %close_delay,
                            "stopping idle conversation");
                        let inputs = json!({
                            "idle_for": idle_for.to_string(),
                            "close_delay": close_delay.to_string(),
                            "attached": 0,
                            "status": "idle",
                        });
                        state.stop(&id, StopReason::Idle, "idle_close", inputs);
                    }
                }
            }
            SupervisorMsg::ObserverAdded { id, user } => {
                if let Some(entry) = state.active.get_mut(id.as_str()) {
                    if !entry.observers.contains(&user) {
                        entry.observers.push(user);
                    }
                }
            }
            SupervisorMsg::Delete { id, reply } => state.delete(&myself, Arc::from(id), reply),
            SupervisorMsg::Deleted { id, result } => {
                for reply in state.deleting.remove(&id).unwrap_or_default() {
                    let _ = reply.send(result.clone());
                }
            }
            SupervisorMsg::Shutdown { reply } => {
                info!(
                    active = state.active.len(),
                    "shutting down every conversation"
                );
                state.shutdown.get_or_insert_with(Vec::new).push(reply);
                let ids: Vec<Arc<str>> = state.active.keys().cloned().collect();
                for id in ids {
                    state.stop(&id, StopReason::Shutdown, "shutdown", json!({}));
                }
                for (proxy, _) in state.proxies.values() {
                    let _ = proxy.cast(ConversationMsg::Shutdown {
                        reason: StopReason::Shutdown,
                    });
                }
                for (_, waiters) in state
                    .loading
                    .drain()
                    .chain(state.after_stop.drain())
                    .chain(state.recovering.drain())
                {
                    for waiter in waiters {
                        let _ = waiter.reply.send(Err(ActivateError::ShuttingDown));
                    }
                }
                state.maybe_finish_shutdown();
            }
            SupervisorMsg::PublishMetrics => {}
            SupervisorMsg::ConfigChanged => {
                for entry in state.active.values().filter(|e| e.stopping.is_none()) {
                    let _ = entry.actor.cast(ConversationMsg::ConfigChanged);
                }
            }
            SupervisorMsg::ListActive { reply } => {
                let _ = reply.send(state.list_active());
            }
        }
        state.publish_metrics();
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        // The default would stop the supervisor when any child stops.
        match event {
            SupervisionEvent::ActorStarted(cell) => {
                if let Some(id) = state.by_actor.get(&cell.get_id()) {
                    let user = state.active.get(id).map(|e| e.user.clone());
                    info!(conversation = %id, user = %user.as_deref().unwrap_or(""),
                        actor = %cell.get_id(), "conversation actor started");
                }
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                state.proxy_gone(cell.get_id());
                state.child_gone(&myself, cell.get_id(), reason, None);
            }
            SupervisionEvent::ActorFailed(cell, err) => {
                state.proxy_gone(cell.get_id());
                state.child_gone(&myself, cell.get_id(), None, Some(err.to_string()));
            }
            SupervisionEvent::ProcessGroupChanged(_) => {}
        }
        state.publish_metrics();
        Ok(())
    }
}

fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64)
}

impl State {
    fn workspace(&self, id: &str) -> PathBuf {
        workspace_dir(&self.config.get().store.path, id)
    }

    fn list_active(&self) -> Vec<ActiveConversation> {
        let node = self.cluster.as_ref().map(|c| c.node.as_str());
        let mut list: Vec<ActiveConversation> = self
            .active
            .iter()
            .map(|(id, e)| {
                active_view::view(id, &e.user, &e.gauge, e.stopping, e.started.elapsed(), node)
            })
            .collect();
        list.sort_by(|a, b| a.user.cmp(&b.user).then_with(|| a.id.cmp(&b.id)));
        list
    }

    fn active_count(&self, user: &str) -> usize {
        self.active
            .values()
            .filter(|e| &*e.user == user && e.stopping.is_none())
            .count()
    }

    /// Creates a conversation whose id is this node's (cluster mode: its
    /// lease is held and its fence written).
    async fn create_claimed(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        create: Box<Creation>,
        claimed_others: Vec<Activity>,
    ) {
        let Creation {
            id,
            user,
            title,
            close_delay,
            reason,
            reply,
        } = *create;
        let others = claimed_others;
        let result = if self.shutdown.is_some() {
            Err(ActivateError::ShuttingDown)
        } else {
            match self.make_room(&user, Some(&id), others) {
                Ok(()) => {
                    let origin = Origin::New {
                        title,
                        close_delay,
                        reason,
                    };
                    self.spawn(myself, id.clone(), user, Vec::new(), origin)
                        .await
                }
                Err(e) => Err(e),
            }
        };
        if result.is_err() {
            self.release(&id);
        }
        let _ = reply.send(result);
    }

    /// Cluster mode: gives up this node's lease on a conversation that
    /// does not run here (any more).
    fn release(&self, id: &Arc<str>) {
        if let Some(cluster) = &self.cluster {
            if let Some(released) = cluster.ownership.forget(id) {
                cluster.ownership.give_back_soon(released);
            }
        }
    }

    fn proxy_gone(&mut self, actor: ActorId) {
        if let Some(id) = self.proxy_ids.remove(&actor) {
            if self
                .proxies
                .get(&id)
                .is_some_and(|(p, _)| p.get_id() == actor)
            {
                self.proxies.remove(&id);
            }
        }
    }

    /// Cluster mode: a conversation whose owner may be gone.
    fn recover(&mut self, myself: &ActorRef<SupervisorMsg>, id: Arc<str>) {
        let Some(cluster) = self.cluster.clone() else {
            return;
        };
        if self.shutdown.is_some()
            || self.active.contains_key(&id)
            || self.loading.contains_key(&id)
            || self.recovering.contains_key(&id)
            || self.deleting.contains_key(&id)
        {
            return;
        }
        self.recovering.insert(id.clone(), Vec::new());
        let store = self.store.clone();
        let me = myself.clone();
        tokio::spawn(async move {
            let result = close_for_lost_node(&cluster, &store, &id, false).await;
            let _ = me.cast(SupervisorMsg::Recovered { id, result });
        });
    }

    fn recovered(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        id: Arc<str>,
        result: Result<(), StoreError>,
    ) {
        let waiters = self.recovering.remove(&id).unwrap_or_default();
        if let Err(e) = &result {
            warn!(conversation = %id, error = %e, "closing a lost node's conversation failed; retried at the next scan");
        }
        if waiters.is_empty() {
            self.release(&id);
        }
        for waiter in waiters {
            self.load(myself, id.clone(), waiter);
        }
    }

    async fn spawn(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        id: Arc<str>,
        user: Arc<str>,
        observers: Vec<String>,
        origin: Origin,
    ) -> Result<Activated, ActivateError> {
        let gauge = Arc::new(ConversationGauge::default());
        let args = ConversationArgs {
            id: id.clone(),
            user: user.clone(),
            origin,
            config: self.config.clone(),
            decisions: self.decisions.clone(),
            store: self.store.clone(),
            agent: self.agent.clone(),
            supervisor: myself.clone(),
            gauge: gauge.clone(),
            workspace: self.workspace(&id),
        };
        let (actor, _) = Actor::spawn_linked(None, Conversation, args, myself.get_cell())
            .await
            .map_err(|e| {
                error!(conversation = %id, user = %user, error = %e, "conversation actor failed to start");
                ActivateError::Internal(e.to_string())
            })?;
        self.by_actor.insert(actor.get_id(), id.clone());
        if let Some(cluster) = &self.cluster {
            cluster.ownership.track(&id, user.clone(), gauge.clone());
        }
        self.active.insert(
            id.clone(),
            Entry {
                user: user.clone(),
                actor: actor.clone(),
                gauge,
                observers,
                stopping: None,
                started: Instant::now(),
            },
        );
        info!(conversation = %id, user = %user, active_for_user = self.active_count(&user),
            "conversation active");
        Ok(Activated { id, actor })
    }

    fn activate(&mut self, myself: &ActorRef<SupervisorMsg>, id: String, waiter: Waiter) {
        let id_for_checks = id.as_str();
        if waiter.local_only
            && !self.active.contains_key(id_for_checks)
            && !self.loading.contains_key(id_for_checks)
            && !self.recovering.contains_key(id_for_checks)
        {
            let _ = waiter.reply.send(Err(ActivateError::Elsewhere));
            return;
        }
        if self.shutdown.is_some() {
            let _ = waiter.reply.send(Err(ActivateError::ShuttingDown));
            return;
        }
        let id: Arc<str> = Arc::from(id);
        if self.deleting.contains_key(&id) {
            let _ = waiter.reply.send(Err(ActivateError::NotFound));
            return;
        }
        if let Some(entry) = self.active.get(&id) {
            if entry.stopping.is_some() {
                self.after_stop.entry(id).or_default().push(waiter);
                return;
            }
            let result = permission(&entry.user, &entry.observers, &waiter).map(|()| Activated {
                id: id.clone(),
                actor: entry.actor.clone(),
            });
            let _ = waiter.reply.send(result);
            return;
        }
        if let Some(waiters) = self.recovering.get_mut(&id) {
            waiters.push(waiter);
            return;
        }
        self.load(myself, id, waiter);
    }

    fn load(&mut self, myself: &ActorRef<SupervisorMsg>, id: Arc<str>, waiter: Waiter) {
        let waiters = self.loading.entry(id.clone()).or_default();
        waiters.push(waiter);
        if waiters.len() > 1 {
            return;
        }
        let store = self.store.clone();
        let config = self.config.get();
        let tail = config.conversations.replay_buffer_events;
        let me = myself.clone();
        let cluster = self.cluster.clone();
        let resume = config.agent.resume_interrupted;
        tokio::spawn(async move {
            let mut result = match &cluster {
                Some(cluster) => load_in_cluster(cluster, &store, &id, tail).await,
                None => store.snapshot(&id, tail).await.map(|s| {
                    s.map(|s| Found::Here {
                        snapshot: Box::new(s),
                        others: Vec::new(),
                        resume: None,
                    })
                }),
            };
            if let (
                true,
                Ok(Some(Found::Here {
                    snapshot, resume, ..
                })),
            ) = (resume, &mut result)
            {
                match crate::recovery::interrupted_turn(&store, snapshot).await {
                    Ok(turn) => *resume = turn,
                    Err(e) => result = Err(e),
                }
            }
            let _ = me.cast(SupervisorMsg::Loaded { id, result });
        });
    }

    async fn loaded(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        id: Arc<str>,
        result: Result<Option<Found>, StoreError>,
    ) {
        let Some(waiters) = self.loading.remove(&id) else {
            return;
        };
        let mut others = Vec::new();
        let mut resume = None;
        let (snapshot_result, elsewhere) = match result {
            Ok(Some(Found::Elsewhere { meta, node })) => (Ok(None), Some((meta, node))),
            Ok(Some(Found::Here {
                snapshot,
                others: theirs,
                resume: turn,
            })) => {
                others = theirs;
                resume = turn;
                (Ok(Some(snapshot)), None)
            }
            Ok(None) => (Ok(None), None),
            Err(e) => (Err(e), None),
        };
        if let Some((meta, node)) = elsewhere {
            self.reach_elsewhere(myself, id, waiters, &meta, node).await;
            return;
        }
        let result = snapshot_result;
        if !matches!(result, Ok(Some(_))) {
            self.release(&id);
        }
        if self.deleting.contains_key(&id) {
            for w in waiters {
                let _ = w.reply.send(Err(ActivateError::NotFound));
            }
            self.start_deleting(myself, id);
            return;
        }
        let snapshot = match result {
            Ok(Some(snapshot)) => snapshot,
            Ok(None) => {
                for w in waiters {
                    let _ = w.reply.send(Err(ActivateError::NotFound));
                }
                return;
            }
            Err(e) => {
                error!(conversation = %id, error = %e, "reading the conversation failed");
                for w in waiters {
                    let _ = w.reply.send(Err(ActivateError::Store(e.clone())));
                }
                return;
            }
        };
        let owner: Arc<str> = Arc::from(snapshot.meta.user.as_str());
        let observers = snapshot.meta.observers.clone();
        let mut allowed = Vec::new();
        for w in waiters {
            match permission(&owner, &observers, &w) {
                Ok(()) => allowed.push(w),
                Err(e) => {
                    let _ = w.reply.send(Err(e));
                }
            }
        }
        if allowed.is_empty() {
            return;
        }
        let room = if allowed.iter().any(|w| *w.user == *owner) {
            self.make_room(&owner, Some(&id), others)
        } else {
            // Observers only read: they never stop one of the owner's
            // conversations to make room.
            let max = self.config.get().conversations.max_per_user;
            if max > 0 && self.active_count(&owner) + others.len() >= max {
                Err(ActivateError::LimitReached { max })
            } else {
                Ok(())
            }
        };
        if let Err(e) = room {
            for w in allowed {
                let _ = w.reply.send(Err(e.clone()));
            }
            return;
        }
        let origin = Origin::Restored {
            snapshot,
            reason: StartReason::Attach,
            resume,
        };
        let result = self
            .spawn(myself, id.clone(), owner, observers, origin)
            .await;
        if result.is_err() {
            self.release(&id);
        }
        for w in allowed {
            let _ = w.reply.send(result.clone());
        }
    }

    /// Cluster mode: answers activations of a conversation another node
    /// runs with this node's stand-in for it (one per conversation and
    /// owner).
    async fn reach_elsewhere(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        id: Arc<str>,
        waiters: Vec<Waiter>,
        meta: &crate::store::ConversationMeta,
        node: String,
    ) {
        let Some(cluster) = self.cluster.clone() else {
            return;
        };
        let mut allowed = Vec::new();
        for w in waiters {
            if w.local_only {
                let _ = w.reply.send(Err(ActivateError::Elsewhere));
                continue;
            }
            match permission(&meta.user, &meta.observers, &w) {
                Ok(()) => allowed.push(w),
                Err(e) => {
                    let _ = w.reply.send(Err(e));
                }
            }
        }
        if allowed.is_empty() {
            return;
        }
        let proxy = match self.proxies.get(&id) {
            // A stand-in with no attachment left is stopping: a new one.
            Some((proxy, owner))
                if *owner == node && proxy.get_status() == ractor::ActorStatus::Running =>
            {
                Ok(proxy.clone())
            }
            _ => {
                let args = ProxyArgs {
                    id: id.clone(),
                    owner: node.clone(),
                    node: cluster.node.clone(),
                    client: cluster.client.clone(),
                    subjects: cluster.subjects.clone(),
                    leases: cluster.ownership.leases().clone(),
                    lease_ttl: self.config.get().cluster.lease_ttl,
                };
                match Actor::spawn_linked(None, RemoteConversation, args, myself.get_cell()).await {
                    Ok((proxy, _)) => {
                        self.proxy_ids.insert(proxy.get_id(), id.clone());
                        self.proxies.insert(id.clone(), (proxy.clone(), node));
                        Ok(proxy)
                    }
                    Err(e) => Err(ActivateError::Internal(e.to_string())),
                }
            }
        };
        let result = proxy.map(|actor| Activated {
            id: id.clone(),
            actor,
        });
        for w in allowed {
            let _ = w.reply.send(result.clone());
        }
    }

    /// Makes room for one more active conversation of `user`: with
    /// `on_limit = "evict"`, stops the one chosen by protocol §6 (in cluster
    /// mode possibly one another node runs, from `others`: that node stops
    /// it); with `"reject"`, refuses.
    fn make_room(
        &mut self,
        user: &Arc<str>,
        activating: Option<&Arc<str>>,
        others: Vec<Activity>,
    ) -> Result<(), ActivateError> {
        let config = self.config.get();
        let max = config.conversations.max_per_user;
        if max == 0 {
            return Ok(());
        }
        let mut others: Vec<Candidate> = others
            .into_iter()
            .filter(|a| activating.is_none_or(|id| **id != *a.conversation))
            .map(|a| Candidate {
                id: Arc::from(a.conversation.as_str()),
                running: a.running,
                attached: a.attached,
                last_activity_us: a.last_activity_us,
                node: Some(a.node),
            })
            .collect();
        while self.active_count(user) + others.len() >= max {
            let active_for_user = self.active_count(user) + others.len();
            if config.conversations.on_limit == OnLimit::Reject {
                info!(user = %user, rule = "user_limit", decision = "reject",
                    active_for_user, max_per_user = max,
                    "activation refused: the user is at the limit");
                self.decisions.record(NewDecision {
                    rule: "user_limit",
                    conversation: activating.map(|id| &**id),
                    user: Some(user),
                    inputs: json!({
                        "active_for_user": active_for_user,
                        "max_per_user": max,
                        "on_limit": "reject",
                    }),
                    outcome: "refused",
                });
                return Err(ActivateError::LimitReached { max });
            }
            let mut candidates: Vec<Candidate> = self
                .active
                .iter()
                .filter(|(id, e)| {
                    e.user == *user && e.stopping.is_none() && Some(*id) != activating
                })
                .map(|(id, e)| Candidate {
                    id: id.clone(),
                    running: matches!(e.gauge.status(), Status::Running | Status::Waiting),
                    attached: e.gauge.attached() > 0,
                    last_activity_us: e.gauge.last_activity_unix_us(),
                    node: None,
                })
                .collect();
            candidates.extend(others.iter().cloned());
            let Some(victim) = eviction::victim(&candidates).cloned() else {
                return Err(ActivateError::LimitReached { max });
            };
            info!(conversation = %victim.id, user = %user, rule = "user_limit", reason = "user_limit",
                class = victim.class_name(), running = victim.running, attached = victim.attached,
                node = victim.node.as_deref().unwrap_or("here"),
                active_for_user, max_per_user = max,
                "evicting the least recently active conversation");
            let inputs = json!({
                "class": victim.class_name(),
                "running": victim.running,
                "attached": victim.attached,
                "node": victim.node.as_deref().unwrap_or("here"),
                "active_for_user": active_for_user,
                "max_per_user": max,
                "activating": activating.map(|id| &**id),
            });
            match (&victim.node, &self.cluster) {
                (Some(node), Some(cluster)) => {
                    self.decisions.record(NewDecision {
                        rule: "user_limit",
                        conversation: Some(&victim.id),
                        user: Some(user),
                        inputs,
                        outcome: "stopped on its node",
                    });
                    others.retain(|o| o.id != victim.id);
                    let (cluster, node) = (cluster.clone(), node.clone());
                    tokio::spawn(async move {
                        stop_on_owner(
                            &cluster.client,
                            &cluster.subjects,
                            &node,
                            &victim.id,
                            StopKind::UserLimit,
                        )
                        .await;
                    });
                }
                _ => self.stop(&victim.id, StopReason::UserLimit, "user_limit", inputs),
            }
        }
        Ok(())
    }

    /// Stops an active conversation for `rule`, recording the decision
    /// with the `inputs` the rule looked at (a JSON object).
    fn stop(
        &mut self,
        id: &Arc<str>,
        reason: StopReason,
        rule: &'static str,
        mut inputs: serde_json::Value,
    ) {
        let Some(entry) = self.active.get_mut(id) else {
            return;
        };
        if entry.stopping.is_some() {
            return;
        }
        entry.stopping = Some(reason);
        info!(conversation = %id, user = %entry.user, rule, reason = reason.as_str(),
            status = entry.gauge.status().as_str(), attached = entry.gauge.attached(),
            "stopping conversation");
        if let Some(fields) = inputs.as_object_mut() {
            fields.insert("reason".into(), reason.as_str().into());
            fields
                .entry("status")
                .or_insert_with(|| entry.gauge.status().as_str().into());
            fields
                .entry("attached")
                .or_insert_with(|| entry.gauge.attached().into());
        }
        self.decisions.record(NewDecision {
            rule,
            conversation: Some(id),
            user: Some(&entry.user),
            inputs,
            outcome: "stopped",
        });
        m::conversation_stopped(reason);
        if entry
            .actor
            .cast(ConversationMsg::Shutdown { reason })
            .is_err()
        {
            warn!(conversation = %id, "conversation actor already gone");
        }
    }

    fn child_gone(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        actor: ActorId,
        reason: Option<String>,
        failure: Option<String>,
    ) {
        let Some(id) = self.by_actor.remove(&actor) else {
            return;
        };
        let entry = self.active.remove(&id);
        let user = entry
            .as_ref()
            .map(|e| e.user.to_string())
            .unwrap_or_default();
        // A conversation drains its mailbox before it stops, which carries
        // no reason: the one it was stopped for is here.
        let reason = reason.or_else(|| {
            entry
                .as_ref()
                .and_then(|e| e.stopping)
                .map(|r| r.as_str().to_owned())
        });
        let lived = entry.as_ref().map(|e| round_ms(e.started.elapsed()));
        let lived = lived
            .map(|d| humantime::format_duration(d).to_string())
            .unwrap_or_default();
        if let Some(err) = &failure {
            self.decisions.record(NewDecision {
                rule: "actor_failed",
                conversation: Some(&id),
                user: Some(&user),
                inputs: json!({ "error": err, "lived": lived }),
                outcome: "removed",
            });
        }
        match &failure {
            Some(err) => error!(conversation = %id, user = %user, actor = %actor, error = %err,
                lived = %lived, "conversation actor failed"),
            None => info!(conversation = %id, user = %user, actor = %actor,
                reason = %reason.as_deref().unwrap_or("none"), lived = %lived,
                "conversation actor stopped"),
        }
        for reply in self.stop_waiters.remove(&id).unwrap_or_default() {
            let _ = reply.send(());
        }
        // Reactivated at once, the lease is kept for the next actor.
        if !self.after_stop.contains_key(&id) {
            self.release(&id);
        }
        if self.deleting.contains_key(&id) {
            for waiter in self.after_stop.remove(&id).unwrap_or_default() {
                let _ = waiter.reply.send(Err(ActivateError::NotFound));
            }
            self.start_deleting(myself, id.clone());
        } else if let Some(waiters) = self.after_stop.remove(&id) {
            for waiter in waiters {
                self.load(myself, id.clone(), waiter);
            }
        }
        self.maybe_finish_shutdown();
    }

    fn delete(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        id: Arc<str>,
        reply: RpcReplyPort<Result<bool, StoreError>>,
    ) {
        let waiters = self.deleting.entry(id.clone()).or_default();
        waiters.push(reply);
        if waiters.len() > 1 {
            return;
        }
        if self.active.contains_key(&id) {
            // Deleted once the actor is gone (`child_gone`).
            self.stop(&id, StopReason::Deleted, "request", json!({}));
        } else if !self.loading.contains_key(&id) {
            // Otherwise deleted once the snapshot read is back (`loaded`).
            self.start_deleting(myself, id);
        }
    }

    /// Deletes the history, then the workspace, in a task (never in the
    /// handler: both are I/O); `Deleted` reports back.
    fn start_deleting(&mut self, myself: &ActorRef<SupervisorMsg>, id: Arc<str>) {
        let store = self.store.clone();
        let workspace = self.workspace(&id);
        let me = myself.clone();
        let cluster = self.cluster.clone();
        tokio::spawn(async move {
            if let Some(cluster) = &cluster {
                // Run by another node: stopped there first, so that it
                // writes nothing after the history is gone.
                if let Ok(Some(holder)) = cluster.ownership.leases().holder(&id).await {
                    if holder.node != cluster.node {
                        stop_on_owner(
                            &cluster.client,
                            &cluster.subjects,
                            &holder.node,
                            &id,
                            StopKind::Deleted,
                        )
                        .await;
                    }
                }
            }
            let mut result = store.delete(&id).await;
            if result.is_ok() {
                match tokio::fs::remove_dir_all(&workspace).await {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        result = Err(StoreError::Backend(format!(
                            "removing the workspace {}: {e}",
                            workspace.display()
                        )))
                    }
                }
            }
            let _ = me.cast(SupervisorMsg::Deleted { id, result });
        });
    }

    fn maybe_finish_shutdown(&mut self) {
        if self.active.is_empty() {
            if let Some(replies) = self.shutdown.as_mut() {
                for reply in replies.drain(..) {
                    let _ = reply.send(());
                }
            }
        }
    }

    fn publish_metrics(&mut self) {
        let now = Instant::now();
        if self
            .metrics_published
            .is_some_and(|at| now.duration_since(at) < METRICS_EVERY / 4)
        {
            return;
        }
        self.metrics_published = Some(now);
        let mut counts: HashMap<Status, usize> = HashMap::new();
        let mut attached = 0;
        for entry in self.active.values() {
            *counts.entry(entry.gauge.status()).or_default() += 1;
            attached += entry.gauge.attached();
        }
        for status in [Status::Running, Status::Waiting, Status::Idle] {
            m::active_conversations(status, counts.get(&status).copied().unwrap_or(0));
        }
        m::attached_connections(attached);
    }
}

/// May this waiter attach? Another user's conversation does not exist for
/// them; an observer may only observe.
fn permission(owner: &str, observers: &[String], waiter: &Waiter) -> Result<(), ActivateError> {
    if *waiter.user == *owner {
        Ok(())
    } else if observers.iter().any(|o| *o == *waiter.user) {
        match waiter.mode {
            Mode::Observe => Ok(()),
            Mode::Control => Err(ActivateError::ObserveOnly),
        }
    } else {
        Err(ActivateError::NotFound)
    }
}

/// Cluster mode: reads a conversation to activate it, claiming it first.
/// Another live node's conversation is reached there; one whose owner died
/// without closing it is closed here (`node_lost`) before it runs again.
async fn load_in_cluster(
    cluster: &ClusterNode,
    store: &Arc<dyn Store>,
    id: &str,
    tail: usize,
) -> Result<Option<Found>, StoreError> {
    // The summary alone (user, observers): the snapshot below reads the
    // exact head, so `Store::get`'s head read would be done twice.
    let Some(meta) = cluster.store.summary(id).await? else {
        return Ok(None);
    };
    // Counted before claiming: a refused activation leaves no trace.
    let others = cluster.ownership.others_of(&meta.user).await?;
    if let Claim::Elsewhere(node) = cluster.ownership.claim(id).await? {
        return Ok(Some(Found::Elsewhere {
            meta: Box::new(meta),
            node,
        }));
    }
    close_for_lost_node(cluster, store, id, true).await?;
    Ok(store.snapshot(id, tail).await?.map(|s| Found::Here {
        snapshot: Box::new(s),
        others,
        resume: None,
    }))
}

/// Cluster mode: claims a new conversation's id for this node; returns its
/// user's active conversations on the other nodes.
async fn claim_new(
    cluster: &ClusterNode,
    id: &str,
    user: &str,
) -> Result<Vec<Activity>, StoreError> {
    let others = cluster.ownership.others_of(user).await?;
    match cluster.ownership.claim(id).await? {
        Claim::Owned => Ok(others),
        Claim::Elsewhere(node) => Err(StoreError::Backend(format!(
            "a new conversation id is already held by node {node}"
        ))),
    }
}

/// Cluster mode: claims a conversation (unless `claimed` already) and, if it is
/// stored as active while nobody runs it, records that its node was lost.
async fn close_for_lost_node(
    cluster: &ClusterNode,
    store: &Arc<dyn Store>,
    id: &str,
    claimed: bool,
) -> Result<(), StoreError> {
    if !claimed {
        match cluster.store.summary(id).await? {
            Some(meta) if meta.status != Status::Stopped => {}
            _ => return Ok(()),
        }
        if let Claim::Elsewhere(_) = cluster.ownership.claim(id).await? {
            return Ok(());
        }
    }
    // The snapshot's head is the log's (the summary may lag one append).
    let Some(snapshot) = store.snapshot(id, 0).await? else {
        return Ok(());
    };
    if snapshot.meta.status == Status::Stopped {
        return Ok(());
    }
    crate::recovery::close(store, &snapshot.meta, StopReason::NodeLost)
        .await
        .map_err(|_| StoreError::Closed)?
}

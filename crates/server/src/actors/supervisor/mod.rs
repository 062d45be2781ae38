//! The supervisor: the only place that knows which conversations are active
//! and whose they are. It creates and activates conversations (checking
//! ownership and enforcing the per-user limit first), stops them (idle close,
//! user limit, close, delete, shutdown), and logs every start, stop and
//! failure of its conversation actors as a supervision line; each decision
//! also goes to the in-memory ring operators read ([`SupervisionLog`]).
//!
//! Activating a stopped conversation reads its snapshot in a task that
//! reports back (`Loaded`), so the supervisor never waits on the store.
//!
//! # Layout
//!
//! This file holds the messages, the actor's state and the dispatch of each
//! message and supervision event to the module that owns its concept:
//!
//! - [`calls`]: what a caller gets back (`Activated`, [`ActivateError`]),
//!   how long it waits, and what an unanswered call means.
//! - [`creation`]: new conversations, from [`create_conversation`] to the
//!   spawned actor.
//! - [`activation`]: "give me conversation X for user U": permission, the
//!   snapshot read in a task, starting the actor.
//! - [`room`]: the per-user limit: counting, and carrying out the plan of
//!   [`super::eviction`].
//! - [`stops`]: stopping for a rule, the bookkeeping once a child is gone,
//!   and shutdown.
//! - [`deletion`]: delete as one operation.
//! - [`cluster`]: cluster mode: claims, stand-ins for conversations other
//!   nodes run, lost leases and lost nodes.
//! - [`metrics`]: the gauges it publishes and the operators' list.

mod activation;
mod active;
mod calls;
mod cluster;
mod creation;
mod deletion;
mod metrics;
mod room;
mod stops;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tracing::info;

use super::active_view::ActiveConversation;
use super::conversation::ConversationMsg;
use super::gauge::ConversationGauge;
use super::supervision_log::SupervisionLog;
use crate::agent::Agent;
use crate::cluster::lease::Activity;
use crate::cluster::node::ClusterNode;
use crate::config::LiveConfig;
use crate::protocol::{Mode, StopReason};
use crate::store::{Store, StoreError};

pub use activation::Found;
pub use calls::{
    activation_reply, list_active, ActivateError, ActivateReply, Activated, Unanswered,
    CALL_TIMEOUT,
};
pub use creation::{create_conversation, Creation};
pub use metrics::METRICS_EVERY;

pub enum SupervisorMsg {
    /// Made by [`create_conversation`], which has already made its workspace.
    Create(Box<Creation>),
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
    /// Cluster mode: the claim on a new id (made for a `Create`) is done.
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

/// An active conversation (this node runs its actor).
struct Entry {
    user: Arc<str>,
    actor: ActorRef<ConversationMsg>,
    gauge: Arc<ConversationGauge>,
    observers: Vec<String>,
    stopping: Option<StopReason>,
    started: Instant,
}

/// An activation waiting for an answer.
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
    active: active::ActiveConversations,
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
            active: Default::default(),
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
            SupervisorMsg::Create(create) => state.create(&myself, create).await,
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
            SupervisorMsg::LeaseLost { id } => state.lease_lost(&id),
            SupervisorMsg::Loaded { id, result } => state.loaded(&myself, id, result).await,
            SupervisorMsg::Stop { id, reason, reply } => {
                state.stop_requested(Arc::from(id), reason, reply)
            }
            SupervisorMsg::IdleExpired {
                id,
                idle_for,
                close_delay,
            } => state.idle_expired(&id, idle_for, close_delay),
            SupervisorMsg::ObserverAdded { id, user } => {
                if let Some(entry) = state.active.get_mut(id.as_str()) {
                    if !entry.observers.contains(&user) {
                        entry.observers.push(user);
                    }
                }
            }
            SupervisorMsg::Delete { id, reply } => state.delete(&myself, Arc::from(id), reply),
            SupervisorMsg::Deleted { id, result } => state.deleted(&id, result),
            SupervisorMsg::Shutdown { reply } => state.shut_down(reply),
            // The gauges are published below, after every message.
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

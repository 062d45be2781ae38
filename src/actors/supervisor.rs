//! The supervisor: the only place that knows which conversations are active
//! and whose they are. It creates and activates conversations (checking
//! ownership and enforcing the per-user limit first), stops them (idle close,
//! user limit, close, delete, shutdown), and logs every start, stop and
//! failure of its conversation actors as a supervision line.
//!
//! Activating a stopped conversation reads its snapshot in a task that
//! reports back (`Loaded`), so the supervisor never waits on the store.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tracing::{error, info, warn};

use super::conversation::{Conversation, ConversationArgs, ConversationMsg, Origin};
use super::gauge::ConversationGauge;
use crate::agent::Agent;
use crate::config::{Config, OnLimit};
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
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ActivateError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ActivateError::NotFound => ErrorCode::NotFound,
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
        reply: ActivateReply,
    },
    Loaded {
        id: Arc<str>,
        result: Result<Option<Box<Snapshot>>, StoreError>,
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
}

/// How often the supervisor refreshes the active-conversation gauges: at
/// most this often after its messages, and at least this often by a timer.
/// Reading every conversation's gauge is O(active conversations), so doing
/// it after every message made a storm of N reconnects O(N²).
pub const METRICS_EVERY: Duration = Duration::from_millis(1000);

pub struct SupervisorArgs {
    pub config: Arc<Config>,
    pub store: Arc<dyn Store>,
    pub agent: Arc<dyn Agent>,
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
    reply: ActivateReply,
}

pub struct State {
    config: Arc<Config>,
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
                let result = state
                    .create(&myself, id, user, title, close_delay, reason)
                    .await;
                let _ = reply.send(result);
            }
            SupervisorMsg::Activate {
                id,
                user,
                mode,
                reply,
            } => state.activate(&myself, id, Waiter { user, mode, reply }),
            SupervisorMsg::Loaded { id, result } => state.loaded(&myself, id, result).await,
            SupervisorMsg::Stop { id, reason, reply } => {
                let id: Arc<str> = Arc::from(id);
                if state.active.contains_key(&id) {
                    if let Some(reply) = reply {
                        state
                            .stop_waiters
                            .entry(id.clone())
                            .or_default()
                            .push(reply);
                    }
                    state.stop(&id, reason, "request");
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
                        info!(conversation = %id, user = %entry.user, rule = "idle_close",
                            reason = "idle",
                            idle_for = %humantime::format_duration(round_ms(idle_for)),
                            close_delay = %humantime::format_duration(close_delay),
                            "stopping idle conversation");
                        state.stop(&id, StopReason::Idle, "idle_close");
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
                    state.stop(&id, StopReason::Shutdown, "shutdown");
                }
                for (_, waiters) in state.loading.drain().chain(state.after_stop.drain()) {
                    for waiter in waiters {
                        let _ = waiter.reply.send(Err(ActivateError::ShuttingDown));
                    }
                }
                state.maybe_finish_shutdown();
            }
            SupervisorMsg::PublishMetrics => {}
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
                state.child_gone(&myself, cell.get_id(), reason, None);
            }
            SupervisionEvent::ActorFailed(cell, err) => {
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
        workspace_dir(&self.config.store.path, id)
    }

    fn active_count(&self, user: &str) -> usize {
        self.active
            .values()
            .filter(|e| &*e.user == user && e.stopping.is_none())
            .count()
    }

    async fn create(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        id: Arc<str>,
        user: Arc<str>,
        title: String,
        close_delay: Option<Duration>,
        reason: StartReason,
    ) -> Result<Activated, ActivateError> {
        if self.shutdown.is_some() {
            return Err(ActivateError::ShuttingDown);
        }
        self.make_room(&user, None)?;
        let origin = Origin::New {
            title,
            close_delay,
            reason,
        };
        self.spawn(myself, id, user, Vec::new(), origin).await
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
        self.load(myself, id, waiter);
    }

    fn load(&mut self, myself: &ActorRef<SupervisorMsg>, id: Arc<str>, waiter: Waiter) {
        let waiters = self.loading.entry(id.clone()).or_default();
        waiters.push(waiter);
        if waiters.len() > 1 {
            return;
        }
        let store = self.store.clone();
        let tail = self.config.conversations.replay_buffer_events;
        let me = myself.clone();
        tokio::spawn(async move {
            let result = store.snapshot(&id, tail).await.map(|s| s.map(Box::new));
            let _ = me.cast(SupervisorMsg::Loaded { id, result });
        });
    }

    async fn loaded(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        id: Arc<str>,
        result: Result<Option<Box<Snapshot>>, StoreError>,
    ) {
        let Some(waiters) = self.loading.remove(&id) else {
            return;
        };
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
            self.make_room(&owner, Some(&id))
        } else {
            // Observers only read: they never stop one of the owner's
            // conversations to make room.
            let max = self.config.conversations.max_per_user;
            if max > 0 && self.active_count(&owner) >= max {
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
        };
        let result = self.spawn(myself, id, owner, observers, origin).await;
        for w in allowed {
            let _ = w.reply.send(result.clone());
        }
    }

    /// Makes room for one more active conversation of `user`: with
    /// `on_limit = "evict"`, stops the one chosen by protocol §6; with
    /// `"reject"`, refuses.
    fn make_room(
        &mut self,
        user: &Arc<str>,
        activating: Option<&Arc<str>>,
    ) -> Result<(), ActivateError> {
        let max = self.config.conversations.max_per_user;
        if max == 0 {
            return Ok(());
        }
        while self.active_count(user) >= max {
            if self.config.conversations.on_limit == OnLimit::Reject {
                info!(user = %user, rule = "user_limit", decision = "reject",
                    active_for_user = self.active_count(user), max_per_user = max,
                    "activation refused: the user is at the limit");
                return Err(ActivateError::LimitReached { max });
            }
            let victim = self
                .active
                .iter()
                .filter(|(id, e)| {
                    e.user == *user && e.stopping.is_none() && Some(*id) != activating
                })
                .map(|(id, e)| (eviction_class(e), e.gauge.last_activity(), id.clone()))
                .min_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
            let Some((class, _, victim)) = victim else {
                return Err(ActivateError::LimitReached { max });
            };
            let (status, attached) = self
                .active
                .get(&victim)
                .map(|e| (e.gauge.status(), e.gauge.attached()))
                .unwrap_or((Status::Stopped, 0));
            info!(conversation = %victim, user = %user, rule = "user_limit", reason = "user_limit",
                class = CLASS_NAMES[class as usize], status = status.as_str(), attached,
                active_for_user = self.active_count(user), max_per_user = max,
                "evicting the least recently active conversation");
            self.stop(&victim, StopReason::UserLimit, "user_limit");
        }
        Ok(())
    }

    fn stop(&mut self, id: &Arc<str>, reason: StopReason, rule: &str) {
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
            self.stop(&id, StopReason::Deleted, "request");
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
        tokio::spawn(async move {
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

const CLASS_NAMES: [&str; 4] = [
    "idle_detached",
    "idle_attached",
    "running_detached",
    "running_attached",
];

/// The eviction class of protocol §6: lower goes first.
fn eviction_class(entry: &Entry) -> u8 {
    let running = matches!(entry.gauge.status(), Status::Running | Status::Waiting);
    let attached = entry.gauge.attached() > 0;
    match (running, attached) {
        (false, false) => 0,
        (false, true) => 1,
        (true, false) => 2,
        (true, true) => 3,
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

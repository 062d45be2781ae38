//! "Give me conversation X for user U": answered at once when it is
//! active, queued behind a stop, delete or recovery that is under way,
//! otherwise read in a task (`Loaded`) and started here once the user may
//! have it and the per-user limit has room.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use ractor::{Actor, ActorRef};
use tracing::{error, info};

use super::calls::{ActivateError, Activated};
use super::cluster::load_in_cluster;
use super::{Entry, State, SupervisorMsg, Waiter};
use crate::actors::conversation::{Conversation, ConversationArgs, Origin};
use crate::actors::eviction;
use crate::actors::gauge::ConversationGauge;
use crate::cluster::lease::Activity;
use crate::event::StartReason;
use crate::protocol::Mode;
use crate::recovery::InterruptedTurn;
use crate::store::{workspace_dir, ConversationMeta, Snapshot, StoreError};

/// What an activation found.
pub enum Found {
    /// This node owns the conversation (single mode: always); `others`
    /// are its user's active conversations on other nodes (cluster mode).
    Here {
        snapshot: Box<Snapshot>,
        others: Vec<Activity>,
        /// With `agent.resume_interrupted`: the turn to run again.
        resume: Option<InterruptedTurn>,
    },
    /// Cluster mode: another node runs it.
    Elsewhere {
        meta: Box<ConversationMeta>,
        node: String,
    },
}

impl State {
    pub(super) fn workspace(&self, id: &str) -> PathBuf {
        workspace_dir(&self.config.get().store.path, id)
    }

    pub(super) fn activate(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        id: String,
        waiter: Waiter,
    ) {
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

    /// Queues `waiter` for the snapshot read of `id`, starting the read
    /// (in a task that reports `Loaded`) unless one is under way.
    pub(super) fn load(&mut self, myself: &ActorRef<SupervisorMsg>, id: Arc<str>, waiter: Waiter) {
        let waiters = self.loading.entry(id.clone()).or_default();
        waiters.push(waiter);
        if waiters.len() > 1 {
            return;
        }
        let store = self.store.clone();
        let config = self.config.get();
        let tail = config.conversations.replay_buffer_events;
        let window = config.conversations.client_msg_id_window;
        let me = myself.clone();
        let cluster = self.cluster.clone();
        let resume = config.agent.resume_interrupted;
        tokio::spawn(async move {
            let mut result = match &cluster {
                Some(cluster) => load_in_cluster(cluster, &store, &id, tail, window).await,
                None => store.snapshot(&id, tail, window).await.map(|s| {
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

    pub(super) async fn loaded(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        id: Arc<str>,
        result: Result<Option<Found>, StoreError>,
    ) {
        let Some(waiters) = self.loading.remove(&id) else {
            return;
        };
        let (result, others, resume) = match result {
            Ok(Some(Found::Elsewhere { meta, node })) => {
                self.reach_elsewhere(myself, id, waiters, &meta, node).await;
                return;
            }
            Ok(Some(Found::Here {
                snapshot,
                others,
                resume,
            })) => (Ok(Some(snapshot)), others, resume),
            Ok(None) => (Ok(None), Vec::new(), None),
            Err(e) => (Err(e), Vec::new(), None),
        };
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
        let allowed = permitted(waiters, &owner, &observers);
        if allowed.is_empty() {
            return;
        }
        let room = if allowed.iter().any(|w| *w.user == *owner) {
            self.make_room(&owner, Some(&id), others)
        } else {
            // Observers only read: they never stop one of the owner's
            // conversations to make room.
            let max = self.config.get().conversations.max_per_user;
            if eviction::at_limit(self.active_count(&owner) + others.len(), max) {
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

    /// Starts a conversation actor, linked to the supervisor, and makes
    /// it active.
    pub(super) async fn spawn(
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
}

/// The waiters that may attach to a conversation of `owner`; the others
/// are answered with why not.
pub(super) fn permitted(waiters: Vec<Waiter>, owner: &str, observers: &[String]) -> Vec<Waiter> {
    let mut allowed = Vec::new();
    for w in waiters {
        match permission(owner, observers, &w) {
            Ok(()) => allowed.push(w),
            Err(e) => {
                let _ = w.reply.send(Err(e));
            }
        }
    }
    allowed
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

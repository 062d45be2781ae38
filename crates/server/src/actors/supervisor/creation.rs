//! New conversations: [`create_conversation`] makes the workspace in the
//! caller's task and asks the supervisor, which (in cluster mode, after
//! claiming the new id in a task) makes room under the per-user limit and
//! starts the actor.

use std::sync::Arc;
use std::time::Duration;

use ractor::ActorRef;

use super::calls::{activation_reply, ActivateError, ActivateReply, Activated, CALL_TIMEOUT};
use super::cluster::claim_new;
use super::{State, SupervisorMsg};
use crate::actors::conversation::Origin;
use crate::cluster::lease::Activity;
use crate::event::StartReason;
use crate::store::workspace_dir;

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
    let called = supervisor
        .call(
            |reply| {
                SupervisorMsg::Create(Box::new(Creation {
                    id,
                    user,
                    title,
                    close_delay,
                    reason,
                    reply,
                }))
            },
            Some(CALL_TIMEOUT),
        )
        .await;
    let result = activation_reply(called);
    if result.is_err() {
        let _ = tokio::fs::remove_dir(&workspace).await;
    }
    result
}

/// A creation, as asked.
pub struct Creation {
    pub(super) id: Arc<str>,
    pub(super) user: Arc<str>,
    title: String,
    close_delay: Option<Duration>,
    reason: StartReason,
    pub(super) reply: ActivateReply,
}

impl State {
    pub(super) async fn create(&mut self, myself: &ActorRef<SupervisorMsg>, create: Box<Creation>) {
        match &self.cluster {
            // The new id is claimed first (lease and fence), in a task: the
            // supervisor never waits on NATS.
            Some(cluster) => {
                let cluster = cluster.clone();
                let me = myself.clone();
                tokio::spawn(async move {
                    let result = claim_new(&cluster, &create.id, &create.user).await;
                    let _ = me.cast(SupervisorMsg::Claimed { create, result });
                });
            }
            None => self.create_claimed(myself, create, Vec::new()).await,
        }
    }

    /// Creates a conversation whose id is this node's (cluster mode: its
    /// lease is held and its fence written); `others` are its user's
    /// active conversations on other nodes.
    pub(super) async fn create_claimed(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        create: Box<Creation>,
        others: Vec<Activity>,
    ) {
        let create = *create;
        let result = if self.shutdown.is_some() {
            Err(ActivateError::ShuttingDown)
        } else {
            match self.make_room(&create.user, Some(&create.id), others) {
                Ok(()) => {
                    let origin = Origin::New {
                        title: create.title,
                        close_delay: create.close_delay,
                        reason: create.reason,
                    };
                    let (id, user) = (create.id.clone(), create.user);
                    self.spawn(myself, id, user, Vec::new(), origin).await
                }
                Err(e) => Err(e),
            }
        };
        if result.is_err() {
            self.release(&create.id);
        }
        let _ = create.reply.send(result);
    }
}

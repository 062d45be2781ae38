//! Cluster mode's part of the supervisor: claiming a conversation before
//! it runs here (in tasks, never in a handler), stand-ins
//! (`RemoteConversation`) for conversations other nodes run, stops asked
//! of their owners, lost ownership, and closing the conversations of a lost
//! node. In single mode (`cluster: None`) each of these does nothing.

use std::sync::Arc;

use ractor::{Actor, ActorId, ActorRef, RpcReplyPort};
use serde_json::json;
use tracing::warn;

use super::activation::{permitted, Found};
use super::calls::{ActivateError, Activated};
use super::{State, SupervisorMsg, Waiter};
use crate::actors::supervision_log::NewDecision;
use crate::cluster::lease::Activity;
use crate::cluster::node::ClusterNode;
use crate::cluster::ownership::Claim;
use crate::cluster::remote::proxy::{stop_on_owner, ProxyArgs, RemoteConversation};
use crate::cluster::remote::wire::StopKind;
use crate::protocol::{Status, StopReason};
use crate::store::{ConversationMeta, Store, StoreError};

impl State {
    /// Gives up this node's ownership record of a conversation that does
    /// not run here (any more).
    pub(super) fn release(&self, id: &Arc<str>) {
        if let Some(cluster) = &self.cluster {
            if let Some(released) = cluster.ownership.forget(id) {
                cluster.ownership.give_back_soon(released);
            }
        }
    }

    /// The node that runs `id` when this one only holds a stand-in for it.
    pub(super) fn owner_elsewhere(&self, id: &Arc<str>) -> Option<(Arc<ClusterNode>, String)> {
        match (self.proxies.get(id), &self.cluster) {
            (Some((_, owner)), Some(cluster)) if !self.active.contains_key(id) => {
                Some((cluster.clone(), owner.clone()))
            }
            _ => None,
        }
    }

    /// A stand-in stopped: forgotten unless a newer one replaced it.
    pub(super) fn proxy_gone(&mut self, actor: ActorId) {
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

    /// This node lost `id` to another node: the conversation stops without
    /// writing (another node may run it now).
    pub(super) fn lease_lost(&mut self, id: &str) {
        if let Some(entry) = self.active.get_mut(id) {
            entry.stopping.get_or_insert(StopReason::NodeLost);
            let _ = entry
                .actor
                .cast(crate::actors::conversation::ConversationMsg::Moved);
            self.decisions.record(NewDecision {
                rule: "lease_lost",
                conversation: Some(id),
                user: Some(&entry.user),
                inputs: json!({}),
                outcome: "moved",
            });
        }
    }

    /// A conversation whose owner may be gone.
    pub(super) fn recover(&mut self, myself: &ActorRef<SupervisorMsg>, id: Arc<str>) {
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

    pub(super) fn recovered(
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

    /// Answers activations of a conversation another node runs with this
    /// node's stand-in for it (one per conversation and owner).
    pub(super) async fn reach_elsewhere(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        id: Arc<str>,
        waiters: Vec<Waiter>,
        meta: &ConversationMeta,
        node: String,
    ) {
        let Some(cluster) = self.cluster.clone() else {
            return;
        };
        let mut reachable = Vec::new();
        for w in waiters {
            if w.local_only {
                let _ = w.reply.send(Err(ActivateError::Elsewhere));
            } else {
                reachable.push(w);
            }
        }
        let allowed = permitted(reachable, &meta.user, &meta.observers);
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
}

/// Asks `owner` to stop `id` for `kind`, in a task; `then` is answered
/// once the owner has answered.
pub(super) fn spawn_stop_on_owner(
    cluster: Arc<ClusterNode>,
    owner: String,
    id: Arc<str>,
    kind: StopKind,
    then: Option<RpcReplyPort<()>>,
) {
    tokio::spawn(async move {
        stop_on_owner(&cluster.client, &cluster.subjects, &owner, &id, kind).await;
        if let Some(reply) = then {
            let _ = reply.send(());
        }
    });
}

/// Before a delete: a conversation another node runs is stopped there
/// first, so that it writes nothing after the history is gone.
pub(super) async fn stop_owner_before_delete(cluster: &ClusterNode, id: &str) {
    if let Ok(Some(holder)) = cluster.ownership.leases().holder(id).await {
        if holder.node != cluster.node {
            stop_on_owner(
                &cluster.client,
                &cluster.subjects,
                &holder.node,
                id,
                StopKind::Deleted,
            )
            .await;
        }
    }
}

/// Reads a conversation to activate it, claiming it first. Another live
/// node's conversation is reached there; one whose owner died without
/// closing it is closed here (`node_lost`) before it runs again.
pub(super) async fn load_in_cluster(
    cluster: &ClusterNode,
    store: &Arc<dyn Store>,
    id: &str,
    tail: usize,
    window: usize,
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
    Ok(store
        .snapshot(id, tail, window)
        .await?
        .map(|s| Found::Here {
            snapshot: Box::new(s),
            others,
            resume: None,
        }))
}

/// Claims a new conversation's id for this node; returns its user's active
/// conversations on the other nodes.
pub(super) async fn claim_new(
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

/// Claims a conversation (unless `claimed` already) and, if it is stored as
/// active while nobody runs it, records that its node was lost.
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
    let Some(snapshot) = store.snapshot(id, 0, 0).await? else {
        return Ok(());
    };
    if snapshot.meta.status == Status::Stopped {
        return Ok(());
    }
    crate::recovery::close(store, &snapshot.meta, StopReason::NodeLost)
        .await
        .map_err(|_| StoreError::Closed)??;
    // The dead node's entry would count against the user until read and
    // skipped; gone before anyone activates it again (we hold it now).
    if let Err(e) = cluster
        .ownership
        .leases()
        .remove_activity(&snapshot.meta.user, id)
        .await
    {
        warn!(conversation = %id, error = %e, "withdrawing a lost node's activity failed");
    }
    Ok(())
}

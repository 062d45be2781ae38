//! Delete as one operation: while an id is in `deleting` no activation is
//! let through; the actor (if any) stops with `deleted` first, a snapshot
//! read under way finishes first, then a task removes the history and the
//! workspace and reports back (`Deleted`) to everyone who asked.

use std::sync::Arc;

use ractor::{ActorRef, RpcReplyPort};
use serde_json::json;

use super::cluster::stop_owner_before_delete;
use super::{State, SupervisorMsg};
use crate::protocol::StopReason;
use crate::store::StoreError;

impl State {
    pub(super) fn delete(
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
    pub(super) fn start_deleting(&mut self, myself: &ActorRef<SupervisorMsg>, id: Arc<str>) {
        let store = self.store.clone();
        let workspace = self.workspace(&id);
        let me = myself.clone();
        let cluster = self.cluster.clone();
        tokio::spawn(async move {
            if let Some(cluster) = &cluster {
                stop_owner_before_delete(cluster, &id).await;
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

    /// The delete task's outcome, to everyone who asked.
    pub(super) fn deleted(&mut self, id: &Arc<str>, result: Result<bool, StoreError>) {
        for reply in self.deleting.remove(id).unwrap_or_default() {
            let _ = reply.send(result.clone());
        }
    }
}

//! Which conversations this node owns: claiming one (lease, then fence),
//! keeping the leases alive, and giving them up.
//!
//! A claim takes the lease with the next term (the log head's term + 1)
//! and then writes the fence ([`NatsStore::take_over`]); only after both is
//! a conversation actor started here. A lease held by another live node
//! makes the claim answer [`Claim::Elsewhere`]: the caller then reaches the
//! conversation through its owner ([`super::remote`]).
//!
//! One task renews every held lease each third of `lease_ttl`. A renewal
//! refused because the lease was lost (it expired while this node was
//! paused or cut off, and someone else may have taken over) is reported on
//! the `lost` channel: the supervisor stops that conversation here without
//! writing (its clients get `detached moved`). A renewal that fails because
//! NATS cannot answer is retried at the next tick: the fence, not the
//! lease, keeps seq safe meanwhile.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{info, warn};

use super::lease::{Activity, Lease, Leases};
use super::store::NatsStore;
use super::ClusterError;
use crate::actors::gauge::ConversationGauge;
use crate::protocol::Status;
use crate::store::StoreError;

/// The outcome of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This node owns the conversation now (or already did).
    Owned,
    /// Another live node does.
    Elsewhere(String),
}

/// A running conversation's owner and gauge, published with its lease.
#[derive(Clone)]
struct Tracked {
    user: Arc<str>,
    gauge: Arc<ConversationGauge>,
}

/// A lease given up by [`Ownership::forget`], to hand back.
pub struct Released {
    lease: Lease,
    user: Option<Arc<str>>,
}

/// This node's leases.
#[derive(Clone)]
pub struct Ownership {
    leases: Leases,
    store: NatsStore,
    held: Arc<Mutex<HashMap<String, Lease>>>,
    tracked: Arc<Mutex<HashMap<String, Tracked>>>,
    lease_ttl: Duration,
    /// Leases being given back, waited for at shutdown so that other nodes
    /// may claim this node's conversations at once, not after `lease_ttl`.
    returns: tokio_util::task::TaskTracker,
}

impl Ownership {
    pub fn new(leases: Leases, store: NatsStore, lease_ttl: Duration) -> Ownership {
        Ownership {
            leases,
            store,
            held: Arc::default(),
            tracked: Arc::default(),
            lease_ttl,
            returns: tokio_util::task::TaskTracker::new(),
        }
    }

    pub fn node(&self) -> &str {
        self.leases.node()
    }

    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<String, Lease>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn tracked(&self) -> std::sync::MutexGuard<'_, HashMap<String, Tracked>> {
        self.tracked.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn activity(&self, conversation: &str, tracked: &Tracked) -> Activity {
        Activity {
            conversation: conversation.to_owned(),
            node: self.node().to_owned(),
            running: matches!(tracked.gauge.status(), Status::Running | Status::Waiting),
            attached: tracked.gauge.attached() > 0,
            last_activity_us: tracked.gauge.last_activity_unix_us(),
        }
    }

    /// A conversation of `user` runs here now: other nodes count it
    /// against the user's limit (published at once, then with each
    /// renewal).
    pub fn track(&self, conversation: &str, user: Arc<str>, gauge: Arc<ConversationGauge>) {
        let tracked = Tracked { user, gauge };
        let activity = self.activity(conversation, &tracked);
        self.tracked()
            .insert(conversation.to_owned(), tracked.clone());
        let leases = self.leases.clone();
        tokio::spawn(async move {
            if let Err(e) = leases.put_activity(&tracked.user, &activity).await {
                warn!(conversation = %activity.conversation, error = %e, "publishing activity failed");
            }
        });
    }

    /// A user's active conversations on the other nodes.
    pub async fn others_of(&self, user: &str) -> Result<Vec<Activity>, StoreError> {
        Ok(self
            .leases
            .user_activity(user)
            .await?
            .into_iter()
            .filter(|a| a.node != self.node())
            .collect())
    }

    pub fn owns(&self, conversation: &str) -> bool {
        self.held().contains_key(conversation)
    }

    /// Makes this node the conversation's owner unless another live node
    /// is. A lease this node's earlier run still holds (same `node_id`,
    /// restarted before it expired) is not trusted: it is waited out.
    pub async fn claim(&self, conversation: &str) -> Result<Claim, StoreError> {
        if self.owns(conversation) {
            return Ok(Claim::Owned);
        }
        // A lease of ours that we do not hold is either being given back
        // (a stop or a takeover's close a moment ago) or left by this
        // node's earlier run; either is gone within lease_ttl.
        let own_deadline = tokio::time::Instant::now() + self.lease_ttl + Duration::from_secs(1);
        let mut attempts = 0;
        while attempts < 3 {
            if let Some(holder) = self.leases.holder(conversation).await? {
                if holder.node != self.node() {
                    return Ok(Claim::Elsewhere(holder.node));
                }
                if tokio::time::Instant::now() >= own_deadline {
                    return Err(StoreError::Unavailable(format!(
                        "{conversation}: this node's earlier run still holds its lease; \
                         it expires within cluster.lease_ttl"
                    )));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            attempts += 1;
            let head = self.store.log().head(conversation).await?;
            let term = head.term + 1;
            let lease = match self.leases.acquire(conversation, term).await {
                Ok(lease) => lease,
                Err(ClusterError::LeaseHeld { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            match self
                .store
                .take_over_from(conversation, term, Some(head))
                .await
            {
                Ok(_) => {
                    self.held().insert(conversation.to_owned(), lease);
                    return Ok(Claim::Owned);
                }
                Err(e) => {
                    // Someone wrote a later term between our head read and
                    // the fence (or NATS failed): give the lease back.
                    let _ = self.leases.release(lease).await;
                    if !matches!(e, StoreError::Fenced { .. }) {
                        return Err(e);
                    }
                }
            }
        }
        Err(StoreError::Unavailable(format!(
            "{conversation}: ownership kept changing while claiming it"
        )))
    }

    /// Stops writing for a conversation here (it stopped, or moved) and
    /// hands back its lease for [`Ownership::give_back`]. Appends already
    /// queued are still committed first.
    pub fn forget(&self, conversation: &str) -> Option<Released> {
        self.store.disown(conversation);
        let user = self.tracked().remove(conversation).map(|t| t.user);
        self.held()
            .remove(conversation)
            .map(|lease| Released { lease, user })
    }

    /// Gives a lease [`Ownership::forget`] handed back, in a task.
    pub fn give_back_soon(&self, released: Released) {
        let ownership = self.clone();
        self.returns
            .spawn(async move { ownership.give_back(released).await });
    }

    /// Waits for the leases being given back (shutdown).
    pub async fn returned(&self) {
        self.returns.close();
        self.returns.wait().await;
    }

    /// Deletes a lease [`Ownership::forget`] handed back, so that another
    /// node may claim the conversation at once.
    pub async fn give_back(&self, released: Released) {
        let conversation = released.lease.conversation.clone();
        if let Some(user) = released.user {
            if let Err(e) = self.leases.remove_activity(&user, &conversation).await {
                warn!(conversation, error = %e, "withdrawing activity failed; it expires by itself");
            }
        }
        if let Err(e) = self.leases.release(released.lease).await {
            warn!(conversation, error = %e, "releasing a lease failed; it expires by itself");
        }
    }

    /// Renews every held lease each third of `lease_ttl`, forever; sends
    /// the id of each lease found lost on `lost`.
    pub async fn keep_alive(self, lost: mpsc::UnboundedSender<String>) {
        let mut ticker = tokio::time::interval(self.lease_ttl / 3);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let leases: Vec<Lease> = self.held().values().cloned().collect();
            let renewals = leases.into_iter().map(|mut lease| {
                let leases = self.leases.clone();
                async move {
                    let result = leases.renew(&mut lease).await;
                    (lease, result)
                }
            });
            for (lease, result) in futures_util::future::join_all(renewals).await {
                match result {
                    Ok(()) => {
                        // Unless released meanwhile, keep the new revision.
                        if let Some(held) = self.held().get_mut(&lease.conversation) {
                            held.revision = lease.revision;
                        }
                    }
                    Err(ClusterError::LeaseHeld {
                        conversation,
                        holder,
                    }) => {
                        // Expired with nobody else holding it (NATS was
                        // unreachable longer than lease_ttl): taken again
                        // with the same term. Safe: if another node has
                        // taken over meanwhile, the fence refuses our next
                        // append anyway.
                        if holder.is_empty() {
                            if let Ok(again) = self.leases.acquire(&conversation, lease.term).await
                            {
                                info!(conversation = %conversation,
                                    "lease had expired with nobody else holding it: taken again");
                                if let Some(held) = self.held().get_mut(&conversation) {
                                    *held = again;
                                }
                                continue;
                            }
                        }
                        info!(conversation = %conversation, holder = %holder,
                            "lease lost: the conversation stops here");
                        self.held().remove(&conversation);
                        self.tracked().remove(&conversation);
                        self.store.disown(&conversation);
                        let _ = lost.send(conversation);
                    }
                    Err(e) => {
                        warn!(conversation = %lease.conversation, error = %e,
                            "renewing a lease failed; retrying")
                    }
                }
            }
            let tracked: Vec<(String, Tracked)> = self
                .tracked()
                .iter()
                .map(|(id, t)| (id.clone(), t.clone()))
                .collect();
            let publishes = tracked.into_iter().map(|(id, t)| {
                let activity = self.activity(&id, &t);
                let leases = self.leases.clone();
                async move { leases.put_activity(&t.user, &activity).await }
            });
            for result in futures_util::future::join_all(publishes).await {
                if let Err(e) = result {
                    warn!(error = %e, "publishing activity failed; retrying");
                }
            }
        }
    }
}

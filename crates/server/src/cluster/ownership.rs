//! Which conversations this node owns: claiming one (ownership record,
//! then fence), keeping this node's heartbeat alive, learning that a
//! conversation was taken, and giving records up.
//!
//! A claim writes the record with the next term (the log head's term + 1)
//! and then the fence ([`NatsStore::take_over`]); only after both is a
//! conversation actor started here. A record held by another live node
//! makes the claim answer [`Claim::Elsewhere`]: the caller then reaches the
//! conversation through its owner ([`super::remote`]).
//!
//! One task renews this node's heartbeat each third of `lease_ttl` and
//! publishes the activity of conversations whose class inputs changed.
//! Another watches the ownership records: a record of a conversation held
//! here, rewritten by another node (it took over while this node was
//! paused or cut off), is reported on the `lost` channel, and the
//! supervisor stops that conversation here without writing (its clients
//! get `detached moved`). A renewal that fails because NATS cannot answer
//! is retried at the next tick: the fence, not the heartbeat, keeps seq
//! safe meanwhile.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::{error, info, warn};

use super::lease::{Activity, Lease, Leases, Lookup};
use super::liveness::{Departure, Renewal};
use super::store::NatsStore;
use super::ClusterError;
use crate::actors::gauge::ConversationGauge;
use crate::protocol::Status;
use crate::store::StoreError;

/// A running conversation's last activity is published at most this often
/// while only its time changes (a flip of running or attached is published
/// at the next tick): eviction ranks a user's running conversations by it,
/// and a second or ten of staleness does not change which class goes first.
const RUNNING_ACTIVITY_EVERY: Duration = Duration::from_secs(10);

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
    /// What was last published, and when.
    published: Option<(Activity, Instant)>,
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
    /// The revision of this node's heartbeat (0: not announced yet).
    heartbeat: Arc<AtomicU64>,
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
            heartbeat: Arc::default(),
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
            incarnation: self.leases.liveness().incarnation().to_owned(),
            running: matches!(tracked.gauge.status(), Status::Running | Status::Waiting),
            attached: tracked.gauge.attached() > 0,
            last_activity_us: tracked.gauge.last_activity_unix_us(),
        }
    }

    /// A conversation of `user` runs here now: other nodes count it
    /// against the user's limit (published at once, then with each
    /// renewal).
    pub fn track(&self, conversation: &str, user: Arc<str>, gauge: Arc<ConversationGauge>) {
        let mut tracked = Tracked {
            user,
            gauge,
            published: None,
        };
        let activity = self.activity(conversation, &tracked);
        tracked.published = Some((activity.clone(), Instant::now()));
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
    /// is. A record this node's earlier run left (same `node_id`, another
    /// incarnation) is an orphan like any other.
    pub async fn claim(&self, conversation: &str) -> Result<Claim, StoreError> {
        if self.owns(conversation) {
            return Ok(Claim::Owned);
        }
        // A record of this very process that is not held is being given
        // back (a stop or a takeover's close a moment ago): wait for it.
        let own_deadline = tokio::time::Instant::now() + self.lease_ttl + Duration::from_secs(1);
        let mut attempts = 0;
        while attempts < 3 {
            let orphan = match self.leases.lookup(conversation).await? {
                Lookup::Held(holder) if self.leases.is_mine(&holder) => {
                    if tokio::time::Instant::now() >= own_deadline {
                        return Err(StoreError::Unavailable(format!(
                            "{conversation}: this node is still giving it back"
                        )));
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Lookup::Held(holder) => return Ok(Claim::Elsewhere(holder.node)),
                Lookup::Free { revision } => revision,
            };
            attempts += 1;
            let head = self.store.log().head(conversation).await?;
            let term = head.term + 1;
            let lease = match self.leases.acquire(conversation, term, orphan).await {
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
                    // the fence (or NATS failed): give the record back.
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
    /// hands back its lease for [`Ownership::give_back_soon`]. Appends already
    /// queued are still committed first.
    pub fn forget(&self, conversation: &str) -> Option<Released> {
        self.store.disown(conversation);
        let user = self.tracked().remove(conversation).map(|t| t.user);
        self.held()
            .remove(conversation)
            .map(|lease| Released { lease, user })
    }

    /// Gives a lease [`Ownership::forget`] handed back, in a task. The
    /// task holds the leases' handle only (a pointer), not a copy of this
    /// node's whole `Ownership` (about 7 KiB): one runs per conversation
    /// that stops.
    pub fn give_back_soon(&self, released: Released) {
        let leases = self.leases.clone();
        self.returns
            .spawn(async move { give_back(&leases, released).await });
    }

    /// Waits for the records being given back, then removes this node's
    /// heartbeat (shutdown): other nodes need not wait for it to age out.
    pub async fn returned(&self) {
        self.returns.close();
        self.returns.wait().await;
        let revision = self.heartbeat.load(Ordering::Relaxed);
        if revision != 0 {
            if let Err(e) = self.leases.liveness().withdraw(revision).await {
                warn!(error = %e, "removing this node's heartbeat failed; it ages out by itself");
            }
        }
    }

    /// Writes this node's heartbeat (at start, before any claim), unless
    /// a live node speaks another version of the cluster's wire.
    pub async fn announce(&self) -> Result<(), ClusterError> {
        self.leases.liveness().refuse_other_versions().await?;
        let revision = self.leases.liveness().announce().await?;
        self.heartbeat.store(revision, Ordering::Relaxed);
        Ok(())
    }

    /// Everything this node holds is lost (another process took its node
    /// id): each is reported on `lost`.
    fn lose_everything(&self, lost: &mpsc::UnboundedSender<String>) {
        let held: Vec<String> = self.held().drain().map(|(c, _)| c).collect();
        for conversation in held {
            self.tracked().remove(&conversation);
            self.store.disown(&conversation);
            let _ = lost.send(conversation);
        }
    }

    /// Renews this node's heartbeat each third of `lease_ttl`, forever, and
    /// publishes the activity that changed.
    pub async fn keep_alive(self, lost: mpsc::UnboundedSender<String>) {
        let mut ticker = tokio::time::interval(self.lease_ttl / 3);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let revision = self.heartbeat.load(Ordering::Relaxed);
            match self.leases.liveness().renew(revision).await {
                Ok(Renewal::Renewed(r)) => self.heartbeat.store(r, Ordering::Relaxed),
                Ok(Renewal::Restored(r)) => {
                    self.heartbeat.store(r, Ordering::Relaxed);
                    warn!(node = %self.node(),
                        "this node's heartbeat had aged out (paused, or cut off from NATS, for \
                         longer than cluster.lease_ttl): conversations another node took over \
                         meanwhile stop here as their new records arrive");
                }
                Ok(Renewal::Replaced(other)) => {
                    error!(node = %self.node(), other_incarnation = %other,
                        "another process runs with this node's cluster.node_id: this one stops \
                         every conversation it ran; give each node its own id");
                    self.lose_everything(&lost);
                }
                Err(e) => warn!(error = %e, "renewing this node's heartbeat failed; retrying"),
            }
            self.publish_changed_activity().await;
        }
    }

    async fn publish_changed_activity(&self) {
        let due: Vec<(String, Arc<str>, Activity)> = {
            let mut tracked = self.tracked();
            let mut due = Vec::new();
            for (id, t) in tracked.iter_mut() {
                let now = self.activity(id, t);
                let publish = match &t.published {
                    None => true,
                    Some((before, at)) => {
                        before.running != now.running
                            || before.attached != now.attached
                            || (before.last_activity_us != now.last_activity_us
                                && (!now.running || at.elapsed() >= RUNNING_ACTIVITY_EVERY))
                    }
                };
                if publish {
                    t.published = Some((now.clone(), Instant::now()));
                    due.push((id.clone(), t.user.clone(), now));
                }
            }
            due
        };
        let publishes = due.into_iter().map(|(_, user, activity)| {
            let leases = self.leases.clone();
            async move { leases.put_activity(&user, &activity).await }
        });
        for result in futures_util::future::join_all(publishes).await {
            if let Err(e) = result {
                warn!(error = %e, "publishing activity failed; retrying");
            }
        }
    }

    /// Watches the ownership records, forever: a conversation held here
    /// whose record another node rewrote is reported on `lost`.
    pub async fn watch_records(self, lost: mpsc::UnboundedSender<String>) {
        loop {
            let error = self
                .leases
                .watch(|conversation, holder, revision| {
                    if self.leases.is_mine(holder) {
                        return;
                    }
                    let mut held = self.held();
                    if held
                        .get(conversation)
                        .is_none_or(|lease| lease.revision >= revision)
                    {
                        return;
                    }
                    held.remove(conversation);
                    drop(held);
                    info!(conversation, holder = %holder.node,
                        "another node took the conversation over: it stops here");
                    self.tracked().remove(conversation);
                    self.store.disown(conversation);
                    let _ = lost.send(conversation.to_owned());
                })
                .await;
            warn!(error = %error, "watching ownership records failed; watching again");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// A departed node's conversations, split between the survivors: those
    /// this node should close first, and those it closes only if the
    /// survivor they fall to has not after a while (it may be gone too).
    /// The split is a preference, so that survivors do not all race for
    /// every conversation; claims stay safe without it.
    pub fn orphans(&self, departure: &Departure) -> (Vec<String>, Vec<String>) {
        let survivors: Vec<String> = self
            .leases
            .liveness()
            .live_nodes()
            .into_iter()
            .filter(|n| *n != departure.node)
            .collect();
        let me = self.node();
        self.leases
            .orphans_of(departure)
            .into_iter()
            .filter(|c| !self.owns(c))
            .partition(|c| preferred(c, &survivors).is_none_or(|n| n == me))
    }

    /// Those of `later` (from [`Ownership::orphans`]) still held by the
    /// departed node.
    pub fn still_orphaned(&self, departure: &Departure, later: Vec<String>) -> Vec<String> {
        let left: std::collections::HashSet<String> =
            self.leases.orphans_of(departure).into_iter().collect();
        later.into_iter().filter(|c| left.contains(c)).collect()
    }
}

/// Which survivor closes an orphaned conversation first: spread by a hash
/// of its id. Every node runs the same build in practice; if two builds
/// hashed differently the only cost is a race the claim already handles.
fn preferred<'a>(conversation: &str, survivors: &'a [String]) -> Option<&'a str> {
    if survivors.is_empty() {
        return None;
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    conversation.hash(&mut hasher);
    let at = (hasher.finish() % survivors.len() as u64) as usize;
    Some(survivors[at].as_str())
}

/// Withdraws a released conversation's activity and deletes its ownership
/// record, so that another node may claim it at once.
async fn give_back(leases: &Leases, released: Released) {
    let conversation = released.lease.conversation.clone();
    if let Some(user) = released.user {
        if let Err(e) = leases.remove_activity(&user, &conversation).await {
            warn!(conversation, error = %e, "withdrawing activity failed; it expires by itself");
        }
    }
    if let Err(e) = leases.release(released.lease).await {
        warn!(conversation, error = %e, "releasing a lease failed; it expires by itself");
    }
}

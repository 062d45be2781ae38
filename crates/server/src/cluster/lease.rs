//! Ownership records: which node process runs a conversation.
//!
//! The owners bucket (no TTL, history 1) has a key per active conversation
//! holding `{node, incarnation, term}`. A record is only as good as its
//! holder's heartbeat ([`super::liveness`]): while that names the same
//! incarnation the conversation is held, and once it ages out or names
//! another incarnation the record is an orphan anyone may replace. So a
//! node keeps all its conversations with one heartbeat, and a record is
//! written once per claim, not renewed.
//!
//! Acquire is KV `create` when no record exists, or `update` with the
//! revision of the orphaned record it read, so two claimants cannot both
//! win; release purges with the expected revision (the purge marker ages
//! out). The term comes from the log (its head's term + 1), not from the
//! record, and a record never authorizes an append: the fence does
//! ([`super::log`]).
//!
//! Every node watches the bucket ([`Leases::watch`]): that is how it keeps
//! a view of who holds what (to find a departed node's conversations) and
//! how it learns at once that a conversation it runs was claimed by
//! another node.
//!
//! Cluster-wide per-user counts: beside each record, its holder keeps a key
//! `u.<hex user>.<conversation>` in the same bucket with what eviction
//! needs to know ([`Activity`]), written when that changes. A user's
//! active conversations are the subjects matching `u.<hex user>.*` (stream
//! info with a subject filter answers that from the server's subject
//! index), read one by one; entries whose holder is gone are skipped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv::{self, CreateErrorKind, Operation, UpdateErrorKind};
use serde::{Deserialize, Serialize};

use super::liveness::{Departure, Liveness};
use super::{check_token, with_deadline, Cluster, ClusterError};

/// How long a released record's purge marker stays (then the key is gone
/// from the bucket altogether).
const RELEASED_MARKER_TTL: Duration = Duration::from_secs(60);

/// The value of an ownership record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub node: String,
    pub incarnation: String,
    pub term: u64,
}

/// What other nodes need to know to count and evict a user's
/// conversation (protocol §6 classes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activity {
    pub conversation: String,
    pub node: String,
    /// The holder's process: an entry left by a node that died is skipped.
    #[serde(default)]
    pub incarnation: String,
    pub running: bool,
    pub attached: bool,
    /// Unix time of the last activity, in microseconds.
    pub last_activity_us: u64,
}

fn activity_key(user: &str, conversation: &str) -> String {
    format!("u.{}.{conversation}", super::meta::user_token(user))
}

/// A record this node wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub conversation: String,
    pub term: u64,
    /// The KV revision written; a release must match it.
    pub revision: u64,
}

/// A conversation's record, as the bucket's leader has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// A live node process holds it.
    Held(Holder),
    /// Nobody live does; `revision` is that of the orphaned record to
    /// replace (`None`: there is none).
    Free { revision: Option<u64> },
}

/// The owners bucket, seen from one node. Cloned into every remote
/// attachment's proxy and route and into each activity publish, so a
/// clone is a pointer: the bucket handles inside are about 4 KiB, which
/// every proxy's actor kept twice (ractor holds a state in two slots).
#[derive(Clone)]
pub struct Leases {
    shared: Arc<Shared>,
}

struct Shared {
    cluster: Cluster,
    kv: kv::Store,
    liveness: Liveness,
    /// Who holds what, as the watch last showed it.
    seen: Mutex<HashMap<String, (Holder, u64)>>,
}

impl Leases {
    pub async fn open(cluster: &Cluster, liveness: Liveness) -> Result<Leases, ClusterError> {
        Ok(Leases {
            shared: Arc::new(Shared {
                kv: cluster.bucket(&cluster.options.owners_bucket()).await?,
                cluster: cluster.clone(),
                liveness,
                seen: Mutex::default(),
            }),
        })
    }

    pub fn node(&self) -> &str {
        self.shared.liveness.node()
    }

    pub fn liveness(&self) -> &Liveness {
        &self.shared.liveness
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Holder, u64)>> {
        self.shared.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This process's record with `term`, and its encoding.
    fn record(&self, term: u64) -> Result<(Holder, bytes::Bytes), ClusterError> {
        let holder = Holder {
            node: self.node().to_owned(),
            incarnation: self.shared.liveness.incarnation().to_owned(),
            term,
        };
        let value =
            serde_json::to_vec(&holder).map_err(|e| ClusterError::Corrupt(e.to_string()))?;
        Ok((holder, value.into()))
    }

    /// Whether `holder` is this very process.
    pub fn is_mine(&self, holder: &Holder) -> bool {
        holder.node == self.node() && holder.incarnation == self.shared.liveness.incarnation()
    }

    /// The conversation's record from the bucket's leader, and whether its
    /// holder is alive.
    pub async fn lookup(&self, conversation: &str) -> Result<Lookup, ClusterError> {
        check_token(conversation)?;
        let got = super::leader_entry(
            &self.shared.kv,
            conversation,
            self.shared.cluster.options.op_timeout,
            "reading an ownership record",
        )
        .await?;
        let Some((value, revision)) = got else {
            return Ok(Lookup::Free { revision: None });
        };
        let holder: Holder = serde_json::from_slice(&value)
            .map_err(|e| ClusterError::Corrupt(format!("owner of {conversation}: {e}")))?;
        if self
            .shared
            .liveness
            .is_alive(&holder.node, &holder.incarnation)
            .await?
        {
            Ok(Lookup::Held(holder))
        } else {
            Ok(Lookup::Free {
                revision: Some(revision),
            })
        }
    }

    /// Who holds the conversation, if a live node process does.
    pub async fn holder(&self, conversation: &str) -> Result<Option<Holder>, ClusterError> {
        match self.lookup(conversation).await? {
            Lookup::Held(holder) => Ok(Some(holder)),
            Lookup::Free { .. } => Ok(None),
        }
    }

    /// Writes this process's record with `term` (the log head's term + 1),
    /// replacing the orphaned record at `orphan` (from [`Leases::lookup`]).
    /// `LeaseHeld` when someone else wrote the record since.
    pub async fn acquire(
        &self,
        conversation: &str,
        term: u64,
        orphan: Option<u64>,
    ) -> Result<Lease, ClusterError> {
        check_token(conversation)?;
        let (holder, value) = self.record(term)?;
        let written = with_deadline(
            self.shared.cluster.options.op_timeout,
            "writing an ownership record",
            || async {
                let result = match orphan {
                    None => self
                        .shared
                        .kv
                        .create(conversation, value.clone())
                        .await
                        .map_err(|e| (e.kind() == CreateErrorKind::AlreadyExists, e.to_string())),
                    Some(revision) => self
                        .shared
                        .kv
                        .update(conversation, value.clone(), revision)
                        .await
                        .map_err(|e| {
                            (
                                e.kind() == UpdateErrorKind::WrongLastRevision,
                                e.to_string(),
                            )
                        }),
                };
                match result {
                    Ok(revision) => Ok(Some(revision)),
                    Err((true, _)) => Ok(None),
                    Err((false, e)) => Err(ClusterError::Unavailable(e)),
                }
            },
        )
        .await?;
        let Some(revision) = written else {
            return Err(ClusterError::LeaseHeld {
                conversation: conversation.to_owned(),
                holder: String::new(),
            });
        };
        self.note_written(conversation, holder, revision);
        Ok(Lease {
            conversation: conversation.to_owned(),
            term,
            revision,
        })
    }

    /// Gives the record up (a stop or a graceful shutdown). One replaced
    /// meanwhile is not an error.
    pub async fn release(&self, lease: Lease) -> Result<(), ClusterError> {
        with_deadline(
            self.shared.cluster.options.op_timeout,
            "releasing an ownership record",
            || async {
                match self
                    .shared
                    .kv
                    .purge_expect_revision_with_ttl(
                        &lease.conversation,
                        lease.revision,
                        RELEASED_MARKER_TTL,
                    )
                    .await
                {
                    Ok(()) => Ok(()),
                    Err(e) if e.kind() == kv::PurgeErrorKind::WrongLastRevision => Ok(()),
                    Err(e) => Err(ClusterError::Unavailable(e.to_string())),
                }
            },
        )
        .await?;
        self.note_removed(&lease.conversation, lease.revision);
        Ok(())
    }

    /// Our own writes and the watch's both update the view; whichever
    /// comes second must not undo a later one, hence the revisions.
    fn note_written(&self, conversation: &str, holder: Holder, revision: u64) {
        let mut seen = self.seen();
        if seen.get(conversation).is_none_or(|(_, r)| revision > *r) {
            seen.insert(conversation.to_owned(), (holder, revision));
        }
    }

    /// Forgets the record if what the view has was written at or before
    /// `revision`.
    fn note_removed(&self, conversation: &str, revision: u64) {
        let mut seen = self.seen();
        if seen.get(conversation).is_some_and(|(_, r)| *r <= revision) {
            seen.remove(conversation);
        }
    }

    /// The conversations the watch last showed held by `departure`'s node
    /// under an incarnation other than the one that replaced it.
    pub fn orphans_of(&self, departure: &Departure) -> Vec<String> {
        self.seen()
            .iter()
            .filter(|(_, (h, _))| {
                h.node == departure.node
                    && departure
                        .except
                        .as_deref()
                        .is_none_or(|keep| h.incarnation != keep)
            })
            .map(|(c, _)| c.clone())
            .collect()
    }

    /// Watches every ownership record (first the current ones, then
    /// changes), keeping [`Leases::orphans_of`]'s view; calls `claimed`
    /// with each record written (conversation, holder, revision). Returns
    /// when the watch breaks; the caller watches again.
    pub async fn watch(&self, mut claimed: impl FnMut(&str, &Holder, u64)) -> ClusterError {
        super::watch_kv(&self.shared.kv, "*", |entry| {
            match entry.operation {
                Operation::Put => {
                    if let Ok(holder) = serde_json::from_slice::<Holder>(&entry.value) {
                        claimed(&entry.key, &holder, entry.revision);
                        self.note_written(&entry.key, holder, entry.revision);
                    }
                }
                Operation::Delete | Operation::Purge => {
                    self.note_removed(&entry.key, entry.revision)
                }
            }
            Ok(())
        })
        .await
    }

    /// Publishes what eviction needs to know of a conversation this node
    /// runs.
    pub async fn put_activity(&self, user: &str, activity: &Activity) -> Result<(), ClusterError> {
        check_token(&activity.conversation)?;
        let value: bytes::Bytes = serde_json::to_vec(activity)
            .map_err(|e| ClusterError::Corrupt(e.to_string()))?
            .into();
        let key = activity_key(user, &activity.conversation);
        with_deadline(
            self.shared.cluster.options.op_timeout,
            "publishing activity",
            || async {
                self.shared
                    .kv
                    .put(&key, value.clone())
                    .await
                    .map(|_| ())
                    .map_err(|e| ClusterError::Unavailable(e.to_string()))
            },
        )
        .await
    }

    /// Withdraws a conversation's activity (it stopped, or its node died).
    pub async fn remove_activity(
        &self,
        user: &str,
        conversation: &str,
    ) -> Result<(), ClusterError> {
        let key = activity_key(user, conversation);
        with_deadline(
            self.shared.cluster.options.op_timeout,
            "withdrawing activity",
            || async {
                self.shared
                    .kv
                    .purge_with_ttl(&key, RELEASED_MARKER_TTL)
                    .await
                    .map_err(|e| ClusterError::Unavailable(e.to_string()))
            },
        )
        .await
    }

    /// A user's active conversations on every live node, as their holders
    /// last published them.
    pub async fn user_activity(&self, user: &str) -> Result<Vec<Activity>, ClusterError> {
        let pattern = format!("u.{}.*", super::meta::user_token(user));
        let keys = super::kv_keys(
            &self.shared.kv,
            &pattern,
            self.shared.cluster.options.op_timeout,
            "listing a user's activity",
        )
        .await?;
        let mut out = Vec::new();
        for key in keys {
            let key = key.as_str();
            let value = with_deadline(
                self.shared.cluster.options.op_timeout,
                "reading a user's activity",
                || async {
                    self.shared
                        .kv
                        .get(key)
                        .await
                        .map_err(|e| ClusterError::Unavailable(e.to_string()))
                },
            )
            .await?;
            let Some(value) = value else { continue };
            let activity = serde_json::from_slice::<Activity>(&value)
                .map_err(|e| ClusterError::Corrupt(format!("activity {key}: {e}")))?;
            if self
                .shared
                .liveness
                .is_alive(&activity.node, &activity.incarnation)
                .await?
            {
                out.push(activity);
            }
        }
        Ok(out)
    }
}

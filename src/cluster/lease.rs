//! Ownership leases: which node should run a conversation.
//!
//! A KV bucket with `max_age = cluster.lease_ttl` and history 1: a key per
//! conversation holding `{node, term}`. JetStream's per-key expiry is per
//! message, so every renewal (a new revision) starts a fresh TTL and a key
//! its owner stopped renewing disappears after `lease_ttl`. The bucket has
//! subject delete markers (2.11 `limit_markers`): an expiry leaves a
//! `MaxAge` marker, which watchers see as a purge, so a surviving node
//! notices a dead node's lease without scanning ([`Leases::expiries`]). A
//! node that starts later finds expired leases by checking the holder of
//! each unfinished conversation ([`Leases::holder`]).
//!
//! Acquire is KV `create` (refused when a live lease exists); renew is KV
//! `update` with the revision last written (refused if anyone else wrote or
//! the key expired); release deletes with the expected revision. The term
//! comes from the log (its head's term + 1), not from the lease: an
//! expired lease leaves no term behind, and the log is what the fence
//! checks. A lease never authorizes an append; the fence does ([`super::log`]).
//!
//! Cluster-wide per-user counts: beside each lease, its holder keeps a key
//! `u.<hex user>.<conversation>` in the same bucket with what eviction
//! needs to know ([`Activity`]), rewritten at each renewal, so it expires
//! with the lease. A user's active conversations are the subjects matching
//! `u.<hex user>.*` (stream info with a subject filter answers that from
//! the server's subject index), read one by one (a deleted key's marker
//! also has a subject until it ages out).

use async_nats::jetstream::kv::{self, CreateErrorKind, Operation, UpdateErrorKind};
use futures_util::{Stream, StreamExt};
use serde::{Deserialize, Serialize};

use super::{check_token, with_deadline, Cluster, ClusterError};

/// The value of a lease key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub node: String,
    pub term: u64,
}

/// What other nodes need to know to count and evict a user's
/// conversation (protocol §6 classes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activity {
    pub conversation: String,
    pub node: String,
    pub running: bool,
    pub attached: bool,
    /// Unix time of the last activity, in microseconds.
    pub last_activity_us: u64,
}

fn activity_key(user: &str, conversation: &str) -> String {
    format!("u.{}.{conversation}", super::meta::user_token(user))
}

/// A lease this node holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub conversation: String,
    pub term: u64,
    /// The KV revision last written; renewals must match it.
    pub revision: u64,
}

/// The lease bucket, seen from one node.
#[derive(Clone)]
pub struct Leases {
    cluster: Cluster,
    kv: kv::Store,
    node: String,
}

impl Leases {
    pub async fn open(cluster: &Cluster, node: &str) -> Result<Leases, ClusterError> {
        check_token(node)?;
        Ok(Leases {
            kv: cluster.bucket(&cluster.options.lease_bucket()).await?,
            cluster: cluster.clone(),
            node: node.to_owned(),
        })
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    fn value(&self, term: u64) -> Result<bytes::Bytes, ClusterError> {
        serde_json::to_vec(&Holder {
            node: self.node.clone(),
            term,
        })
        .map(Into::into)
        .map_err(|e| ClusterError::Corrupt(e.to_string()))
    }

    /// Takes the lease if nobody holds a live one. `term` is the log head's
    /// term + 1.
    pub async fn acquire(&self, conversation: &str, term: u64) -> Result<Lease, ClusterError> {
        check_token(conversation)?;
        let value = self.value(term)?;
        let created = with_deadline(
            self.cluster.options.op_timeout,
            "acquiring a lease",
            || async {
                match self.kv.create(conversation, value.clone()).await {
                    Ok(revision) => Ok(Some(revision)),
                    Err(e) if e.kind() == CreateErrorKind::AlreadyExists => Ok(None),
                    Err(e) => Err(ClusterError::Unavailable(e.to_string())),
                }
            },
        )
        .await?;
        match created {
            Some(revision) => Ok(Lease {
                conversation: conversation.to_owned(),
                term,
                revision,
            }),
            None => Err(ClusterError::LeaseHeld {
                conversation: conversation.to_owned(),
                holder: self
                    .holder(conversation)
                    .await?
                    .map(|h| h.node)
                    .unwrap_or_default(),
            }),
        }
    }

    /// Renews a held lease; `LeaseHeld` means it was lost (expired, or
    /// taken), and the conversation must be stopped here.
    pub async fn renew(&self, lease: &mut Lease) -> Result<(), ClusterError> {
        let value = self.value(lease.term)?;
        let revision = lease.revision;
        let result = with_deadline(
            self.cluster.options.op_timeout,
            "renewing a lease",
            || async {
                match self
                    .kv
                    .update(&lease.conversation, value.clone(), revision)
                    .await
                {
                    Ok(r) => Ok(Some(r)),
                    Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => Ok(None),
                    Err(e) => Err(ClusterError::Unavailable(e.to_string())),
                }
            },
        )
        .await?;
        match result {
            Some(r) => {
                lease.revision = r;
                Ok(())
            }
            None => Err(ClusterError::LeaseHeld {
                conversation: lease.conversation.clone(),
                holder: self
                    .holder(&lease.conversation)
                    .await?
                    .map(|h| h.node)
                    .unwrap_or_default(),
            }),
        }
    }

    /// Gives the lease up (a stop or a graceful shutdown). A lease already
    /// lost is not an error.
    pub async fn release(&self, lease: Lease) -> Result<(), ClusterError> {
        with_deadline(
            self.cluster.options.op_timeout,
            "releasing a lease",
            || async {
                match self
                    .kv
                    .delete_expect_revision(&lease.conversation, Some(lease.revision))
                    .await
                {
                    Ok(()) => Ok(()),
                    Err(e) if e.kind() == kv::DeleteErrorKind::WrongLastRevision => Ok(()),
                    Err(e) => Err(ClusterError::Unavailable(e.to_string())),
                }
            },
        )
        .await
    }

    /// Who holds a live lease on the conversation, if anyone, as the
    /// bucket's leader has it (a follower may not have seen a claim yet).
    pub async fn holder(&self, conversation: &str) -> Result<Option<Holder>, ClusterError> {
        check_token(conversation)?;
        let value = super::leader_entry(
            &self.kv,
            conversation,
            self.cluster.options.op_timeout,
            "reading a lease",
        )
        .await?;
        match value {
            None => Ok(None),
            Some((v, _)) => serde_json::from_slice(&v)
                .map(Some)
                .map_err(|e| ClusterError::Corrupt(format!("lease {conversation}: {e}"))),
        }
    }

    /// Publishes what eviction needs to know of a conversation this node
    /// runs (with each renewal: it expires with the lease).
    pub async fn put_activity(&self, user: &str, activity: &Activity) -> Result<(), ClusterError> {
        check_token(&activity.conversation)?;
        let value: bytes::Bytes = serde_json::to_vec(activity)
            .map_err(|e| ClusterError::Corrupt(e.to_string()))?
            .into();
        let key = activity_key(user, &activity.conversation);
        with_deadline(
            self.cluster.options.op_timeout,
            "publishing activity",
            || async {
                self.kv
                    .put(&key, value.clone())
                    .await
                    .map(|_| ())
                    .map_err(|e| ClusterError::Unavailable(e.to_string()))
            },
        )
        .await
    }

    /// Withdraws a conversation's activity (it stopped here).
    pub async fn remove_activity(
        &self,
        user: &str,
        conversation: &str,
    ) -> Result<(), ClusterError> {
        let key = activity_key(user, conversation);
        with_deadline(
            self.cluster.options.op_timeout,
            "withdrawing activity",
            || async {
                self.kv
                    .delete(&key)
                    .await
                    .map_err(|e| ClusterError::Unavailable(e.to_string()))
            },
        )
        .await
    }

    /// A user's active conversations on every node, as their holders last
    /// published them.
    pub async fn user_activity(&self, user: &str) -> Result<Vec<Activity>, ClusterError> {
        let pattern = format!("u.{}.*", super::meta::user_token(user));
        let keys = super::kv_keys(
            &self.kv,
            &pattern,
            self.cluster.options.op_timeout,
            "listing a user's activity",
        )
        .await?;
        let mut out = Vec::new();
        for key in keys {
            let key = key.as_str();
            let value = with_deadline(
                self.cluster.options.op_timeout,
                "reading a user's activity",
                || async {
                    self.kv
                        .get(key)
                        .await
                        .map_err(|e| ClusterError::Unavailable(e.to_string()))
                },
            )
            .await?;
            if let Some(value) = value {
                match serde_json::from_slice::<Activity>(&value) {
                    Ok(a) => out.push(a),
                    Err(e) => return Err(ClusterError::Corrupt(format!("activity {key}: {e}"))),
                }
            }
        }
        Ok(out)
    }

    /// Conversations whose lease expired (its holder stopped renewing) from
    /// now on; a release is not an expiry. Ends when the watch breaks (the
    /// caller watches again after NATS trouble, and scans with `holder`).
    pub async fn expiries(
        &self,
    ) -> Result<impl Stream<Item = String> + Send + 'static, ClusterError> {
        let watch = self
            .kv
            .watch_all()
            .await
            .map_err(|e| ClusterError::Unavailable(e.to_string()))?;
        Ok(watch
            .take_while(|e| std::future::ready(e.is_ok()))
            .filter_map(|e| {
                std::future::ready(match e {
                    // Activity keys (`u.…`) expire with their lease.
                    Ok(entry)
                        if entry.operation == Operation::Purge && !entry.key.contains('.') =>
                    {
                        Some(entry.key)
                    }
                    _ => None,
                })
            }))
    }
}

//! Which nodes are alive: one heartbeat per node process, not one lease per
//! conversation.
//!
//! Each node process writes `n.<node>` = `{incarnation}` in the lease
//! bucket (`max_age = cluster.lease_ttl`, history 1, subject delete
//! markers) when it starts and renews it every third of `lease_ttl`. The
//! incarnation is new for every process, so a node restarted under the
//! same `node_id` replaces its heartbeat at once and everything its earlier
//! run owned is known to be orphaned without waiting for an expiry.
//!
//! Keeping a thousand conversations costs one write per `lease_ttl / 3`
//! instead of a thousand: per-conversation ownership records
//! ([`super::lease`]) are written once per claim and are valid while their
//! holder's heartbeat names the same incarnation.
//!
//! Every node watches the heartbeats and keeps what it saw ([`NodeState`]):
//! a heartbeat that ages out (the max-age marker arrives as a purge), is
//! deleted (graceful shutdown) or is replaced by another incarnation is a
//! [`Departure`], whose conversations the survivors take over. What the
//! watch has not shown yet (this node just started) is asked of the bucket's
//! leader. None of this decides who may append: the fence does.
//!
//! A heartbeat also says which [`WIRE_VERSION`] its node speaks. A node
//! refuses to join a cluster where a live node speaks another one
//! ([`Liveness::refuse_other_versions`]): builds whose nodes cannot
//! understand each other are never mixed by a rolling restart.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_nats::jetstream::kv::{self, Operation, UpdateErrorKind};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tracing::error;

use super::{check_token, kv_keys, with_deadline, Cluster, ClusterError};

/// The version of what nodes say to each other: the subjects and messages
/// between nodes, heartbeats, ownership and activity records, and the
/// events stream's layout. Raised by any change that a node of the earlier
/// build would misread; a change that earlier nodes can ignore safely (a
/// new request they leave unanswered) keeps it.
pub const WIRE_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Heartbeat {
    incarnation: String,
    /// Absent in the heartbeats of builds before the field: they speak
    /// version 1.
    #[serde(default = "first_wire_version")]
    wire: u32,
}

fn first_wire_version() -> u32 {
    1
}

/// What this node last saw of another node's heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeState {
    Alive(String),
    Gone,
}

/// A node process that stopped: its conversations held under any
/// incarnation but `except` (the one that replaced it, if any) are orphans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Departure {
    pub node: String,
    pub except: Option<String>,
}

/// The outcome of a heartbeat renewal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Renewal {
    /// Renewed; the new revision.
    Renewed(u64),
    /// The heartbeat had aged out (this process was paused or cut off from
    /// NATS for longer than `lease_ttl`) and was written again: other nodes
    /// may have taken over some of its conversations meanwhile.
    Restored(u64),
    /// Another process wrote this node's heartbeat: two processes run with
    /// one `node_id`.
    Replaced(String),
}

fn key(node: &str) -> String {
    format!("n.{node}")
}

/// This node's heartbeat and its view of the others'.
#[derive(Clone)]
pub struct Liveness {
    cluster: Cluster,
    kv: kv::Store,
    node: String,
    incarnation: String,
    seen: Arc<Mutex<HashMap<String, NodeState>>>,
}

impl Liveness {
    pub async fn open(cluster: &Cluster, node: &str) -> Result<Liveness, ClusterError> {
        check_token(node)?;
        Ok(Liveness {
            kv: cluster.bucket(&cluster.options.lease_bucket()).await?,
            cluster: cluster.clone(),
            node: node.to_owned(),
            incarnation: ulid::Ulid::new().to_string(),
            seen: Arc::default(),
        })
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn incarnation(&self) -> &str {
        &self.incarnation
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, HashMap<String, NodeState>> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn value(&self) -> Result<bytes::Bytes, ClusterError> {
        serde_json::to_vec(&Heartbeat {
            incarnation: self.incarnation.clone(),
            wire: WIRE_VERSION,
        })
        .map(Into::into)
        .map_err(|e| ClusterError::Corrupt(e.to_string()))
    }

    /// Writes this process's heartbeat, replacing one an earlier process
    /// under the same node id left (its conversations become claimable at
    /// once). Returns the revision to renew.
    pub async fn announce(&self) -> Result<u64, ClusterError> {
        let value = self.value()?;
        let revision = with_deadline(
            self.cluster.options.op_timeout,
            "writing this node's heartbeat",
            || async {
                self.kv
                    .put(key(&self.node), value.clone())
                    .await
                    .map_err(|e| ClusterError::Unavailable(e.to_string()))
            },
        )
        .await?;
        self.seen().insert(
            self.node.clone(),
            NodeState::Alive(self.incarnation.clone()),
        );
        Ok(revision)
    }

    /// Renews the heartbeat written at `revision`.
    pub async fn renew(&self, revision: u64) -> Result<Renewal, ClusterError> {
        let value = self.value()?;
        let updated = with_deadline(
            self.cluster.options.op_timeout,
            "renewing this node's heartbeat",
            || async {
                match self
                    .kv
                    .update(key(&self.node), value.clone(), revision)
                    .await
                {
                    Ok(r) => Ok(Some(r)),
                    Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => Ok(None),
                    Err(e) => Err(ClusterError::Unavailable(e.to_string())),
                }
            },
        )
        .await?;
        if let Some(r) = updated {
            return Ok(Renewal::Renewed(r));
        }
        match self.read(&self.node).await? {
            Some(other) if other != self.incarnation => Ok(Renewal::Replaced(other)),
            _ => self.announce().await.map(Renewal::Restored),
        }
    }

    /// Removes the heartbeat (graceful shutdown, after every conversation
    /// was given back).
    pub async fn withdraw(&self, revision: u64) -> Result<(), ClusterError> {
        with_deadline(
            self.cluster.options.op_timeout,
            "removing this node's heartbeat",
            || async {
                match self
                    .kv
                    .delete_expect_revision(key(&self.node), Some(revision))
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

    /// Refuses to join when a live node speaks another [`WIRE_VERSION`]:
    /// called before this node announces itself, so a refused node has
    /// written nothing. A heartbeat under this node's own id is an earlier
    /// run that this one replaces, not a node to agree with.
    pub async fn refuse_other_versions(&self) -> Result<(), ClusterError> {
        let keys = kv_keys(
            &self.kv,
            "n.*",
            self.cluster.options.op_timeout,
            "listing node heartbeats",
        )
        .await?;
        for node in keys.iter().filter_map(|k| k.strip_prefix("n.")) {
            if node == self.node {
                continue;
            }
            match self.heartbeat(node).await? {
                Some(h) if h.wire != WIRE_VERSION => {
                    return Err(ClusterError::OtherVersion {
                        node: node.to_owned(),
                        theirs: h.wire,
                        ours: WIRE_VERSION,
                    })
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The incarnation a node's heartbeat names, as the bucket's leader
    /// has it (`None`: no live heartbeat).
    async fn read(&self, node: &str) -> Result<Option<String>, ClusterError> {
        Ok(self.heartbeat(node).await?.map(|h| h.incarnation))
    }

    /// A node's heartbeat as the bucket's leader has it.
    async fn heartbeat(&self, node: &str) -> Result<Option<Heartbeat>, ClusterError> {
        let got = super::leader_entry(
            &self.kv,
            &key(node),
            self.cluster.options.op_timeout,
            "reading a node's heartbeat",
        )
        .await?;
        match got {
            None => Ok(None),
            Some((value, _)) => serde_json::from_slice::<Heartbeat>(&value)
                .map(Some)
                .map_err(|e| ClusterError::Corrupt(format!("heartbeat of {node}: {e}"))),
        }
    }

    /// Whether `node`'s process `incarnation` is alive. The watch's view
    /// answers when it has seen that node; otherwise, or when it shows
    /// another incarnation (which may be one the watch has not caught up
    /// with), the bucket's leader does.
    pub async fn is_alive(&self, node: &str, incarnation: &str) -> Result<bool, ClusterError> {
        if node == self.node {
            return Ok(incarnation == self.incarnation);
        }
        match self.seen().get(node) {
            Some(NodeState::Alive(i)) if i == incarnation => return Ok(true),
            Some(NodeState::Gone) => return Ok(false),
            _ => {}
        }
        Ok(self.read(node).await?.as_deref() == Some(incarnation))
    }

    /// The nodes whose heartbeat the watch last saw alive, this one
    /// included, sorted.
    pub fn live_nodes(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self
            .seen()
            .iter()
            .filter(|(_, s)| matches!(s, NodeState::Alive(_)))
            .map(|(n, _)| n.clone())
            .collect();
        if !nodes.contains(&self.node) {
            nodes.push(self.node.clone());
        }
        nodes.sort();
        nodes
    }

    /// Watches every heartbeat (first the current ones, then changes),
    /// keeping [`Liveness::is_alive`]'s view, and sends each departure of
    /// another node on `departures`. Returns when the watch breaks (NATS
    /// trouble); the caller watches again.
    pub async fn watch(&self, departures: &mpsc::UnboundedSender<Departure>) -> ClusterError {
        super::watch_kv(&self.kv, "n.*", |entry| {
            let Some(node) = entry.key.strip_prefix("n.") else {
                return Ok(());
            };
            if node == self.node {
                return Ok(());
            }
            let now = match entry.operation {
                Operation::Put => match serde_json::from_slice::<Heartbeat>(&entry.value) {
                    Ok(h) => {
                        if h.wire != WIRE_VERSION {
                            // It started in the moment between this node's
                            // check and its heartbeat, or does not check.
                            error!(
                                node,
                                theirs = h.wire,
                                ours = WIRE_VERSION,
                                "a node of another version joined the cluster: nodes of \
                                 different versions misread each other; stop it"
                            );
                        }
                        NodeState::Alive(h.incarnation)
                    }
                    Err(_) => return Ok(()),
                },
                Operation::Delete | Operation::Purge => NodeState::Gone,
            };
            let before = self.seen().insert(node.to_owned(), now.clone());
            let departure = match (&before, &now) {
                (Some(NodeState::Gone), NodeState::Gone) => None,
                (_, NodeState::Gone) => Some(Departure {
                    node: node.to_owned(),
                    except: None,
                }),
                (Some(NodeState::Alive(old)), NodeState::Alive(new)) if old != new => {
                    Some(Departure {
                        node: node.to_owned(),
                        except: Some(new.clone()),
                    })
                }
                _ => None,
            };
            match departure.map(|d| departures.send(d)) {
                Some(Err(_)) => Err(ClusterError::Unavailable(
                    "nobody handles departures".into(),
                )),
                _ => Ok(()),
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Heartbeats of builds from before the version field speak version 1.
    #[test]
    fn a_heartbeat_without_a_version_is_version_1() {
        let old: Heartbeat = serde_json::from_str(r#"{"incarnation":"x"}"#).expect("parses");
        assert_eq!(old.wire, 1);
        let new: Heartbeat =
            serde_json::from_str(r#"{"incarnation":"x","wire":7}"#).expect("parses");
        assert_eq!(new.wire, 7);
    }
}

//! Conversation summaries ([`ConversationMeta`]) in a KV bucket.
//!
//! Keys: `c.<conversation>` holds the summary as JSON, with the writer's
//! `(term, head_seq)`; `u.<hex(user)>.<conversation>` (empty) indexes a
//! user's conversations; `d.<conversation>.<hex(client_msg_id)>.<seq>`
//! (empty) records the `client_msg_id`s used, so that reactivation finds
//! them with one subject listing instead of reading the whole log. A user's list is the set of index subjects under
//! `u.<hex(user)>.*`, answered by one stream-info request with a subject
//! filter from the server's per-subject index, then one get per summary.
//! Deleting a conversation purges its subjects outright (no markers left),
//! so the index lists live conversations only.
//!
//! The summary is derived state: the log is the truth for history and
//! head. Writes are compare-and-set on the KV revision and never go back:
//! a write from an older `(term, head_seq)` than the stored one is dropped,
//! so a fenced-out owner that wakes up cannot roll the summary back.

use std::time::Duration;

use async_nats::jetstream::kv::{self, UpdateErrorKind};
use futures_util::TryStreamExt;
use serde::{Deserialize, Serialize};

use super::{check_token, with_deadline, Cluster, ClusterError};
use crate::protocol::Status;
use crate::store::ConversationMeta;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Stored {
    id: String,
    user: String,
    title: String,
    status: Status,
    created_at: String,
    last_activity_at: String,
    head_seq: u64,
    close_delay_ms: Option<u64>,
    observers: Vec<String>,
    current_turn_id: Option<String>,
    last_turn_message_seq: u64,
    /// Term of the owner that wrote this.
    term: u64,
}

impl Stored {
    fn from_meta(m: &ConversationMeta, term: u64) -> Stored {
        Stored {
            id: m.id.clone(),
            user: m.user.clone(),
            title: m.title.clone(),
            status: m.status,
            created_at: m.created_at.clone(),
            last_activity_at: m.last_activity_at.clone(),
            head_seq: m.head_seq,
            close_delay_ms: m.close_delay.map(|d| d.as_millis() as u64),
            observers: m.observers.clone(),
            current_turn_id: m.current_turn_id.clone(),
            last_turn_message_seq: m.last_turn_message_seq,
            term,
        }
    }

    fn into_meta(self) -> ConversationMeta {
        ConversationMeta {
            id: self.id,
            user: self.user,
            title: self.title,
            status: self.status,
            created_at: self.created_at,
            last_activity_at: self.last_activity_at,
            head_seq: self.head_seq,
            close_delay: self.close_delay_ms.map(Duration::from_millis),
            observers: self.observers,
            current_turn_id: self.current_turn_id,
            last_turn_message_seq: self.last_turn_message_seq,
        }
    }
}

/// Any text as a subject token: lower-case hex of its bytes.
pub(crate) fn user_token(user: &str) -> String {
    user.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(token: &str) -> Option<String> {
    if !token.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    String::from_utf8(bytes?).ok()
}

/// The summaries bucket.
#[derive(Clone)]
pub struct Summaries {
    cluster: Cluster,
    kv: kv::Store,
}

impl Summaries {
    pub async fn open(cluster: &Cluster) -> Result<Summaries, ClusterError> {
        Ok(Summaries {
            kv: cluster.bucket(&cluster.options.meta_bucket()).await?,
            cluster: cluster.clone(),
        })
    }

    async fn entry(&self, id: &str) -> Result<Option<(Stored, u64)>, ClusterError> {
        let key = format!("c.{}", check_token(id)?);
        let entry = with_deadline(
            self.cluster.options.op_timeout,
            "reading a summary",
            || async {
                self.kv
                    .entry(key.clone())
                    .await
                    .map_err(|e| ClusterError::Unavailable(e.to_string()))
            },
        )
        .await?;
        match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                let stored: Stored = serde_json::from_slice(&e.value)
                    .map_err(|err| ClusterError::Corrupt(format!("summary {id}: {err}")))?;
                Ok(Some((stored, e.revision)))
            }
            _ => Ok(None),
        }
    }

    pub async fn get(&self, id: &str) -> Result<Option<ConversationMeta>, ClusterError> {
        Ok(self.entry(id).await?.map(|(s, _)| s.into_meta()))
    }

    /// Writes the summary unless a newer one (higher term, or same term and
    /// higher head) is stored. `change` may adjust it against what is
    /// stored (e.g. keep observers added meanwhile).
    pub async fn put(&self, meta: &ConversationMeta, term: u64) -> Result<(), ClusterError> {
        let key = format!("c.{}", check_token(&meta.id)?);
        let index = format!("u.{}.{}", user_token(&meta.user), meta.id);
        for _ in 0..16 {
            let current = self.entry(&meta.id).await?;
            let mut next = Stored::from_meta(meta, term);
            let revision = match &current {
                Some((old, _)) if (old.term, old.head_seq) > (term, meta.head_seq) => return Ok(()),
                Some((old, rev)) => {
                    // Observers are added by any node; keep the union.
                    for o in &old.observers {
                        if !next.observers.contains(o) {
                            next.observers.push(o.clone());
                        }
                    }
                    *rev
                }
                None => 0,
            };
            let value: bytes::Bytes = serde_json::to_vec(&next)
                .map_err(|e| ClusterError::Corrupt(e.to_string()))?
                .into();
            let written = with_deadline(
                self.cluster.options.op_timeout,
                "writing a summary",
                || async {
                    let r = if revision == 0 {
                        self.kv.create(&key, value.clone()).await.map_err(|e| {
                            if e.kind() == kv::CreateErrorKind::AlreadyExists {
                                None
                            } else {
                                Some(e.to_string())
                            }
                        })
                    } else {
                        self.kv
                            .update(&key, value.clone(), revision)
                            .await
                            .map_err(|e| {
                                if e.kind() == UpdateErrorKind::WrongLastRevision {
                                    None
                                } else {
                                    Some(e.to_string())
                                }
                            })
                    };
                    match r {
                        Ok(_) => Ok(true),
                        Err(None) => Ok(false),
                        Err(Some(why)) => Err(ClusterError::Unavailable(why)),
                    }
                },
            )
            .await?;
            if written {
                if revision == 0 {
                    with_deadline(
                        self.cluster.options.op_timeout,
                        "indexing a summary",
                        || async {
                            self.kv
                                .put(&index, bytes::Bytes::new())
                                .await
                                .map(|_| ())
                                .map_err(|e| ClusterError::Unavailable(e.to_string()))
                        },
                    )
                    .await?;
                }
                return Ok(());
            }
        }
        Err(ClusterError::Unavailable(format!(
            "summary {}: too many concurrent writers",
            meta.id
        )))
    }

    /// Lets `user` observe the conversation (any node may call this).
    pub async fn add_observer(&self, id: &str, user: &str) -> Result<(), ClusterError> {
        let key = format!("c.{}", check_token(id)?);
        for _ in 0..16 {
            let Some((mut stored, revision)) = self.entry(id).await? else {
                return Err(ClusterError::NotFound(id.to_owned()));
            };
            if stored.observers.iter().any(|o| o == user) {
                return Ok(());
            }
            stored.observers.push(user.to_owned());
            let value: bytes::Bytes = serde_json::to_vec(&stored)
                .map_err(|e| ClusterError::Corrupt(e.to_string()))?
                .into();
            let written = with_deadline(
                self.cluster.options.op_timeout,
                "adding an observer",
                || async {
                    match self.kv.update(&key, value.clone(), revision).await {
                        Ok(_) => Ok(true),
                        Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => Ok(false),
                        Err(e) => Err(ClusterError::Unavailable(e.to_string())),
                    }
                },
            )
            .await?;
            if written {
                return Ok(());
            }
        }
        Err(ClusterError::Unavailable(format!(
            "summary {id}: too many concurrent writers"
        )))
    }

    /// The ids of a user's conversations (every user's for `None`).
    async fn ids(&self, user: Option<&str>) -> Result<Vec<String>, ClusterError> {
        let pattern = match user {
            Some(u) => format!("u.{}.*", user_token(u)),
            None => "c.*".to_owned(),
        };
        let keys = super::kv_keys(
            &self.kv,
            &pattern,
            self.cluster.options.op_timeout,
            "listing summaries",
        )
        .await?;
        Ok(keys
            .into_iter()
            .filter_map(|k| k.rsplit('.').next().map(str::to_owned))
            .collect())
    }

    /// Summaries of one user's conversations (or everyone's), newest
    /// activity first.
    pub async fn list(&self, user: Option<&str>) -> Result<Vec<ConversationMeta>, ClusterError> {
        let mut out = Vec::new();
        for id in self.ids(user).await? {
            if let Some(m) = self.get(&id).await? {
                out.push(m);
            }
        }
        out.sort_by(|a, b| b.last_activity_at.cmp(&a.last_activity_at));
        Ok(out)
    }

    /// Records `client_msg_id`s with the seq of their `user_message`.
    pub async fn add_client_ids(
        &self,
        id: &str,
        ids: &[(String, u64)],
    ) -> Result<(), ClusterError> {
        check_token(id)?;
        for (cid, seq) in ids {
            let key = format!("d.{id}.{}.{seq}", user_token(cid));
            with_deadline(
                self.cluster.options.op_timeout,
                "recording a client_msg_id",
                || async {
                    self.kv
                        .put(&key, bytes::Bytes::new())
                        .await
                        .map(|_| ())
                        .map_err(|e| ClusterError::Unavailable(e.to_string()))
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Every `client_msg_id` recorded for the conversation, by seq.
    pub async fn client_ids(&self, id: &str) -> Result<Vec<(String, u64)>, ClusterError> {
        let filter = format!("{}d.{}.*.*", self.kv.prefix, check_token(id)?);
        let subjects = self.subjects(&filter).await?;
        let mut out = Vec::new();
        for s in subjects {
            let mut parts = s.rsplit('.');
            let seq = parts.next().and_then(|p| p.parse::<u64>().ok());
            let cid = parts.next().and_then(unhex);
            match (cid, seq) {
                (Some(cid), Some(seq)) => out.push((cid, seq)),
                _ => return Err(ClusterError::Corrupt(format!("client_msg_id key {s}"))),
            }
        }
        out.sort_by_key(|(_, seq)| *seq);
        Ok(out)
    }

    async fn subjects(&self, filter: &str) -> Result<Vec<String>, ClusterError> {
        with_deadline(self.cluster.options.op_timeout, "listing keys", || async {
            let subjects: Vec<(String, usize)> = self
                .kv
                .stream
                .info_with_subjects(filter)
                .await
                .map_err(|e| ClusterError::Unavailable(e.to_string()))?
                .try_collect()
                .await
                .map_err(|e| ClusterError::Unavailable(e.to_string()))?;
            Ok(subjects.into_iter().map(|(s, _)| s).collect())
        })
        .await
    }

    /// Removes a summary and its index entry; whether it existed.
    pub async fn delete(&self, id: &str) -> Result<bool, ClusterError> {
        let Some((stored, _)) = self.entry(id).await? else {
            return Ok(false);
        };
        let prefix = self.kv.prefix.clone();
        for key in [
            format!("d.{id}.>"),
            format!("u.{}.{id}", user_token(&stored.user)),
            format!("c.{id}"),
        ] {
            let subject = format!("{prefix}{key}");
            with_deadline(
                self.cluster.options.op_timeout,
                "deleting a summary",
                || async {
                    self.kv
                        .stream
                        .purge()
                        .filter(subject.clone())
                        .await
                        .map(|_| ())
                        .map_err(|e| ClusterError::Unavailable(e.to_string()))
                },
            )
            .await?;
        }
        Ok(true)
    }
}

//! Conversation summaries ([`ConversationMeta`]) in a KV bucket.
//!
//! Keys: `c.<conversation>` holds the summary as JSON, with the writer's
//! `(term, head_seq)`; `u.<hex(user)>.<conversation>` (empty) indexes a
//! user's conversations; `d.<conversation>.<hex(client_msg_id)>.<seq>`
//! (empty) records the `client_msg_id`s used, so that reactivation finds
//! them with one subject listing instead of reading the whole log; those
//! that left the conversation's window are purged by its owner, so there
//! are at most `conversations.client_msg_id_window` of them. A user's list is the set of index subjects under
//! `u.<hex(user)>.*`, answered by one stream-info request with a subject
//! filter from the server's per-subject index, then one get per summary.
//! Deleting a conversation purges its subjects outright (no markers left),
//! so the index lists live conversations only.
//!
//! The summary is derived state: the log is the truth for history and
//! head. Its owner writes it with the commit that changed whether the
//! conversation runs, its turn or its queued messages, and otherwise (the
//! head and last activity) at most once a second (see `store`). Reads go
//! to the bucket's leader. Writes are compare-and-set on the KV revision and never go back:
//! a write from an older `(term, head_seq)` than the stored one is dropped,
//! so a fenced-out owner that wakes up cannot roll the summary back.

use std::time::Duration;

use async_nats::jetstream::kv::{self, UpdateErrorKind};
use futures_util::TryStreamExt;
use serde::{Deserialize, Serialize};

use super::{check_token, purge_subject, with_deadline, Cluster, ClusterError};
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

fn encode(stored: &Stored) -> Result<bytes::Bytes, ClusterError> {
    serde_json::to_vec(stored)
        .map(Into::into)
        .map_err(|e| ClusterError::Corrupt(e.to_string()))
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
        let entry = super::leader_entry(
            &self.kv,
            &key,
            self.cluster.options.op_timeout,
            "reading a summary",
        )
        .await?;
        match entry {
            Some((value, revision)) => {
                let stored: Stored = serde_json::from_slice(&value)
                    .map_err(|err| ClusterError::Corrupt(format!("summary {id}: {err}")))?;
                Ok(Some((stored, revision)))
            }
            None => Ok(None),
        }
    }

    pub async fn get(&self, id: &str) -> Result<Option<ConversationMeta>, ClusterError> {
        Ok(self.entry(id).await?.map(|(s, _)| s.into_meta()))
    }

    /// The summary with its revision, for a writer that goes on to
    /// [`Summaries::put`] it.
    pub async fn get_with_revision(
        &self,
        id: &str,
    ) -> Result<Option<(ConversationMeta, u64)>, ClusterError> {
        Ok(self.entry(id).await?.map(|(s, r)| (s.into_meta(), r)))
    }

    /// Writes the summary unless a newer one (higher term, or same term and
    /// higher head) is stored; observers added meanwhile by any node are
    /// kept. `last` is the revision this writer wrote (or read) last: the
    /// write is then one conditional update, no read, unless someone else
    /// wrote in between. Without `last` the summary may be created; with
    /// it, a summary found missing was deleted and is not brought back.
    /// Returns the revision written, `None` when nothing was written;
    /// `meta.observers` gains the observers found stored.
    pub async fn put(
        &self,
        meta: &mut ConversationMeta,
        term: u64,
        last: Option<u64>,
    ) -> Result<Option<u64>, ClusterError> {
        let key = format!("c.{}", check_token(&meta.id)?);
        if let Some(revision) = last {
            let value = encode(&Stored::from_meta(meta, term))?;
            if let Some(written) = self.write(&key, value, revision).await? {
                return Ok(Some(written));
            }
        }
        for _ in 0..16 {
            let current = self.entry(&meta.id).await?;
            let revision = match &current {
                Some((old, _)) if (old.term, old.head_seq) > (term, meta.head_seq) => {
                    return Ok(None)
                }
                Some((old, rev)) => {
                    for o in &old.observers {
                        if !meta.observers.contains(o) {
                            meta.observers.push(o.clone());
                        }
                    }
                    *rev
                }
                None if last.is_some() => return Ok(None),
                None => 0,
            };
            let next = encode(&Stored::from_meta(meta, term))?;
            if let Some(written) = self.write(&key, next, revision).await? {
                if revision == 0 {
                    let index = format!("u.{}.{}", user_token(&meta.user), meta.id);
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
                return Ok(Some(written));
            }
        }
        Err(ClusterError::Unavailable(format!(
            "summary {}: too many concurrent writers",
            meta.id
        )))
    }

    /// One compare-and-set write (`revision` 0: create); the new revision,
    /// or `None` when the stored revision was another.
    async fn write(
        &self,
        key: &str,
        value: bytes::Bytes,
        revision: u64,
    ) -> Result<Option<u64>, ClusterError> {
        with_deadline(
            self.cluster.options.op_timeout,
            "writing a summary",
            || async {
                let r = if revision == 0 {
                    self.kv.create(key, value.clone()).await.map_err(|e| {
                        (e.kind() != kv::CreateErrorKind::AlreadyExists).then(|| e.to_string())
                    })
                } else {
                    self.kv
                        .update(key, value.clone(), revision)
                        .await
                        .map_err(|e| {
                            (e.kind() != UpdateErrorKind::WrongLastRevision).then(|| e.to_string())
                        })
                };
                match r {
                    Ok(written) => Ok(Some(written)),
                    Err(None) => Ok(None),
                    Err(Some(why)) => Err(ClusterError::Unavailable(why)),
                }
            },
        )
        .await
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
            if self
                .write(&key, encode(&stored)?, revision)
                .await?
                .is_some()
            {
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

    /// The newest `newest` `client_msg_id`s recorded for the conversation,
    /// by seq.
    pub async fn client_ids(
        &self,
        id: &str,
        newest: usize,
    ) -> Result<Vec<(String, u64)>, ClusterError> {
        let mut all = self.all_client_ids(id).await?;
        all.drain(..all.len().saturating_sub(newest));
        Ok(all)
    }

    /// Forgets the `client_msg_id`s of messages before seq `before` (they
    /// left the conversation's window): their keys are purged outright, no
    /// markers left, so the bucket holds at most the window.
    pub async fn forget_client_ids(&self, id: &str, before: u64) -> Result<(), ClusterError> {
        for (cid, seq) in self.all_client_ids(id).await? {
            if seq >= before {
                break;
            }
            let subject = format!("{}d.{id}.{}.{seq}", self.kv.prefix, user_token(&cid));
            self.purge(subject, "forgetting a client_msg_id").await?;
        }
        Ok(())
    }

    /// Removes every message of `subject` from the bucket's stream.
    async fn purge(&self, subject: String, doing: &str) -> Result<(), ClusterError> {
        let timeout = self.cluster.options.op_timeout;
        purge_subject(&self.kv.stream, subject, timeout, doing).await
    }

    /// Every `client_msg_id` recorded for the conversation, by seq.
    async fn all_client_ids(&self, id: &str) -> Result<Vec<(String, u64)>, ClusterError> {
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
            self.purge(format!("{prefix}{key}"), "deleting a summary")
                .await?;
        }
        Ok(true)
    }
}

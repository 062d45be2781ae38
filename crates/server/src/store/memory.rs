//! A [`Store`] in memory: everything the trait promises (contiguous appends,
//! callbacks after the write, snapshots, observers), nothing durable. For the
//! in-process tests of the actors' rules under tokio's paused time, where a
//! real database's threads would let the clock run on its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_trait::async_trait;

use super::{
    AppendBatch, CommitCallback, ConversationMeta, QueuedMessage, Snapshot, Store, StoreError,
};
use crate::event::EventRecord;

#[derive(Default)]
struct Conversation {
    meta: Option<ConversationMeta>,
    events: Vec<Arc<EventRecord>>,
    client_msg_ids: Vec<(String, u64)>,
}

pub struct MemoryStore {
    conversations: Mutex<HashMap<String, Conversation>>,
    /// Counts appends, so that a test can wait for the next one.
    appends: tokio::sync::watch::Sender<u64>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            conversations: Mutex::default(),
            appends: tokio::sync::watch::channel(0).0,
        }
    }
}

impl MemoryStore {
    /// Changes after every append.
    pub fn appends(&self) -> tokio::sync::watch::Receiver<u64> {
        self.appends.subscribe()
    }

    fn with<T>(&self, f: impl FnOnce(&mut HashMap<String, Conversation>) -> T) -> T {
        let mut map = self
            .conversations
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut map)
    }

    fn apply(&self, batch: AppendBatch) -> Result<(), StoreError> {
        self.with(|map| {
            let id = batch.conversation_id.to_string();
            let exists = map.get(&id).is_some_and(|c| c.meta.is_some());
            if batch.create.is_some() == exists {
                return Err(StoreError::Backend(format!(
                    "conversation {id}: create {} an existing conversation",
                    if exists { "of" } else { "missing for" }
                )));
            }
            let conv = map.entry(id.clone()).or_default();
            let head = conv.meta.as_ref().map_or(0, |m| m.head_seq);
            for (i, event) in batch.events.iter().enumerate() {
                if event.seq != head + 1 + i as u64 {
                    return Err(StoreError::Backend(format!(
                        "conversation {id}: seq {} does not follow {head}",
                        event.seq
                    )));
                }
            }
            let state = &batch.state;
            let meta = conv.meta.get_or_insert_with(|| {
                let new = batch.create.as_ref();
                ConversationMeta {
                    id: id.clone(),
                    user: new.map(|n| n.user.clone()).unwrap_or_default(),
                    title: new.map(|n| n.title.clone()).unwrap_or_default(),
                    status: state.status,
                    created_at: new.map(|n| n.created_at.clone()).unwrap_or_default(),
                    last_activity_at: batch.last_activity_at().into_owned(),
                    head_seq: 0,
                    close_delay: new.and_then(|n| n.close_delay),
                    observers: Vec::new(),
                    current_turn_id: None,
                    last_turn_message_seq: 0,
                }
            });
            meta.status = state.status;
            meta.head_seq = state.head_seq;
            meta.last_activity_at = batch.last_activity_at().into_owned();
            meta.current_turn_id = state.current_turn_id.as_deref().map(String::from);
            meta.last_turn_message_seq = state.last_turn_message_seq;
            conv.events.extend(batch.events.iter().cloned());
            conv.client_msg_ids
                .extend(batch.client_msg_ids.iter().cloned());
            let forget = batch.forget_client_msg_ids_before;
            conv.client_msg_ids.retain(|(_, seq)| *seq >= forget);
            Ok(())
        })
    }
}

/// The text of a stored `user_message`, read from its frame.
fn message_text(record: &EventRecord) -> Option<String> {
    let frame: serde_json::Value = serde_json::from_str(record.frame.as_str()).ok()?;
    frame["data"]["text"].as_str().map(str::to_owned)
}

#[async_trait]
impl Store for MemoryStore {
    fn append(&self, batch: AppendBatch, done: CommitCallback) {
        let events = batch.events.clone();
        let result = self.apply(batch);
        self.appends.send_modify(|n| *n += 1);
        done(result, &events);
    }

    async fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn get(&self, id: &str) -> Result<Option<ConversationMeta>, StoreError> {
        Ok(self.with(|map| map.get(id).and_then(|c| c.meta.clone())))
    }

    async fn list(&self, user: Option<&str>) -> Result<Vec<ConversationMeta>, StoreError> {
        Ok(self.with(|map| {
            map.values()
                .filter_map(|c| c.meta.clone())
                .filter(|m| user.is_none_or(|u| m.user == u))
                .collect()
        }))
    }

    async fn events(
        &self,
        id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Arc<EventRecord>>, StoreError> {
        Ok(self.with(|map| {
            map.get(id)
                .map(|c| {
                    c.events
                        .iter()
                        .filter(|e| e.seq > after)
                        .take(limit)
                        .cloned()
                        .collect()
                })
                .unwrap_or_default()
        }))
    }

    async fn snapshot(
        &self,
        id: &str,
        tail: usize,
        client_msg_ids: usize,
    ) -> Result<Option<Snapshot>, StoreError> {
        Ok(self.with(|map| {
            let conv = map.get(id)?;
            let meta = conv.meta.clone()?;
            let start = conv.events.len().saturating_sub(tail);
            let queued = conv
                .events
                .iter()
                .filter(|e| &*e.kind == "user_message" && e.seq > meta.last_turn_message_seq)
                .filter_map(|e| {
                    Some(QueuedMessage {
                        seq: e.seq,
                        text: message_text(e)?,
                    })
                })
                .collect();
            Some(Snapshot {
                tail: conv.events[start..].to_vec(),
                queued,
                client_msg_ids: conv.client_msg_ids
                    [conv.client_msg_ids.len().saturating_sub(client_msg_ids)..]
                    .to_vec(),
                meta,
            })
        }))
    }

    async fn unfinished(&self) -> Result<Vec<ConversationMeta>, StoreError> {
        Ok(self.with(|map| {
            map.values()
                .filter_map(|c| c.meta.clone())
                .filter(|m| m.status != crate::protocol::Status::Stopped)
                .collect()
        }))
    }

    async fn delete(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self.with(|map| map.remove(id).is_some()))
    }

    async fn add_observer(&self, id: &str, user: &str) -> Result<(), StoreError> {
        self.with(|map| {
            let meta = map
                .get_mut(id)
                .and_then(|c| c.meta.as_mut())
                .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
            if !meta.observers.iter().any(|o| o == user) {
                meta.observers.push(user.to_owned());
            }
            Ok(())
        })
    }

    async fn prune(&self, _before: SystemTime) -> Result<u64, StoreError> {
        Ok(0)
    }

    fn health(&self) -> Result<(), String> {
        Ok(())
    }

    async fn probe(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

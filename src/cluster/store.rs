//! [`NatsStore`]: linger's [`Store`] over JetStream, plus ownership.
//!
//! The seam: the [`Store`] trait stays what the actors see, and ownership
//! is an extension used by whoever starts a conversation actor (the
//! supervisor, after winning the lease): [`NatsStore::take_over`] writes the
//! fence message with the lease's term and registers the fence; from then
//! on `Store::append` for that conversation is a fenced append. An append
//! for a conversation this node does not own (never taken, or
//! [`NatsStore::disown`]ed) fails with `StoreError::Fenced`, as does one
//! refused by the server because another node took over: the actor then
//! stops the conversation locally (`detached {reason:"moved"}`).
//! `StoreError::Unavailable` means NATS could not confirm the append;
//! nothing of it may be sent, and the same fence still holds, so the next
//! append is safe once NATS is back.
//!
//! Appends of one conversation go through one task (its queue), so they
//! are committed in order; different conversations append in parallel.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_trait::async_trait;
use tokio::sync::{mpsc, watch};

use super::log::{EventLog, Fence};
use super::meta::Summaries;
use super::{Cluster, ClusterError};
use crate::protocol::Status;
use crate::store::{
    AppendBatch, CommitCallback, ConversationMeta, QueuedMessage, Snapshot, Store, StoreError,
};

type Job = (AppendBatch, CommitCallback);

struct Owned {
    queue: mpsc::UnboundedSender<Job>,
}

/// History and summaries in JetStream for one node.
#[derive(Clone)]
pub struct NatsStore {
    log: EventLog,
    summaries: Summaries,
    node: String,
    owned: Arc<Mutex<HashMap<String, Owned>>>,
    /// Appends queued and not yet answered, for `flush`.
    pending: Arc<watch::Sender<usize>>,
    /// Whether appends reach JetStream, from each append's outcome.
    health: Arc<crate::store::StoreHealth>,
}

impl NatsStore {
    pub async fn open(cluster: &Cluster, node: &str) -> Result<NatsStore, ClusterError> {
        super::check_token(node)?;
        Ok(NatsStore {
            log: EventLog::open(cluster).await?,
            summaries: Summaries::open(cluster).await?,
            node: node.to_owned(),
            owned: Arc::new(Mutex::new(HashMap::new())),
            pending: Arc::new(watch::channel(0).0),
            health: Arc::default(),
        })
    }

    pub fn log(&self) -> &EventLog {
        &self.log
    }

    /// Makes this node the conversation's writer with `term` (the lease's):
    /// fences earlier owners out, and returns the head seq (appends go on
    /// from head + 1). For a new conversation the head is 0.
    pub async fn take_over(&self, conversation: &str, term: u64) -> Result<u64, StoreError> {
        let known = self.summaries.get(conversation).await?;
        let floor = known.as_ref().map_or(0, |m| m.head_seq);
        let fence = self
            .log
            .take_over(conversation, term, &self.node, floor)
            .await?;
        let head = fence.head_seq;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(writer(
            self.log.clone(),
            self.summaries.clone(),
            fence,
            known,
            rx,
            self.pending.clone(),
        ));
        self.lock()
            .insert(conversation.to_owned(), Owned { queue: tx });
        Ok(head)
    }

    /// Stops writing for a conversation here (stopped, moved, shut down).
    /// Appends already queued are still committed.
    pub fn disown(&self, conversation: &str) {
        self.lock().remove(conversation);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Owned>> {
        self.owned.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Commits one conversation's appends in order: the events (fenced), then
/// its summary.
async fn writer(
    log: EventLog,
    summaries: Summaries,
    mut fence: Fence,
    mut meta: Option<ConversationMeta>,
    mut queue: mpsc::UnboundedReceiver<Job>,
    pending: Arc<watch::Sender<usize>>,
) {
    let mut fenced: Option<StoreError> = None;
    while let Some((batch, done)) = queue.recv().await {
        let result = match &fenced {
            Some(e) => Err(e.clone()),
            None => commit(&log, &summaries, &mut fence, &mut meta, batch).await,
        };
        if let Err(e @ StoreError::Fenced { .. }) = &result {
            fenced = Some(e.clone());
        }
        done(result);
        pending.send_modify(|n| *n = n.saturating_sub(1));
    }
}

async fn commit(
    log: &EventLog,
    summaries: &Summaries,
    fence: &mut Fence,
    meta: &mut Option<ConversationMeta>,
    batch: AppendBatch,
) -> Result<(), StoreError> {
    if meta.is_none() {
        let Some(create) = &batch.create else {
            return Err(StoreError::NotFound(batch.conversation_id.to_string()));
        };
        *meta = Some(ConversationMeta {
            id: batch.conversation_id.to_string(),
            user: create.user.clone(),
            title: create.title.clone(),
            status: batch.state.status,
            created_at: create.created_at.clone(),
            last_activity_at: batch.state.last_activity_at.clone(),
            head_seq: 0,
            close_delay: create.close_delay,
            observers: Vec::new(),
            current_turn_id: None,
            last_turn_message_seq: 0,
        });
    }
    log.append(fence, &batch.events).await?;
    summaries
        .add_client_ids(&batch.conversation_id, &batch.client_msg_ids)
        .await?;
    let Some(m) = meta.as_mut() else {
        return Err(StoreError::NotFound(batch.conversation_id.to_string()));
    };
    m.status = batch.state.status;
    m.head_seq = batch.state.head_seq;
    m.last_activity_at = batch.state.last_activity_at.clone();
    m.current_turn_id = batch.state.current_turn_id.clone();
    m.last_turn_message_seq = batch.state.last_turn_message_seq;
    summaries.put(m, fence.term).await?;
    Ok(())
}

fn field(data: &str, key: &str) -> Option<String> {
    serde_json::from_str::<serde_json::Value>(data)
        .ok()?
        .get(key)?
        .as_str()
        .map(str::to_owned)
}

#[async_trait]
impl Store for NatsStore {
    fn append(&self, batch: AppendBatch, done: CommitCallback) {
        let health = self.health.clone();
        let done: CommitCallback = Box::new(move |result| {
            health.record(result.as_ref().map(|_| ()));
            done(result)
        });
        let conversation = batch.conversation_id.to_string();
        let queue = self.lock().get(&conversation).map(|o| o.queue.clone());
        let not_owner = || StoreError::Fenced {
            conversation: conversation.clone(),
            term: 0,
        };
        let Some(queue) = queue else {
            done(Err(not_owner()));
            return;
        };
        self.pending.send_modify(|n| *n += 1);
        if let Err(mpsc::error::SendError((_, done))) = queue.send((batch, done)) {
            self.pending.send_modify(|n| *n = n.saturating_sub(1));
            done(Err(not_owner()));
        }
    }

    fn health(&self) -> Result<(), String> {
        self.health.check()
    }

    /// Reads a head from the stream's leader: JetStream answers only with
    /// a leader, which is what an append needs too.
    async fn probe(&self) -> Result<(), StoreError> {
        let result = self.log.head("health-probe").await.map(|_| ()).map_err(StoreError::from);
        self.health.record(result.as_ref().map(|_| ()));
        result
    }

    async fn flush(&self) -> Result<(), StoreError> {
        let mut rx = self.pending.subscribe();
        rx.wait_for(|n| *n == 0)
            .await
            .map(|_| ())
            .map_err(|_| StoreError::Closed)
    }

    async fn get(&self, id: &str) -> Result<Option<ConversationMeta>, StoreError> {
        Ok(self.summaries.get(id).await?)
    }

    async fn list(&self, user: Option<&str>) -> Result<Vec<ConversationMeta>, StoreError> {
        Ok(self.summaries.list(user).await?)
    }

    async fn events(
        &self,
        id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Arc<crate::event::EventRecord>>, StoreError> {
        Ok(self.log.read(id, after, limit).await?)
    }

    async fn snapshot(&self, id: &str, tail: usize) -> Result<Option<Snapshot>, StoreError> {
        let Some(mut meta) = self.summaries.get(id).await? else {
            return Ok(None);
        };
        // The log is the truth for the head (the summary is written after
        // the events and may lag by one append).
        let head = self.log.head(id).await?;
        meta.head_seq = meta.head_seq.max(head.seq);
        let tail_events = self
            .log
            .read(id, meta.head_seq.saturating_sub(tail as u64), tail)
            .await?;
        let mut queued = Vec::new();
        for e in self
            .log
            .read(id, meta.last_turn_message_seq, usize::MAX)
            .await?
        {
            if &*e.kind == "user_message" {
                let text = field(&e.data, "text").ok_or_else(|| {
                    StoreError::Backend(format!(
                        "conversation {id}: user_message {} has no text",
                        e.seq
                    ))
                })?;
                queued.push(QueuedMessage { seq: e.seq, text });
            }
        }
        let client_msg_ids = self.summaries.client_ids(id).await?;
        Ok(Some(Snapshot {
            meta,
            tail: tail_events,
            queued,
            client_msg_ids,
        }))
    }

    async fn unfinished(&self) -> Result<Vec<ConversationMeta>, StoreError> {
        Ok(self
            .summaries
            .list(None)
            .await?
            .into_iter()
            .filter(|m| m.status != Status::Stopped)
            .collect())
    }

    async fn delete(&self, id: &str) -> Result<bool, StoreError> {
        self.flush().await?;
        self.disown(id);
        let existed = self.summaries.delete(id).await?;
        self.log.delete(id).await?;
        Ok(existed)
    }

    async fn add_observer(&self, id: &str, user: &str) -> Result<(), StoreError> {
        Ok(self.summaries.add_observer(id, user).await?)
    }

    /// JetStream drops history older than `store.retain` by itself (the
    /// stream's `max_age`).
    async fn prune(&self, _before: SystemTime) -> Result<u64, StoreError> {
        Ok(0)
    }
}

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
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use tokio::sync::{mpsc, watch};
use tracing::warn;

use super::log::{EventLog, Fence, Head};
use super::meta::Summaries;
use super::{Cluster, ClusterError};
use crate::event::EventRecord;
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
        self.take_over_from(conversation, term, None).await
    }

    /// [`NatsStore::take_over`] from a head just read from the leader.
    pub async fn take_over_from(
        &self,
        conversation: &str,
        term: u64,
        head: Option<Head>,
    ) -> Result<u64, StoreError> {
        let known = self.summaries.get_with_revision(conversation).await?;
        let floor = known.as_ref().map_or(0, |(m, _)| m.head_seq);
        let fence = self
            .log
            .take_over_from(conversation, term, &self.node, floor, head)
            .await?;
        let head = fence.head_seq;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(writer(
            self.log.clone(),
            SummaryWriter::new(self.summaries.clone(), known),
            fence,
            rx,
            self.pending.clone(),
        ));
        self.lock()
            .insert(conversation.to_owned(), Owned { queue: tx });
        Ok(head)
    }

    /// The summary as stored, without the head read `Store::get` adds:
    /// for deciding from its status alone.
    pub async fn summary(
        &self,
        conversation: &str,
    ) -> Result<Option<ConversationMeta>, StoreError> {
        Ok(self.summaries.get(conversation).await?)
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

/// Most events one merged commit holds (see [`writer`]).
const MERGE_MAX_EVENTS: usize = 1024;

/// How long a summary may lag the log when only its head and last
/// activity changed (see [`SummaryWriter`]).
const SUMMARY_LAG: Duration = Duration::from_secs(1);

/// Commits one conversation's appends in order. Appends that queued while
/// the previous commit was in flight are merged into one: one fenced
/// publish and at most one summary write for all of them, which is what
/// keeps a busy node's NATS round trips per event falling as load rises.
async fn writer(
    log: EventLog,
    mut summary: SummaryWriter,
    mut fence: Fence,
    mut queue: mpsc::UnboundedReceiver<Job>,
    pending: Arc<watch::Sender<usize>>,
) {
    let mut fenced: Option<StoreError> = None;
    loop {
        let due = summary.due();
        let first = tokio::select! {
            job = queue.recv() => job,
            _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)),
                if due.is_some() => {
                summary.write().await;
                continue;
            }
        };
        let Some(first) = first else { break };
        let mut rest = Vec::new();
        let mut events = first.0.events.len();
        let mut bytes = batch_bytes(&first.0);
        // Half a message: merged appends stay one all-or-nothing publish.
        let room = log.max_message() / 2;
        while events < MERGE_MAX_EVENTS && bytes < room {
            let Ok(job) = queue.try_recv() else { break };
            events += job.0.events.len();
            bytes += batch_bytes(&job.0);
            rest.push(job);
        }
        let (batch, callbacks) = merge(first, rest);
        let result = match &fenced {
            Some(e) => Err(e.clone()),
            None => commit(&log, &mut summary, &mut fence, &batch).await,
        };
        if let Err(e @ StoreError::Fenced { .. }) = &result {
            fenced = Some(e.clone());
        }
        answer(callbacks, &result, &batch.events, || {
            pending.send_modify(|n| *n = n.saturating_sub(1))
        });
    }
    if fenced.is_none() {
        summary.write().await;
    }
}

fn batch_bytes(batch: &AppendBatch) -> usize {
    batch.events.iter().map(|e| e.frame.len()).sum()
}

/// Appends queued one after the other, as one: their events in order, the
/// last one's state, the first one's creation (only a conversation's first
/// append creates it). Each callback comes with how many of the events
/// are its append's.
fn merge(first: Job, rest: Vec<Job>) -> (AppendBatch, Vec<(CommitCallback, usize)>) {
    let (mut merged, done) = first;
    let mut callbacks = Vec::with_capacity(rest.len() + 1);
    callbacks.push((done, merged.events.len()));
    for (batch, done) in rest {
        callbacks.push((done, batch.events.len()));
        merged.events.extend(batch.events);
        merged.client_msg_ids.extend(batch.client_msg_ids);
        merged.forget_client_msg_ids_before = merged
            .forget_client_msg_ids_before
            .max(batch.forget_client_msg_ids_before);
        merged.state = batch.state;
        if merged.create.is_none() {
            merged.create = batch.create;
        }
    }
    (merged, callbacks)
}

/// Answers each merged append with the outcome and its own events (the
/// merged events are theirs one after the other); `answered` after each.
fn answer(
    callbacks: Vec<(CommitCallback, usize)>,
    result: &Result<(), StoreError>,
    events: &[Arc<EventRecord>],
    mut answered: impl FnMut(),
) {
    let mut rest = events;
    for (done, count) in callbacks {
        let (own, after) = rest.split_at(count.min(rest.len()));
        rest = after;
        done(result.clone(), own);
        answered();
    }
}

/// Commits the events (fenced), then brings the summary up to date. Once
/// the log has the events they are committed, whatever the summary write
/// does: the log is the truth, and a summary write that failed is retried.
async fn commit(
    log: &EventLog,
    summary: &mut SummaryWriter,
    fence: &mut Fence,
    batch: &AppendBatch,
) -> Result<(), StoreError> {
    summary.start(batch)?;
    let before = fence.head_seq;
    if let Err(e) = log.append(fence, &batch.events).await {
        if fence.head_seq != before {
            // Part of it is stored (a group larger than one message): the
            // actor would number its next events after what it believes is
            // committed, which is no longer the head. Stopping here (as if
            // moved) makes the next activation start from the log.
            return Err(StoreError::Fenced {
                conversation: fence.conversation.clone(),
                term: fence.term,
            });
        }
        return Err(e.into());
    }
    summary.committed(batch, fence.term);
    if summary.urgent() {
        summary.write().await;
    }
    Ok(())
}

/// The parts of a summary that must never lag the log: whether the
/// conversation runs (orphan detection), its turn, and where its queued
/// messages start (what a takeover runs next).
#[derive(Debug, Clone, PartialEq)]
struct Decisive {
    status: Status,
    current_turn_id: Option<String>,
    last_turn_message_seq: u64,
}

impl Decisive {
    fn of(meta: &ConversationMeta) -> Decisive {
        Decisive {
            status: meta.status,
            current_turn_id: meta.current_turn_id.clone(),
            last_turn_message_seq: meta.last_turn_message_seq,
        }
    }
}

/// The owner's copy of a conversation's summary and its `client_msg_id`
/// records, and when they must be written. A change of a [`Decisive`] part
/// (or a new `client_msg_id`) is written with the commit that made it; a
/// change of only the head and last activity waits up to [`SUMMARY_LAG`],
/// so a streaming turn costs one summary write a second, not one per
/// event (readers of the head ask the log, see `NatsStore::snapshot`).
/// A write that fails is retried after the same lag.
struct SummaryWriter {
    summaries: Summaries,
    term: u64,
    meta: Option<ConversationMeta>,
    /// The revision last written or read (`None`: not yet).
    revision: Option<u64>,
    /// What the stored summary says of the decisive parts.
    stored: Option<Decisive>,
    client_ids: Vec<(String, u64)>,
    /// The ids of messages before this seq left the window and are still
    /// to be purged (0: none).
    forget_before: u64,
    /// When the stored summary started lagging the owner's copy.
    stale_since: Option<tokio::time::Instant>,
    /// Written right away (set by a decisive change or new ids).
    urgent: bool,
}

impl SummaryWriter {
    fn new(summaries: Summaries, known: Option<(ConversationMeta, u64)>) -> SummaryWriter {
        let (meta, revision) = match known {
            Some((m, r)) => (Some(m), Some(r)),
            None => (None, None),
        };
        SummaryWriter {
            summaries,
            term: 0,
            stored: meta.as_ref().map(Decisive::of),
            meta,
            revision,
            client_ids: Vec::new(),
            forget_before: 0,
            stale_since: None,
            urgent: false,
        }
    }

    /// Checks the append can be summarized: the first append of a
    /// conversation must create it.
    fn start(&mut self, batch: &AppendBatch) -> Result<(), StoreError> {
        if self.meta.is_some() {
            return Ok(());
        }
        let Some(create) = &batch.create else {
            return Err(StoreError::NotFound(batch.conversation_id.to_string()));
        };
        self.meta = Some(ConversationMeta {
            id: batch.conversation_id.to_string(),
            user: create.user.clone(),
            title: create.title.clone(),
            status: batch.state.status,
            created_at: create.created_at.clone(),
            last_activity_at: batch.last_activity_at().into_owned(),
            head_seq: 0,
            close_delay: create.close_delay,
            observers: Vec::new(),
            current_turn_id: None,
            last_turn_message_seq: 0,
        });
        Ok(())
    }

    /// Takes in a committed append's state.
    fn committed(&mut self, batch: &AppendBatch, term: u64) {
        let Some(m) = self.meta.as_mut() else { return };
        self.term = term;
        m.status = batch.state.status;
        m.head_seq = batch.state.head_seq;
        m.last_activity_at = batch.last_activity_at().into_owned();
        m.current_turn_id = batch.state.current_turn_id.as_deref().map(String::from);
        m.last_turn_message_seq = batch.state.last_turn_message_seq;
        self.client_ids.extend(batch.client_msg_ids.iter().cloned());
        self.forget_before = self.forget_before.max(batch.forget_client_msg_ids_before);
        self.stale_since
            .get_or_insert_with(tokio::time::Instant::now);
        if self.stored.as_ref() != Some(&Decisive::of(m)) || !self.client_ids.is_empty() {
            self.urgent = true;
        }
    }

    fn urgent(&self) -> bool {
        self.urgent
    }

    /// When the lagging summary must be written (`None`: it does not lag).
    fn due(&self) -> Option<tokio::time::Instant> {
        self.stale_since.map(|since| since + SUMMARY_LAG)
    }

    /// Writes the `client_msg_id`s (and forgets those that left the
    /// window) and the summary; on failure keeps them to try again after
    /// [`SUMMARY_LAG`].
    async fn write(&mut self) {
        let Some(meta) = self.meta.as_mut() else {
            self.stale_since = None;
            return;
        };
        if self.stale_since.is_none() {
            return;
        }
        let result = async {
            self.summaries
                .add_client_ids(&meta.id, &self.client_ids)
                .await?;
            self.client_ids.clear();
            if self.forget_before > 0 {
                self.summaries
                    .forget_client_ids(&meta.id, self.forget_before)
                    .await?;
                self.forget_before = 0;
            }
            self.summaries.put(meta, self.term, self.revision).await
        }
        .await;
        match result {
            Ok(written) => {
                // Nothing written: a newer owner's summary is stored, or the
                // conversation was deleted; either way ours is not wanted.
                self.revision = written.or(self.revision);
                self.stored = Some(Decisive::of(meta));
                self.stale_since = None;
                self.urgent = false;
            }
            Err(e) => {
                warn!(conversation = %meta.id, error = %e,
                    "writing the conversation summary failed; the log has the events, retrying");
                self.stale_since = Some(tokio::time::Instant::now());
                self.urgent = false;
            }
        }
    }
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
        let done: CommitCallback = Box::new(move |result, events| {
            health.record(result.as_ref().map(|_| ()));
            done(result, events)
        });
        let conversation = batch.conversation_id.to_string();
        let queue = self.lock().get(&conversation).map(|o| o.queue.clone());
        let not_owner = || StoreError::Fenced {
            conversation: conversation.clone(),
            term: 0,
        };
        let Some(queue) = queue else {
            done(Err(not_owner()), &batch.events);
            return;
        };
        self.pending.send_modify(|n| *n += 1);
        if let Err(mpsc::error::SendError((batch, done))) = queue.send((batch, done)) {
            self.pending.send_modify(|n| *n = n.saturating_sub(1));
            done(Err(not_owner()), &batch.events);
        }
    }

    fn health(&self) -> Result<(), String> {
        self.health.check()
    }

    /// Reads a head from the stream's leader: JetStream answers only with
    /// a leader, which is what an append needs too.
    async fn probe(&self) -> Result<(), StoreError> {
        let result = self
            .log
            .head("health-probe")
            .await
            .map(|_| ())
            .map_err(StoreError::from);
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

    /// The summary, with the head from the log: the owner writes a head
    /// that only moved up to [`SUMMARY_LAG`] late.
    async fn get(&self, id: &str) -> Result<Option<ConversationMeta>, StoreError> {
        let Some(mut meta) = self.summaries.get(id).await? else {
            return Ok(None);
        };
        meta.head_seq = meta.head_seq.max(self.log.head(id).await?.seq);
        Ok(Some(meta))
    }

    /// Summaries as stored: a head and last activity may be up to
    /// [`SUMMARY_LAG`] behind the log.
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

    async fn snapshot(
        &self,
        id: &str,
        tail: usize,
        client_msg_ids: usize,
    ) -> Result<Option<Snapshot>, StoreError> {
        let Some(meta) = self.get(id).await? else {
            return Ok(None);
        };
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
                let text = field(e.data(), "text").ok_or_else(|| {
                    StoreError::Backend(format!(
                        "conversation {id}: user_message {} has no text",
                        e.seq
                    ))
                })?;
                queued.push(QueuedMessage { seq: e.seq, text });
            }
        }
        let client_msg_ids = self.summaries.client_ids(id, client_msg_ids).await?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::EventData;
    use crate::store::ConversationState;

    fn job(seqs: std::ops::RangeInclusive<u64>, heard: &Arc<Mutex<Vec<Vec<u64>>>>) -> Job {
        let events: Vec<_> = seqs
            .clone()
            .map(|seq| {
                Arc::new(EventRecord::new(
                    "c_1",
                    seq,
                    &EventData::TextDelta {
                        turn_id: "t_1".into(),
                        text: "x".into(),
                    },
                ))
            })
            .collect();
        let batch = AppendBatch {
            conversation_id: Arc::from("c_1"),
            create: None,
            events,
            state: ConversationState {
                status: Status::Running,
                head_seq: *seqs.end(),
                last_activity_at: None,
                current_turn_id: None,
                last_turn_message_seq: 0,
            },
            client_msg_ids: Vec::new(),
            forget_client_msg_ids_before: 0,
        };
        let heard = heard.clone();
        let done: CommitCallback = Box::new(move |result, events| {
            assert!(result.is_ok());
            let seqs = events.iter().map(|e| e.seq).collect();
            heard.lock().unwrap().push(seqs);
        });
        (batch, done)
    }

    #[test]
    fn merged_appends_each_hear_of_their_own_events() {
        let heard = Arc::new(Mutex::new(Vec::new()));
        let first = job(1..=2, &heard);
        let rest = vec![job(3..=3, &heard), job(4..=6, &heard)];
        let (merged, callbacks) = merge(first, rest);
        assert_eq!(merged.events.len(), 6);
        assert_eq!(merged.state.head_seq, 6, "the last append's state");
        let mut answered = 0;
        answer(callbacks, &Ok(()), &merged.events, || answered += 1);
        assert_eq!(answered, 3);
        assert_eq!(*heard.lock().unwrap(), [vec![1, 2], vec![3], vec![4, 5, 6]]);
    }
}

//! The per-conversation event log in JetStream, fenced.
//!
//! # Subjects
//! One stream (`LINGER_EVENTS`) holds every conversation; conversation `c`
//! writes to the single subject `linger.ev.<c>`. One message holds one
//! append group: the events of one [`crate::store::AppendBatch`] (split
//! only when larger than the server's `max_payload`), as JSON lines, with
//! headers `Linger-Term` (the writer's ownership term), `Linger-Seq` and
//! `Linger-Last-Seq` (the linger seq range it holds). A takeover writes a
//! *fence message*: the new term and an empty range (`Linger-Seq` =
//! head + 1, `Linger-Last-Seq` = head).
//!
//! Why one subject per conversation, not one per event
//! (`ev.<c>.<seq>`, found with a `last_by_subj` get): JetStream keeps an
//! in-memory index entry per distinct subject in a stream (the file store's
//! `psim`, a subject tree of per-subject first/last block), and a per-block
//! subject map. Millions of events would mean millions of entries, hundreds
//! of MB of server memory on every replica, for an O(1) lookup that
//! O(log n) probes already make cheap. With one subject per conversation
//! the index holds one entry per conversation.
//!
//! Why one message per append group, not one per event: in a clustered
//! stream the leader refuses a second publish with an expected-sequence
//! header for a subject while another one for it is still in flight (error
//! 10164, `expectedPerSubjectInProcess` in `checkMsgHeadersPreClusteredProposal`),
//! so per-event conditional publishes could only go one round trip at a
//! time, and a batch could be half stored. One message per group is one
//! round trip and all-or-nothing. (Atomic batch publish would also do, but
//! needs 2.12 and a stream option; 2.11 is the floor here.)
//!
//! # The fence
//! Every append carries `Nats-Expected-Last-Subject-Sequence: S`, where `S`
//! is the *stream* sequence of the conversation's last message (the server
//! compares it with `LoadLastMsg(subject).seq`, `processJetStreamMsg` in
//! `server/stream.go`), so the owner keeps `S` in its [`Fence`] and moves it
//! with every ack. A takeover appends a fence message conditional on the
//! head it read from the stream leader: from then on the old owner's `S` is
//! stale and its appends get 10071 "wrong last sequence", reported as
//! [`ClusterError::Fenced`].
//!
//! `Nats-Msg-Id` is `<c>.<term>.<first seq>` (`.fence` for fence messages).
//! The server checks duplicates *before* the expected sequence (the msg-id
//! check comes first in `checkMsgHeadersPreClusteredProposal` and in
//! `processJetStreamMsg`), so a retry of a publish whose ack was lost is
//! answered "duplicate" with the first position instead of 10071; and the
//! term in the id keeps a new owner's event at the same seq from being
//! taken for a duplicate of the old owner's. After the dedup window a
//! retried append that gets 10071 reads the head from the leader and
//! recognizes its own message by term and seq.
//!
//! `Nats-Expected-Last-Subject-Sequence-Subject` (2.11) makes the server
//! check the last message of another subject, wildcards included, instead
//! of the published one; it is what would let per-event subjects be fenced
//! on `ev.<c>.*`. With one subject per conversation it is not needed.
//!
//! # Finding linger seq N
//! A search over stream sequences with `next_by_subj` gets: a probe at
//! stream sequence `p` returns the conversation's first message at or
//! after `p`, and its `Linger-Last-Seq` says whether N lies before or after
//! it. What is read is nearly always recent (a reattach, a takeover's
//! queue), so the search starts at the conversation's last message (often
//! N is in it: no probe at all) and goes down in doubling steps, then
//! bisects between the last two probes: O(log distance) probes, each a
//! server-side indexed lookup; no history is scanned.
//!
//! # Reads
//! What decides ownership or the head is read from the stream leader
//! (`STREAM.MSG.GET`), never from a direct get that a follower may answer
//! with stale data: a takeover must see the true head. History below a
//! head read from the leader is read in batches of [`READ_BATCH`] messages
//! with one batched direct get (any replica): a replica that is behind
//! answers a shorter prefix of the same log, never another history, and
//! the read goes on from where it stopped (from the leader when the
//! replica has nothing more).

use std::sync::Arc;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{RawMessageError, RawMessageErrorKind, Stream};
use async_nats::jetstream::ErrorCode;
use async_nats::{HeaderMap, StatusCode};
use bytes::Bytes;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

use super::{check_token, purge_subject, with_deadline, Cluster, ClusterError};
use crate::event::{intern_kind, EventRecord};

const TERM: &str = "Linger-Term";
const NODE: &str = "Linger-Node";
const FIRST: &str = "Linger-Seq";
const LAST: &str = "Linger-Last-Seq";

/// Most messages one batched read asks for.
const READ_BATCH: usize = 256;

/// Room left in a message for headers when splitting a large group.
const HEADER_ROOM: usize = 1024;

/// The last message of a conversation's log, as the stream leader has it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Head {
    /// The last linger seq stored (0: none).
    pub seq: u64,
    /// The stream sequence of the conversation's last message (0: none).
    pub stream_seq: u64,
    /// The term of whoever wrote it (0: none).
    pub term: u64,
    /// The node that wrote it (empty: none).
    pub node: String,
}

/// What an owner needs to append: its term and the stream sequence of the
/// conversation's last message, moved by every ack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub conversation: String,
    /// Ownership is (term, node): two nodes that computed the same term
    /// from the same head still cannot both believe they own.
    pub term: u64,
    pub node: String,
    /// Stream sequence the next append expects as the subject's last.
    pub expected: u64,
    /// The last linger seq stored.
    pub head_seq: u64,
}

/// One message of the log as read back.
#[derive(Debug, Clone)]
struct Group {
    stream_seq: u64,
    term: u64,
    node: String,
    first: u64,
    last: u64,
    payload: Bytes,
}

#[derive(Serialize, Deserialize)]
struct Line<'a> {
    seq: u64,
    ts: &'a str,
    kind: &'a str,
    data: &'a serde_json::value::RawValue,
}

/// The event log of every conversation.
#[derive(Clone)]
pub struct EventLog {
    cluster: Cluster,
    stream: Stream<()>,
}

impl EventLog {
    pub async fn open(cluster: &Cluster) -> Result<EventLog, ClusterError> {
        Ok(EventLog {
            stream: cluster.events_stream().await?,
            cluster: cluster.clone(),
        })
    }

    fn subject(&self, conversation: &str) -> Result<String, ClusterError> {
        Ok(self
            .cluster
            .options
            .events_subject(check_token(conversation)?))
    }

    /// The conversation's head, read from the stream leader.
    pub async fn head(&self, conversation: &str) -> Result<Head, ClusterError> {
        let subject = self.subject(conversation)?;
        Ok(self
            .last_group(&subject)
            .await?
            .map(|g| Head {
                seq: g.last,
                stream_seq: g.stream_seq,
                term: g.term,
                node: g.node,
            })
            .unwrap_or_default())
    }

    /// The conversation's last message, read from the stream leader.
    async fn last_group(&self, subject: &str) -> Result<Option<Group>, ClusterError> {
        with_deadline(
            self.cluster.options.op_timeout,
            "reading the head",
            || async {
                let got = self
                    .stream
                    .raw_message_builder()
                    .last_by_subject(subject.to_owned())
                    .send()
                    .await;
                found_group(got)
            },
        )
        .await
    }

    /// Takes the conversation over with `term` (greater than any term in its
    /// log): appends a fence message after the head read from the leader,
    /// so that every append of an earlier owner is refused from now on.
    /// `floor_seq` is the head known from elsewhere (the summary), in case
    /// the log's messages have aged out: seq never goes back.
    pub async fn take_over(
        &self,
        conversation: &str,
        term: u64,
        node: &str,
        floor_seq: u64,
    ) -> Result<Fence, ClusterError> {
        self.take_over_from(conversation, term, node, floor_seq, None)
            .await
    }

    /// [`EventLog::take_over`] starting from a head the caller just read
    /// from the leader (a claim reads it to choose the term): a takeover is
    /// then one publish when nothing else moves.
    pub async fn take_over_from(
        &self,
        conversation: &str,
        term: u64,
        node: &str,
        floor_seq: u64,
        mut known: Option<Head>,
    ) -> Result<Fence, ClusterError> {
        check_token(node)?;
        let subject = self.subject(conversation)?;
        let deadline = tokio::time::Instant::now() + self.cluster.options.op_timeout;
        loop {
            let head = match known.take() {
                Some(head) => head,
                None => self.head(conversation).await?,
            };
            if head.term >= term {
                return Err(ClusterError::Fenced {
                    conversation: conversation.to_owned(),
                    term,
                });
            }
            let seq = head.seq.max(floor_seq);
            let mut headers = HeaderMap::new();
            headers.insert(
                "Nats-Msg-Id",
                format!("{conversation}.{term}.{node}.fence").as_str(),
            );
            headers.insert(TERM, term.to_string().as_str());
            headers.insert(NODE, node);
            headers.insert(FIRST, (seq + 1).to_string().as_str());
            headers.insert(LAST, seq.to_string().as_str());
            match self
                .publish_once(&subject, head.stream_seq, headers, Bytes::new())
                .await
            {
                Ok(stored) if !stored.duplicate => {
                    // Stored right after the head it was conditional on: the
                    // fence is in place. (Anything later is a later term's,
                    // which refuses our first append.)
                    return Ok(Fence {
                        conversation: conversation.to_owned(),
                        term,
                        node: node.to_owned(),
                        expected: stored.seq,
                        head_seq: seq,
                    });
                }
                Ok(_) | Err(Refusal::WrongLast) => {
                    // Stored before (duplicate), or someone appended in
                    // between: the head read next says which.
                }
                Err(Refusal::Unavailable(why)) => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(ClusterError::Unavailable(format!("taking over: {why}")));
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            }
            let now = self.head(conversation).await?;
            if now.term == term && now.node == node {
                return Ok(Fence {
                    conversation: conversation.to_owned(),
                    term,
                    node: node.to_owned(),
                    expected: now.stream_seq,
                    head_seq: now.seq,
                });
            }
            if now.term >= term {
                return Err(ClusterError::Fenced {
                    conversation: conversation.to_owned(),
                    term,
                });
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ClusterError::Unavailable(
                    "taking over: the old owner kept appending".into(),
                ));
            }
        }
    }

    /// Appends events (contiguous after `fence.head_seq`) with fenced
    /// publishes; on success the fence has moved past them. `Fenced`: a
    /// later owner has written; `Unavailable`: nothing is known to be stored
    /// beyond what the fence says (a retry with the same fence is safe).
    pub async fn append(
        &self,
        fence: &mut Fence,
        events: &[Arc<EventRecord>],
    ) -> Result<(), ClusterError> {
        let subject = self.subject(&fence.conversation)?;
        for (i, e) in events.iter().enumerate() {
            if e.seq != fence.head_seq + 1 + i as u64 {
                return Err(ClusterError::Corrupt(format!(
                    "append to {}: seq {} after head {} is not contiguous",
                    fence.conversation, e.seq, fence.head_seq
                )));
            }
        }
        for chunk in chunks(events, self.max_message())? {
            let first = fence.head_seq + 1;
            let last = fence.head_seq + chunk.count;
            let stream_seq = self
                .publish_group(fence, &subject, first, last, chunk.payload)
                .await?;
            fence.expected = stream_seq;
            fence.head_seq = last;
        }
        Ok(())
    }

    /// The most bytes of events one message of the log holds (the
    /// server's `max_payload`, less room for headers).
    pub fn max_message(&self) -> usize {
        let max = self.cluster.client.server_info().max_payload;
        max.saturating_sub(HEADER_ROOM).max(1)
    }

    async fn publish_group(
        &self,
        fence: &Fence,
        subject: &str,
        first: u64,
        last: u64,
        payload: Bytes,
    ) -> Result<u64, ClusterError> {
        let fenced = || ClusterError::Fenced {
            conversation: fence.conversation.clone(),
            term: fence.term,
        };
        with_deadline(self.cluster.options.op_timeout, "appending", || {
            let payload = payload.clone();
            async move {
                let mut headers = HeaderMap::new();
                headers.insert(
                    "Nats-Msg-Id",
                    format!(
                        "{}.{}.{}.{first}",
                        fence.conversation, fence.term, fence.node
                    )
                    .as_str(),
                );
                headers.insert(TERM, fence.term.to_string().as_str());
                headers.insert(NODE, fence.node.as_str());
                headers.insert(FIRST, first.to_string().as_str());
                headers.insert(LAST, last.to_string().as_str());
                match self
                    .publish_once(subject, fence.expected, headers, payload)
                    .await
                {
                    Ok(stored) => Ok(stored.seq),
                    Err(Refusal::Unavailable(why)) => Err(ClusterError::Unavailable(why)),
                    Err(Refusal::WrongLast) => {
                        // Ours, stored by an earlier try whose ack was lost
                        // (after the dedup window), or someone else's.
                        let head = self.head(&fence.conversation).await?;
                        if head.term == fence.term && head.node == fence.node && head.seq == last {
                            Ok(head.stream_seq)
                        } else {
                            Err(fenced())
                        }
                    }
                }
            }
        })
        .await
    }

    /// One conditional publish: where it was stored, or why not.
    async fn publish_once(
        &self,
        subject: &str,
        expected: u64,
        mut headers: HeaderMap,
        payload: Bytes,
    ) -> Result<Stored, Refusal> {
        if self.cluster.client.connection_state() != async_nats::connection::State::Connected {
            return Err(Refusal::Unavailable("not connected to NATS".into()));
        }
        headers.insert(
            "Nats-Expected-Last-Subject-Sequence",
            expected.to_string().as_str(),
        );
        let ack = self
            .cluster
            .js
            .publish_with_headers(subject.to_owned(), headers, payload)
            .await
            .map_err(|e| Refusal::Unavailable(e.to_string()))?
            .await;
        match ack {
            Ok(ack) => Ok(Stored {
                seq: ack.sequence,
                duplicate: ack.duplicate,
            }),
            Err(e) => Err(classify(&e)),
        }
    }

    /// Stream position of the message holding linger seq `seq` (or the
    /// first one after it), without scanning: see the module doc.
    pub async fn locate(&self, conversation: &str, seq: u64) -> Result<Option<u64>, ClusterError> {
        let subject = self.subject(conversation)?;
        match self.last_group(&subject).await? {
            Some(last) if seq <= last.last => {
                self.locate_below(&subject, seq, &last).await.map(Some)
            }
            _ => Ok(None),
        }
    }

    /// [`EventLog::locate`] given the conversation's last message (which
    /// holds seq or a later one). Searched from the top down, because what
    /// is read is nearly always recent (a reattach, a takeover's queue):
    /// probes at the last message's position minus 1, 2, 4, … until one
    /// lands on a message ending before `seq`, then a binary search between
    /// the last two probes. O(log distance) probes, at most twice the
    /// O(log stream) of a plain binary search.
    async fn locate_below(
        &self,
        subject: &str,
        seq: u64,
        last: &Group,
    ) -> Result<u64, ClusterError> {
        if last.first <= seq {
            return Ok(last.stream_seq);
        }
        // `found`: the earliest message seen that ends at or after `seq`.
        let mut found = last.stream_seq;
        let mut step = 1u64;
        let mut lo = loop {
            let probe = found.saturating_sub(step).max(1);
            match self.next_group(subject, probe).await? {
                Some(g) if g.stream_seq < found && g.last < seq => break g.stream_seq + 1,
                Some(g) if g.stream_seq < found => found = g.stream_seq,
                // Nothing of this conversation in [probe, found): the
                // answer is at or below the probe.
                _ => {}
            }
            if probe == 1 {
                // The conversation's first message ends at or after `seq`.
                return Ok(found);
            }
            step = step.saturating_mul(2);
        };
        let mut hi = found.saturating_sub(1);
        while lo <= hi {
            let mid = lo + (hi - lo) / 2;
            match self.next_group(subject, mid).await? {
                Some(g) if g.stream_seq <= hi && g.last < seq => lo = g.stream_seq + 1,
                Some(g) if g.stream_seq <= hi => {
                    found = g.stream_seq;
                    hi = mid - 1;
                }
                // Nothing of this conversation in [mid, hi]: look lower.
                _ => hi = mid - 1,
            }
        }
        Ok(found)
    }

    /// Stored events with seq > `after`, oldest first, at most `limit`.
    /// Found with [`EventLog::locate`], then read in batches.
    pub async fn read(
        &self,
        conversation: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Arc<EventRecord>>, ClusterError> {
        let subject = self.subject(conversation)?;
        let mut out = Vec::new();
        if limit == 0 {
            return Ok(out);
        }
        let Some(last) = self.last_group(&subject).await? else {
            return Ok(out);
        };
        if after >= last.last {
            return Ok(out);
        }
        let mut at = self.locate_below(&subject, after + 1, &last).await?;
        while out.len() < limit && at <= last.stream_seq {
            let groups = if at == last.stream_seq {
                vec![last.clone()]
            } else {
                self.groups(&subject, at, last.stream_seq).await?
            };
            let Some(end) = groups.last().map(|g| g.stream_seq) else {
                break;
            };
            for g in &groups {
                for record in decode(conversation, g)? {
                    if record.seq > after && out.len() < limit {
                        out.push(Arc::new(record));
                    }
                }
            }
            at = end + 1;
        }
        Ok(out)
    }

    /// The conversation's messages from stream sequence `from` up to
    /// `upto` (at least one when there is one): a batch from any replica,
    /// or, when the replica answering has not applied them yet, one from
    /// the leader.
    async fn groups(
        &self,
        subject: &str,
        from: u64,
        upto: u64,
    ) -> Result<Vec<Group>, ClusterError> {
        let batch = self.batch(subject, from, upto).await?;
        if !batch.is_empty() {
            return Ok(batch);
        }
        Ok(self
            .next_group(subject, from)
            .await?
            .filter(|g| g.stream_seq <= upto)
            .into_iter()
            .collect())
    }

    /// Up to [`READ_BATCH`] of the conversation's messages from stream
    /// sequence `from`, stopping after `upto`, in one batched direct get
    /// (NATS 2.11, ADR-31; `async-nats` sends only single gets, so the
    /// request is made here). Any replica may answer, so the batch may end
    /// early on one that is behind: it is a prefix of the log, never a
    /// different history, and the caller goes on from where it ended.
    async fn batch(&self, subject: &str, from: u64, upto: u64) -> Result<Vec<Group>, ClusterError> {
        #[derive(Serialize)]
        struct Request<'a> {
            seq: u64,
            next_by_subj: &'a str,
            batch: usize,
        }
        let request = serde_json::to_vec(&Request {
            seq: from.max(1),
            next_by_subj: subject,
            batch: READ_BATCH,
        })
        .map_err(|e| ClusterError::Corrupt(e.to_string()))?;
        let api = format!(
            "$JS.API.DIRECT.GET.{}",
            self.cluster.options.events_stream()
        );
        let client = &self.cluster.client;
        with_deadline(self.cluster.options.op_timeout, "reading the log", || {
            let request = Bytes::from(request.clone());
            let api = api.clone();
            async move {
                let unavailable =
                    |e: &dyn std::fmt::Display| ClusterError::Unavailable(e.to_string());
                let inbox = client.new_inbox();
                let mut replies = client
                    .subscribe(inbox.clone())
                    .await
                    .map_err(|e| unavailable(&e))?;
                client
                    .publish_with_reply(api, inbox, request)
                    .await
                    .map_err(|e| unavailable(&e))?;
                let mut out = Vec::new();
                while let Some(m) = replies.next().await {
                    match m.status {
                        None => {}
                        // 204: end of the batch; 404: nothing at or after `from`.
                        Some(s) if s.as_u16() == 204 || s == StatusCode::NOT_FOUND => break,
                        Some(s) => {
                            return Err(ClusterError::Unavailable(format!(
                                "batched read: status {s} {}",
                                m.description.unwrap_or_default()
                            )))
                        }
                    }
                    let headers = m.headers.unwrap_or_default();
                    let seq = header_u64(&headers, "Nats-Sequence", 0)?;
                    if seq > upto {
                        continue;
                    }
                    out.push(group(seq, &headers, m.payload)?);
                }
                Ok(out)
            }
        })
        .await
    }

    /// Removes a conversation's whole log.
    pub async fn delete(&self, conversation: &str) -> Result<(), ClusterError> {
        let subject = self.subject(conversation)?;
        let timeout = self.cluster.options.op_timeout;
        purge_subject(&self.stream, subject, timeout, "deleting a log").await
    }

    /// The conversation's first message at or after stream sequence `from`.
    async fn next_group(&self, subject: &str, from: u64) -> Result<Option<Group>, ClusterError> {
        with_deadline(
            self.cluster.options.op_timeout,
            "reading the log",
            || async {
                let got = self
                    .stream
                    .raw_message_builder()
                    .sequence(from.max(1))
                    .next_by_subject(subject.to_owned())
                    .send()
                    .await;
                found_group(got)
            },
        )
        .await
    }
}

/// Where a conditional publish was stored.
struct Stored {
    /// The stream sequence it got (or had, for a duplicate).
    seq: u64,
    /// Stored by an earlier publish with the same `Nats-Msg-Id`.
    duplicate: bool,
}

/// Why a conditional publish was not stored.
enum Refusal {
    /// The subject's last message is not the expected one (10071, or 10164
    /// once the other in-flight publish has landed).
    WrongLast,
    Unavailable(String),
}

fn classify(e: &async_nats::jetstream::context::PublishError) -> Refusal {
    if e.kind() == PublishErrorKind::WrongLastSequence {
        return Refusal::WrongLast;
    }
    let code = std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
        .map(|j| j.error_code());
    match code {
        Some(ErrorCode::STREAM_WRONG_LAST_SEQUENCE) => Refusal::WrongLast,
        // 10164: another conditional publish for this subject is in flight;
        // 10163: expected-sequence checks paused by a leader change. Both are
        // retried; a retry after the other one landed gets 10071.
        _ => Refusal::Unavailable(e.to_string()),
    }
}

struct Chunk {
    count: u64,
    payload: Bytes,
}

/// Encodes events as JSON lines, split so that each message fits `max`.
fn chunks(events: &[Arc<EventRecord>], max: usize) -> Result<Vec<Chunk>, ClusterError> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let mut count = 0u64;
    for e in events {
        let data = serde_json::from_str::<&serde_json::value::RawValue>(e.data())
            .map_err(|err| ClusterError::Corrupt(format!("event {}: {err}", e.seq)))?;
        let line = serde_json::to_vec(&Line {
            seq: e.seq,
            ts: e.ts(),
            kind: &e.kind,
            data,
        })
        .map_err(|err| ClusterError::Corrupt(format!("event {}: {err}", e.seq)))?;
        if line.len() + 1 > max {
            return Err(ClusterError::Unavailable(format!(
                "event {} is {} bytes, more than the NATS server's max_payload allows",
                e.seq,
                line.len()
            )));
        }
        if count > 0 && buf.len() + line.len() + 1 > max {
            out.push(Chunk {
                count,
                payload: Bytes::from(std::mem::take(&mut buf)),
            });
            count = 0;
        }
        buf.extend_from_slice(&line);
        buf.push(b'\n');
        count += 1;
    }
    if count > 0 {
        out.push(Chunk {
            count,
            payload: Bytes::from(buf),
        });
    }
    Ok(out)
}

fn header_u64(headers: &HeaderMap, name: &str, seq: u64) -> Result<u64, ClusterError> {
    headers
        .get(name)
        .and_then(|v| v.as_str().parse().ok())
        .ok_or_else(|| ClusterError::Corrupt(format!("message {seq}: no valid {name} header")))
}

/// The group of a message read from the leader; `None` when the
/// conversation has no such message.
fn found_group(got: Result<StreamMessage, RawMessageError>) -> Result<Option<Group>, ClusterError> {
    match got {
        Ok(m) => group(m.sequence, &m.headers, m.payload).map(Some),
        Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(ClusterError::Unavailable(e.to_string())),
    }
}

fn group(stream_seq: u64, headers: &HeaderMap, payload: Bytes) -> Result<Group, ClusterError> {
    Ok(Group {
        stream_seq,
        term: header_u64(headers, TERM, stream_seq)?,
        node: headers
            .get(NODE)
            .map(|v| v.as_str().to_owned())
            .ok_or_else(|| {
                ClusterError::Corrupt(format!("message {stream_seq}: no {NODE} header"))
            })?,
        first: header_u64(headers, FIRST, stream_seq)?,
        last: header_u64(headers, LAST, stream_seq)?,
        payload,
    })
}

fn decode(conversation: &str, g: &Group) -> Result<Vec<EventRecord>, ClusterError> {
    let mut out = Vec::new();
    for (i, line) in g
        .payload
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .enumerate()
    {
        let l: Line = serde_json::from_slice(line)
            .map_err(|e| ClusterError::Corrupt(format!("message {}: {e}", g.stream_seq)))?;
        if l.seq != g.first + i as u64 || l.seq > g.last {
            return Err(ClusterError::Corrupt(format!(
                "message {}: seq {} outside {}..={}",
                g.stream_seq, l.seq, g.first, g.last
            )));
        }
        out.push(EventRecord::from_parts(
            conversation,
            l.seq,
            l.ts,
            intern_kind(l.kind),
            l.data.get(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u64, text: &str) -> Arc<EventRecord> {
        Arc::new(EventRecord::from_parts(
            "c_1",
            seq,
            "2026-01-01T00:00:00.000Z",
            intern_kind("text_delta"),
            &serde_json::json!({ "turn_id": "t", "text": text }).to_string(),
        ))
    }

    #[test]
    fn chunks_round_trip_and_split() {
        let events: Vec<_> = (1..=10).map(|s| record(s, &"x".repeat(50))).collect();
        let parts = chunks(&events, 300).unwrap();
        assert!(parts.len() > 1);
        let mut first = 1;
        let mut back = Vec::new();
        for (i, c) in parts.iter().enumerate() {
            assert!(c.payload.len() <= 300);
            let g = Group {
                stream_seq: i as u64 + 1,
                term: 1,
                node: "n".into(),
                first,
                last: first + c.count - 1,
                payload: c.payload.clone(),
            };
            back.extend(decode("c_1", &g).unwrap());
            first += c.count;
        }
        assert_eq!(back.len(), 10);
        for (a, b) in events.iter().zip(&back) {
            assert_eq!(a.frame, b.frame);
        }
    }

    #[test]
    fn an_event_larger_than_a_message_is_refused() {
        assert!(chunks(&[record(1, &"x".repeat(500))], 100).is_err());
    }
}

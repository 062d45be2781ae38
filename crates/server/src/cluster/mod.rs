//! Cluster mode's foundation (protocol §10): history, ownership and
//! conversation summaries in NATS JetStream, through `async-nats`.
//!
//! # Layout
//! - [`connect`]: connecting to `cluster.nats_urls`, refusing servers older
//!   than 2.11, creating (or checking) the stream and buckets.
//! - [`log`]: the per-conversation event log, every append a conditional
//!   publish (the fence), and finding linger seq N without a scan.
//! - [`liveness`]: one heartbeat per node process (a KV key with a TTL);
//!   departures of other nodes are watched.
//! - [`lease`]: who should run a conversation: an ownership record per
//!   conversation, valid while its holder's heartbeat lives.
//! - [`meta`]: conversation summaries ([`crate::store::ConversationMeta`]) in
//!   a KV bucket, with a per-user index.
//! - [`store`]: [`store::NatsStore`], the [`crate::store::Store`] trait over
//!   the three, plus ownership (take over, fence) as its extension.
//! - [`ownership`]: claiming a conversation (record, then fence), the
//!   heartbeat, noticing a conversation taken over, giving records back.
//! - [`remote`]: attachments served by the owner to clients on other
//!   nodes (node-to-node traffic over core NATS).
//! - [`node`]: this node's part, put together, and the watch for
//!   conversations of lost nodes.
//!
//! # Two mechanisms, two jobs
//! The ownership record (and its holder's heartbeat) says which node
//! *should* run a conversation and lets others notice a dead one. The fence decides who *can* append: every append is
//! conditional on the stream sequence of the conversation's last message,
//! and a new owner's first act is a fence message of its own, so a node
//! that was paused or cut off and still believes it owns the conversation
//! has its next append refused ([`ClusterError::Fenced`]) and must stop.
//! A record alone never decides who may append.
//!
//! # When NATS is slow, full, gone or lying
//! - **Slow**: every operation has a deadline ([`ClusterOptions::op_timeout`]);
//!   past it the caller gets [`ClusterError::Unavailable`]. An append whose
//!   ack did not come may still have been stored: it is retried with the
//!   same `Nats-Msg-Id` (the server answers "duplicate" with the first
//!   position), and when the dedup window has passed, the log's head is read
//!   from the stream leader and recognized by its term and seq headers. So an
//!   unknown outcome is resolved, never guessed.
//! - **Full** (stream or account limits, message too large): the publish is
//!   refused with an API error; it is reported as `Unavailable` (nothing was
//!   stored, nothing may be sent) with the server's description in the text.
//! - **Gone** (no server, no JetStream quorum, leader election): publishes
//!   time out, get "no responders" or 503 errors (10163 on some 2.11
//!   pre-releases: expected-sequence checks paused during a leader change;
//!   10164: another conditional publish on the subject is in flight). These are retried until the
//!   deadline, then reported `Unavailable` (protocol: `store_unavailable`,
//!   `/healthz` 503). The client reconnects by itself forever; the next
//!   append after recovery works without any reset because the fence is
//!   checked by the server, not remembered by us.
//! - **Lying** (a follower answering reads with stale data): reads that
//!   decide ownership or the head go to the stream leader (`$JS.API.STREAM.
//!   MSG.GET`, never a direct get that followers may answer). A server that
//!   is too old to enforce expected sequences atomically across a leader
//!   change (< 2.11) is refused at connect. Headers we read back are
//!   checked; a message without them is reported as corrupt, not skipped.

pub mod connect;
pub mod lease;
pub mod liveness;
pub mod log;
pub mod meta;
pub mod node;
pub mod ownership;
pub mod remote;
pub mod store;

use std::time::Duration;

pub use connect::{connect, Cluster, ClusterOptions, MIN_SERVER_VERSION};

/// The typed errors of the cluster layer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClusterError {
    /// NATS or JetStream could not answer in time, or refused for a reason
    /// that is not about ownership. Maps to `store_unavailable`.
    #[error("NATS unavailable: {0}")]
    Unavailable(String),
    /// Another owner (a later term) has appended since this node's last
    /// append: this node lost the conversation and must stop it.
    #[error("conversation {conversation}: fenced out (this node's term {term} is stale)")]
    Fenced { conversation: String, term: u64 },
    /// The NATS server cannot enforce linger's fencing.
    #[error(
        "NATS server {version} is too old: linger needs {MIN_SERVER_VERSION} or later, because \
         older servers can accept two conditional appends for the same position (during a \
         leader change), which would let two nodes write the same seq"
    )]
    ServerTooOld { version: String },
    /// A live node of the cluster speaks another version of what nodes say
    /// to each other: this build must not join it.
    #[error(
        "node {node} of this cluster speaks cluster version {theirs} and this build speaks \
         {ours}: nodes of different versions cannot share a cluster; stop every node, then \
         start them all on one build (README: \"Run a cluster\", upgrading)"
    )]
    OtherVersion {
        node: String,
        theirs: u32,
        ours: u32,
    },
    /// A stored message or value is not what linger writes.
    #[error("NATS data: {0}")]
    Corrupt(String),
    /// A name that cannot be a NATS subject token.
    #[error("invalid name for NATS: {0:?}")]
    InvalidName(String),
    #[error("conversation {0} not found")]
    NotFound(String),
    /// The lease is held by another node (or was lost).
    #[error("conversation {conversation}: lease held by node {holder}")]
    LeaseHeld {
        conversation: String,
        holder: String,
    },
}

impl From<ClusterError> for crate::store::StoreError {
    fn from(e: ClusterError) -> Self {
        match e {
            ClusterError::Unavailable(why) => crate::store::StoreError::Unavailable(why),
            ClusterError::Fenced { conversation, term } => {
                crate::store::StoreError::Fenced { conversation, term }
            }
            ClusterError::NotFound(id) => crate::store::StoreError::NotFound(id),
            other => crate::store::StoreError::Backend(other.to_string()),
        }
    }
}

/// Conversation ids become subject tokens and KV keys: only
/// `[A-Za-z0-9_-]` (linger's ids are `c_<ULID>`).
pub(crate) fn check_token(name: &str) -> Result<&str, ClusterError> {
    if !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        Ok(name)
    } else {
        Err(ClusterError::InvalidName(name.to_owned()))
    }
}

/// Removes every message of `subject` from `stream` outright (no markers
/// left), retried within `timeout`.
pub(crate) async fn purge_subject<I>(
    stream: &async_nats::jetstream::stream::Stream<I>,
    subject: String,
    timeout: Duration,
    what: &str,
) -> Result<(), ClusterError> {
    with_deadline(timeout, what, || async {
        stream
            .purge()
            .filter(subject.clone())
            .await
            .map(|_| ())
            .map_err(|e| ClusterError::Unavailable(e.to_string()))
    })
    .await
}

/// Runs `op` until it succeeds, fails for good, or `timeout` passes; the
/// retryable failures are the ones [`ClusterError::Unavailable`] stands for.
pub(crate) async fn with_deadline<T, F, Fut>(
    timeout: Duration,
    what: &str,
    mut op: F,
) -> Result<T, ClusterError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClusterError>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut backoff = Duration::from_millis(20);
    loop {
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let result = match tokio::time::timeout(remaining, op()).await {
            Ok(r) => r,
            Err(_) => Err(ClusterError::Unavailable(format!("{what}: timed out"))),
        };
        match result {
            Err(ClusterError::Unavailable(why)) => {
                if tokio::time::Instant::now() + backoff >= deadline {
                    return Err(ClusterError::Unavailable(format!("{what}: {why}")));
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            other => return other,
        }
    }
}

/// A key's value and revision as the bucket's stream leader has them
/// (`None`: never written, deleted, purged or aged out). Not
/// `kv::Store::entry`: on buckets with direct gets (every bucket
/// `async-nats` creates) that may be answered by a follower that has not
/// yet applied the latest write, so a summary written a moment ago on
/// another node could read as missing, or a lease as free.
pub(crate) async fn leader_entry(
    kv: &async_nats::jetstream::kv::Store,
    key: &str,
    timeout: Duration,
    what: &str,
) -> Result<Option<(bytes::Bytes, u64)>, ClusterError> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    let subject = format!("{}{key}", kv.prefix);
    let got = with_deadline(timeout, what, || async {
        match kv.stream.get_last_raw_message_by_subject(&subject).await {
            Ok(m) => Ok(Some(m)),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(ClusterError::Unavailable(e.to_string())),
        }
    })
    .await?;
    let Some(message) = got else {
        return Ok(None);
    };
    // A put carries no operation header; deletes and purges say so, and a
    // key that aged out leaves a marker naming the reason.
    let removed = message
        .headers
        .get("KV-Operation")
        .is_some_and(|op| op.as_str() != "PUT")
        || message.headers.get("Nats-Marker-Reason").is_some();
    Ok((!removed).then_some((message.payload, message.sequence)))
}

/// The keys of a KV bucket matching `pattern` (e.g. `u.<hex user>.*`),
/// from the stream's subject index: no scan of values. A deleted key's
/// marker is listed too until it ages out, so callers read each key.
pub(crate) async fn kv_keys(
    kv: &async_nats::jetstream::kv::Store,
    pattern: &str,
    timeout: Duration,
    what: &str,
) -> Result<Vec<String>, ClusterError> {
    use futures_util::TryStreamExt;
    let filter = format!("{}{pattern}", kv.prefix);
    let subjects: Vec<(String, usize)> = with_deadline(timeout, what, || async {
        kv.stream
            .info_with_subjects(&filter)
            .await
            .map_err(|e| ClusterError::Unavailable(e.to_string()))?
            .try_collect()
            .await
            .map_err(|e| ClusterError::Unavailable(e.to_string()))
    })
    .await?;
    Ok(subjects
        .into_iter()
        .filter_map(|(s, _)| s.strip_prefix(kv.prefix.as_str()).map(str::to_owned))
        .collect())
}

/// Hands `each` every entry of `kv` matching `pattern`, first the current
/// ones, then every change, until the watch breaks or `each` fails; returns
/// why (the caller watches again).
pub(crate) async fn watch_kv(
    kv: &async_nats::jetstream::kv::Store,
    pattern: &str,
    mut each: impl FnMut(async_nats::jetstream::kv::Entry) -> Result<(), ClusterError>,
) -> ClusterError {
    use futures_util::StreamExt;
    let mut watch = match kv.watch_with_history(pattern).await {
        Ok(w) => w,
        Err(e) => return ClusterError::Unavailable(e.to_string()),
    };
    while let Some(entry) = watch.next().await {
        let result = entry
            .map_err(|e| ClusterError::Unavailable(e.to_string()))
            .and_then(&mut each);
        if let Err(e) = result {
            return e;
        }
    }
    ClusterError::Unavailable(format!("the watch of {pattern} ended"))
}

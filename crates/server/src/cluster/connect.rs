//! Connecting to NATS: the server must be 2.11 or later, and the stream and
//! buckets linger uses are created (or checked) with `cluster.replicas`.
//!
//! Why 2.11: before it, a newly elected stream leader could check
//! `Nats-Expected-Last-Subject-Sequence` against a state that did not yet
//! hold entries the old leader had accepted, so two publishes expecting the
//! same position could both be stored. nats-server 2.11.0 fixed this in two
//! steps (commits 469f834b2 "ensure 'expected per subject' consistency",
//! which answered 10163 "temporarily unavailable" until the new leader had
//! applied its backlog and 10164 for a second in-flight publish on one
//! subject, and 43e7a0279 "Completeness/consistency after leader changes",
//! which makes a new leader apply everything before accepting anything).
//! That is what makes the fence in [`super::log`] sound; 10163/10164 and any
//! other refusal but 10071 are retried as `Unavailable`.

use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};

use super::{with_deadline, ClusterError};
use crate::config::ClusterConfig;

/// The oldest NATS server linger accepts, as `(major, minor)`.
pub const MIN_SERVER_VERSION: &str = "2.11";
const MIN_VERSION: (u64, u64) = (2, 11);

/// Names of what linger keeps in JetStream; tests use their own prefix.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Deadline of one operation (an append with its retries, a read, a
    /// lease call); past it the caller gets `Unavailable`.
    pub op_timeout: Duration,
    /// Prefix of the stream, buckets and subjects (`LINGER` by default), so
    /// that several deployments (or tests) can share one NATS.
    pub prefix: String,
    /// Replicas of the stream and the buckets (`cluster.replicas`).
    pub replicas: usize,
    /// `cluster.lease_ttl`: the lease bucket's `max_age`.
    pub lease_ttl: Duration,
    /// History older than this is dropped by JetStream (`store.retain`).
    pub retain: Duration,
}

impl ClusterOptions {
    pub fn from_config(cluster: &ClusterConfig, retain: Duration) -> ClusterOptions {
        ClusterOptions {
            op_timeout: Duration::from_secs(10),
            prefix: "LINGER".into(),
            replicas: cluster.replicas,
            lease_ttl: cluster.lease_ttl,
            retain,
        }
    }

    pub fn events_stream(&self) -> String {
        format!("{}_EVENTS", self.prefix)
    }
    /// Subject of one conversation's log.
    pub fn events_subject(&self, conversation: &str) -> String {
        format!("{}.ev.{conversation}", self.prefix.to_ascii_lowercase())
    }
    pub fn meta_bucket(&self) -> String {
        format!("{}_conversations", self.prefix)
    }
    /// Node heartbeats ([`super::liveness`]).
    pub fn lease_bucket(&self) -> String {
        format!("{}_leases", self.prefix)
    }
    /// Ownership records and activity ([`super::lease`]).
    pub fn owners_bucket(&self) -> String {
        format!("{}_owners", self.prefix)
    }
}

/// A connection to NATS with linger's stream and buckets ready.
#[derive(Clone)]
pub struct Cluster {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub options: ClusterOptions,
    /// The version the server announced at connect.
    pub server_version: String,
}

/// Connects to the first reachable URL, refuses a server older than 2.11,
/// and creates or checks the stream and buckets.
pub async fn connect(urls: &[String], options: ClusterOptions) -> Result<Cluster, ClusterError> {
    // One try of a request or publish waits this long for its answer, then
    // is retried (same msg id) until `op_timeout`: a publish sent on a
    // connection that died is never answered, and waiting the whole
    // deadline for it would leave no time for the retry on the new one.
    let attempt =
        (options.op_timeout / 4).clamp(Duration::from_millis(250), Duration::from_secs(2));
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(options.op_timeout)
        .request_timeout(Some(attempt))
        // After the first connection, reconnect forever: NATS trouble is
        // reported per operation (Unavailable), never by giving up.
        .max_reconnects(None)
        .connect(urls)
        .await
        .map_err(|e| ClusterError::Unavailable(format!("connecting to {urls:?}: {e}")))?;
    let version = client.server_info().version;
    check_version(&version)?;
    let js = jetstream::ContextBuilder::new()
        .timeout(attempt)
        .build(client.clone());
    let cluster = Cluster {
        client,
        js,
        options,
        server_version: version,
    };
    cluster.ensure_storage().await?;
    Ok(cluster)
}

/// Refuses versions before [`MIN_SERVER_VERSION`] (and ones we cannot read).
pub fn check_version(version: &str) -> Result<(), ClusterError> {
    let too_old = || ClusterError::ServerTooOld {
        version: version.to_owned(),
    };
    let mut parts = version.trim_start_matches('v').split(['.', '-']);
    let major: u64 = parts
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(too_old)?;
    let minor: u64 = parts
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(too_old)?;
    if (major, minor) < MIN_VERSION {
        return Err(too_old());
    }
    Ok(())
}

impl Cluster {
    async fn ensure_storage(&self) -> Result<(), ClusterError> {
        let o = &self.options;
        let unavailable = |what: &str, e: &dyn std::fmt::Display| {
            ClusterError::Unavailable(format!("creating {what}: {e}"))
        };
        let events = stream::Config {
            name: o.events_stream(),
            subjects: vec![o.events_subject("*")],
            num_replicas: o.replicas,
            storage: stream::StorageType::File,
            retention: stream::RetentionPolicy::Limits,
            discard: stream::DiscardPolicy::Old,
            max_age: o.retain,
            // Retried appends are recognized by Nats-Msg-Id within this
            // window; later ones by reading the head (see `log`). Every
            // replica keeps each id for the whole window, so its memory is
            // the event rate times the window: a retry ends within
            // `op_timeout`, and the window is three times that at most.
            duplicate_window: (o.op_timeout * 3).min(Duration::from_secs(120)),
            allow_direct: true,
            deny_delete: true,
            ..Default::default()
        };
        with_deadline(o.op_timeout, "creating the events stream", || async {
            self.js
                .create_or_update_stream(events.clone())
                .await
                .map_err(|e| unavailable("the events stream", &e))
        })
        .await?;
        let meta = kv::Config {
            bucket: o.meta_bucket(),
            history: 1,
            num_replicas: o.replicas,
            storage: stream::StorageType::File,
            ..Default::default()
        };
        with_deadline(
            o.op_timeout,
            "creating the conversations bucket",
            || async {
                self.js
                    .create_or_update_key_value(meta.clone())
                    .await
                    .map_err(|e| unavailable("the conversations bucket", &e))
            },
        )
        .await?;
        let leases = kv::Config {
            bucket: o.lease_bucket(),
            history: 1,
            max_age: o.lease_ttl,
            num_replicas: o.replicas,
            storage: stream::StorageType::File,
            // A lease that ages out leaves a marker (2.11 subject delete
            // markers), so that watchers see a dead node's lease expire.
            limit_markers: Some(o.lease_ttl.max(Duration::from_secs(1))),
            ..Default::default()
        };
        with_deadline(o.op_timeout, "creating the leases bucket", || async {
            self.js
                .create_or_update_key_value(leases.clone())
                .await
                .map_err(|e| unavailable("the leases bucket", &e))
        })
        .await?;
        let owners = kv::Config {
            bucket: o.owners_bucket(),
            history: 1,
            num_replicas: o.replicas,
            storage: stream::StorageType::File,
            // Enables per-message TTLs, so that the marker a released
            // record leaves ages out instead of staying forever.
            limit_markers: Some(Duration::from_secs(60)),
            ..Default::default()
        };
        with_deadline(o.op_timeout, "creating the owners bucket", || async {
            self.js
                .create_or_update_key_value(owners.clone())
                .await
                .map_err(|e| unavailable("the owners bucket", &e))
        })
        .await?;
        Ok(())
    }

    pub(crate) async fn events_stream(&self) -> Result<stream::Stream<()>, ClusterError> {
        self.js
            .get_stream_no_info(self.options.events_stream())
            .await
            .map_err(|e| ClusterError::Unavailable(format!("events stream: {e}")))
    }

    pub(crate) async fn bucket(&self, name: &str) -> Result<kv::Store, ClusterError> {
        self.js
            .get_key_value(name)
            .await
            .map_err(|e| ClusterError::Unavailable(format!("bucket {name}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        for ok in [
            "2.11.0",
            "2.11.4",
            "v2.12.1",
            "2.15.1",
            "3.0.0",
            "2.11.0-beta.1",
        ] {
            assert!(check_version(ok).is_ok(), "{ok}");
        }
        for old in ["2.10.22", "2.9.25", "1.4.1", "", "garbage", "2"] {
            let err = check_version(old).unwrap_err().to_string();
            assert!(
                err.contains("too old") && err.contains("two conditional appends"),
                "{err}"
            );
        }
    }
}

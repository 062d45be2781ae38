//! Which configuration keys may change while the server runs, and what a
//! new configuration changes compared to the running one.
//!
//! [`reloadability`] is the one place that decides whether a key takes a
//! new value live; config/linger.toml, docs/protocol.md §7 and the README
//! say the same, and a test holds docs/protocol.md to this list.

use serde_json::{Map, Value};

use super::{Config, ConfigError};

/// Whether a key can take a new value without a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reloadability {
    /// Read at each decision (or at each new connection): a reload applies.
    Live,
    /// Used once at start; the reason, for the operator.
    Restart(&'static str),
}

/// Keys read at each decision or at each new connection.
const LIVE: &[&str] = &[
    "server.allowed_origins",
    "server.shutdown_grace",
    "conversations.close_delay",
    "conversations.detach_grace",
    "conversations.max_per_user",
    "conversations.on_limit",
    "conversations.max_close_delay",
    "conversations.replay_buffer_events",
    "conversations.max_queued_messages",
    "conversations.client_msg_id_window",
    "agent.turn_timeout",
    "agent.resume_interrupted",
    "limits.max_frame_bytes",
    "limits.max_outbound_frames",
    "limits.max_connections_per_user",
    "limits.messages_per_second",
    "limits.messages_burst",
    "limits.slow_consumer_patience",
    "log.level",
    "log.format",
];

/// Keys used once at start, with why.
const RESTART: &[(&str, &str)] = &[
    ("server.listen", "the listening socket is opened at start"),
    ("auth.mode", "the token checker is built at start"),
    ("auth.tokens", "the token checker is built at start"),
    ("auth.jwt_secret_env", "the token checker is built at start"),
    ("store.path", "the store is opened at start"),
    ("store.retain", "the store's pruning is set up at start"),
    ("agent.kind", "the agent is built at start"),
    ("agent.command", "the agent is built at start"),
    (
        "cluster.mode",
        "the store and cluster membership are set up at start",
    ),
    (
        "cluster.nats_urls",
        "the NATS connection is opened at start",
    ),
    ("cluster.node_id", "this node's name is fixed at start"),
    ("cluster.lease_ttl", "leases are set up at start"),
    (
        "cluster.replicas",
        "streams and buckets are created at start",
    ),
];

/// Whether `key` (`section.key`) can change while the server runs.
pub fn reloadability(key: &str) -> Reloadability {
    if LIVE.contains(&key) {
        return Reloadability::Live;
    }
    let why = RESTART
        .iter()
        .find(|(k, _)| *k == key)
        .map_or("it is used only at start", |(_, why)| why);
    Reloadability::Restart(why)
}

/// One key whose value differs between two configurations.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyChange {
    /// `section.key`.
    pub key: String,
    /// As the config file would spell them (durations as humantime text).
    pub from: Value,
    pub to: Value,
}

/// Every leaf of a configuration as `section.key` → value.
fn leaves(config: &Config) -> Vec<(String, Value)> {
    fn walk(prefix: &str, value: Value, out: &mut Vec<(String, Value)>) {
        match value {
            Value::Object(map) => {
                for (key, value) in map {
                    let path = if prefix.is_empty() {
                        key
                    } else {
                        format!("{prefix}.{key}")
                    };
                    walk(&path, value, out);
                }
            }
            leaf => out.push((prefix.to_owned(), leaf)),
        }
    }
    let mut out = Vec::new();
    // A Config is plain data: serializing it cannot fail.
    let value = serde_json::to_value(config).unwrap_or(Value::Null);
    walk("", value, &mut out);
    out
}

/// Every key whose value differs from `old` to `new`, sorted by key.
pub fn changes(old: &Config, new: &Config) -> Vec<KeyChange> {
    let new_leaves: Map<String, Value> = leaves(new).into_iter().collect();
    let mut old_leaves = leaves(old);
    old_leaves.sort_by(|a, b| a.0.cmp(&b.0));
    old_leaves
        .into_iter()
        .filter_map(|(key, from)| {
            let to = new_leaves.get(&key)?;
            (*to != from).then(|| KeyChange {
                to: to.clone(),
                key,
                from,
            })
        })
        .collect()
}

/// `base` with the listed changes applied, checked like a loaded file.
pub fn apply(base: &Config, changes: &[&KeyChange]) -> Result<Config, ConfigError> {
    let mut value = serde_json::to_value(base)
        .map_err(|e| ConfigError::Invalid(format!("the running configuration: {e}")))?;
    for change in changes {
        let Some((section, key)) = change.key.split_once('.') else {
            continue;
        };
        if let Some(slot) = value.get_mut(section).and_then(|s| s.get_mut(key)) {
            *slot = change.to.clone();
        }
    }
    let config: Config = serde_json::from_value(value)
        .map_err(|e| ConfigError::Invalid(format!("the new configuration: {e}")))?;
    config.validate()?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::time::Duration;

    use super::*;

    #[test]
    fn every_key_is_decided_once() {
        let keys: BTreeSet<String> = leaves(&Config::default())
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        let live: BTreeSet<String> = LIVE.iter().map(|k| (*k).to_owned()).collect();
        let restart: BTreeSet<String> = RESTART.iter().map(|(k, _)| (*k).to_owned()).collect();
        assert!(
            live.is_disjoint(&restart),
            "{:?}",
            live.intersection(&restart)
        );
        let listed: BTreeSet<String> = live.union(&restart).cloned().collect();
        assert_eq!(
            keys, listed,
            "every config key must be listed as LIVE or RESTART in config/keys.rs"
        );
    }

    #[test]
    fn the_issue_s_keys_are_classified_as_promised() {
        for key in [
            "conversations.close_delay",
            "conversations.max_per_user",
            "limits.max_outbound_frames",
            "agent.turn_timeout",
            "log.level",
            "log.format",
        ] {
            assert_eq!(reloadability(key), Reloadability::Live, "{key}");
        }
        for key in [
            "server.listen",
            "store.path",
            "store.retain",
            "cluster.mode",
        ] {
            assert!(
                matches!(reloadability(key), Reloadability::Restart(_)),
                "{key}"
            );
        }
        assert!(matches!(
            reloadability("no.such"),
            Reloadability::Restart(_)
        ));
    }

    #[test]
    fn changes_name_each_changed_key_with_file_spelled_values() {
        let old = Config::default();
        let mut new = Config::default();
        new.conversations.close_delay = Duration::from_secs(2);
        new.conversations.max_per_user = 1;
        new.server.listen = "127.0.0.1:7421".parse().unwrap();
        let found = changes(&old, &new);
        let keys: Vec<&str> = found.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "conversations.close_delay",
                "conversations.max_per_user",
                "server.listen",
            ]
        );
        assert_eq!(found[0].from, Value::from("15m"));
        assert_eq!(found[0].to, Value::from("2s"));
        assert_eq!(found[1].from, Value::from(3));
        assert!(changes(&old, &old).is_empty());
    }

    #[test]
    fn apply_takes_only_the_given_changes_and_validates() {
        let old = Config::default();
        let mut new = Config::default();
        new.conversations.close_delay = Duration::from_secs(2);
        new.server.listen = "127.0.0.1:7421".parse().unwrap();
        let found = changes(&old, &new);
        let live: Vec<&KeyChange> = found
            .iter()
            .filter(|c| reloadability(&c.key) == Reloadability::Live)
            .collect();
        let merged = apply(&old, &live).unwrap();
        assert_eq!(merged.conversations.close_delay, Duration::from_secs(2));
        assert_eq!(merged.server.listen, old.server.listen);

        let mut zero = Config::default();
        zero.conversations.replay_buffer_events = 0;
        let bad = changes(&old, &zero);
        let err = apply(&old, &bad.iter().collect::<Vec<_>>()).unwrap_err();
        assert!(
            err.to_string()
                .contains("conversations.replay_buffer_events"),
            "{err}"
        );
    }
}

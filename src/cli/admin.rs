//! What the admin commands (`linger ps`, `linger top`, `linger reload`)
//! read from the server (`/v1/admin/*`, admins only), and how `ps` and
//! `top` draw it.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use serde::Deserialize;
use serde_json::Value;

use super::Client;

/// One active conversation, as `GET /v1/admin/conversations` lists it.
#[derive(Debug, Clone, Deserialize)]
pub struct Active {
    pub id: String,
    pub user: String,
    pub status: String,
    #[serde(default)]
    pub stopping: Option<String>,
    #[serde(default)]
    pub attached: u64,
    #[serde(default)]
    pub last_activity_at: String,
    #[serde(default)]
    pub turn: Option<Turn>,
    #[serde(default)]
    pub queued: u64,
    #[serde(default)]
    pub replay_buffer: Buffer,
    #[serde(default)]
    pub node: Option<String>,
}

/// The active conversations, and the nodes (cluster mode) that did not
/// answer the node asked, whose conversations are missing.
#[derive(Debug, Clone, Default)]
pub struct ActiveList {
    pub conversations: Vec<Active>,
    pub unanswered: Vec<String>,
}

impl ActiveList {
    /// What to tell the operator about missing nodes, if any.
    pub fn missing(&self) -> Option<String> {
        not_listed(&self.unanswered)
    }
}

/// What to tell the operator about the nodes a list lacks, if any.
pub fn not_listed(unanswered: &[String]) -> Option<String> {
    (!unanswered.is_empty()).then(|| {
        format!(
            "not listed: the conversations of node {} (did not answer in time)",
            unanswered.join(", ")
        )
    })
}

/// The header naming the nodes that did not answer a cluster-wide list.
const UNANSWERED_NODES: &str = "linger-unanswered-nodes";

/// The running turn; only its age is shown.
#[derive(Debug, Clone, Deserialize)]
pub struct Turn {
    #[serde(default)]
    pub age_ms: u64,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Buffer {
    #[serde(default)]
    pub events: u64,
    #[serde(default)]
    pub bytes: u64,
}

/// One supervision decision.
#[derive(Debug, Clone, Deserialize)]
pub struct Decision {
    pub seq: u64,
    pub at: String,
    pub rule: String,
    #[serde(default)]
    pub conversation: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub inputs: Value,
    pub outcome: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct DecisionPage {
    pub decisions: Vec<Decision>,
    pub head: u64,
}

/// The answer of a reload.
#[derive(Debug, Clone, Deserialize)]
pub struct ReloadOutcome {
    pub applied: Vec<AppliedKey>,
    pub refused: Vec<RefusedKey>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct AppliedKey {
    pub key: String,
    pub from: Value,
    pub to: Value,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RefusedKey {
    pub key: String,
    pub message: String,
}

/// Says what a 404 means on these routes.
const ADMINS_ONLY: &str = "(admins only: is the token an admin's?)";

impl Client {
    pub async fn active(&self) -> anyhow::Result<ActiveList> {
        let (value, unanswered) = self.active_json().await?;
        let conversations =
            serde_json::from_value(value).context("the server sent an unexpected list")?;
        Ok(ActiveList {
            conversations,
            unanswered,
        })
    }

    /// `GET /v1/admin/conversations` as the server sent it, and the nodes
    /// whose conversations it lacks (cluster mode).
    pub async fn active_json(&self) -> anyhow::Result<(Value, Vec<String>)> {
        let (value, headers) = self
            .request_with_headers(
                self.http.get(self.url("/v1/admin/conversations")),
                &format!("listing active conversations {ADMINS_ONLY}"),
            )
            .await?;
        let unanswered = headers
            .get(UNANSWERED_NODES)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(',').map(str::to_owned).collect())
            .unwrap_or_default();
        Ok((value, unanswered))
    }

    pub async fn decisions(&self, since: u64) -> anyhow::Result<DecisionPage> {
        let value = self
            .request(
                self.http
                    .get(self.url(&format!("/v1/admin/supervision?since={since}"))),
                &format!("reading the supervision log {ADMINS_ONLY}"),
            )
            .await?;
        serde_json::from_value(value).context("the server sent an unexpected page")
    }

    pub async fn reload(&self) -> anyhow::Result<ReloadOutcome> {
        let value = self
            .request(
                self.http.post(self.url("/v1/admin/reload")),
                &format!("reloading the configuration {ADMINS_ONLY}"),
            )
            .await?;
        serde_json::from_value(value).context("the server sent an unexpected answer")
    }
}

/// `1h 2m`, `3m 4s`, `5s`, `120ms`: short, for tables.
pub fn short_duration(d: Duration) -> String {
    let secs = d.as_secs();
    match secs {
        0 => format!("{}ms", d.as_millis()),
        1..=59 => format!("{secs}s"),
        60..=3599 => format!("{}m {}s", secs / 60, secs % 60),
        _ => format!("{}h {}m", secs / 3600, secs % 3600 / 60),
    }
}

/// `900 B`, `20.4 KiB`, `3.1 MiB`.
fn short_bytes(bytes: u64) -> String {
    match bytes {
        0..1024 => format!("{bytes} B"),
        1024..1_048_576 => format!("{:.1} KiB", bytes as f64 / 1024.0),
        _ => format!("{:.1} MiB", bytes as f64 / 1_048_576.0),
    }
}

/// How long ago an RFC 3339 time was, or the text itself when unreadable.
fn ago(at: &str, now: SystemTime) -> String {
    match humantime::parse_rfc3339(at) {
        Ok(then) => short_duration(now.duration_since(then).unwrap_or_default()),
        Err(_) => at.to_owned(),
    }
}

/// The active conversations as a table (with a NODE column in cluster
/// mode).
pub fn active_table(list: &[Active], now: SystemTime) -> String {
    let clustered = list.iter().any(|c| c.node.is_some());
    let id_width = list.iter().map(|c| c.id.len()).max().unwrap_or(2).max(2);
    let user_width = list.iter().map(|c| c.user.len()).max().unwrap_or(4).max(4);
    let mut out = String::new();
    let _ = write!(
        out,
        "{:<id_width$}  {:<user_width$}  {:<8}  {:>3}  {:>8}  {:>8}  {:>6}  {:>16}",
        "ID", "USER", "STATUS", "ATT", "IDLE", "TURN AGE", "QUEUED", "REPLAY BUFFER"
    );
    if clustered {
        out.push_str("  NODE");
    }
    out.push('\n');
    for c in list {
        let status = match &c.stopping {
            Some(reason) => format!("stopping ({reason})"),
            None => c.status.clone(),
        };
        let turn_age = c
            .turn
            .as_ref()
            .map(|t| short_duration(Duration::from_millis(t.age_ms)))
            .unwrap_or_else(|| "-".into());
        let buffer = format!(
            "{} ev, {}",
            c.replay_buffer.events,
            short_bytes(c.replay_buffer.bytes)
        );
        let _ = write!(
            out,
            "{:<id_width$}  {:<user_width$}  {:<8}  {:>3}  {:>8}  {:>8}  {:>6}  {:>16}",
            c.id,
            c.user,
            status,
            c.attached,
            ago(&c.last_activity_at, now),
            turn_age,
            c.queued,
            buffer
        );
        if clustered {
            let _ = write!(out, "  {}", c.node.as_deref().unwrap_or("-"));
        }
        out.push('\n');
    }
    out
}

/// One decision on one line: time, rule, outcome, who, and the inputs.
pub fn decision_line(d: &Decision) -> String {
    // `2026-11-30T10:04:31.870Z` → `10:04:31`.
    let time = d.at.get(11..19).unwrap_or(&d.at);
    let who = match (&d.conversation, &d.user) {
        (Some(c), Some(u)) => format!("{c} ({u})"),
        (Some(c), None) => c.clone(),
        (None, Some(u)) => format!("by {u}"),
        (None, None) => String::new(),
    };
    // `key=value` pairs, as a log line would show them.
    let inputs = match &d.inputs {
        Value::Object(map) => map
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| match v {
                Value::String(text) => format!("{k}={text}"),
                other => format!("{k}={other}"),
            })
            .collect::<Vec<_>>()
            .join(" "),
        Value::Null => String::new(),
        other => other.to_string(),
    };
    format!(
        "{time}  #{:<5} {:<14} {:<15} {who}  {inputs}",
        d.seq, d.rule, d.outcome
    )
    .trim_end()
    .to_owned()
}

/// The newest decisions seen, for `top`.
#[derive(Default)]
pub struct RecentDecisions {
    pub head: u64,
    kept: VecDeque<Decision>,
}

impl RecentDecisions {
    pub fn add(&mut self, page: DecisionPage, keep: usize) {
        self.head = page.head;
        self.kept.extend(page.decisions);
        while self.kept.len() > keep {
            self.kept.pop_front();
        }
    }

    pub fn lines(&self) -> impl Iterator<Item = String> + '_ {
        self.kept.iter().map(decision_line)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn draws_a_table_and_decisions() {
        let list: Vec<Active> = serde_json::from_value(json!([{
            "id": "c_1", "user": "alice", "status": "running", "stopping": null, "attached": 1,
            "last_activity_at": "2026-11-30T10:00:00.000Z",
            "turn": {"id": "t_1", "started_at": "2026-11-30T09:59:50.000Z", "age_ms": 12_000},
            "queued": 2, "replay_buffer": {"events": 118, "bytes": 20_900}, "node": null
        }]))
        .unwrap();
        let now = humantime::parse_rfc3339("2026-11-30T10:00:05Z").unwrap();
        let table = active_table(&list, now);
        let row = table.lines().nth(1).unwrap();
        for part in [
            "c_1",
            "alice",
            "running",
            "5s",
            "12s",
            "2",
            "118 ev, 20.4 KiB",
        ] {
            assert!(row.contains(part), "{part} in {row}");
        }
        assert!(!table.contains("NODE"));
        let d: Decision = serde_json::from_value(json!({
            "seq": 4, "at": "2026-11-30T10:04:31.870Z", "rule": "idle_close",
            "conversation": "c_1", "user": "alice", "inputs": {"close_delay": "15m"},
            "outcome": "stopped"
        }))
        .unwrap();
        let line = decision_line(&d);
        assert!(line.starts_with("10:04:31  #4"), "{line}");
        assert!(
            line.contains("idle_close") && line.contains("c_1 (alice)"),
            "{line}"
        );
        let mut recent = RecentDecisions::default();
        recent.add(
            DecisionPage {
                decisions: vec![d.clone(), d.clone(), d],
                head: 4,
            },
            2,
        );
        assert_eq!((recent.head, recent.lines().count()), (4, 2));
    }

    #[test]
    fn short_units() {
        assert_eq!(short_duration(Duration::from_millis(120)), "120ms");
        assert_eq!(short_duration(Duration::from_secs(184)), "3m 4s");
        assert_eq!(short_duration(Duration::from_secs(3720)), "1h 2m");
        assert_eq!(short_bytes(900), "900 B");
        assert_eq!(short_bytes(3 * 1_048_576), "3.0 MiB");
    }
}

//! What an operator sees of one active conversation
//! (`GET /v1/admin/conversations`, `linger ps`): read from its gauge by the
//! supervisor, without asking the conversation. In cluster mode the same
//! view travels between nodes, so it reads back as it was written.

use std::borrow::Cow;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::gauge::ConversationGauge;
use crate::protocol::StopReason;

/// One active conversation, on this node or (cluster mode) another.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ActiveConversation {
    #[schema(example = "c_01JDX9Q8ZK3M4T5V6W7X8Y9Z0A")]
    pub id: String,
    /// The owner.
    pub user: String,
    /// `running`, `waiting` (on a client tool result) or `idle`.
    #[schema(value_type = String, example = "running")]
    pub status: Cow<'static, str>,
    /// Set while it is being stopped: the reason (`idle`, `user_limit`, …).
    #[schema(value_type = Option<String>)]
    pub stopping: Option<Cow<'static, str>>,
    /// Connections attached now.
    pub attached: usize,
    /// When its last event was recorded (RFC 3339, UTC).
    #[schema(example = "2026-11-30T10:04:31.870Z")]
    pub last_activity_at: String,
    /// Since when this node runs it (RFC 3339, UTC).
    pub active_since: String,
    /// The running turn, if any.
    pub turn: Option<TurnView>,
    /// Messages waiting for the running turn to end.
    pub queued: usize,
    pub replay_buffer: BufferView,
    /// Cluster mode: the node that runs it; absent otherwise.
    pub node: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TurnView {
    #[schema(example = "t_01JDX9R2J5W8QH3M4N5P6Q7R8S")]
    pub id: String,
    pub started_at: String,
    /// How long it has run, in milliseconds.
    pub age_ms: u64,
}

/// The replay buffer: the newest events kept in memory for fast replays.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BufferView {
    pub events: usize,
    pub bytes: usize,
}

fn rfc3339(at: SystemTime) -> String {
    humantime::format_rfc3339_millis(at).to_string()
}

/// The view of one active conversation.
pub fn view(
    id: &str,
    user: &str,
    gauge: &ConversationGauge,
    stopping: Option<StopReason>,
    active_for: Duration,
    node: Option<&str>,
) -> ActiveConversation {
    let now = SystemTime::now();
    let last_activity = UNIX_EPOCH + Duration::from_micros(gauge.last_activity_unix_us());
    let holding = gauge.holding();
    ActiveConversation {
        id: id.to_owned(),
        user: user.to_owned(),
        status: Cow::Borrowed(gauge.status().as_str()),
        stopping: stopping.map(|r| Cow::Borrowed(r.as_str())),
        attached: gauge.attached(),
        last_activity_at: rfc3339(last_activity),
        active_since: rfc3339(now.checked_sub(active_for).unwrap_or(now)),
        turn: gauge.turn().map(|t| TurnView {
            id: t.id.to_string(),
            started_at: rfc3339(t.started),
            age_ms: now
                .duration_since(t.started)
                .map_or(0, |d| d.as_millis() as u64),
        }),
        queued: holding.queued,
        replay_buffer: BufferView {
            events: holding.buffer_events,
            bytes: holding.buffer_bytes,
        },
        node: node.map(str::to_owned),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::actors::gauge::{Holding, TurnStamp};
    use crate::protocol::Status;

    #[test]
    fn shows_the_gauge() {
        let gauge = ConversationGauge::default();
        gauge.publish(Status::Running, 2, std::time::Instant::now());
        gauge.publish_holding(Holding {
            queued: 1,
            buffer_events: 7,
            buffer_bytes: 900,
        });
        let started = SystemTime::now() - Duration::from_secs(3);
        gauge.set_turn(Some(TurnStamp {
            id: Arc::from("t_1"),
            started,
        }));
        let v = view(
            "c_1",
            "alice",
            &gauge,
            None,
            Duration::from_secs(60),
            Some("n1"),
        );
        assert_eq!((v.status.as_ref(), v.attached, v.queued), ("running", 2, 1));
        assert_eq!((v.replay_buffer.events, v.replay_buffer.bytes), (7, 900));
        let turn = v.turn.expect("a turn");
        assert_eq!(turn.id, "t_1");
        assert!(turn.age_ms >= 3000, "{}", turn.age_ms);
        assert_eq!(v.node.as_deref(), Some("n1"));
        gauge.set_turn(None);
        let v = view(
            "c_1",
            "alice",
            &gauge,
            Some(StopReason::Idle),
            Duration::ZERO,
            None,
        );
        assert!(v.turn.is_none());
        assert_eq!(v.stopping.as_deref(), Some("idle"));
    }

    /// Another node's list reads back as that node wrote it.
    #[test]
    fn reads_back_as_written() {
        let gauge = ConversationGauge::default();
        gauge.publish(Status::Waiting, 1, std::time::Instant::now());
        gauge.set_turn(Some(TurnStamp {
            id: Arc::from("t_2"),
            started: SystemTime::now(),
        }));
        let written = view(
            "c_2",
            "bob",
            &gauge,
            Some(StopReason::UserLimit),
            Duration::from_secs(5),
            Some("n2"),
        );
        let json = serde_json::to_value(&written).expect("a view serializes");
        let read: ActiveConversation =
            serde_json::from_value(json.clone()).expect("and reads back");
        assert_eq!(serde_json::to_value(&read).expect("again"), json);
        assert_eq!(read.stopping.as_deref(), Some("user_limit"));
        assert_eq!(read.node.as_deref(), Some("n2"));
    }
}

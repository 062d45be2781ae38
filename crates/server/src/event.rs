//! Sequenced events (protocol §4): their typed payloads and the record that is
//! serialized once, at append, and shared by the store and every connection.

use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::ws::Utf8Bytes;
use serde::Serialize;
use serde_json::Value;

use crate::protocol::StopReason;

/// The payload of one event; the variant decides its `kind`
/// ([`EventKind::VARIANTS`] names them all).
#[derive(Debug, Clone, Serialize, strum::EnumDiscriminants)]
#[serde(untagged)]
#[strum_discriminants(
    name(EventKind),
    derive(strum::VariantNames, strum::IntoStaticStr),
    strum(serialize_all = "snake_case")
)]
pub enum EventData {
    ConversationCreated {
        user: String,
        title: String,
    },
    AgentStarted {
        reason: StartReason,
    },
    UserMessage {
        text: String,
        client_msg_id: Option<String>,
    },
    TurnStarted {
        turn_id: String,
        message_seq: u64,
        /// Protocol §11: the interrupted turn this one runs again.
        #[serde(skip_serializing_if = "Option::is_none")]
        resumed_from: Option<String>,
    },
    TextDelta {
        turn_id: String,
        text: String,
    },
    AssistantMessage {
        turn_id: String,
        text: String,
    },
    ToolCall {
        turn_id: String,
        call_id: String,
        name: String,
        args: Value,
        target: ToolTarget,
    },
    ToolResult {
        turn_id: String,
        call_id: String,
        output: Value,
        is_error: bool,
    },
    TurnFinished {
        turn_id: String,
        status: TurnStatus,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    AgentStopped {
        reason: StopReason,
    },
}

impl EventData {
    pub fn kind(&self) -> &'static str {
        EventKind::from(self).into()
    }
}

/// Why a conversation became active (`agent_started.reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
pub enum StartReason {
    Created,
    Attach,
    Message,
    Rest,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
pub enum ToolTarget {
    Client,
    Agent,
}

/// Final status of a turn (`turn_finished.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Hash, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
pub enum TurnStatus {
    Completed,
    Failed,
    Stopped,
    Abandoned,
    Interrupted,
}

impl TurnStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TurnStatus::Completed => "completed",
            TurnStatus::Failed => "failed",
            TurnStatus::Stopped => "stopped",
            TurnStatus::Abandoned => "abandoned",
            TurnStatus::Interrupted => "interrupted",
        }
    }
}

/// One recorded event, serialized once. `frame` is the exact text frame every
/// connection is sent; `data` is what the store keeps.
#[derive(Debug, Clone)]
pub struct EventRecord {
    pub seq: u64,
    pub ts: String,
    pub kind: Arc<str>,
    pub data: String,
    pub frame: Utf8Bytes,
}

impl EventRecord {
    /// Builds the record of a new event, stamping it with the current time.
    pub fn new(conversation_id: &str, seq: u64, data: &EventData) -> EventRecord {
        let ts = now_rfc3339();
        // Serializing EventData cannot fail: it holds strings, numbers and
        // already-parsed JSON values only.
        let json = serde_json::to_string(data).unwrap_or_else(|_| "{}".to_owned());
        EventRecord::from_parts(conversation_id, seq, ts, Arc::from(data.kind()), json)
    }

    /// Rebuilds a record read back from the store.
    pub fn from_parts(
        conversation_id: &str,
        seq: u64,
        ts: String,
        kind: Arc<str>,
        data: String,
    ) -> EventRecord {
        let id = serde_json::to_string(conversation_id).unwrap_or_else(|_| "\"\"".into());
        let frame = format!(
            r#"{{"type":"event","conversation_id":{id},"seq":{seq},"ts":"{ts}","kind":"{kind}","data":{data}}}"#
        );
        EventRecord {
            seq,
            ts,
            kind,
            data,
            frame: Utf8Bytes::from(frame),
        }
    }
}

/// RFC 3339 UTC timestamp with milliseconds, as events and REST carry.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_is_valid_json_with_all_fields() {
        let rec = EventRecord::new(
            "c_1",
            7,
            &EventData::TextDelta {
                turn_id: "t_1".into(),
                text: "he said \"hi\"".into(),
            },
        );
        let v: Value = serde_json::from_str(rec.frame.as_str()).unwrap();
        assert_eq!(v["type"], "event");
        assert_eq!(v["seq"], 7);
        assert_eq!(v["kind"], "text_delta");
        assert_eq!(v["data"]["text"], "he said \"hi\"");
        assert!(v["ts"].as_str().unwrap().ends_with('Z'));
    }
}

//! Sequenced events (protocol §4): their typed payloads and the record that is
//! serialized once, at append, and shared by the store and every connection.

use std::io::Write as _;
use std::ops::Range;
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use serde::Serialize;
use serde_json::Value;
use tokio_tungstenite::tungstenite::Utf8Bytes;

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
/// connection is sent; the event's `ts` and `data` (what the store keeps) are
/// slices of it, so each event's JSON is held once.
#[derive(Debug, Clone)]
pub struct EventRecord {
    pub seq: u64,
    pub kind: Arc<str>,
    pub frame: Utf8Bytes,
    /// Where `ts` is in `frame`.
    ts: Range<usize>,
    /// Where `data` starts in `frame` (it ends before the closing brace).
    data_start: usize,
}

/// The bookkeeping of one heap allocation: what the allocator adds to each
/// (glibc: an 8-byte header, sizes rounded up to 16).
const fn allocated(size: usize) -> usize {
    (size + 8).next_multiple_of(16)
}

/// What a record costs besides its frame's bytes: the record in its `Arc`
/// (two counters) and the shared header `bytes` gives the frame once it is
/// cloned towards a connection.
const RECORD_OVERHEAD: usize = allocated(2 * size_of::<usize>() + size_of::<EventRecord>())
    + allocated(3 * size_of::<usize>());

impl EventRecord {
    /// Builds the record of a new event, stamping it with the current time.
    pub fn new(conversation_id: &str, seq: u64, data: &EventData) -> EventRecord {
        EventRecord::build(
            conversation_id,
            seq,
            now_ts(),
            intern_kind(data.kind()),
            128,
            |frame| {
                // Serializing EventData cannot fail: it holds strings,
                // numbers and already-parsed JSON values only.
                if serde_json::to_writer(&mut *frame, data).is_err() {
                    frame.extend_from_slice(b"{}");
                }
            },
        )
    }

    /// Rebuilds a record read back from the store.
    pub fn from_parts(
        conversation_id: &str,
        seq: u64,
        ts: &str,
        kind: Arc<str>,
        data: &str,
    ) -> EventRecord {
        EventRecord::build(conversation_id, seq, ts, kind, data.len(), |frame| {
            frame.extend_from_slice(data.as_bytes())
        })
    }

    /// Writes the frame, `data` written by `write_data` (about `data_len`
    /// bytes), into one buffer of its exact size, and notes where `ts` and
    /// `data` are in it.
    fn build(
        conversation_id: &str,
        seq: u64,
        ts: impl std::fmt::Display,
        kind: Arc<str>,
        data_len: usize,
        write_data: impl FnOnce(&mut Vec<u8>),
    ) -> EventRecord {
        // Every part is written straight into the frame, none built as a
        // string of its own first.
        let mut frame = Vec::with_capacity(128 + conversation_id.len() + kind.len() + data_len);
        frame.extend_from_slice(br#"{"type":"event","conversation_id":"#);
        // Writing into a Vec cannot fail, and a str always serializes.
        let _ = serde_json::to_writer(&mut frame, conversation_id);
        let _ = write!(frame, r#","seq":{seq},"ts":""#);
        let ts_start = frame.len();
        let _ = write!(frame, "{ts}");
        let ts_range = ts_start..frame.len();
        frame.extend_from_slice(br#"","kind":""#);
        frame.extend_from_slice(kind.as_bytes());
        frame.extend_from_slice(br#"","data":"#);
        let data_start = frame.len();
        write_data(&mut frame);
        frame.push(b'}');
        // Exactly as long as its content: the buffer kept by every holder of
        // the frame has no spare capacity.
        let frame = frame.into_boxed_slice().into_vec();
        match String::from_utf8(frame) {
            Ok(frame) => EventRecord {
                seq,
                kind,
                frame: Utf8Bytes::from(frame),
                ts: ts_range,
                data_start,
            },
            // Every part is a string or JSON written by serde_json, so UTF-8;
            // were it not, the event's data is an empty object, not a panic.
            Err(e) => {
                let ts = String::from_utf8_lossy(e.as_bytes().get(ts_range).unwrap_or_default())
                    .into_owned();
                EventRecord::from_parts(conversation_id, seq, &ts, kind, "{}")
            }
        }
    }

    /// The event's time, RFC 3339 UTC with milliseconds.
    pub fn ts(&self) -> &str {
        self.frame.as_str().get(self.ts.clone()).unwrap_or_default()
    }

    /// The event's `data`, as JSON: what the store keeps.
    pub fn data(&self) -> &str {
        let end = self.frame.len().saturating_sub(1);
        self.frame
            .as_str()
            .get(self.data_start..end)
            .unwrap_or_default()
    }

    /// The memory this record holds while something keeps it: its frame,
    /// the record in its `Arc`, and what the allocator adds to each (the
    /// kind is shared by every record of that kind, see [`intern_kind`]).
    pub fn held_bytes(&self) -> usize {
        allocated(self.frame.len()) + RECORD_OVERHEAD
    }
}

/// The kind's shared name: the known kinds are allocated once, whichever
/// record names them (only an unknown kind read back from a store is
/// allocated per record).
pub fn intern_kind(kind: &str) -> Arc<str> {
    static KINDS: OnceLock<Vec<Arc<str>>> = OnceLock::new();
    let kinds = KINDS.get_or_init(|| {
        <EventKind as strum::VariantNames>::VARIANTS
            .iter()
            .map(|k| Arc::from(*k))
            .collect()
    });
    kinds
        .iter()
        .find(|k| &***k == kind)
        .cloned()
        .unwrap_or_else(|| Arc::from(kind))
}

/// The current time as events and REST carry it, RFC 3339 UTC with
/// milliseconds, to be formatted where it is written.
pub fn now_ts() -> humantime::Rfc3339Timestamp {
    humantime::format_rfc3339_millis(SystemTime::now())
}

/// [`now_ts`] as a string.
pub fn now_rfc3339() -> String {
    now_ts().to_string()
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

    #[test]
    fn ts_and_data_are_the_frames_own() {
        let data = EventData::ToolCall {
            turn_id: "t_1".into(),
            call_id: "k".into(),
            name: "n".into(),
            args: serde_json::json!({"nested": {"a": [1, "}"]}}),
            target: ToolTarget::Client,
        };
        let rec = EventRecord::new("c_\"1", 3, &data);
        let v: Value = serde_json::from_str(rec.frame.as_str()).unwrap();
        assert_eq!(rec.ts(), v["ts"]);
        assert_eq!(
            serde_json::from_str::<Value>(rec.data()).unwrap(),
            v["data"]
        );
        assert_eq!(rec.data(), serde_json::to_string(&data).unwrap());
        // Read back from a store, the same record.
        let back =
            EventRecord::from_parts("c_\"1", 3, rec.ts(), intern_kind("tool_call"), rec.data());
        assert_eq!(
            (back.frame.as_str(), back.ts(), back.data()),
            (rec.frame.as_str(), rec.ts(), rec.data())
        );
        assert!(Arc::ptr_eq(&back.kind, &rec.kind), "known kinds are shared");
        assert!(rec.held_bytes() > rec.frame.len() + size_of::<EventRecord>());
    }
}

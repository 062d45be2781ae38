//! Sequenced events (protocol §4): their typed payloads and the record that is
//! serialized once, at append, and shared by the store and every connection.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::Value;
use tokio_tungstenite::tungstenite::Utf8Bytes;

use crate::frame_arena::FrameArena;
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
        turn_id: Arc<str>,
        message_seq: u64,
        /// Protocol §11: the interrupted turn this one runs again.
        #[serde(skip_serializing_if = "Option::is_none")]
        resumed_from: Option<String>,
    },
    TextDelta {
        turn_id: Arc<str>,
        text: String,
    },
    AssistantMessage {
        turn_id: Arc<str>,
        text: String,
    },
    ToolCall {
        turn_id: Arc<str>,
        call_id: String,
        name: String,
        args: Value,
        target: ToolTarget,
    },
    ToolResult {
        turn_id: Arc<str>,
        call_id: String,
        output: Value,
        is_error: bool,
    },
    TurnFinished {
        turn_id: Arc<str>,
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
    pub kind: Kind,
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
        EventRecord::stamped(conversation_id, seq, data, |frame| {
            Utf8Bytes::from(frame.to_owned())
        })
    }

    /// [`EventRecord::new`] with the frame placed by `arena` (a block
    /// shared with the conversation's other frames, unless it is large).
    pub fn new_in(
        arena: &mut FrameArena,
        conversation_id: &str,
        seq: u64,
        data: &EventData,
    ) -> EventRecord {
        EventRecord::stamped(conversation_id, seq, data, |frame| arena.place(frame))
    }

    /// A new event's record, its frame kept by `keep`.
    fn stamped(
        conversation_id: &str,
        seq: u64,
        data: &EventData,
        keep: impl FnOnce(&str) -> Utf8Bytes,
    ) -> EventRecord {
        EventRecord::build(
            conversation_id,
            seq,
            |frame| write_ts(frame, SystemTime::now()),
            intern_kind(data.kind()),
            |frame| write_data(frame, data),
            keep,
        )
    }

    /// Rebuilds a record read back from the store.
    pub fn from_parts(
        conversation_id: &str,
        seq: u64,
        ts: &str,
        kind: Kind,
        data: &str,
    ) -> EventRecord {
        EventRecord::build(
            conversation_id,
            seq,
            |frame| frame.push_str(ts),
            kind,
            |frame| frame.push_str(data),
            |frame| Utf8Bytes::from(frame.to_owned()),
        )
    }

    /// Writes the frame, its `ts` written by `write_ts` and its `data` by
    /// `write_data`, has `keep` copy it to where the record holds it, and
    /// notes where both are in it.
    fn build(
        conversation_id: &str,
        seq: u64,
        write_ts: impl FnOnce(&mut String),
        kind: Kind,
        write_data: impl FnOnce(&mut String),
        keep: impl FnOnce(&str) -> Utf8Bytes,
    ) -> EventRecord {
        // The frame is written into this thread's scratch buffer, then
        // copied once into a buffer of its exact size (or a frame block's
        // next bytes): the one every holder of the frame keeps, with no
        // spare capacity and no reallocation on the way (growing and
        // shrinking cost more than the copy). The
        // buffer is a String, written from strs and serde_json's output, so
        // the frame is never checked as UTF-8 (about 140 instructions an
        // event).
        thread_local! {
            static SCRATCH: RefCell<String> = const { RefCell::new(String::new()) };
        }
        let (frame, ts_range, data_start) = SCRATCH.with_borrow_mut(|scratch| {
            scratch.clear();
            scratch.push_str(r#"{"type":"event","conversation_id":"#);
            push_json_str(scratch, conversation_id);
            scratch.push_str(r#","seq":"#);
            scratch.push_str(itoa::Buffer::new().format(seq));
            scratch.push_str(r#","ts":""#);
            let ts_start = scratch.len();
            write_ts(scratch);
            let ts_range = ts_start..scratch.len();
            scratch.push_str(r#"","kind":""#);
            scratch.push_str(&kind);
            scratch.push_str(r#"","data":"#);
            let data_start = scratch.len();
            write_data(scratch);
            scratch.push('}');
            let frame = keep(scratch.as_str());
            // One very large event (a tool's output) does not keep its
            // room in every thread for good.
            if scratch.capacity() > MAX_KEPT_SCRATCH {
                *scratch = String::new();
            }
            (frame, ts_range, data_start)
        });
        EventRecord {
            seq,
            kind,
            frame,
            ts: ts_range,
            data_start,
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
    /// the record in its `Arc`, and what the allocator adds to each (a
    /// known kind is static, see [`Kind`]). A frame in a block
    /// ([`FrameArena`]) is counted as if it had its allocation: that is
    /// more than its share of the block's header and of the room blocks
    /// are left with.
    pub fn held_bytes(&self) -> usize {
        allocated(self.frame.len()) + RECORD_OVERHEAD
    }
}

/// Writes `data`'s JSON as serde_json writes it. A text delta, most of a
/// turn's events, is written field by field: through serde each of its
/// keys was escaped like its values, behind the serializer's layers, about
/// a third of building the event.
fn write_data(out: &mut String, data: &EventData) {
    match data {
        EventData::TextDelta { turn_id, text } => {
            out.push_str(r#"{"turn_id":"#);
            push_json_str(out, turn_id);
            out.push_str(r#","text":"#);
            push_json_str(out, text);
            out.push('}');
        }
        // Serializing EventData cannot fail: it holds strings, numbers and
        // already-parsed JSON values only.
        _ => match serde_json::to_string(data) {
            Ok(json) => out.push_str(&json),
            Err(_) => out.push_str("{}"),
        },
    }
}

/// Whether serde_json escapes anything in `s` (a control character, a
/// quote or a backslash). Every byte is looked at, without an early exit:
/// for the strings it is asked about (ids, times, kinds, tokens: short,
/// and rarely needing escapes) that took fewer instructions than an early
/// exit, a lookup table or 16-byte chunks (callgrind).
pub(crate) fn needs_json_escape(s: &str) -> bool {
    s.bytes().fold(false, |any, b| {
        any | (b < 0x20) | (b == b'"') | (b == b'\\')
    })
}

/// Writes `s` as a JSON string, as serde_json does: one with nothing to
/// escape is copied as it is, without the allocation a serializer makes.
pub(crate) fn push_json_str(out: &mut String, s: &str) {
    if !needs_json_escape(s) {
        out.reserve(s.len() + 2);
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else if let Ok(quoted) = serde_json::to_string(s) {
        // A str always serializes.
        out.push_str(&quoted);
    }
}

/// An event's kind. A known kind is a static name, so that making and
/// dropping a record touches no count shared by every record of its kind (a
/// shared `Arc` was one cache line that every thread wrote twice per event);
/// only an unknown kind read back from a store is allocated per record.
#[derive(Debug, Clone)]
pub enum Kind {
    Known(&'static str),
    Other(Arc<str>),
}

/// Kinds are equal when their names are, however each is held.
impl PartialEq for Kind {
    fn eq(&self, other: &Kind) -> bool {
        **self == **other
    }
}

impl Eq for Kind {}

impl std::ops::Deref for Kind {
    type Target = str;

    fn deref(&self) -> &str {
        match self {
            Kind::Known(name) => name,
            Kind::Other(name) => name,
        }
    }
}

/// The kind named `kind`: [`Kind::Known`] for every kind this version
/// writes.
pub fn intern_kind(kind: &str) -> Kind {
    <EventKind as strum::VariantNames>::VARIANTS
        .iter()
        .find(|known| **known == kind)
        .map_or_else(|| Kind::Other(Arc::from(kind)), |known| Kind::Known(known))
}

/// The most room a thread's frame scratch buffer keeps between events.
const MAX_KEPT_SCRATCH: usize = 64 * 1024;

/// Writes `time` as events and REST carry it, RFC 3339 UTC with
/// milliseconds. Events come by the thousand each second: the date and time
/// of day are formatted once a second per thread, the milliseconds each time.
fn write_ts(out: &mut String, time: SystemTime) {
    thread_local! {
        /// The second last formatted, and its text without the `Z`.
        static SECOND: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let since_epoch = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let (secs, millis) = (since_epoch.as_secs(), since_epoch.subsec_millis());
    SECOND.with_borrow_mut(|(cached, text)| {
        if *cached != secs {
            text.clear();
            let second = UNIX_EPOCH + Duration::from_secs(secs);
            let _ = write!(text, "{}", humantime::format_rfc3339_seconds(second));
            text.pop();
            *cached = secs;
        }
        out.push_str(text);
    });
    let digit = |d: u32| char::from(b'0' + (d % 10) as u8);
    out.extend([
        '.',
        digit(millis / 100),
        digit(millis / 10),
        digit(millis),
        'Z',
    ]);
}

/// The current time as events and REST carry it, RFC 3339 UTC with
/// milliseconds.
pub fn now_rfc3339() -> String {
    let mut text = String::with_capacity(24);
    write_ts(&mut text, SystemTime::now());
    text
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
        assert!(
            matches!(back.kind, Kind::Known("tool_call")),
            "known kinds are static"
        );
        let future = intern_kind("future_kind");
        assert!(matches!(&future, Kind::Other(name) if &**name == "future_kind"));
        assert_eq!(Kind::Other(Arc::from("tool_call")), back.kind);
        assert!(rec.held_bytes() > rec.frame.len() + size_of::<EventRecord>());
    }

    /// The text delta's own writer and the conversation id's give the
    /// bytes serde_json gives, whatever the strings hold.
    #[test]
    fn text_deltas_are_written_as_serde_writes_them() {
        let strings = [
            "",
            "tok12 ",
            "c_01JBENCH00000000000000001",
            "he said \"hi\"",
            "back\\slash",
            "tab\tnewline\ncr\r",
            "\u{0}\u{1f}\u{7f}",
            "é ü 中文 🎉",
            "</script> /",
        ];
        for id in strings {
            for (turn, text) in strings.iter().zip(strings.iter().rev()) {
                let data = EventData::TextDelta {
                    turn_id: Arc::from(*turn),
                    text: (*text).to_owned(),
                };
                let rec = EventRecord::new(id, 9, &data);
                assert_eq!(rec.data(), serde_json::to_string(&data).unwrap());
                let frame: Value = serde_json::from_str(rec.frame.as_str()).unwrap();
                assert_eq!(frame["conversation_id"], id);
                let mut quoted = String::new();
                push_json_str(&mut quoted, id);
                assert_eq!(quoted, serde_json::to_string(id).unwrap());
            }
        }
    }

    #[test]
    fn timestamps_match_rfc3339_with_millis() {
        let base = UNIX_EPOCH + Duration::from_secs(1_764_892_799);
        // Across a second, a day, a year and back again (the per-second
        // text is cached, so each step must replace it).
        for offset_ms in [
            0,
            1,
            10,
            999,
            1_000,
            1_001,
            86_400_000,
            2_678_400_000,
            5,
            123_456,
        ] {
            let time = base + Duration::from_millis(offset_ms);
            let mut ours = String::new();
            write_ts(&mut ours, time);
            assert_eq!(ours, humantime::format_rfc3339_millis(time).to_string());
        }
        assert_eq!(now_rfc3339().len(), "2026-12-05T07:50:45.123Z".len());
    }

    #[test]
    fn a_large_event_round_trips_and_the_next_starts_clean() {
        let text = "x".repeat(3 * MAX_KEPT_SCRATCH);
        let data = EventData::AssistantMessage {
            turn_id: "t_1".into(),
            text: text.clone(),
        };
        let big = EventRecord::new("c_1", 1, &data);
        let v: Value = serde_json::from_str(big.frame.as_str()).unwrap();
        assert_eq!(v["data"]["text"], text);
        let small = EventRecord::new(
            "c_1",
            2,
            &EventData::AgentStarted {
                reason: StartReason::Attach,
            },
        );
        let v: Value = serde_json::from_str(small.frame.as_str()).unwrap();
        assert_eq!(
            (v["seq"].as_u64(), v["data"]["reason"].as_str()),
            (Some(2), Some("attach"))
        );
    }
}

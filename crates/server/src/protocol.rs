//! Wire types of protocol v1 (`docs/protocol.md` §3 and §4): every client
//! frame we parse and every unsequenced server frame we send. Sequenced events
//! are built in [`crate::event`]; actors exchange typed messages, never JSON.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The `req` a client may put on any frame; echoed on the direct reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ReqId {
    Int(i64),
    Str(String),
}

/// Attachment mode of a connection on a conversation.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, strum::VariantArray,
)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Control,
    Observe,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Control => "control",
            Mode::Observe => "observe",
        }
    }
}

/// A parsed, validated client frame. [`ClientFrameType::VARIANTS`] names
/// every `type` (docs/protocol.md lists each one; a test checks).
#[derive(Debug, Clone, PartialEq, Deserialize, strum::EnumDiscriminants)]
#[serde(tag = "type", rename_all = "snake_case")]
#[strum_discriminants(
    name(ClientFrameType),
    derive(strum::VariantNames),
    strum(serialize_all = "snake_case")
)]
pub enum ClientFrame {
    Create {
        #[serde(default)]
        req: Option<ReqId>,
        #[serde(default)]
        title: Option<String>,
        #[serde(default)]
        close_delay: Option<String>,
    },
    Attach {
        #[serde(default)]
        req: Option<ReqId>,
        conversation_id: String,
        #[serde(default)]
        last_seq: Option<u64>,
        #[serde(default)]
        mode: Option<Mode>,
        /// Protocol §11: leave finished turns' `text_delta`s out of the
        /// replay.
        #[serde(default)]
        compact: Option<bool>,
    },
    Detach {
        #[serde(default)]
        req: Option<ReqId>,
        conversation_id: String,
    },
    Message {
        #[serde(default)]
        req: Option<ReqId>,
        conversation_id: String,
        text: String,
        #[serde(default)]
        client_msg_id: Option<String>,
    },
    ToolResult {
        #[serde(default)]
        req: Option<ReqId>,
        conversation_id: String,
        call_id: String,
        output: Value,
        #[serde(default)]
        is_error: Option<bool>,
    },
    Stop {
        #[serde(default)]
        req: Option<ReqId>,
        conversation_id: String,
    },
    Close {
        #[serde(default)]
        req: Option<ReqId>,
        conversation_id: String,
    },
    Ping {
        #[serde(default)]
        req: Option<ReqId>,
    },
}

/// Why a client frame could not be parsed: the message of a `bad_request`
/// error plus whatever `req` we could still recover from it.
#[derive(Debug, Clone, PartialEq)]
pub struct FrameError {
    pub req: Option<ReqId>,
    pub conversation_id: Option<String>,
    pub message: String,
}

impl ClientFrame {
    /// Parses one text frame. Unknown fields are ignored: the protocol lets
    /// clients and servers grow fields, and an older server must not refuse a
    /// newer client.
    pub fn parse(text: &str) -> Result<ClientFrame, FrameError> {
        let value: Value = serde_json::from_str(text).map_err(|e| FrameError {
            req: None,
            conversation_id: None,
            message: format!("not JSON: {e}"),
        })?;
        let req = value
            .get("req")
            .and_then(|r| serde_json::from_value::<ReqId>(r.clone()).ok());
        let conversation_id = value
            .get("conversation_id")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let fail = |message: String| FrameError {
            req: req.clone(),
            conversation_id: conversation_id.clone(),
            message,
        };
        let Some(object) = value.as_object() else {
            return Err(fail("a frame must be a JSON object".into()));
        };
        match object.get("type") {
            Some(Value::String(_)) => {}
            Some(_) => return Err(fail("`type` must be a string".into())),
            None => return Err(fail("missing field `type`".into())),
        }
        serde_json::from_value::<ClientFrame>(value.clone()).map_err(|e| fail(e.to_string()))
    }

    pub fn conversation_id(&self) -> Option<&str> {
        match self {
            ClientFrame::Attach {
                conversation_id, ..
            }
            | ClientFrame::Detach {
                conversation_id, ..
            }
            | ClientFrame::Message {
                conversation_id, ..
            }
            | ClientFrame::ToolResult {
                conversation_id, ..
            }
            | ClientFrame::Stop {
                conversation_id, ..
            }
            | ClientFrame::Close {
                conversation_id, ..
            } => Some(conversation_id),
            ClientFrame::Create { .. } | ClientFrame::Ping { .. } => None,
        }
    }

    pub fn req(&self) -> Option<&ReqId> {
        match self {
            ClientFrame::Create { req, .. }
            | ClientFrame::Attach { req, .. }
            | ClientFrame::Detach { req, .. }
            | ClientFrame::Message { req, .. }
            | ClientFrame::ToolResult { req, .. }
            | ClientFrame::Stop { req, .. }
            | ClientFrame::Close { req, .. }
            | ClientFrame::Ping { req } => req.as_ref(),
        }
    }
}

/// Conversation status as reported to clients and REST.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Running,
    Waiting,
    Idle,
    Stopped,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Running => "running",
            Status::Waiting => "waiting",
            Status::Idle => "idle",
            Status::Stopped => "stopped",
        }
    }

    pub fn parse(s: &str) -> Option<Status> {
        match s {
            "running" => Some(Status::Running),
            "waiting" => Some(Status::Waiting),
            "idle" => Some(Status::Idle),
            "stopped" => Some(Status::Stopped),
            _ => None,
        }
    }
}

/// Error codes of protocol §4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    BadRequest,
    NotFound,
    NotAttached,
    ReadOnly,
    UnknownCall,
    QueueFull,
    LimitReached,
    RateLimited,
    TooManyConnections,
    /// The store cannot write now: nothing was recorded; retry later.
    StoreUnavailable,
    Internal,
}

/// Why a connection was detached from a conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
pub enum DetachReason {
    Client,
    UserLimit,
    Closed,
    Deleted,
    Shutdown,
    /// Cluster mode: another node owns the conversation now; attach again
    /// (any node) and resume.
    Moved,
}

/// Why a conversation's agent stopped (`agent_stopped.reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Hash, strum::VariantArray)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Idle,
    UserLimit,
    Closed,
    Shutdown,
    RestartRecovery,
    Deleted,
    /// Cluster mode: the node that ran it was lost; another node closed it.
    NodeLost,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Idle => "idle",
            StopReason::UserLimit => "user_limit",
            StopReason::Closed => "closed",
            StopReason::Shutdown => "shutdown",
            StopReason::RestartRecovery => "restart_recovery",
            StopReason::Deleted => "deleted",
            StopReason::NodeLost => "node_lost",
        }
    }

    /// The `detached` reason connections get when a conversation stops for
    /// this reason. An idle close has nobody attached to tell; it maps to
    /// `closed` so that the match stays total.
    pub fn detach_reason(self) -> DetachReason {
        match self {
            StopReason::UserLimit => DetachReason::UserLimit,
            StopReason::Deleted => DetachReason::Deleted,
            StopReason::Shutdown | StopReason::RestartRecovery => DetachReason::Shutdown,
            StopReason::NodeLost => DetachReason::Moved,
            StopReason::Closed | StopReason::Idle => DetachReason::Closed,
        }
    }
}

/// Unsequenced server frames (never recorded); [`ServerFrameType::VARIANTS`]
/// names every `type`.
#[derive(Debug, Clone, Serialize, strum::EnumDiscriminants)]
#[serde(tag = "type", rename_all = "snake_case")]
#[strum_discriminants(
    name(ServerFrameType),
    derive(strum::VariantNames),
    strum(serialize_all = "snake_case")
)]
pub enum ServerFrame {
    Created {
        #[serde(skip_serializing_if = "Option::is_none")]
        req: Option<ReqId>,
        conversation_id: String,
    },
    Attached {
        #[serde(skip_serializing_if = "Option::is_none")]
        req: Option<ReqId>,
        conversation_id: String,
        status: Status,
        mode: Mode,
        head_seq: u64,
        replay_from: u64,
        replay_incomplete: bool,
        pending_calls: Vec<String>,
        queued_messages: usize,
        /// Present (true) when the attach asked for a compact replay.
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        compact: bool,
    },
    Detached {
        #[serde(skip_serializing_if = "Option::is_none")]
        req: Option<ReqId>,
        conversation_id: String,
        reason: DetachReason,
    },
    Ack {
        #[serde(skip_serializing_if = "Option::is_none")]
        req: Option<ReqId>,
        conversation_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        seq: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        duplicate: Option<bool>,
    },
    Pong {
        #[serde(skip_serializing_if = "Option::is_none")]
        req: Option<ReqId>,
    },
    Error {
        #[serde(skip_serializing_if = "Option::is_none")]
        req: Option<ReqId>,
        code: ErrorCode,
        message: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        conversation_id: Option<String>,
    },
}

impl ServerFrame {
    pub fn error(
        req: Option<ReqId>,
        code: ErrorCode,
        message: impl Into<String>,
        conversation_id: Option<String>,
    ) -> ServerFrame {
        ServerFrame::Error {
            req,
            code,
            message: message.into(),
            conversation_id,
        }
    }

    /// Serializes the frame. Serializing these types cannot fail: they hold
    /// only strings, numbers and already-valid JSON values.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| {
            format!(r#"{{"type":"error","code":"internal","message":"serialize: {e}"}}"#)
        })
    }
}

/// Longest accepted conversation title, in characters.
pub const MAX_TITLE_CHARS: usize = 200;
/// Longest accepted user name, in bytes (a token's user, an observer).
pub const MAX_USER_BYTES: usize = 64;
/// Longest accepted id (conversation, call, client message), in bytes.
pub const MAX_ID_BYTES: usize = 128;
/// Longest accepted message text, in bytes.
pub const MAX_TEXT_BYTES: usize = 256 * 1024;

/// Deepest accepted nesting of a tool result's `output`: recorded inside an
/// event, it must stay readable by JSON parsers with a recursion limit.
pub const MAX_OUTPUT_DEPTH: usize = 64;

/// How deeply a JSON value nests (a scalar is 0). The parser already refused
/// anything deeper than its own limit, so the recursion is bounded.
fn depth(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// A request field that breaks its limit or cannot be read, named in the
/// message; the websocket (`create` frames) and REST share these checks so
/// that both refuse the same values with the same words.
#[derive(Debug, thiserror::Error)]
pub enum FieldError {
    #[error("title is longer than {MAX_TITLE_CHARS} characters")]
    TitleTooLong,
    #[error("close_delay: {0} (use a duration such as \"90s\" or \"15m\")")]
    CloseDelay(#[from] humantime::DurationError),
    #[error("user must be 1 to {MAX_USER_BYTES} bytes")]
    UserNameLength,
}

/// A new conversation's title fits [`MAX_TITLE_CHARS`].
pub fn check_title(title: &str) -> Result<(), FieldError> {
    if title.chars().count() > MAX_TITLE_CHARS {
        return Err(FieldError::TitleTooLong);
    }
    Ok(())
}

/// A new conversation's `close_delay`, a humantime duration (`90s`, `2h`);
/// absent: the configured one applies.
pub fn parse_close_delay(text: Option<&str>) -> Result<Option<Duration>, FieldError> {
    Ok(text.map(humantime::parse_duration).transpose()?)
}

/// A user name is 1 to [`MAX_USER_BYTES`] bytes. Authentication also
/// limits its characters; an observer named over REST needs only the
/// length, since a fixed token list may name any user.
pub fn check_user_name(name: &str) -> Result<(), FieldError> {
    if name.is_empty() || name.len() > MAX_USER_BYTES {
        return Err(FieldError::UserNameLength);
    }
    Ok(())
}

/// Checks the sizes a parsed frame may carry; the error names the field.
pub fn check_limits(frame: &ClientFrame) -> Result<(), String> {
    let id = |name: &str, value: &str| {
        if value.is_empty() || value.len() > MAX_ID_BYTES {
            Err(format!("{name} must be 1 to {MAX_ID_BYTES} bytes"))
        } else {
            Ok(())
        }
    };
    match frame {
        ClientFrame::Create { title, .. } => match title {
            Some(title) => check_title(title).map_err(|e| e.to_string()),
            None => Ok(()),
        },
        ClientFrame::Attach {
            conversation_id, ..
        }
        | ClientFrame::Detach {
            conversation_id, ..
        }
        | ClientFrame::Stop {
            conversation_id, ..
        }
        | ClientFrame::Close {
            conversation_id, ..
        } => id("conversation_id", conversation_id),
        ClientFrame::Message {
            conversation_id,
            text,
            client_msg_id,
            ..
        } => {
            id("conversation_id", conversation_id)?;
            if let Some(c) = client_msg_id {
                id("client_msg_id", c)?;
            }
            if text.len() > MAX_TEXT_BYTES {
                return Err(format!("text is longer than {MAX_TEXT_BYTES} bytes"));
            }
            Ok(())
        }
        ClientFrame::ToolResult {
            conversation_id,
            call_id,
            output,
            ..
        } => {
            id("conversation_id", conversation_id)?;
            id("call_id", call_id)?;
            if depth(output) > MAX_OUTPUT_DEPTH {
                return Err(format!(
                    "output is nested deeper than {MAX_OUTPUT_DEPTH} levels"
                ));
            }
            Ok(())
        }
        ClientFrame::Ping { .. } => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_attach_with_defaults() {
        let f = ClientFrame::parse(r#"{"type":"attach","conversation_id":"c_1","req":3}"#).unwrap();
        assert_eq!(
            f,
            ClientFrame::Attach {
                req: Some(ReqId::Int(3)),
                conversation_id: "c_1".into(),
                last_seq: None,
                mode: None,
                compact: None
            }
        );
    }

    #[test]
    fn bad_frames_keep_req() {
        let e =
            ClientFrame::parse(r#"{"type":"message","req":"r9","conversation_id":5}"#).unwrap_err();
        assert_eq!(e.req, Some(ReqId::Str("r9".into())));
        assert!(ClientFrame::parse("[1,2]").is_err());
        assert!(ClientFrame::parse(r#"{"type":"nope"}"#).is_err());
        assert!(ClientFrame::parse(r#"{"type":"ping","extra":1}"#).is_ok());
        assert!(
            ClientFrame::parse(r#"{"type":"attach","conversation_id":"c","last_seq":-1}"#).is_err()
        );
    }
}

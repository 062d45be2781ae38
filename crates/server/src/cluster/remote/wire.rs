//! The messages nodes exchange about remote attachments (JSON).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::actors::conversation::DetachCause;
use crate::protocol::{ErrorCode, Mode, ReqId};

/// A socket node asks the owner to attach one of its connections.
#[derive(Debug, Serialize, Deserialize)]
pub struct AttachRequest {
    pub conversation: String,
    /// The socket's node: frames go to `route.<socket_node>.<route>`.
    pub socket_node: String,
    pub route: String,
    pub user: String,
    pub mode: Mode,
    pub last_seq: u64,
    /// Protocol §11: a compact replay.
    #[serde(default)]
    pub compact: bool,
    pub req: Option<ReqId>,
}

/// The owner's answer to an [`AttachRequest`].
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum AttachReply {
    /// The conversation has the attachment; `attached` and the replay
    /// come over the route.
    Attached,
    /// Refused as a local attach would be (`code` is the protocol's).
    Refused { code: ErrorCode, message: String },
    /// This node does not run the conversation (any more).
    NotHere,
}

/// A client frame for an attachment, from its socket node.
#[derive(Debug, Serialize, Deserialize)]
pub struct RouteCommand {
    pub route: String,
    /// The command's number on its route: 1, 2, 3, ... A gap means one was
    /// lost between the nodes.
    pub n: u64,
    pub command: Command,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Command {
    Message {
        text: String,
        client_msg_id: Option<String>,
        req: Option<ReqId>,
    },
    ToolResult {
        call_id: String,
        output: Value,
        is_error: bool,
        req: Option<ReqId>,
    },
    Stop {
        req: Option<ReqId>,
    },
    /// A controller's `close` (the owner judges the rights).
    Close {
        req: Option<ReqId>,
    },
    /// The client detached, or its socket went away.
    Detach {
        cause: DetachCause,
    },
}

impl Command {
    /// The request of a command that asks the owner to record something
    /// (`None` for a detach, which records nothing).
    pub fn recording_request(&self) -> Option<Option<&ReqId>> {
        match self {
            Command::Message { req, .. }
            | Command::ToolResult { req, .. }
            | Command::Stop { req }
            | Command::Close { req } => Some(req.as_ref()),
            Command::Detach { .. } => None,
        }
    }
}

/// The routes a socket node still holds with one owner.
#[derive(Debug, Serialize, Deserialize)]
pub struct Alive {
    /// The socket's node, where the owner answers about a route it no
    /// longer has.
    pub node: String,
    pub routes: Vec<AliveRoute>,
}

/// One route as its socket node sees it.
#[derive(Debug, Serialize, Deserialize)]
pub struct AliveRoute {
    pub route: String,
    /// The owner answered the attach: from then on a route it does not
    /// know is one it ended (or lost).
    pub attached: bool,
    /// How many commands were published on the route: more than the owner
    /// received means the last ones were lost.
    pub commands: u64,
}

/// Stop a conversation on its owner (`close`, delete, the user's limit).
#[derive(Debug, Serialize, Deserialize)]
pub struct StopRequest {
    pub conversation: String,
    pub reason: StopKind,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum StopKind {
    Closed,
    Deleted,
    UserLimit,
}

impl StopKind {
    pub fn reason(self) -> crate::protocol::StopReason {
        match self {
            StopKind::Closed => crate::protocol::StopReason::Closed,
            StopKind::Deleted => crate::protocol::StopReason::Deleted,
            StopKind::UserLimit => crate::protocol::StopReason::UserLimit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_detach_carries_its_cause_between_nodes() {
        let causes = [
            DetachCause::Client {
                req: Some(ReqId::Str("r1".into())),
            },
            DetachCause::Client { req: None },
            DetachCause::SocketGone,
        ];
        for cause in causes {
            let json = serde_json::to_string(&Command::Detach {
                cause: cause.clone(),
            })
            .expect("a command serializes");
            let back: Command = serde_json::from_str(&json).expect("and reads back");
            assert!(
                matches!(&back, Command::Detach { cause: got } if *got == cause),
                "{json} read back as {back:?}"
            );
            assert_eq!(back.recording_request(), None, "a detach records nothing");
        }
    }
}

//! Control rights: which attached connection may steer the conversation.
//! The conversation is their only owner: it keeps each attachment's mode,
//! and every steering frame (`message`, `tool_result`, `stop`, `close`) is
//! judged here. A connection keeps only which actor to route a frame to.

use super::*;

/// What an attachment may do with a steering frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Right {
    Steer,
    /// Attached in observe mode.
    ReadOnly,
    NotAttached,
}

impl Right {
    /// The right of a connection attached in `mode` (`None`: not attached).
    pub(super) fn of(mode: Option<Mode>) -> Right {
        match mode {
            Some(Mode::Control) => Right::Steer,
            Some(Mode::Observe) => Right::ReadOnly,
            None => Right::NotAttached,
        }
    }

    /// How a steering frame is refused under this right (`None`: it is not).
    pub(super) fn refusal(self) -> Option<(ErrorCode, &'static str)> {
        match self {
            Right::Steer => None,
            Right::ReadOnly => Some((ErrorCode::ReadOnly, "attached in observe mode: read only")),
            Right::NotAttached => Some((
                ErrorCode::NotAttached,
                "not attached to this conversation; attach again",
            )),
        }
    }
}

impl ConversationMsg {
    /// For a client frame that steers the conversation: who sent it.
    fn steering_request(&self) -> Option<(ConnId, &Option<ReqId>)> {
        match self {
            ConversationMsg::UserMessage { conn, req, .. }
            | ConversationMsg::ToolResult { conn, req, .. }
            | ConversationMsg::StopTurn { conn, req }
            | ConversationMsg::Close { conn, req } => Some((*conn, req)),
            _ => None,
        }
    }
}

impl State {
    fn right(&self, conn: ConnId) -> Right {
        Right::of(self.attachments.get(&conn).map(|a| a.mode))
    }

    /// Answers an observer's steering frame with `read_only`. Judged
    /// before anything else: an observer hears `read_only` whatever state
    /// the conversation is in. Returns whether it was refused.
    pub(super) fn refuse_read_only(&self, message: &ConversationMsg) -> bool {
        self.refuse_steering(message, Right::ReadOnly)
    }

    /// Answers a steering frame from a connection this conversation does
    /// not hold (it was detached, or stopped with it) with `not_attached`.
    /// Returns whether it was refused.
    pub(super) fn refuse_unattached(&self, message: &ConversationMsg) -> bool {
        self.refuse_steering(message, Right::NotAttached)
    }

    /// Refuses `message` if it steers and its sender has `right`.
    fn refuse_steering(&self, message: &ConversationMsg, right: Right) -> bool {
        let Some((conn, req)) = message.steering_request() else {
            return false;
        };
        let Some((code, why)) = right.refusal().filter(|_| self.right(conn) == right) else {
            return false;
        };
        self.refuse(conn, req.clone(), code, why.into());
        true
    }

    /// A controller's `close`: the supervisor decides stops (invariant 3),
    /// so it is asked; the ack goes out now, before the `detached closed`
    /// that the stop brings.
    pub(super) fn close(&self, conn: ConnId, req: Option<ReqId>) {
        let _ = self.supervisor.cast(SupervisorMsg::Stop {
            id: self.id.to_string(),
            reason: StopReason::Closed,
            reply: None,
        });
        self.ack_now(conn, req);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_controller_steers() {
        assert_eq!(Right::of(Some(Mode::Control)), Right::Steer);
        assert_eq!(Right::of(Some(Mode::Observe)), Right::ReadOnly);
        assert_eq!(Right::of(None), Right::NotAttached);
        assert_eq!(Right::Steer.refusal(), None);
        assert!(matches!(
            Right::ReadOnly.refusal(),
            Some((ErrorCode::ReadOnly, _))
        ));
        assert!(matches!(
            Right::NotAttached.refusal(),
            Some((ErrorCode::NotAttached, _))
        ));
    }
}

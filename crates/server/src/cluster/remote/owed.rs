//! The requests sent through one remote route that the owner has not
//! answered yet. A route can end before the owner's answer comes back (a
//! command lost between the nodes, the owner ending the route, the lease
//! moving): the socket's node then answers each of them itself,
//! `not_attached`, so that no request a client sent is left unanswered.
//!
//! Shared by the proxy, which notes each request as it sends it, and the
//! route's task, which strikes off the owner's answers as they pass and
//! ends the route.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use serde::Deserialize;

use crate::actors::outbound::Outbound;
use crate::protocol::{ErrorCode, ReqId, ServerFrame};

/// At most this many unanswered requests are kept per route; beyond it the
/// oldest is forgotten (and, should the route end before its answer, not
/// answered). A connection's rate limit keeps far fewer in flight.
const MAX_OWED: usize = 256;

#[derive(Default)]
pub struct Owed(Mutex<OwedState>);

#[derive(Default)]
struct OwedState {
    ended: bool,
    requests: VecDeque<ReqId>,
}

/// The two fields of a frame that say whether it answers a request.
#[derive(Deserialize)]
struct ReplyHead {
    #[serde(rename = "type")]
    kind: String,
    req: Option<ReqId>,
}

impl Owed {
    fn lock(&self) -> MutexGuard<'_, OwedState> {
        // Every use is one push, removal or drain: a panic cannot leave it
        // half-changed.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Notes a request about to go to the owner. Returns false once the
    /// route has ended: the caller answers it itself, and sends nothing.
    pub fn expect(&self, req: Option<&ReqId>) -> bool {
        let mut state = self.lock();
        if state.ended {
            return false;
        }
        if let Some(req) = req {
            if state.requests.len() == MAX_OWED {
                state.requests.pop_front();
            }
            state.requests.push_back(req.clone());
        }
        true
    }

    /// Strikes off the request `frame` answers, if it is an answer (`ack`
    /// or `error` with a `req`). Only a frame naming a `req` is parsed.
    pub fn answered_in(&self, frame: &str) {
        if !frame.contains("\"req\":") {
            return;
        }
        let Ok(head) = serde_json::from_str::<ReplyHead>(frame) else {
            return;
        };
        let (Some(req), "ack" | "error") = (head.req, head.kind.as_str()) else {
            return;
        };
        let mut state = self.lock();
        if let Some(at) = state.requests.iter().position(|owed| *owed == req) {
            state.requests.remove(at);
        }
    }

    /// Ends the route (once): returns the requests the owner never
    /// answered. Later requests are refused by [`Owed::expect`].
    pub fn end(&self) -> Vec<ReqId> {
        let mut state = self.lock();
        state.ended = true;
        state.requests.drain(..).collect()
    }

    /// Ends the route and answers each request the owner never answered
    /// on `outbound`, [`unanswered`].
    pub fn end_answering(&self, outbound: &Outbound, conversation_id: &str) {
        for req in self.end() {
            outbound.reply(&unanswered(Some(req), conversation_id));
        }
    }
}

/// The answer to a request whose route ended first: it may or may not have
/// been recorded (the replay after the next attach says), so the client
/// attaches again and resends with its `client_msg_id`.
pub fn unanswered(req: Option<ReqId>, conversation_id: &str) -> ServerFrame {
    ServerFrame::error(
        req,
        ErrorCode::NotAttached,
        "the attachment ended before this was answered: attach again; the replay shows \
         whether it was recorded",
        Some(conversation_id.to_owned()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(s: &str) -> ReqId {
        ReqId::Str(s.to_owned())
    }

    #[test]
    fn only_the_requests_never_answered_are_owed_at_the_end() {
        let owed = Owed::default();
        assert!(owed.expect(Some(&req("a"))));
        assert!(owed.expect(None));
        assert!(owed.expect(Some(&req("b"))));
        assert!(owed.expect(Some(&ReqId::Int(7))));
        owed.answered_in(r#"{"type":"ack","req":"a","conversation_id":"c","seq":4}"#);
        owed.answered_in(r#"{"req":7,"code":"read_only","message":"m","type":"error"}"#);
        // An event whose data names a `req` answers nothing.
        owed.answered_in(
            r#"{"type":"event","kind":"tool_call","data":{"input":{"req":"b"}},"seq":5}"#,
        );
        assert_eq!(owed.end(), vec![req("b")]);
        assert!(!owed.expect(Some(&req("c"))), "refused once ended");
        assert!(owed.end().is_empty());
    }

    #[test]
    fn a_request_id_used_twice_is_owed_until_answered_twice() {
        let owed = Owed::default();
        owed.expect(Some(&req("x")));
        owed.expect(Some(&req("x")));
        owed.answered_in(r#"{"type":"ack","req":"x"}"#);
        assert_eq!(owed.end(), vec![req("x")]);
    }

    #[test]
    fn at_most_max_owed_are_kept() {
        let owed = Owed::default();
        for n in 0..(MAX_OWED as i64 + 3) {
            owed.expect(Some(&ReqId::Int(n)));
        }
        let left = owed.end();
        assert_eq!(left.len(), MAX_OWED);
        assert_eq!(left[0], ReqId::Int(3), "the oldest are forgotten");
    }
}

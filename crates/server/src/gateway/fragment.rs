//! How one outgoing text message becomes websocket frames: a large message
//! goes out as a text frame and continuation frames of at most
//! [`FRAGMENT_BYTES`] each (RFC 6455 §5.4).
//!
//! Why: the websocket library assembles each frame whole in its write
//! buffer and never gives that buffer's memory back. Sent whole, a 3 MB
//! `assistant_message` left every connection that received it holding
//! 3 MB for its lifetime; sent in fragments, the buffer never grows past
//! its flush threshold and one fragment.

use bytes::Bytes;
use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::frame::Frame;
use tokio_tungstenite::tungstenite::Utf8Bytes;

/// The largest payload of one frame. A message up to this size goes out as
/// one frame, as it would unfragmented.
pub const FRAGMENT_BYTES: usize = 16 * 1024;

/// What is left to send of one text message.
pub struct Fragments {
    text: Utf8Bytes,
    /// Bytes of `text` already sent.
    sent: usize,
    /// The final frame was sent (an empty message is one empty frame).
    done: bool,
}

impl Fragments {
    pub fn new(text: Utf8Bytes) -> Self {
        Fragments {
            text,
            sent: 0,
            done: false,
        }
    }

    /// The next frame, and where it ends; `None` once all was sent. It is
    /// counted as sent only by [`Self::sent_up_to`], so that a send given
    /// up half-way sends the same frame again.
    pub fn next(&self) -> Option<(Frame, usize)> {
        if self.done {
            return None;
        }
        let len = self.text.len();
        let first = self.sent == 0;
        let mut end = len.min(self.sent + FRAGMENT_BYTES);
        // Cut between characters, so that each fragment is valid UTF-8 on
        // its own (a client that checks fragments one by one accepts them);
        // a character is at most 4 bytes, so a fragment stays non-empty.
        while !self.text.as_str().is_char_boundary(end) {
            end -= 1;
        }
        let payload = Bytes::from(self.text.clone()).slice(self.sent..end);
        let opcode = if first {
            OpCode::Data(Data::Text)
        } else {
            OpCode::Data(Data::Continue)
        };
        Some((Frame::message(payload, opcode, end == len), end))
    }

    pub fn sent_up_to(&mut self, end: usize) {
        self.sent = end;
        self.done = end == self.text.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every frame of `text`, as (opcode, fin, payload).
    fn frames(text: &str) -> Vec<(OpCode, bool, String)> {
        let mut fragments = Fragments::new(Utf8Bytes::from(text));
        let mut out = Vec::new();
        while let Some((frame, end)) = fragments.next() {
            let fin = frame.header().is_final;
            let opcode = frame.header().opcode;
            let payload = String::from_utf8(frame.into_payload().to_vec()).expect("UTF-8 fragment");
            out.push((opcode, fin, payload));
            fragments.sent_up_to(end);
        }
        out
    }

    #[test]
    fn a_small_message_is_one_final_text_frame() {
        let text = OpCode::Data(Data::Text);
        assert_eq!(frames("{\"a\":1}"), [(text, true, "{\"a\":1}".to_owned())]);
        assert_eq!(frames(""), [(text, true, String::new())]);
        let exact = "x".repeat(FRAGMENT_BYTES);
        assert_eq!(frames(&exact), [(text, true, exact.clone())]);
    }

    /// A large message: a text frame, then continuations, the last final;
    /// each within the bound, cut between characters, together the message.
    #[test]
    fn a_large_message_is_cut_between_characters() {
        let message = "é€😀a".repeat(FRAGMENT_BYTES / 3);
        let frames = frames(&message);
        assert!(frames.len() >= 3, "{} frames", frames.len());
        assert_eq!(frames[0].0, OpCode::Data(Data::Text));
        for (i, (opcode, fin, payload)) in frames.iter().enumerate() {
            if i > 0 {
                assert_eq!(*opcode, OpCode::Data(Data::Continue));
            }
            assert_eq!(*fin, i == frames.len() - 1);
            assert!(!payload.is_empty() && payload.len() <= FRAGMENT_BYTES);
        }
        let whole: String = frames.into_iter().map(|(_, _, p)| p).collect();
        assert_eq!(whole, message);
    }

    /// A frame not marked sent is offered again.
    #[test]
    fn an_unsent_frame_is_offered_again() {
        let mut fragments = Fragments::new(Utf8Bytes::from("y".repeat(FRAGMENT_BYTES + 1)));
        let (_, first_end) = fragments.next().expect("a first frame");
        let (_, again) = fragments.next().expect("the same frame");
        assert_eq!(first_end, again);
        fragments.sent_up_to(first_end);
        let (last, end) = fragments.next().expect("the rest");
        assert!(last.header().is_final);
        fragments.sent_up_to(end);
        assert!(fragments.next().is_none());
    }
}

//! A replay: one attachment's cursor catching up with its conversation's log.
//! It sends the attach's reply (first, when it is the attach's own replay),
//! then the events `from..=to`, from a snapshot of the replay buffer when the
//! buffer holds them and from the store otherwise, at the pace the socket
//! drains, then tells the conversation where it stopped. The conversation
//! decides whether the attachment is live or needs another round. A compact
//! replay (protocol §11) leaves out the `text_delta`s of finished turns.
//!
//! `attached` says where the replay starts, which only the replay learns
//! (retention may have deleted the start of the range): the conversation
//! hands it a [`Greeting`] with what it knows, and the frame is built here,
//! once.

use std::sync::Arc;

use ractor::ActorRef;
use tokio_tungstenite::tungstenite::Utf8Bytes;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::connection::ConnectionHandle;
use super::conversation::ConversationMsg;
use super::outbound::close_code;
use crate::event::EventRecord;
use crate::protocol::{ErrorCode, Mode, ReqId, ServerFrame, Status};
use crate::store::Store;

/// Events read from the store per page while replaying.
const REPLAY_PAGE: usize = 128;

/// What a compact replay keeps of the deltas: those of the turn running at
/// the attach (every turn before it has finished).
#[derive(Debug, Clone)]
pub struct Compact {
    pub running_turn: Option<Arc<str>>,
}

impl Compact {
    /// Whether a compact replay leaves this event out.
    fn omits(&self, record: &EventRecord) -> bool {
        #[derive(serde::Deserialize)]
        struct TurnRef<'a> {
            #[serde(borrow)]
            turn_id: &'a str,
        }
        if &*record.kind != "text_delta" {
            return false;
        }
        match serde_json::from_str::<TurnRef>(record.data()) {
            Ok(delta) => self.running_turn.as_deref() != Some(delta.turn_id),
            // Unreadable: sent, never silently dropped.
            Err(_) => false,
        }
    }
}

/// The first reply of an attach, as the conversation knows it at the attach.
pub enum Greeting {
    /// `created`, for the connection that created the conversation.
    Created {
        req: Option<ReqId>,
        conversation_id: String,
    },
    /// `attached`, but for where the replay starts.
    Attached(AttachedFacts),
}

/// What `attached` says that the conversation knows at the attach.
pub struct AttachedFacts {
    pub req: Option<ReqId>,
    pub conversation_id: String,
    pub status: Status,
    pub mode: Mode,
    pub head_seq: u64,
    pub pending_calls: Vec<String>,
    pub queued_messages: usize,
    pub compact: bool,
}

impl Greeting {
    /// The frame, once the replay knows the first seq it sends
    /// (`replay_from`) and whether the store no longer held the ones
    /// asked for before it (`replay_incomplete`).
    fn frame(self, replay_from: u64, replay_incomplete: bool) -> ServerFrame {
        match self {
            Greeting::Created {
                req,
                conversation_id,
            } => ServerFrame::Created {
                req,
                conversation_id,
            },
            Greeting::Attached(facts) => ServerFrame::Attached {
                req: facts.req,
                conversation_id: facts.conversation_id,
                status: facts.status,
                mode: facts.mode,
                head_seq: facts.head_seq,
                replay_from,
                replay_incomplete,
                pending_calls: facts.pending_calls,
                queued_messages: facts.queued_messages,
                compact: facts.compact,
            },
        }
    }
}

/// One replay: sends the attach's reply (if any), then the events `from..=to` from
/// the buffer snapshot or the store, at the pace the socket drains, then
/// reports where it stopped.
pub struct Replay {
    pub conversation: ActorRef<ConversationMsg>,
    pub conversation_id: Arc<str>,
    pub store: Arc<dyn Store>,
    pub conn: ConnectionHandle,
    pub cancel: CancellationToken,
    pub generation: u64,
    pub from: u64,
    pub to: u64,
    pub from_buffer: Option<Vec<Arc<EventRecord>>>,
    /// Sent first, for the attach's own replay (later rounds have none).
    pub greeting: Option<Greeting>,
    /// A compact replay (the attach's own, never a later catch-up).
    pub compact: Option<Compact>,
}

impl Replay {
    pub async fn run(mut self) {
        let cancel = self.cancel.clone();
        let outcome = tokio::select! {
            _ = cancel.cancelled() => return,
            outcome = self.replay() => outcome,
        };
        match outcome {
            Ok(next_seq) => {
                let _ = self.conversation.cast(ConversationMsg::CaughtUp {
                    conn: self.conn.id,
                    generation: self.generation,
                    next_seq,
                });
            }
            Err(ReplayError::Closed) => {}
            Err(ReplayError::Store(e)) => {
                warn!(conversation = %self.conversation_id, connection = self.conn.id,
                    error = %e, "replay from the store failed; closing the connection");
                self.conn.outbound.reply(&ServerFrame::error(
                    None,
                    ErrorCode::Internal,
                    "replay from the store failed; attach again",
                    Some(self.conversation_id.to_string()),
                ));
                self.conn
                    .outbound
                    .close(close_code::INTERNAL, "replay failed", true);
            }
        }
    }

    /// Sends one event of the replay, unless a compact replay omits it.
    async fn send_event(&self, record: &EventRecord) -> Result<(), ReplayError> {
        if self.compact.as_ref().is_some_and(|c| c.omits(record)) {
            return Ok(());
        }
        self.send(record.frame.clone()).await
    }

    async fn send(&self, frame: Utf8Bytes) -> Result<(), ReplayError> {
        self.conn
            .outbound
            .send(frame)
            .await
            .map_err(|_| ReplayError::Closed)
    }

    /// Sends the greeting, if it has not gone yet.
    async fn greet(&mut self, replay_from: u64, incomplete: bool) -> Result<(), ReplayError> {
        let Some(greeting) = self.greeting.take() else {
            return Ok(());
        };
        let frame = greeting.frame(replay_from, incomplete);
        self.send(Utf8Bytes::from(frame.to_json())).await
    }

    async fn replay(&mut self) -> Result<u64, ReplayError> {
        if let Some(records) = self.from_buffer.take() {
            self.greet(self.from, false).await?;
            let range = self.from..=self.to;
            for record in records.iter().filter(|r| range.contains(&r.seq)) {
                self.send_event(record).await?;
            }
            return Ok(self.to + 1);
        }
        let mut next = self.from;
        while next <= self.to {
            let page = self
                .store
                .events(&self.conversation_id, next - 1, REPLAY_PAGE)
                .await
                .map_err(ReplayError::Store)?;
            if self.greeting.is_some() {
                // Retention may have deleted the start of the range.
                let first = page.first().map(|r| r.seq).unwrap_or(self.to + 1);
                let replay_from = first.min(self.to + 1).max(next);
                self.greet(replay_from, replay_from > next).await?;
            }
            if page.is_empty() {
                next = self.to + 1;
                break;
            }
            for record in page.iter().filter(|r| r.seq <= self.to) {
                self.send_event(record).await?;
                next = record.seq + 1;
            }
            if page.last().is_some_and(|r| r.seq >= self.to) {
                break;
            }
        }
        // Nothing to replay: the greeting has not gone yet.
        self.greet(self.from, false).await?;
        Ok(next.max(self.from))
    }
}

enum ReplayError {
    Closed,
    Store(crate::store::StoreError),
}

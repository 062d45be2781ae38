//! A replay: one attachment's cursor catching up with its conversation's log.
//! It sends `attached` (first, when it is the attach's own replay), then the
//! events `from..=to`, from a snapshot of the replay buffer when the buffer
//! holds them and from the store otherwise, at the pace the socket drains,
//! then tells the conversation where it stopped. The conversation decides
//! whether the attachment is live or needs another round. A compact replay
//! (protocol §11) leaves out the `text_delta`s of finished turns.

use std::sync::Arc;

use axum::extract::ws::Utf8Bytes;
use ractor::ActorRef;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::connection::ConnectionHandle;
use super::conversation::ConversationMsg;
use super::outbound::close_code;
use crate::event::EventRecord;
use crate::protocol::{ErrorCode, ServerFrame};
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
        match serde_json::from_str::<TurnRef>(&record.data) {
            Ok(delta) => self.running_turn.as_deref() != Some(delta.turn_id),
            // Unreadable: sent, never silently dropped.
            Err(_) => false,
        }
    }
}

/// One replay: sends `attached` (if any), then the events `from..=to` from
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
    pub attached: Option<ServerFrame>,
    /// A compact replay (the attach's own, never a later catch-up).
    pub compact: Option<Compact>,
}

impl Replay {
    pub async fn run(self) {
        let outcome = tokio::select! {
            _ = self.cancel.cancelled() => return,
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

    async fn send_attached(
        &self,
        attached: &Option<ServerFrame>,
        replay_from: u64,
        incomplete: bool,
    ) -> Result<(), ReplayError> {
        let Some(mut frame) = attached.clone() else {
            return Ok(());
        };
        if let ServerFrame::Attached {
            replay_from: from,
            replay_incomplete,
            ..
        } = &mut frame
        {
            *from = replay_from;
            *replay_incomplete = incomplete;
        }
        self.send(Utf8Bytes::from(frame.to_json())).await
    }

    async fn replay(&self) -> Result<u64, ReplayError> {
        let mut next = self.from;
        if let Some(records) = &self.from_buffer {
            let next = next;
            self.send_attached(&self.attached, self.from, false).await?;
            for record in records.iter().filter(|r| r.seq >= next && r.seq <= self.to) {
                self.send_event(record).await?;
            }
            return Ok(self.to + 1);
        }
        let mut announced = self.attached.is_none();
        while next <= self.to {
            let page = self
                .store
                .events(&self.conversation_id, next - 1, REPLAY_PAGE)
                .await
                .map_err(ReplayError::Store)?;
            if !announced {
                // Retention may have deleted the start of the range.
                let first = page.first().map(|r| r.seq).unwrap_or(self.to + 1);
                let replay_from = first.min(self.to + 1).max(next);
                self.send_attached(&self.attached, replay_from, replay_from > next)
                    .await?;
                announced = true;
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
        if !announced {
            self.send_attached(&self.attached, self.from, false).await?;
        }
        Ok(next.max(self.from))
    }
}

enum ReplayError {
    Closed,
    Store(crate::store::StoreError),
}

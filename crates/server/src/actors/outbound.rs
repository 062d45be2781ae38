//! A connection's outbound queue: the bounded channel between everything that
//! sends to one websocket (its connection, conversation actors, replay
//! tasks) and the task that owns the socket's write half. Its bound is
//! `limits.max_outbound_frames`: the most unsent frames held for a connection.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Utf8Bytes;
use tokio_util::sync::CancellationToken;

use crate::protocol::ServerFrame;

/// Close codes linger uses beyond the standard ones.
pub mod close_code {
    pub const GOING_AWAY: u16 = 1001;
    pub const POLICY: u16 = 1008;
    pub const INTERNAL: u16 = 1011;
    pub const TOO_BIG: u16 = 1009;
    pub const SLOW_CONSUMER: u16 = 4008;
}

/// Most replies that may wait for room in one connection's full queue; the
/// queue itself is that much smaller, so the two together stay within
/// `limits.max_outbound_frames`.
pub const MAX_WAITING_REPLIES: usize = 64;

/// Why a frame could not be queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueError {
    /// The connection has `max_outbound_frames` unsent frames.
    Full,
    /// The connection is gone.
    Closed,
}

/// How a connection is asked to close.
#[derive(Debug, Clone)]
pub struct CloseRequest {
    pub code: u16,
    pub reason: &'static str,
    /// Send what is queued before the close frame (shutdown), or drop it
    /// (a slow consumer would never drain it).
    pub drain: bool,
}

/// The sending side; cheap to clone.
#[derive(Clone)]
pub struct Outbound {
    tx: mpsc::Sender<Utf8Bytes>,
    /// Replies waiting for room in a full queue.
    waiting_replies: Arc<AtomicUsize>,
    max_waiting: usize,
    /// How long the client may read nothing while frames wait for it
    /// before it is closed as a slow consumer (`limits.slow_consumer_patience`).
    patience: Duration,
    close: CancellationToken,
    close_request: Arc<Mutex<Option<CloseRequest>>>,
}

/// The receiving side, owned by the socket writer task.
pub struct OutboundReceiver {
    pub rx: mpsc::Receiver<Utf8Bytes>,
    pub close: CancellationToken,
    close_request: Arc<Mutex<Option<CloseRequest>>>,
}

impl OutboundReceiver {
    /// The close asked for; `None` when the queue was closed by the token it
    /// was made with ([`channel_stopped_by`]) or not closed.
    pub fn close_request(&self) -> Option<CloseRequest> {
        self.close_request
            .lock()
            .expect("close request lock poisoned")
            .clone()
    }
}

/// A connection's queue holding at most `limit` unsent frames in all: the
/// bounded channel, plus the replies that may wait for room in it; a client
/// that reads nothing for `patience` while frames wait is closed with 4008.
pub fn channel(limit: usize, patience: Duration) -> (Outbound, OutboundReceiver) {
    with_close(limit, patience, CancellationToken::new())
}

/// [`channel`], closed also when `stop` is cancelled (the server's shutdown
/// of its sockets), with no [`CloseRequest`]. One token to watch instead of
/// two: the socket's writer polls it at every frame, and the shutdown
/// token is shared by every connection (each poll takes its locks).
pub fn channel_stopped_by(
    limit: usize,
    patience: Duration,
    stop: &CancellationToken,
) -> (Outbound, OutboundReceiver) {
    with_close(limit, patience, stop.child_token())
}

fn with_close(
    limit: usize,
    patience: Duration,
    close: CancellationToken,
) -> (Outbound, OutboundReceiver) {
    let max_waiting = (limit / 4).clamp(1, MAX_WAITING_REPLIES);
    let (tx, rx) = mpsc::channel(limit.saturating_sub(max_waiting).max(1));
    let close_request = Arc::new(Mutex::new(None));
    (
        Outbound {
            tx,
            waiting_replies: Arc::new(AtomicUsize::new(0)),
            max_waiting,
            patience,
            close: close.clone(),
            close_request: close_request.clone(),
        },
        OutboundReceiver {
            rx,
            close,
            close_request,
        },
    )
}

impl Outbound {
    /// Queues a frame without waiting.
    pub fn try_send(&self, frame: Utf8Bytes) -> Result<(), QueueError> {
        self.tx.try_send(frame).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => QueueError::Full,
            mpsc::error::TrySendError::Closed(_) => QueueError::Closed,
        })
    }

    /// Queues an unsequenced reply. A reply cannot be replayed later, so
    /// when the queue is momentarily full (a burst of events ahead of it)
    /// it waits for room in a task, like a replay does; only a client with
    /// its share of replies (at most [`MAX_WAITING_REPLIES`]) already waiting
    /// is closed as a slow
    /// consumer, which keeps what one connection can hold bounded.
    pub fn reply(&self, frame: &ServerFrame) {
        let text = Utf8Bytes::from(frame.to_json());
        if self.try_send(text.clone()) != Err(QueueError::Full) {
            return;
        }
        if self.waiting_replies.fetch_add(1, Ordering::AcqRel) >= self.max_waiting {
            self.waiting_replies.fetch_sub(1, Ordering::AcqRel);
            self.close(close_code::SLOW_CONSUMER, "slow consumer", false);
            return;
        }
        let outbound = self.clone();
        tokio::spawn(async move {
            let _ = outbound.send(text).await;
            outbound.waiting_replies.fetch_sub(1, Ordering::AcqRel);
        });
    }

    /// Queues a frame, waiting for room; gives up (and closes the connection
    /// as a slow consumer) when the client reads nothing for the patience.
    pub async fn send(&self, frame: Utf8Bytes) -> Result<(), QueueError> {
        let patience = self.patience;
        tokio::select! {
            _ = self.close.cancelled() => Err(QueueError::Closed),
            sent = tokio::time::timeout(patience, self.tx.send(frame)) => match sent {
                Ok(Ok(())) => Ok(()),
                Ok(Err(_)) => Err(QueueError::Closed),
                Err(_) => {
                    self.close(close_code::SLOW_CONSUMER, "slow consumer", false);
                    Err(QueueError::Closed)
                }
            },
        }
    }

    /// Asks the writer to close the socket; the first request wins.
    pub fn close(&self, code: u16, reason: &'static str, drain: bool) {
        let mut request = self
            .close_request
            .lock()
            .expect("close request lock poisoned");
        if request.is_none() {
            if code == close_code::SLOW_CONSUMER {
                crate::metrics::slow_consumer_closed();
            }
            *request = Some(CloseRequest {
                code,
                reason,
                drain,
            });
        }
        drop(request);
        self.close.cancel();
    }

    pub fn is_closed(&self) -> bool {
        self.close.is_cancelled() || self.tx.is_closed()
    }
}

impl Outbound {
    /// Resolves once a close has been requested.
    pub async fn closed(&self) {
        self.close.cancelled().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Queued frames and waiting replies together never exceed the limit.
    #[tokio::test]
    async fn the_limit_covers_queued_frames_and_waiting_replies() {
        let limit = 40;
        let (out, mut receiver) = channel(limit, Duration::from_secs(30));
        let mut queued = 0;
        while out.try_send(Utf8Bytes::from_static("{}")).is_ok() {
            queued += 1;
        }
        let pong = ServerFrame::Pong { req: None };
        let mut waiting = 0;
        while !out.is_closed() {
            out.reply(&pong);
            waiting += 1;
            tokio::task::yield_now().await;
        }
        // The reply that found no room closed the connection.
        assert!(
            queued + waiting - 1 <= limit,
            "{queued} queued + {waiting} replies"
        );
        assert_eq!(
            receiver.close_request().map(|r| r.code),
            Some(close_code::SLOW_CONSUMER)
        );
        receiver.rx.close();
    }
}

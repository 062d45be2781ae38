//! A connection's outbound queue: the bounded channel between everything that
//! sends to one websocket (its connection actor, conversation actors, replay
//! tasks) and the task that owns the socket's write half. Its bound is
//! `limits.max_outbound_frames`: the most unsent frames held for a connection.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::ws::Utf8Bytes;
use tokio::sync::mpsc;
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
    pub fn close_request(&self) -> Option<CloseRequest> {
        self.close_request
            .lock()
            .expect("close request lock poisoned")
            .clone()
    }
}

pub fn channel(capacity: usize) -> (Outbound, OutboundReceiver) {
    let (tx, rx) = mpsc::channel(capacity);
    let close = CancellationToken::new();
    let close_request = Arc::new(Mutex::new(None));
    (
        Outbound {
            tx,
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

    /// Queues an unsequenced reply; a full queue closes the connection as a
    /// slow consumer, since a reply cannot be replayed later.
    pub fn reply(&self, frame: &ServerFrame) {
        if self.try_send(Utf8Bytes::from(frame.to_json())) == Err(QueueError::Full) {
            self.close(close_code::SLOW_CONSUMER, "slow consumer", false);
        }
    }

    /// Queues a frame, waiting for room; gives up (and closes the connection
    /// as a slow consumer) when the client reads nothing for `patience`.
    pub async fn send(&self, frame: Utf8Bytes, patience: Duration) -> Result<(), QueueError> {
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

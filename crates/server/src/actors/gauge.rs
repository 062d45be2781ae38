//! What the supervisor may read about an active conversation without asking
//! it: its status, how many connections are attached, when it was last
//! active, and for operators (`GET /v1/admin/conversations`) its current
//! turn, queued messages and replay buffer. The conversation actor writes
//! these after each message; readers get a recent value without a round
//! trip, which is all that eviction ordering and listings need.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Instant, SystemTime};

use crate::protocol::Status;

pub struct ConversationGauge {
    status: AtomicU8,
    attached: AtomicUsize,
    /// Microseconds since `epoch()` of the last activity.
    last_activity: AtomicU64,
    queued: AtomicUsize,
    buffer_events: AtomicUsize,
    buffer_bytes: AtomicUsize,
    /// Written twice a turn (start, end), read by operators' listings only.
    turn: Mutex<Option<TurnStamp>>,
}

/// The running turn, as an operator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnStamp {
    pub id: Arc<str>,
    pub started: SystemTime,
}

/// How much an active conversation holds in memory, for operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Holding {
    /// Messages waiting for the running turn to end.
    pub queued: usize,
    /// Events (and their bytes) in the replay buffer.
    pub buffer_events: usize,
    pub buffer_bytes: usize,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn encode(status: Status) -> u8 {
    match status {
        Status::Running => 0,
        Status::Waiting => 1,
        Status::Idle => 2,
        Status::Stopped => 3,
    }
}

fn decode(value: u8) -> Status {
    match value {
        0 => Status::Running,
        1 => Status::Waiting,
        2 => Status::Idle,
        _ => Status::Stopped,
    }
}

impl Default for ConversationGauge {
    fn default() -> Self {
        ConversationGauge {
            status: AtomicU8::new(encode(Status::Idle)),
            attached: AtomicUsize::new(0),
            last_activity: AtomicU64::new(epoch().elapsed().as_micros() as u64),
            queued: AtomicUsize::new(0),
            buffer_events: AtomicUsize::new(0),
            buffer_bytes: AtomicUsize::new(0),
            turn: Mutex::new(None),
        }
    }
}

impl ConversationGauge {
    pub fn publish(&self, status: Status, attached: usize, last_activity: Instant) {
        self.status.store(encode(status), Ordering::Relaxed);
        self.attached.store(attached, Ordering::Relaxed);
        let micros = last_activity.saturating_duration_since(epoch()).as_micros() as u64;
        self.last_activity.store(micros, Ordering::Relaxed);
    }

    pub fn publish_holding(&self, holding: Holding) {
        self.queued.store(holding.queued, Ordering::Relaxed);
        self.buffer_events
            .store(holding.buffer_events, Ordering::Relaxed);
        self.buffer_bytes
            .store(holding.buffer_bytes, Ordering::Relaxed);
    }

    pub fn holding(&self) -> Holding {
        Holding {
            queued: self.queued.load(Ordering::Relaxed),
            buffer_events: self.buffer_events.load(Ordering::Relaxed),
            buffer_bytes: self.buffer_bytes.load(Ordering::Relaxed),
        }
    }

    /// The running turn (None once it ended).
    pub fn set_turn(&self, turn: Option<TurnStamp>) {
        *self.turn.lock().unwrap_or_else(|e| e.into_inner()) = turn;
    }

    pub fn turn(&self) -> Option<TurnStamp> {
        self.turn.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_stopped(&self) {
        self.status
            .store(encode(Status::Stopped), Ordering::Relaxed);
        self.attached.store(0, Ordering::Relaxed);
    }

    pub fn status(&self) -> Status {
        decode(self.status.load(Ordering::Relaxed))
    }

    pub fn attached(&self) -> usize {
        self.attached.load(Ordering::Relaxed)
    }

    /// Monotonic last-activity stamp: larger is more recent.
    pub fn last_activity(&self) -> u64 {
        self.last_activity.load(Ordering::Relaxed)
    }

    /// The last activity as Unix time in microseconds, to compare with
    /// other nodes' (cluster mode).
    pub fn last_activity_unix_us(&self) -> u64 {
        let ago = (epoch().elapsed().as_micros() as u64).saturating_sub(self.last_activity());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        now.saturating_sub(ago)
    }
}

//! What the supervisor may read about an active conversation without asking
//! it: its status, how many connections are attached, and when it was last
//! active. The conversation actor writes these after each message; readers
//! get a recent value without a round trip, which is all that eviction
//! ordering and listings need.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use crate::protocol::Status;

pub struct ConversationGauge {
    status: AtomicU8,
    attached: AtomicUsize,
    /// Microseconds since `epoch()` of the last activity.
    last_activity: AtomicU64,
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

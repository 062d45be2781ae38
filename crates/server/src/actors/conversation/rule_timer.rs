//! A rule timer: the one scheduled message of one lifecycle rule (idle
//! close, detach grace). Each arming gets a new generation, carried by the
//! message, so a message from a timer that was disarmed or re-armed since
//! (already in the mailbox when it was aborted) is recognised and ignored.

use tokio::task::AbortHandle;
use tokio::time::Instant;

/// One rule's timer: disarmed, or armed with a generation.
#[derive(Debug, Default)]
pub(super) struct RuleTimer {
    generations: u64,
    /// Boxed: disarmed most of the time, and every conversation has two.
    armed: Option<Box<Armed>>,
}

#[derive(Debug)]
struct Armed {
    generation: u64,
    abort: AbortHandle,
    /// Since when the rule's condition holds: a re-arm for a new duration
    /// counts from here.
    since: Instant,
}

impl RuleTimer {
    pub(super) fn is_armed(&self) -> bool {
        self.armed.is_some()
    }

    /// Arms the timer, replacing an armed one. `schedule` is given the
    /// generation its message must carry, and returns how to abort it.
    pub(super) fn arm(&mut self, since: Instant, schedule: impl FnOnce(u64) -> AbortHandle) {
        self.disarm();
        self.generations += 1;
        let generation = self.generations;
        self.armed = Some(Box::new(Armed {
            generation,
            abort: schedule(generation),
            since,
        }));
    }

    /// Disarms the timer; returns since when its condition held, if armed.
    pub(super) fn disarm(&mut self) -> Option<Instant> {
        let armed = self.armed.take()?;
        armed.abort.abort();
        Some(armed.since)
    }

    /// A message of this timer arrived. Returns whether it is the armed
    /// timer's (which is then spent); a stale one changes nothing.
    pub(super) fn fire(&mut self, generation: u64) -> bool {
        if self
            .armed
            .as_ref()
            .is_none_or(|armed| armed.generation != generation)
        {
            return false;
        }
        self.armed = None;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scheduled message that never comes on its own.
    fn pending() -> AbortHandle {
        tokio::spawn(std::future::pending::<()>()).abort_handle()
    }

    /// Lets the runtime act on an abort.
    async fn settle(handle: &AbortHandle) {
        for _ in 0..100 {
            if handle.is_finished() {
                return;
            }
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn only_the_armed_generation_fires_and_only_once() {
        let mut timer = RuleTimer::default();
        let mut first = 0;
        timer.arm(Instant::now(), |g| {
            first = g;
            pending()
        });
        let mut second = 0;
        timer.arm(Instant::now(), |g| {
            second = g;
            pending()
        });
        assert_ne!(first, second);
        assert!(!timer.fire(first), "a replaced timer's message is stale");
        assert!(timer.is_armed());
        assert!(timer.fire(second));
        assert!(!timer.is_armed());
        assert!(!timer.fire(second), "a spent timer fires once");
    }

    #[tokio::test]
    async fn disarming_aborts_and_keeps_since() {
        let mut timer = RuleTimer::default();
        assert_eq!(timer.disarm(), None);
        let since = Instant::now();
        let handle = pending();
        let mut generation = 0;
        timer.arm(since, |g| {
            generation = g;
            handle.clone()
        });
        assert_eq!(timer.disarm(), Some(since));
        settle(&handle).await;
        assert!(handle.is_finished(), "the scheduled message was aborted");
        assert!(
            !timer.fire(generation),
            "a disarmed timer's message is stale"
        );
    }

    #[tokio::test]
    async fn re_arming_aborts_the_previous_message() {
        let mut timer = RuleTimer::default();
        let old = pending();
        timer.arm(Instant::now(), |_| old.clone());
        timer.arm(Instant::now(), |_| pending());
        settle(&old).await;
        assert!(old.is_finished());
    }
}

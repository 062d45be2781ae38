//! The agent's events on their way to the conversation actor: a queue the
//! session's runner appends to, and one doorbell message in the actor's
//! mailbox while the queue holds anything. A runner that streams costs the
//! actor one message (and one round of its after-message bookkeeping) per
//! batch of events rather than per event.
//!
//! The queue is bounded by the agent's credits ([`crate::agent::EventSink`]):
//! every event but a runner's last (`emit_now`) holds one until it commits.

use std::sync::{Arc, Mutex, MutexGuard};

use ractor::ActorRef;

use super::ConversationMsg;
use crate::agent::{AgentEvent, EventTarget};

pub(super) struct AgentInbox {
    actor: ActorRef<ConversationMsg>,
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    events: Vec<AgentEvent>,
    /// The conversation stopped: nothing is taken in any more.
    closed: bool,
}

impl AgentInbox {
    pub(super) fn new(actor: ActorRef<ConversationMsg>) -> Arc<AgentInbox> {
        Arc::new(AgentInbox {
            actor,
            queue: Mutex::default(),
        })
    }

    /// Everything delivered since the last take, in order. The doorbell's
    /// handler calls it; the next delivery rings again.
    pub(super) fn take(&self) -> Vec<AgentEvent> {
        std::mem::take(&mut self.lock().events)
    }

    /// The conversation stopped: what is queued is dropped (a stopped
    /// conversation records nothing more) and the runner hears it is gone.
    pub(super) fn close(&self) {
        let mut queue = self.lock();
        queue.closed = true;
        queue.events.clear();
    }

    /// The queue holds plain data and every change to it is a push, a take
    /// or a clear: a panic elsewhere while it was held leaves it whole.
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl EventTarget for AgentInbox {
    fn deliver(&self, event: AgentEvent) -> bool {
        let ring = {
            let mut queue = self.lock();
            if queue.closed {
                return false;
            }
            queue.events.push(event);
            queue.events.len() == 1
        };
        if ring && self.actor.cast(ConversationMsg::AgentEvents).is_err() {
            self.close();
            return false;
        }
        true
    }
}

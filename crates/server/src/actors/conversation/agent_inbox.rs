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
    /// How many the last take took: the next delivery into an empty queue
    /// makes room for as many at once instead of growing from one by
    /// doubling (each step a copy of everything queued).
    /// The room is made on delivery, not on take, so an idle
    /// conversation's inbox holds none.
    last_taken: usize,
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
        let mut queue = self.lock();
        let events = std::mem::take(&mut queue.events);
        queue.last_taken = events.len();
        events
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
            if queue.events.capacity() == 0 {
                let room = queue.last_taken;
                queue.events.reserve(room);
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

#[cfg(test)]
mod tests {
    use ractor::{Actor, ActorProcessingErr};
    use tokio::sync::mpsc;

    use super::*;
    use crate::agent::AgentOutput;

    /// What the stand-in conversation was sent, in mailbox order.
    #[derive(Debug, PartialEq)]
    enum Seen {
        Doorbell,
        Marker,
    }

    /// A conversation actor stand-in that reports the doorbells it gets and
    /// a marker (`CommitSeen`) the test sends after its deliveries: the
    /// mailbox is in order, so what precedes the marker is all that rang.
    struct Probe;

    impl Actor for Probe {
        type Msg = ConversationMsg;
        type State = mpsc::UnboundedSender<Seen>;
        type Arguments = mpsc::UnboundedSender<Seen>;

        async fn pre_start(
            &self,
            _myself: ActorRef<ConversationMsg>,
            seen: mpsc::UnboundedSender<Seen>,
        ) -> Result<mpsc::UnboundedSender<Seen>, ActorProcessingErr> {
            Ok(seen)
        }

        async fn handle(
            &self,
            _myself: ActorRef<ConversationMsg>,
            message: ConversationMsg,
            seen: &mut mpsc::UnboundedSender<Seen>,
        ) -> Result<(), ActorProcessingErr> {
            let _ = seen.send(match message {
                ConversationMsg::AgentEvents => Seen::Doorbell,
                _ => Seen::Marker,
            });
            Ok(())
        }
    }

    fn delta(text: &str) -> AgentEvent {
        AgentEvent {
            turn_id: Arc::from("t_1"),
            output: AgentOutput::TextDelta(text.to_owned()),
            credited: true,
        }
    }

    fn texts(events: Vec<AgentEvent>) -> Vec<String> {
        events
            .into_iter()
            .map(|e| match e.output {
                AgentOutput::TextDelta(text) => text,
                other => panic!("not a delta: {other:?}"),
            })
            .collect()
    }

    /// Sends the marker and returns what the actor saw up to it.
    async fn seen_until_marker(
        actor: &ActorRef<ConversationMsg>,
        rx: &mut mpsc::UnboundedReceiver<Seen>,
    ) -> Vec<Seen> {
        actor
            .cast(ConversationMsg::CommitSeen)
            .expect("probe alive");
        let mut seen = Vec::new();
        loop {
            match rx.recv().await.expect("probe alive") {
                Seen::Marker => return seen,
                doorbell => seen.push(doorbell),
            }
        }
    }

    #[tokio::test]
    async fn a_batch_rings_once_and_the_next_delivery_rings_again() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (actor, _) = Actor::spawn(None, Probe, tx).await.expect("probe");
        let inbox = AgentInbox::new(actor.clone());

        for text in ["a", "b", "c"] {
            assert!(inbox.deliver(delta(text)));
        }
        assert_eq!(seen_until_marker(&actor, &mut rx).await, [Seen::Doorbell]);
        assert_eq!(texts(inbox.take()), ["a", "b", "c"]);

        // Taken: the queue is empty, so the next delivery rings again.
        assert!(inbox.deliver(delta("d")));
        assert_eq!(seen_until_marker(&actor, &mut rx).await, [Seen::Doorbell]);
        assert_eq!(texts(inbox.take()), ["d"]);

        // Closed (the conversation stopped): the runner hears it is gone
        // and nothing rings or stays queued.
        assert!(inbox.deliver(delta("e")));
        inbox.close();
        assert!(!inbox.deliver(delta("f")));
        assert_eq!(seen_until_marker(&actor, &mut rx).await, [Seen::Doorbell]);
        assert!(inbox.take().is_empty());
        actor.stop(None);
    }

    #[tokio::test]
    async fn an_idle_inbox_holds_no_room_and_the_next_batch_gets_the_last_ones() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let (actor, _) = Actor::spawn(None, Probe, tx).await.expect("probe");
        let inbox = AgentInbox::new(actor.clone());
        for _ in 0..100 {
            assert!(inbox.deliver(delta("x")));
        }
        assert_eq!(inbox.take().len(), 100);
        assert_eq!(inbox.lock().events.capacity(), 0, "idle: no room held");

        assert!(inbox.deliver(delta("y")));
        assert!(
            inbox.lock().events.capacity() >= 100,
            "the first delivery makes room for a batch like the last"
        );
        assert_eq!(inbox.take().len(), 1);
        assert!(inbox.deliver(delta("z")));
        assert!(
            inbox.lock().events.capacity() < 100,
            "a small batch shrinks the room made for the next"
        );
        actor.stop(None);
    }

    #[tokio::test]
    async fn a_conversation_gone_refuses_deliveries() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let (actor, handle) = Actor::spawn(None, Probe, tx).await.expect("probe");
        let inbox = AgentInbox::new(actor.clone());
        actor.stop(None);
        handle.await.expect("probe stopped");
        assert!(!inbox.deliver(delta("a")), "the doorbell cannot ring");
        assert!(!inbox.deliver(delta("b")), "and the inbox stays closed");
        assert!(inbox.take().is_empty());
    }
}

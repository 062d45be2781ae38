//! Where the writer's outcomes are handed out: each group's commands are
//! answered (append callbacks called, replies sent) on the async runtime,
//! by one task, in commit order, so that the writer thread only writes.
//!
//! A callback sends its events to the connections' queues, which wakes
//! each connection's task. Woken from the writer, a thread the runtime
//! does not run, each wake went through the runtime's shared queue and
//! often woke a parked worker; from this task they are local wakes. The
//! commands are also freed where they were made. Without a runtime (a
//! store opened outside one, or the runtime gone at shutdown) the writer
//! answers them itself, as before.
//!
//! The queue is unbounded, and bounded all the same: it holds commands the
//! writer took, and each conversation has at most one append in flight.
//! The writer must never wait on it: the last store handle may be dropped
//! by a callback this task runs, and that drop waits for the writer.

use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

use super::writer::{Command, Done};
use super::StoreError;

/// One command and what it produced.
pub(super) type Outcome = (Command, Result<Done, StoreError>);

pub(super) struct Answers {
    to_runtime: Option<UnboundedSender<Vec<Outcome>>>,
}

impl Answers {
    /// Answers on the current runtime if there is one, else on the writer.
    pub(super) fn start() -> Answers {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Answers { to_runtime: None };
        };
        let (tx, mut rx) = unbounded_channel::<Vec<Outcome>>();
        runtime.spawn(async move {
            while let Some(group) = rx.recv().await {
                answer(group);
            }
        });
        Answers {
            to_runtime: Some(tx),
        }
    }

    /// Hands out a group's outcomes, in the group's order.
    pub(super) fn send(&self, group: Vec<Outcome>) {
        let group = match &self.to_runtime {
            Some(tx) => match tx.send(group) {
                Ok(()) => return,
                // The runtime is gone (shutting down): nobody else will.
                Err(returned) => returned.0,
            },
            None => group,
        };
        answer(group);
    }
}

fn answer(group: Vec<Outcome>) {
    for (cmd, result) in group {
        cmd.finish(result);
    }
}

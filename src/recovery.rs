//! Closing conversations whose owner is gone. On start-up (protocol §5.4) a
//! conversation the store still shows as active was cut off by a crash or
//! kill: before serving, close its turn as `interrupted` (if one was running
//! or waiting) and record `agent_stopped restart_recovery`, continuing its
//! seq. This runs before any conversation actor exists, so it is the one
//! writer of those histories. In cluster mode the same closing, with
//! `node_lost`, is what a node does for a conversation whose owner died
//! (protocol §10.4), after claiming it.

use std::sync::Arc;

use tokio::sync::oneshot;
use tracing::info;

use crate::event::{now_rfc3339, EventData, EventRecord, TurnStatus};
use crate::protocol::{Status, StopReason};
use crate::store::{AppendBatch, ConversationMeta, ConversationState, Store, StoreError};

/// Recovers every unfinished conversation; returns how many.
pub async fn recover(store: &Arc<dyn Store>) -> Result<usize, StoreError> {
    let unfinished = store.unfinished().await?;
    let waits: Vec<_> = unfinished
        .iter()
        .map(|meta| close(store, meta, StopReason::RestartRecovery))
        .collect();
    for wait in waits {
        wait.await.map_err(|_| StoreError::Closed)??;
    }
    Ok(unfinished.len())
}

/// Closes one conversation cut off from its owner: `turn_finished
/// interrupted` for a turn that was running or waiting, then
/// `agent_stopped {reason}`, stored as `stopped`. Queued messages stay
/// queued (`last_turn_message_seq` is kept), so the next activation runs
/// them. The receiver answers once the append is committed.
pub fn close(
    store: &Arc<dyn Store>,
    meta: &ConversationMeta,
    reason: StopReason,
) -> oneshot::Receiver<Result<(), StoreError>> {
    let mut seq = meta.head_seq;
    let mut events = Vec::new();
    let interrupted_turn = match meta.status {
        Status::Running | Status::Waiting => meta.current_turn_id.clone(),
        _ => None,
    };
    if let Some(turn_id) = &interrupted_turn {
        seq += 1;
        let why = match reason {
            StopReason::NodeLost => "the node running the turn was lost",
            _ => "the server stopped while the turn was running",
        };
        events.push(Arc::new(EventRecord::new(
            &meta.id,
            seq,
            &EventData::TurnFinished {
                turn_id: turn_id.clone(),
                status: TurnStatus::Interrupted,
                error: Some(why.into()),
            },
        )));
    }
    seq += 1;
    events.push(Arc::new(EventRecord::new(
        &meta.id,
        seq,
        &EventData::AgentStopped { reason },
    )));
    let turn = interrupted_turn.as_deref().unwrap_or("");
    match reason {
        StopReason::NodeLost => info!(conversation = %meta.id, user = %meta.user,
            status = meta.status.as_str(), interrupted_turn = turn, head_seq = seq,
            "closed a conversation of a lost node"),
        _ => info!(conversation = %meta.id, user = %meta.user,
            status = meta.status.as_str(), interrupted_turn = turn, head_seq = seq,
            "recovered conversation after restart"),
    }
    let (tx, rx) = oneshot::channel();
    store.append(
        AppendBatch {
            conversation_id: Arc::from(meta.id.as_str()),
            create: None,
            events,
            state: ConversationState {
                status: Status::Stopped,
                head_seq: seq,
                last_activity_at: now_rfc3339(),
                current_turn_id: None,
                last_turn_message_seq: meta.last_turn_message_seq,
            },
            client_msg_ids: Vec::new(),
        },
        Box::new(move |result| {
            let _ = tx.send(result);
        }),
    );
    rx
}

//! Start-up recovery (protocol §5.4): a conversation the store still shows as
//! active was cut off by a crash or kill. Before serving, close its turn as
//! `interrupted` (if one was running or waiting) and record
//! `agent_stopped restart_recovery`, continuing its seq. This runs before any
//! conversation actor exists, so it is the one writer of those histories.

use std::sync::Arc;

use tokio::sync::oneshot;
use tracing::info;

use crate::event::{now_rfc3339, EventData, EventRecord, TurnStatus};
use crate::protocol::{Status, StopReason};
use crate::store::{AppendBatch, ConversationState, Store, StoreError};

/// Recovers every unfinished conversation; returns how many.
pub async fn recover(store: &Arc<dyn Store>) -> Result<usize, StoreError> {
    let unfinished = store.unfinished().await?;
    let mut waits = Vec::with_capacity(unfinished.len());
    for meta in &unfinished {
        let mut seq = meta.head_seq;
        let mut events = Vec::new();
        let interrupted_turn = match meta.status {
            Status::Running | Status::Waiting => meta.current_turn_id.clone(),
            _ => None,
        };
        if let Some(turn_id) = &interrupted_turn {
            seq += 1;
            events.push(Arc::new(EventRecord::new(
                &meta.id,
                seq,
                &EventData::TurnFinished {
                    turn_id: turn_id.clone(),
                    status: TurnStatus::Interrupted,
                    error: Some("the server stopped while the turn was running".into()),
                },
            )));
        }
        seq += 1;
        events.push(Arc::new(EventRecord::new(
            &meta.id,
            seq,
            &EventData::AgentStopped {
                reason: StopReason::RestartRecovery,
            },
        )));
        info!(conversation = %meta.id, user = %meta.user, status = meta.status.as_str(),
            interrupted_turn = interrupted_turn.as_deref().unwrap_or(""), head_seq = seq,
            "recovered conversation after restart");
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
        waits.push(rx);
    }
    for wait in waits {
        wait.await.map_err(|_| StoreError::Closed)??;
    }
    Ok(unfinished.len())
}

//! Closing conversations whose owner is gone. On start-up (protocol §5.4) a
//! conversation the store still shows as active was cut off by a crash or
//! kill: before serving, close its turn as `interrupted` (if one was running
//! or waiting) and record `agent_stopped restart_recovery`, continuing its
//! seq. This runs before any conversation actor exists, so it is the one
//! writer of those histories. In cluster mode the same closing, with
//! `node_lost`, is what a node does for a conversation whose owner died
//! (protocol §10.4), after claiming it. With `agent.resume_interrupted`,
//! [`interrupted_turn`] finds the turn such a closing ended, to run it again
//! (protocol §11).

use std::sync::Arc;

use tokio::sync::oneshot;
use tracing::info;

use crate::event::{now_rfc3339, EventData, EventRecord, TurnStatus};
use crate::protocol::{Status, StopReason};
use crate::store::{AppendBatch, ConversationMeta, ConversationState, Snapshot, Store, StoreError};

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
                turn_id: turn_id.as_str().into(),
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
                last_activity_at: Some(now_rfc3339()),
                current_turn_id: None,
                last_turn_message_seq: meta.last_turn_message_seq,
            },
            client_msg_ids: Vec::new(),
            forget_client_msg_ids_before: 0,
        },
        Box::new(move |result, _| {
            let _ = tx.send(result);
        }),
    );
    rx
}

/// An interrupted turn to run again (protocol §11).
#[derive(Debug, Clone, PartialEq)]
pub struct InterruptedTurn {
    /// The interrupted turn's id (`resumed_from` of the new one).
    pub turn_id: String,
    /// The user message it answered, and its text.
    pub message_seq: u64,
    pub text: String,
}

/// Events read per page when looking back for a turn's start.
const LOOK_BACK_PAGE: u64 = 512;

/// The conversation's last turn, if it ended `interrupted` and was not
/// itself a resumed turn (a resumed turn is never resumed twice). Looks at
/// the snapshot's tail first, then back through the store page by page, so
/// a long turn is found too.
pub async fn interrupted_turn(
    store: &Arc<dyn Store>,
    snapshot: &Snapshot,
) -> Result<Option<InterruptedTurn>, StoreError> {
    let id = snapshot.meta.id.as_str();
    let mut finished: Option<String> = None;
    let mut page: Vec<Arc<EventRecord>> = snapshot.tail.clone();
    let mut first = page.first().map_or(snapshot.meta.head_seq + 1, |e| e.seq);
    loop {
        for event in page.iter().rev() {
            let data = || serde_json::from_str::<serde_json::Value>(event.data()).ok();
            match &*event.kind {
                "turn_finished" if finished.is_none() => {
                    let Some(d) = data() else { return Ok(None) };
                    if d["status"] != "interrupted" {
                        return Ok(None);
                    }
                    finished = d["turn_id"].as_str().map(str::to_owned);
                }
                "turn_started" => {
                    let Some(d) = data() else { return Ok(None) };
                    let Some(turn_id) = finished.clone() else {
                        // The last turn never finished.
                        return Ok(None);
                    };
                    if d["turn_id"] != turn_id.as_str() {
                        continue;
                    }
                    if !d["resumed_from"].is_null() {
                        return Ok(None);
                    }
                    let Some(message_seq) = d["message_seq"].as_u64() else {
                        return Ok(None);
                    };
                    let message = store.events(id, message_seq.saturating_sub(1), 1).await?;
                    let text = message
                        .first()
                        .filter(|m| m.seq == message_seq && &*m.kind == "user_message")
                        .and_then(|m| serde_json::from_str::<serde_json::Value>(m.data()).ok())
                        .and_then(|d| d["text"].as_str().map(str::to_owned));
                    return Ok(text.map(|text| InterruptedTurn {
                        turn_id,
                        message_seq,
                        text,
                    }));
                }
                _ => {}
            }
        }
        if first <= 1 {
            return Ok(None);
        }
        let after = first.saturating_sub(1 + LOOK_BACK_PAGE);
        page = store
            .events(id, after, (first - 1 - after) as usize)
            .await?;
        match page.first() {
            Some(e) if e.seq < first => first = e.seq,
            // Pruned by retention, or nothing before: not found.
            _ => return Ok(None),
        }
    }
}

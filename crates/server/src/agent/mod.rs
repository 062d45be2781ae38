//! Turn runners. A conversation opens one [`AgentSession`] when it becomes
//! active; the session runs turns in the background and reports what the
//! agent does through an [`EventSink`] to an [`EventTarget`], which the
//! conversation actor implements on its side: this layer does not know the
//! actor's messages. Nothing here ever blocks the conversation: every call
//! returns at once.

pub mod command;
pub mod demo;

use std::path::PathBuf;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde_json::Value;
use tokio::sync::Semaphore;

/// What an agent reports during a turn.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentOutput {
    TextDelta(String),
    AssistantMessage(String),
    /// A tool call the client must answer (`target: "client"`).
    ToolCall {
        call_id: String,
        name: String,
        args: Value,
    },
    /// The turn is over; `failed` carries the error.
    Finished {
        failed: Option<String>,
    },
}

/// One output of one turn; outputs of a turn that is no longer current are
/// dropped by the conversation.
#[derive(Debug, Clone)]
pub struct AgentEvent {
    pub turn_id: Arc<str>,
    pub output: AgentOutput,
    /// Whether the event holds a credit the conversation must return.
    pub credited: bool,
}

/// Where a session's events go: its conversation. Implemented by the
/// conversation actor's side, so that runners depend on this layer only.
pub trait EventTarget: Send + Sync + 'static {
    /// Hands one event over without waiting. Returns false when the
    /// conversation is gone.
    fn deliver(&self, event: AgentEvent) -> bool;
}

/// How a runner reports to its conversation. Each event takes a credit that
/// the conversation returns once the event is committed, so a runner that
/// produces faster than the store commits waits instead of growing the
/// conversation's mailbox without bound.
#[derive(Clone)]
pub struct EventSink {
    conversation: Arc<dyn EventTarget>,
    credits: Arc<Semaphore>,
}

/// How many agent events may be in flight (sent, not yet committed) per
/// conversation.
pub const AGENT_EVENT_CREDITS: usize = 1024;

impl EventSink {
    pub fn new(conversation: Arc<dyn EventTarget>, credits: Arc<Semaphore>) -> EventSink {
        EventSink {
            conversation,
            credits,
        }
    }

    /// Sends one output, waiting for a credit first. Returns false when the
    /// conversation is gone (the runner should stop).
    pub async fn emit(&self, turn_id: &Arc<str>, output: AgentOutput) -> bool {
        match self.credits.acquire().await {
            Ok(permit) => permit.forget(),
            Err(_) => return false,
        }
        self.conversation.deliver(AgentEvent {
            turn_id: turn_id.clone(),
            output,
            credited: true,
        })
    }

    /// Reports without taking a credit: for the one final event a runner's
    /// watchdog sends (a panic or an exit), which must never wait.
    pub fn emit_now(&self, turn_id: &Arc<str>, output: AgentOutput) -> bool {
        self.conversation.deliver(AgentEvent {
            turn_id: turn_id.clone(),
            output,
            credited: false,
        })
    }
}

/// What a session knows about its conversation.
#[derive(Clone)]
pub struct SessionContext {
    pub conversation_id: String,
    pub user: String,
    pub workspace: PathBuf,
    pub events: EventSink,
}

/// Opens sessions: one per active conversation.
pub trait Agent: Send + Sync + 'static {
    fn open(&self, ctx: SessionContext) -> Box<dyn AgentSession>;

    /// Resolves once everything the agent started (processes, tasks) has
    /// ended; a graceful shutdown waits for it, bounded by its grace.
    fn drained(&self) -> BoxFuture<'static, ()> {
        Box::pin(std::future::ready(()))
    }
}

/// One active conversation's runner. All methods return at once.
/// A turn for the agent to work on.
#[derive(Debug, Clone)]
pub struct TurnRequest {
    pub turn_id: Arc<str>,
    /// The user message the turn answers.
    pub text: String,
    /// Protocol §11: the turn re-runs one that was interrupted.
    pub resumed: bool,
}

pub trait AgentSession: Send + 'static {
    /// Starts a turn. The conversation starts one turn at a time.
    fn start_turn(&mut self, turn: TurnRequest);
    /// Hands a client's answer to a pending tool call of the current turn.
    fn tool_result(&mut self, call_id: &str, output: Value, is_error: bool);
    /// Aborts the current turn; the conversation has already recorded it as
    /// ended and ignores anything it still reports.
    fn stop_turn(&mut self);
    /// The conversation stops: release everything (processes, tasks).
    fn close(&mut self);
}

//! The conversation actor: the single writer of one conversation's history.
//! It assigns seq, hands events to the store, and delivers each one to the
//! attached connections once the store has committed it. It owns the turn
//! runner (an [`AgentSession`]), the replay buffer, the attachments, the
//! pending client tool calls, the message queue, and the timers of its own
//! lifecycle rules (detach grace, idle close, turn timeout).
//!
//! Every attachment is a cursor over the log: `Live` attachments are sent
//! each event as it commits; an attachment that is replaying, or whose
//! connection fell behind, is `CatchingUp`, served by a task that reads the
//! buffer or the store at the pace the socket drains and reports back when it
//! reaches the head. Replay and live delivery are the same path.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info};

use super::connection::{ConnId, ConnectionHandle, ConnectionMsg};
use super::gauge::ConversationGauge;
use super::outbound::QueueError;
use super::replay::Replay;
use super::supervisor::SupervisorMsg;
use crate::agent::AGENT_EVENT_CREDITS;
use crate::agent::{Agent, AgentEvent, AgentOutput, AgentSession, EventSink, SessionContext};
use crate::config::Config;
use crate::event::{now_rfc3339, EventData, EventRecord, StartReason, ToolTarget, TurnStatus};
use crate::metrics as m;
use crate::protocol::{ErrorCode, Mode, ReqId, ServerFrame, Status, StopReason};
use crate::store::{
    AppendBatch, ConversationState, NewConversation, QueuedMessage, Snapshot, Store,
};

pub enum ConversationMsg {
    Attach {
        conn: ConnectionHandle,
        mode: Mode,
        last_seq: u64,
        req: Option<ReqId>,
        /// Send `attached` (false for the creator, who gets `created`).
        announce: bool,
    },
    Detach {
        conn: ConnId,
        /// Some for a client's `detach` (answered with `detached client`).
        req: Option<Option<ReqId>>,
    },
    UserMessage {
        conn: ConnId,
        text: String,
        client_msg_id: Option<String>,
        req: Option<ReqId>,
    },
    ToolResult {
        conn: ConnId,
        call_id: String,
        output: Value,
        is_error: bool,
        req: Option<ReqId>,
    },
    StopTurn {
        conn: ConnId,
        req: Option<ReqId>,
    },
    Agent(AgentEvent),
    Committed {
        upto: u64,
        credits: usize,
        result: Result<(), crate::store::StoreError>,
    },
    CaughtUp {
        conn: ConnId,
        generation: u64,
        next_seq: u64,
    },
    TurnTimeout {
        turn_id: Arc<str>,
    },
    DetachGraceOver {
        generation: u64,
    },
    IdleCheck {
        generation: u64,
    },
    /// From the supervisor only: record why, detach everyone, stop.
    Shutdown {
        reason: StopReason,
    },
}

/// How a conversation comes to be active.
pub enum Origin {
    New {
        title: String,
        close_delay: Option<Duration>,
        reason: StartReason,
    },
    Restored {
        snapshot: Box<Snapshot>,
        reason: StartReason,
    },
}

pub struct ConversationArgs {
    pub id: Arc<str>,
    pub user: Arc<str>,
    pub origin: Origin,
    pub config: Arc<Config>,
    pub store: Arc<dyn Store>,
    pub agent: Arc<dyn Agent>,
    pub supervisor: ActorRef<SupervisorMsg>,
    pub gauge: Arc<ConversationGauge>,
    pub workspace: PathBuf,
}

pub struct Conversation;

/// A message scheduled with `send_after`; aborting it cancels the timer.
type Timer = tokio::task::JoinHandle<Result<(), ractor::MessagingErr<ConversationMsg>>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cursor {
    Live,
    CatchingUp,
}

struct Attachment {
    conn: ConnectionHandle,
    mode: Mode,
    cursor: Cursor,
    generation: u64,
    cancel: CancellationToken,
}

struct Turn {
    id: Arc<str>,
    started: Instant,
    pending_calls: Vec<String>,
    timeout: Timer,
}

/// A reply that must wait until the event it names is committed.
struct DeferredReply {
    seq: u64,
    conn: ConnId,
    frame: ServerFrame,
}

pub struct State {
    id: Arc<str>,
    user: Arc<str>,
    config: Arc<Config>,
    store: Arc<dyn Store>,
    supervisor: ActorRef<SupervisorMsg>,
    gauge: Arc<ConversationGauge>,
    session: Box<dyn AgentSession>,
    credits: Arc<Semaphore>,
    close_delay: Duration,

    /// The next seq to assign.
    next_seq: u64,
    /// Every seq up to this one is durable and may be sent.
    committed: u64,
    /// Assigned, not yet handed to the store (flushed at the end of each
    /// handler so one handler's events are one append).
    batch: Vec<Arc<EventRecord>>,
    batch_credits: usize,
    batch_client_ids: Vec<(String, u64)>,
    batch_create: Option<NewConversation>,
    /// Handed to the store, not yet committed, in seq order.
    in_flight: VecDeque<Arc<EventRecord>>,
    /// The last committed events, at most `replay_buffer_events`.
    buffer: VecDeque<Arc<EventRecord>>,
    deferred: VecDeque<DeferredReply>,

    attachments: HashMap<ConnId, Attachment>,
    next_generation: u64,
    turn: Option<Turn>,
    queue: VecDeque<QueuedMessage>,
    seen_msg_ids: HashMap<String, u64>,
    last_turn_message_seq: u64,
    last_activity: Instant,
    last_activity_at: String,

    /// The rule timers: each is (generation, handle) while armed.
    idle_timer: Option<(u64, Timer)>,
    grace_timer: Option<(u64, Timer)>,
    stopping: Option<StopReason>,
}

impl Actor for Conversation {
    type Msg = ConversationMsg;
    type State = State;
    type Arguments = ConversationArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ConversationMsg>,
        args: ConversationArgs,
    ) -> Result<State, ActorProcessingErr> {
        let credits = Arc::new(Semaphore::new(AGENT_EVENT_CREDITS));
        let session = args.agent.open(SessionContext {
            conversation_id: args.id.to_string(),
            user: args.user.to_string(),
            workspace: args.workspace.clone(),
            events: EventSink::new(myself.clone(), credits.clone()),
        });
        let buffer_cap = args.config.conversations.replay_buffer_events;
        let mut state = State {
            id: args.id.clone(),
            user: args.user.clone(),
            close_delay: args.config.conversations.close_delay,
            config: args.config.clone(),
            store: args.store,
            supervisor: args.supervisor,
            gauge: args.gauge,
            session,
            credits,
            next_seq: 1,
            committed: 0,
            batch: Vec::new(),
            batch_credits: 0,
            batch_client_ids: Vec::new(),
            batch_create: None,
            in_flight: VecDeque::new(),
            buffer: VecDeque::with_capacity(buffer_cap.min(4096)),
            deferred: VecDeque::new(),
            attachments: HashMap::new(),
            next_generation: 0,
            turn: None,
            queue: VecDeque::new(),
            seen_msg_ids: HashMap::new(),
            last_turn_message_seq: 0,
            last_activity: Instant::now(),
            last_activity_at: now_rfc3339(),
            idle_timer: None,
            grace_timer: None,
            stopping: None,
        };
        let max_close_delay = args.config.conversations.max_close_delay;
        match args.origin {
            Origin::New {
                title,
                close_delay,
                reason,
            } => {
                if let Some(delay) = close_delay {
                    state.close_delay = delay.min(max_close_delay);
                }
                state.batch_create = Some(NewConversation {
                    user: args.user.to_string(),
                    title: title.clone(),
                    created_at: state.last_activity_at.clone(),
                    close_delay,
                });
                state.append(EventData::ConversationCreated {
                    user: args.user.to_string(),
                    title,
                });
                state.append(EventData::AgentStarted { reason });
            }
            Origin::Restored { snapshot, reason } => {
                let Snapshot {
                    meta,
                    tail,
                    queued,
                    client_msg_ids,
                } = *snapshot;
                if let Some(delay) = meta.close_delay {
                    state.close_delay = delay.min(max_close_delay);
                }
                state.next_seq = meta.head_seq + 1;
                state.committed = meta.head_seq;
                state.buffer.extend(tail);
                state.queue.extend(queued);
                state.seen_msg_ids.extend(client_msg_ids);
                state.last_turn_message_seq = meta.last_turn_message_seq;
                state.append(EventData::AgentStarted { reason });
                state.start_next_turn(&myself);
            }
        }
        state.flush(&myself);
        state.rearm_timers(&myself);
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<ConversationMsg>,
        message: ConversationMsg,
        state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        if state.stopping.is_some() && state.refuse_while_stopping(&message) {
            return Ok(());
        }
        match message {
            ConversationMsg::Attach {
                conn,
                mode,
                last_seq,
                req,
                announce,
            } => state.attach(&myself, conn, mode, last_seq, req, announce),
            ConversationMsg::Detach { conn, req } => state.detach(conn, req),
            ConversationMsg::UserMessage {
                conn,
                text,
                client_msg_id,
                req,
            } => state.user_message(&myself, conn, text, client_msg_id, req),
            ConversationMsg::ToolResult {
                conn,
                call_id,
                output,
                is_error,
                req,
            } => state.tool_result(conn, call_id, output, is_error, req),
            ConversationMsg::StopTurn { conn, req } => {
                if state.check_control(conn, &req) {
                    state.stop_turn(&myself);
                    state.reply_to(
                        conn,
                        &ServerFrame::Ack {
                            req,
                            conversation_id: state.id.to_string(),
                            seq: None,
                            duplicate: None,
                        },
                    );
                }
            }
            ConversationMsg::Agent(event) => state.agent_event(&myself, event),
            ConversationMsg::Committed {
                upto,
                credits,
                result,
            } => {
                if let Err(e) = result {
                    // Nothing of this append was sent to anyone; without a
                    // store the conversation cannot keep its promises.
                    error!(conversation = %state.id, error = %e, "store append failed");
                    return Err(Box::new(e));
                }
                state.credits.add_permits(credits);
                state.on_committed(&myself, upto);
                if state.stopping.is_some() && state.in_flight.is_empty() {
                    state.finish_stop(&myself);
                    return Ok(());
                }
            }
            ConversationMsg::CaughtUp {
                conn,
                generation,
                next_seq,
            } => state.caught_up(&myself, conn, generation, next_seq),
            ConversationMsg::TurnTimeout { turn_id } => {
                if state.turn.as_ref().is_some_and(|t| t.id == turn_id) {
                    let limit = humantime::format_duration(state.config.agent.turn_timeout);
                    info!(conversation = %state.id, user = %state.user, turn = %turn_id,
                        rule = "turn_timeout", timeout = %limit, "turn timed out");
                    state.session.stop_turn();
                    state.end_turn(
                        &myself,
                        TurnStatus::Failed,
                        Some(format!(
                            "the turn timed out after {limit} (agent.turn_timeout)"
                        )),
                    );
                }
            }
            ConversationMsg::DetachGraceOver { generation } => {
                if state
                    .grace_timer
                    .as_ref()
                    .is_some_and(|(g, _)| *g == generation)
                {
                    state.grace_timer = None;
                    if state.turn.is_some() && state.attachments.is_empty() {
                        let grace =
                            humantime::format_duration(state.config.conversations.detach_grace);
                        info!(conversation = %state.id, user = %state.user,
                            rule = "detach_grace", detach_grace = %grace,
                            "turn abandoned: nobody attached");
                        // Queued messages stay queued: they were recorded,
                        // and each of their turns gets its own grace.
                        state.session.stop_turn();
                        state.end_turn(&myself, TurnStatus::Abandoned, None);
                    }
                }
            }
            ConversationMsg::IdleCheck { generation } => {
                if state
                    .idle_timer
                    .as_ref()
                    .is_some_and(|(g, _)| *g == generation)
                {
                    state.idle_timer = None;
                    let idle_for = state.last_activity.elapsed();
                    if state.is_idle_detached() && idle_for >= state.close_delay {
                        let _ = state.supervisor.cast(SupervisorMsg::IdleExpired {
                            id: state.id.clone(),
                            idle_for,
                            close_delay: state.close_delay,
                        });
                    }
                }
            }
            ConversationMsg::Shutdown { reason } => state.begin_stop(&myself, reason),
        }
        if state.stopping.is_none() || !state.batch.is_empty() {
            state.flush(&myself);
        }
        if state.stopping.is_none() {
            state.rearm_timers(&myself);
        }
        state.publish_gauge();
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ConversationMsg>,
        state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        state.session.close();
        for attachment in state.attachments.values() {
            attachment.cancel.cancel();
        }
        state.cancel_timers();
        state.gauge.set_stopped();
        Ok(())
    }
}

impl State {
    /// A stopping conversation records nothing more from clients: answer
    /// them as if it were already gone, so they attach again.
    fn refuse_while_stopping(&self, message: &ConversationMsg) -> bool {
        let (conn, req) = match message {
            ConversationMsg::UserMessage { conn, req, .. }
            | ConversationMsg::ToolResult { conn, req, .. }
            | ConversationMsg::StopTurn { conn, req } => (*conn, req.clone()),
            _ => return false,
        };
        self.reply_to(
            conn,
            &ServerFrame::error(
                req,
                ErrorCode::NotAttached,
                "the conversation is stopping; attach again",
                Some(self.id.to_string()),
            ),
        );
        true
    }

    fn status(&self) -> Status {
        match &self.turn {
            None => Status::Idle,
            Some(turn) if !turn.pending_calls.is_empty() => Status::Waiting,
            Some(_) => Status::Running,
        }
    }

    fn is_idle_detached(&self) -> bool {
        self.turn.is_none() && self.attachments.is_empty() && self.stopping.is_none()
    }

    fn publish_gauge(&self) {
        self.gauge
            .publish(self.status(), self.attachments.len(), self.last_activity);
    }

    /// Assigns the next seq to an event and adds it to the current batch.
    fn append(&mut self, data: EventData) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let record = Arc::new(EventRecord::new(&self.id, seq, &data));
        self.last_activity = Instant::now();
        self.last_activity_at = record.ts.clone();
        self.batch.push(record);
        seq
    }

    /// Hands the batch to the store; the commit comes back as a message.
    fn flush(&mut self, myself: &ActorRef<ConversationMsg>) {
        if self.batch.is_empty() {
            return;
        }
        let events = std::mem::take(&mut self.batch);
        let upto = self.next_seq - 1;
        let credits = std::mem::take(&mut self.batch_credits);
        self.in_flight.extend(events.iter().cloned());
        let status = if self.stopping.is_some() {
            Status::Stopped
        } else {
            self.status()
        };
        let batch = AppendBatch {
            conversation_id: self.id.clone(),
            create: self.batch_create.take(),
            events,
            state: ConversationState {
                status,
                head_seq: upto,
                last_activity_at: self.last_activity_at.clone(),
                current_turn_id: self.turn.as_ref().map(|t| t.id.to_string()),
                last_turn_message_seq: self.last_turn_message_seq,
            },
            client_msg_ids: std::mem::take(&mut self.batch_client_ids),
        };
        let me = myself.clone();
        self.store.append(
            batch,
            Box::new(move |result| {
                let _ = me.cast(ConversationMsg::Committed {
                    upto,
                    credits,
                    result,
                });
            }),
        );
    }

    fn on_committed(&mut self, myself: &ActorRef<ConversationMsg>, upto: u64) {
        let cap = self.config.conversations.replay_buffer_events;
        let mut new_events = Vec::new();
        while self.in_flight.front().is_some_and(|r| r.seq <= upto) {
            if let Some(record) = self.in_flight.pop_front() {
                m::event_appended(&record.kind);
                if self.buffer.len() == cap {
                    self.buffer.pop_front();
                }
                self.buffer.push_back(record.clone());
                new_events.push(record);
            }
        }
        self.committed = self.committed.max(upto);
        let mut fallen_behind = Vec::new();
        let mut gone = Vec::new();
        for (conn_id, attachment) in &self.attachments {
            if attachment.cursor != Cursor::Live {
                continue;
            }
            for record in &new_events {
                match attachment.conn.outbound.try_send(record.frame.clone()) {
                    Ok(()) => {}
                    Err(QueueError::Full) => {
                        fallen_behind.push((*conn_id, record.seq));
                        break;
                    }
                    Err(QueueError::Closed) => {
                        gone.push(*conn_id);
                        break;
                    }
                }
            }
        }
        for conn_id in gone {
            self.remove_attachment(conn_id);
        }
        for (conn_id, from) in fallen_behind {
            debug!(conversation = %self.id, connection = conn_id, from, "connection fell behind; catching up from the log");
            self.spawn_catch_up(myself, conn_id, from, None);
        }
        while self
            .deferred
            .front()
            .is_some_and(|d| d.seq <= self.committed)
        {
            if let Some(reply) = self.deferred.pop_front() {
                self.reply_to(reply.conn, &reply.frame);
            }
        }
    }

    fn reply_to(&self, conn: ConnId, frame: &ServerFrame) {
        if let Some(attachment) = self.attachments.get(&conn) {
            attachment.conn.outbound.reply(frame);
        }
    }

    fn attach(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        conn: ConnectionHandle,
        mode: Mode,
        last_seq: u64,
        req: Option<ReqId>,
        announce: bool,
    ) {
        if self.stopping.is_some() {
            conn.outbound.reply(&ServerFrame::error(
                req,
                ErrorCode::NotFound,
                "the conversation is stopping; attach again",
                Some(self.id.to_string()),
            ));
            let _ = conn.actor.cast(ConnectionMsg::DetachedBy {
                conversation_id: self.id.clone(),
                actor: myself.get_id(),
            });
            return;
        }
        let conn_id = conn.id;
        if let Some(old) = self.attachments.remove(&conn_id) {
            old.cancel.cancel();
        }
        let from = last_seq.min(self.committed) + 1;
        let attached = announce.then(|| ServerFrame::Attached {
            req,
            conversation_id: self.id.to_string(),
            status: self.status(),
            mode,
            head_seq: self.committed,
            replay_from: from,
            replay_incomplete: false,
            pending_calls: self
                .turn
                .as_ref()
                .map(|t| t.pending_calls.clone())
                .unwrap_or_default(),
            queued_messages: self.queue.len(),
        });
        info!(conversation = %self.id, user = %self.user, connection = conn_id,
            attach_user = %conn.user, mode = ?mode, last_seq, head_seq = self.committed, "attached");
        self.attachments.insert(
            conn_id,
            Attachment {
                conn,
                mode,
                cursor: Cursor::CatchingUp,
                generation: 0,
                cancel: CancellationToken::new(),
            },
        );
        self.last_activity = Instant::now();
        // Published before the replay starts, so that anyone who has seen
        // this attachment's frames also sees it counted.
        self.publish_gauge();
        self.spawn_catch_up(myself, conn_id, from, attached);
    }

    /// Starts (or restarts) a replay task for one attachment from `from` up
    /// to the committed head.
    fn spawn_catch_up(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        conn_id: ConnId,
        from: u64,
        attached: Option<ServerFrame>,
    ) {
        self.next_generation += 1;
        let generation = self.next_generation;
        let to = self.committed;
        let in_buffer = from > to || self.buffer.front().is_some_and(|r| r.seq <= from);
        let from_buffer: Option<Vec<Arc<EventRecord>>> = in_buffer.then(|| {
            let start = self.buffer.front().map(|r| r.seq).unwrap_or(from);
            let skip = from.saturating_sub(start) as usize;
            self.buffer.iter().skip(skip).cloned().collect()
        });
        let Some(attachment) = self.attachments.get_mut(&conn_id) else {
            return;
        };
        attachment.cursor = Cursor::CatchingUp;
        attachment.generation = generation;
        if attached.is_some() && from <= to {
            m::replay(if from_buffer.is_some() {
                "buffer"
            } else {
                "store"
            });
        }
        let job = Replay {
            conversation: myself.clone(),
            conversation_id: self.id.clone(),
            store: self.store.clone(),
            conn: attachment.conn.clone(),
            cancel: attachment.cancel.clone(),
            generation,
            from,
            to,
            from_buffer,
            attached,
        };
        tokio::spawn(job.run());
    }

    fn caught_up(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        conn_id: ConnId,
        generation: u64,
        next_seq: u64,
    ) {
        let Some(attachment) = self.attachments.get_mut(&conn_id) else {
            return;
        };
        if attachment.generation != generation {
            return;
        }
        if next_seq > self.committed {
            attachment.cursor = Cursor::Live;
        } else {
            self.spawn_catch_up(myself, conn_id, next_seq, None);
        }
    }

    fn detach(&mut self, conn_id: ConnId, req: Option<Option<ReqId>>) {
        let Some(attachment) = self.remove_attachment(conn_id) else {
            return;
        };
        if let Some(req) = req {
            attachment.conn.outbound.reply(&ServerFrame::Detached {
                req,
                conversation_id: self.id.to_string(),
                reason: crate::protocol::DetachReason::Client,
            });
        }
    }

    fn remove_attachment(&mut self, conn_id: ConnId) -> Option<Attachment> {
        let attachment = self.attachments.remove(&conn_id)?;
        attachment.cancel.cancel();
        self.last_activity = Instant::now();
        info!(conversation = %self.id, user = %self.user, connection = conn_id,
            status = self.status().as_str(), attached = self.attachments.len(), "detached");
        Some(attachment)
    }

    /// Whether `conn` may steer the conversation; answers the error if not.
    fn check_control(&self, conn: ConnId, req: &Option<ReqId>) -> bool {
        match self.attachments.get(&conn) {
            Some(a) if a.mode == Mode::Control => true,
            Some(a) => {
                a.conn.outbound.reply(&ServerFrame::error(
                    req.clone(),
                    ErrorCode::ReadOnly,
                    "attached in observe mode: read only",
                    Some(self.id.to_string()),
                ));
                false
            }
            None => false,
        }
    }

    fn user_message(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        conn: ConnId,
        text: String,
        client_msg_id: Option<String>,
        req: Option<ReqId>,
    ) {
        if !self.check_control(conn, &req) {
            return;
        }
        if let Some(seq) = client_msg_id
            .as_ref()
            .and_then(|id| self.seen_msg_ids.get(id))
        {
            let reply = DeferredReply {
                seq: *seq,
                conn,
                frame: ServerFrame::Ack {
                    req,
                    conversation_id: self.id.to_string(),
                    seq: Some(*seq),
                    duplicate: Some(true),
                },
            };
            self.defer(reply);
            return;
        }
        let max_queued = self.config.conversations.max_queued_messages;
        if self.turn.is_some() && self.queue.len() >= max_queued {
            self.reply_to(
                conn,
                &ServerFrame::error(
                    req,
                    ErrorCode::QueueFull,
                    format!("{max_queued} messages are already queued (conversations.max_queued_messages)"),
                    Some(self.id.to_string()),
                ),
            );
            return;
        }
        let seq = self.append(EventData::UserMessage {
            text: text.clone(),
            client_msg_id: client_msg_id.clone(),
        });
        if let Some(id) = client_msg_id {
            self.seen_msg_ids.insert(id.clone(), seq);
            self.batch_client_ids.push((id, seq));
        }
        self.defer(DeferredReply {
            seq,
            conn,
            frame: ServerFrame::Ack {
                req,
                conversation_id: self.id.to_string(),
                seq: Some(seq),
                duplicate: Some(false),
            },
        });
        self.queue.push_back(QueuedMessage { seq, text });
        self.start_next_turn(myself);
    }

    fn defer(&mut self, reply: DeferredReply) {
        if reply.seq <= self.committed {
            self.reply_to(reply.conn, &reply.frame);
        } else {
            self.deferred.push_back(reply);
        }
    }

    fn start_next_turn(&mut self, myself: &ActorRef<ConversationMsg>) {
        if self.turn.is_some() || self.stopping.is_some() {
            return;
        }
        let Some(message) = self.queue.pop_front() else {
            return;
        };
        let turn_id: Arc<str> = Arc::from(format!("t_{}", ulid::Ulid::new()));
        self.last_turn_message_seq = message.seq;
        self.append(EventData::TurnStarted {
            turn_id: turn_id.to_string(),
            message_seq: message.seq,
        });
        let timeout =
            ractor::time::send_after(self.config.agent.turn_timeout, myself.get_cell(), {
                let turn_id = turn_id.clone();
                move || ConversationMsg::TurnTimeout { turn_id }
            });
        info!(conversation = %self.id, user = %self.user, turn = %turn_id,
            message_seq = message.seq, queued = self.queue.len(), "turn started");
        m::turn_started();
        self.turn = Some(Turn {
            id: turn_id.clone(),
            started: Instant::now(),
            pending_calls: Vec::new(),
            timeout,
        });
        self.session.start_turn(turn_id, message.text);
    }

    fn end_turn(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        status: TurnStatus,
        error: Option<String>,
    ) {
        let Some(turn) = self.turn.take() else {
            return;
        };
        turn.timeout.abort();
        info!(conversation = %self.id, user = %self.user, turn = %turn.id,
            status = status.as_str(), error = error.as_deref().unwrap_or(""), "turn finished");
        m::turn_finished(status);
        m::turn_duration(turn.started.elapsed());
        self.append(EventData::TurnFinished {
            turn_id: turn.id.to_string(),
            status,
            error,
        });
        self.start_next_turn(myself);
    }

    fn stop_turn(&mut self, myself: &ActorRef<ConversationMsg>) {
        if self.turn.is_some() {
            self.session.stop_turn();
            self.end_turn(myself, TurnStatus::Stopped, None);
        }
    }

    fn tool_result(
        &mut self,
        conn: ConnId,
        call_id: String,
        output: Value,
        is_error: bool,
        req: Option<ReqId>,
    ) {
        if !self.check_control(conn, &req) {
            return;
        }
        let pending = self.turn.as_mut().and_then(|t| {
            let index = t.pending_calls.iter().position(|c| *c == call_id)?;
            t.pending_calls.remove(index);
            Some(t.id.clone())
        });
        let Some(turn_id) = pending else {
            self.reply_to(
                conn,
                &ServerFrame::error(
                    req,
                    ErrorCode::UnknownCall,
                    format!("no pending client tool call {call_id}"),
                    Some(self.id.to_string()),
                ),
            );
            return;
        };
        let seq = self.append(EventData::ToolResult {
            turn_id: turn_id.to_string(),
            call_id: call_id.clone(),
            output: output.clone(),
            is_error,
        });
        self.session.tool_result(&call_id, output, is_error);
        self.defer(DeferredReply {
            seq,
            conn,
            frame: ServerFrame::Ack {
                req,
                conversation_id: self.id.to_string(),
                seq: Some(seq),
                duplicate: None,
            },
        });
    }

    fn agent_event(&mut self, myself: &ActorRef<ConversationMsg>, event: AgentEvent) {
        let current = self.turn.as_ref().is_some_and(|t| t.id == event.turn_id);
        if !current || self.stopping.is_some() {
            // A stopped turn's runner may still report; its credit is free.
            if event.credited {
                self.credits.add_permits(1);
            }
            return;
        }
        if event.credited {
            self.batch_credits += 1;
        }
        let turn_id = event.turn_id.to_string();
        match event.output {
            AgentOutput::TextDelta(text) => {
                self.append(EventData::TextDelta { turn_id, text });
            }
            AgentOutput::AssistantMessage(text) => {
                self.append(EventData::AssistantMessage { turn_id, text });
            }
            AgentOutput::ToolCall {
                call_id,
                name,
                args,
            } => {
                self.append(EventData::ToolCall {
                    turn_id,
                    call_id: call_id.clone(),
                    name,
                    args,
                    target: ToolTarget::Client,
                });
                if let Some(turn) = self.turn.as_mut() {
                    turn.pending_calls.push(call_id);
                }
            }
            AgentOutput::Finished { failed } => {
                let status = if failed.is_some() {
                    TurnStatus::Failed
                } else {
                    TurnStatus::Completed
                };
                self.end_turn(myself, status, failed);
            }
        }
    }

    /// Ends the turn, records `agent_stopped`, and waits for the commit
    /// before detaching everyone and stopping (`finish_stop`).
    fn begin_stop(&mut self, myself: &ActorRef<ConversationMsg>, reason: StopReason) {
        if self.stopping.is_some() {
            return;
        }
        self.cancel_timers();
        // Set first: ending the turn must not start a queued one. Queued
        // messages stay recorded and run when the conversation comes back.
        self.stopping = Some(reason);
        if self.turn.is_some() {
            self.session.stop_turn();
            let status = if reason == StopReason::Shutdown {
                TurnStatus::Interrupted
            } else {
                TurnStatus::Stopped
            };
            self.end_turn(myself, status, None);
        }
        self.session.close();
        self.append(EventData::AgentStopped { reason });
        self.flush(myself);
    }

    fn finish_stop(&mut self, myself: &ActorRef<ConversationMsg>) {
        let Some(reason) = self.stopping else {
            return;
        };
        let detach_reason = reason.detach_reason();
        for (_, attachment) in self.attachments.drain() {
            attachment.cancel.cancel();
            attachment.conn.outbound.reply(&ServerFrame::Detached {
                req: None,
                conversation_id: self.id.to_string(),
                reason: detach_reason,
            });
            let _ = attachment.conn.actor.cast(ConnectionMsg::DetachedBy {
                conversation_id: self.id.clone(),
                actor: myself.get_id(),
            });
        }
        self.gauge.set_stopped();
        myself.stop(Some(reason.as_str().to_owned()));
    }

    fn cancel_timers(&mut self) {
        if let Some((_, t)) = self.idle_timer.take() {
            t.abort();
        }
        if let Some((_, t)) = self.grace_timer.take() {
            t.abort();
        }
    }

    /// Arms or disarms the detach-grace and idle timers to match the state.
    /// One timer per rule per conversation, owned here: no global scan.
    fn rearm_timers(&mut self, myself: &ActorRef<ConversationMsg>) {
        let detached_turn = self.turn.is_some() && self.attachments.is_empty();
        match (&self.grace_timer, detached_turn) {
            (None, true) => {
                self.next_generation += 1;
                let generation = self.next_generation;
                let handle = ractor::time::send_after(
                    self.config.conversations.detach_grace,
                    myself.get_cell(),
                    move || ConversationMsg::DetachGraceOver { generation },
                );
                self.grace_timer = Some((generation, handle));
            }
            (Some(_), false) => {
                if let Some((_, t)) = self.grace_timer.take() {
                    t.abort();
                }
            }
            _ => {}
        }
        let idle = self.is_idle_detached();
        match (&self.idle_timer, idle) {
            (None, true) => {
                self.next_generation += 1;
                let generation = self.next_generation;
                let wait = self
                    .close_delay
                    .saturating_sub(self.last_activity.elapsed());
                let handle = ractor::time::send_after(wait, myself.get_cell(), move || {
                    ConversationMsg::IdleCheck { generation }
                });
                self.idle_timer = Some((generation, handle));
            }
            (Some(_), false) => {
                if let Some((_, t)) = self.idle_timer.take() {
                    t.abort();
                }
            }
            _ => {}
        }
    }
}

//! The conversation actor: the single writer of one conversation's history.
//! It assigns seq, hands events to the store, and delivers each one to the
//! attached connections once the store has committed it (while a turn
//! runs, the store's commit callback delivers through the actor's fanout). It owns the turn
//! runner (an [`AgentSession`]), the replay buffer, the attachments, the
//! pending client tool calls, the message queue, and the timers of its own
//! lifecycle rules (detach grace, idle close, turn timeout).
//!
//! Every attachment is a cursor over the log: `Live` attachments are sent
//! each event as it commits; an attachment that is replaying, or whose
//! connection fell behind, is `CatchingUp`, served by a task that reads the
//! buffer or the store at the pace the socket drains and reports back when it
//! reaches the head. Replay and live delivery are the same path.

mod agent_inbox;
mod attachments;
mod control;
mod cursor;
mod fanout;
mod history;
mod lifecycle;
mod log;
mod msg_ids;
mod replay_buffer;
mod rule_timer;
mod store_failure;
mod turns;

use agent_inbox::AgentInbox;
use attachments::AttachAsk;
use cursor::{Cursor, Rounds};
use fanout::Fanout;
use log::{DeferredReply, Log};
use msg_ids::MsgIdLedger;
use rule_timer::RuleTimer;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

// The rules' clock is tokio's, so that the timers and the "how long has it
// been quiet" checks agree, also under a paused clock in tests.
use tokio::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::connection::{ConnId, ConnectionHandle};
use super::gauge::{ConversationGauge, Holding, TurnStamp};
use super::replay::{Compact, Replay};
use super::supervision_log::{NewDecision, SupervisionLog};
use super::supervisor::SupervisorMsg;
use crate::agent::AGENT_EVENT_CREDITS;
use crate::agent::{
    Agent, AgentEvent, AgentOutput, AgentSession, EventSink, SessionContext, TurnRequest,
};
use crate::config::LiveConfig;
use crate::event::{now_rfc3339, EventData, StartReason, ToolTarget, TurnStatus};
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
        /// Protocol §11: a compact replay.
        compact: bool,
        req: Option<ReqId>,
        announce: Announce,
    },
    Detach {
        conn: ConnId,
        cause: DetachCause,
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
    /// A client's `close`: the conversation checks the sender's control
    /// rights, then asks the supervisor to stop it.
    Close {
        conn: ConnId,
        req: Option<ReqId>,
    },
    /// The agent reported: its events wait in the [`AgentInbox`].
    AgentEvents,
    Committed {
        upto: u64,
        credits: usize,
        /// The log's epoch the append was made in: the outcome of an
        /// append discarded by a store failure changes nothing.
        epoch: u64,
        result: Result<(), crate::store::StoreError>,
    },
    /// A commit that the live fanout sent, while something waits on it
    /// here (`fanout.rs`): the actor takes it in.
    CommitSeen,
    /// After a store failure: time to see whether writes work again.
    RetryStore,
    /// After a store failure: the committed state, read back to go on from.
    Reloaded(Result<Option<Box<Snapshot>>, crate::store::StoreError>),
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
    /// From the supervisor: the running configuration changed; re-arm the
    /// rule timers with the new values.
    ConfigChanged,
    /// From the supervisor only: record why, detach everyone, stop.
    Shutdown {
        reason: StopReason,
    },
    /// From the supervisor only (cluster mode): this node's lease was
    /// lost; stop without writing and tell everyone `detached moved`.
    Moved,
    /// A remote conversation's own events (cluster mode: the stand-in for
    /// a conversation owned by another node); a local one has none.
    Proxy(crate::cluster::remote::proxy::ProxyEvent),
}

impl ConversationMsg {
    /// For a client request that records an event (`message`,
    /// `tool_result`, `stop`): who sent it, to answer it when it cannot be.
    fn recording_request(&self) -> Option<(ConnId, Option<ReqId>)> {
        match self {
            ConversationMsg::UserMessage { conn, req, .. }
            | ConversationMsg::ToolResult { conn, req, .. }
            | ConversationMsg::StopTurn { conn, req } => Some((*conn, req.clone())),
            _ => None,
        }
    }
}

/// Why an attachment ends on the client's side. In cluster mode it travels
/// as it is from the socket's node to the owner (`cluster/remote/wire.rs`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DetachCause {
    /// The client sent `detach`: it is answered `detached client`, echoing
    /// its `req`.
    Client { req: Option<ReqId> },
    /// The socket went away (or, in cluster mode, its node stopped naming
    /// the route): there is nobody to answer.
    SocketGone,
}

/// The first reply an attaching connection gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announce {
    /// `attached`, for an `attach`.
    Attached,
    /// `created`, for the connection that created the conversation: sent
    /// once the conversation is committed, before its first events.
    Created,
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
        /// Protocol §11: an interrupted turn to run again first.
        resume: Option<crate::recovery::InterruptedTurn>,
    },
}

pub struct ConversationArgs {
    pub id: Arc<str>,
    pub user: Arc<str>,
    pub origin: Origin,
    /// Read at each decision: a reload applies from the next one on.
    pub config: LiveConfig,
    /// Where rule decisions are recorded for operators.
    pub decisions: Arc<SupervisionLog>,
    pub store: Arc<dyn Store>,
    pub agent: Arc<dyn Agent>,
    pub supervisor: ActorRef<SupervisorMsg>,
    pub gauge: Arc<ConversationGauge>,
    pub workspace: PathBuf,
}

pub struct Conversation;

/// Most events one append carries: a burst is cut into appends of this size
/// so that no single store transaction (and what waits on it) grows large.
/// 256 rather than 128: at saturation, fewer appends and callbacks per
/// event (BENCHMARKS.md item 35). Paced output gathers only what comes
/// while one write is in flight, one or two events, far from the cap.
const MAX_BATCH_EVENTS: usize = 256;

/// A message scheduled with `send_after`; aborting it cancels the timer.
type Timer = tokio::task::JoinHandle<Result<(), ractor::MessagingErr<ConversationMsg>>>;

struct Attachment {
    conn: ConnectionHandle,
    mode: Mode,
    cursor: Cursor,
    /// Cancels the replay round serving the cursor; made when a round
    /// starts and dropped when the cursor goes live (an idle live
    /// attachment does not hold one).
    cancel: Option<CancellationToken>,
}

impl Attachment {
    /// Ends the replay round serving the cursor, if one does.
    fn stop_replay(&self) {
        if let Some(cancel) = &self.cancel {
            cancel.cancel();
        }
    }
}

struct Turn {
    id: Arc<str>,
    started: Instant,
    /// The same moment on the wall clock, for operators.
    started_at: std::time::SystemTime,
    pending_calls: Vec<String>,
    timeout: Timer,
}

/// The connection that created the conversation, waiting for its first
/// commit before it is told `created` and attached.
struct PendingCreator {
    conn: ConnectionHandle,
    mode: Mode,
    req: Option<ReqId>,
}

pub struct State {
    id: Arc<str>,
    user: Arc<str>,
    config: LiveConfig,
    decisions: Arc<SupervisionLog>,
    store: Arc<dyn Store>,
    supervisor: ActorRef<SupervisorMsg>,
    gauge: Arc<ConversationGauge>,
    session: Box<dyn AgentSession>,
    /// Where the session's events wait for this actor.
    agent_inbox: Arc<AgentInbox>,
    credits: Arc<Semaphore>,
    /// The close delay given at creation, if any (capped by
    /// `conversations.max_close_delay` when read: [`State::close_delay`]).
    own_close_delay: Option<Duration>,

    /// Seq, the batch, the writes in flight, the committed head, the
    /// replay buffer and the replies waiting for a commit. The batch is
    /// handed to the store after the handler that appended to it when no
    /// write is in flight; otherwise it grows until the write's commit
    /// comes back (or it reaches [`MAX_BATCH_EVENTS`], or the
    /// conversation stops), so that what arrives meanwhile is one append.
    log: Log,

    /// Boxed: the map reserves room for several entries at its first
    /// insert, and most conversations have one attachment or none.
    attachments: HashMap<ConnId, Box<Attachment>>,
    /// While a turn runs: the live attachments' queues, which the store's
    /// commit callback sends to directly (`fanout.rs`).
    fanout: Option<Arc<Fanout>>,
    /// Numbers the attachments' catch-up rounds.
    rounds: Rounds,
    turn: Option<Box<Turn>>,
    queue: VecDeque<QueuedMessage>,
    /// The window of recent `client_msg_id`s (`msg_ids.rs`).
    seen_msg_ids: MsgIdLedger,
    last_turn_message_seq: u64,
    last_activity: Instant,

    /// The rule timers. The grace timer keeps since when nobody watches
    /// the turn, to re-arm it for what is left when `detach_grace` changes.
    idle_timer: RuleTimer,
    grace_timer: RuleTimer,
    stopping: Option<StopReason>,

    /// This and the other fields that are rarely set are boxed: the state
    /// of every idle conversation holds their room otherwise.
    pending_creator: Option<Box<PendingCreator>>,
    /// Why the first commit failed, for a creator whose attach arrives
    /// after the failure (the commit can fail before the creator's attach
    /// reaches the actor): it hears that, not "stopping".
    creation_failed: Option<Box<str>>,
    /// Connections detached by the stop, kept so that requests still in
    /// the mailbox when it stops are answered, not dropped.
    /// A list, not a map: filled once, at the stop, and every
    /// conversation's state holds one.
    departed: Vec<ConnectionHandle>,
    /// Set while the store cannot write: what failed. Requests that need an
    /// append are refused with `store_unavailable` until a retry works.
    store_failure: Option<Box<str>>,
    /// Store failures in a row, for the retry's backoff.
    failed_attempts: u32,
    /// Protocol §11: the interrupted turn the next turn runs again.
    resume: Option<Box<crate::recovery::InterruptedTurn>>,
    /// The turn last written to the gauge (it is written on change only).
    gauge_turn: Option<Arc<str>>,
}

impl Actor for Conversation {
    type Msg = ConversationMsg;
    /// Boxed: ractor keeps the state twice in each actor's memory, once in
    /// the task's future (the slot it was moved out of) and once in the
    /// processing loop's; a box makes both slots a pointer (about 1 KiB less
    /// per active conversation).
    type State = Box<State>;
    type Arguments = ConversationArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ConversationMsg>,
        args: ConversationArgs,
    ) -> Result<Box<State>, ActorProcessingErr> {
        let credits = Arc::new(Semaphore::new(AGENT_EVENT_CREDITS));
        let agent_inbox = AgentInbox::new(myself.clone());
        let session = args.agent.open(SessionContext {
            conversation_id: args.id.to_string(),
            user: args.user.to_string(),
            workspace: args.workspace.clone(),
            events: EventSink::new(agent_inbox.clone(), credits.clone()),
        });
        let mut state = State {
            id: args.id.clone(),
            user: args.user.clone(),
            own_close_delay: None,
            config: args.config.clone(),
            decisions: args.decisions,
            store: args.store,
            supervisor: args.supervisor,
            gauge: args.gauge,
            session,
            agent_inbox,
            credits,
            log: Log::new(args.id.clone()),
            attachments: HashMap::new(),
            fanout: None,
            rounds: Rounds::default(),
            turn: None,
            queue: VecDeque::new(),
            seen_msg_ids: MsgIdLedger::default(),
            last_turn_message_seq: 0,
            last_activity: Instant::now(),
            idle_timer: RuleTimer::default(),
            grace_timer: RuleTimer::default(),
            stopping: None,
            pending_creator: None,
            creation_failed: None,
            departed: Vec::new(),
            store_failure: None,
            failed_attempts: 0,
            resume: None,
            gauge_turn: None,
        };
        match args.origin {
            Origin::New {
                title,
                close_delay,
                reason,
            } => {
                state.own_close_delay = close_delay;
                state.log.create(NewConversation {
                    user: args.user.to_string(),
                    title: title.clone(),
                    created_at: now_rfc3339(),
                    close_delay,
                });
                state.append(EventData::ConversationCreated {
                    user: args.user.to_string(),
                    title,
                });
                state.append(EventData::AgentStarted { reason });
            }
            Origin::Restored {
                snapshot,
                reason,
                resume,
            } => {
                let Snapshot {
                    meta,
                    tail,
                    queued,
                    client_msg_ids,
                } = *snapshot;
                state.own_close_delay = meta.close_delay;
                state.log.reset_to(meta.head_seq, tail);
                if let Some(turn) = resume {
                    // Its message was answered by no turn that finished: it
                    // goes first, before the messages queued after it.
                    state.queue.push_back(QueuedMessage {
                        seq: turn.message_seq,
                        text: turn.text.clone(),
                    });
                    state.resume = Some(Box::new(turn));
                }
                state.queue.extend(queued);
                let window = state.config.get().conversations.client_msg_id_window;
                state.seen_msg_ids = MsgIdLedger::restored(client_msg_ids, window);
                state.last_turn_message_seq = meta.last_turn_message_seq;
                state.close_orphaned_turn(
                    &meta,
                    TurnStatus::Interrupted,
                    "the conversation stopped unexpectedly during this turn",
                );
                state.append(EventData::AgentStarted { reason });
                state.start_next_turn(&myself);
            }
        }
        state.flush(&myself);
        state.rearm_timers(&myself);
        Ok(Box::new(state))
    }

    async fn handle(
        &self,
        myself: ActorRef<ConversationMsg>,
        message: ConversationMsg,
        state: &mut Box<State>,
    ) -> Result<(), ActorProcessingErr> {
        // Before anything reads the log: what the fanout sent is committed.
        state.take_in_commits(&myself);
        if state.refuse_read_only(&message) {
            return Ok(());
        }
        if state.stopping.is_some() && state.refuse_while_stopping(&message) {
            return Ok(());
        }
        if state.store_failure.is_some() && state.refuse_while_store_fails(&message) {
            return Ok(());
        }
        if state.refuse_unattached(&message) {
            return Ok(());
        }
        match message {
            ConversationMsg::Attach {
                conn,
                mode,
                last_seq,
                compact,
                req,
                announce,
            } => state.attach(
                &myself,
                conn,
                AttachAsk {
                    mode,
                    last_seq,
                    compact,
                    req,
                    announce,
                },
            ),
            ConversationMsg::Detach { conn, cause } => state.detach(conn, cause),
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
                state.stop_turn(&myself);
                state.ack_now(conn, req);
            }
            ConversationMsg::Close { conn, req } => state.close(conn, req),
            ConversationMsg::AgentEvents => state.agent_events(&myself),
            ConversationMsg::Committed {
                upto,
                credits,
                epoch,
                result,
            } => {
                state.credits.add_permits(credits);
                if !state.log.is_current(epoch) {
                    // Discarded by an earlier failure: nobody was sent it.
                    return Ok(());
                }
                if let Err(e) = result {
                    if state.on_store_failure(&myself, e) {
                        return Ok(());
                    }
                } else {
                    state.failed_attempts = 0;
                    state.on_committed(&myself, upto);
                    if state.stopping.is_some() && state.log.nothing_in_flight() {
                        state.finish_stop(&myself);
                        return Ok(());
                    }
                }
            }
            // Taken in above; the batch that waited on it goes below.
            ConversationMsg::CommitSeen => {}
            ConversationMsg::RetryStore => state.retry_store(&myself),
            ConversationMsg::Reloaded(result) => {
                if state.on_reloaded(&myself, result) {
                    return Ok(());
                }
            }
            ConversationMsg::CaughtUp {
                conn,
                generation,
                next_seq,
            } => state.caught_up(&myself, conn, generation, next_seq),
            ConversationMsg::TurnTimeout { turn_id } => state.on_turn_timeout(&myself, turn_id),
            ConversationMsg::DetachGraceOver { generation } => {
                state.on_detach_grace_over(&myself, generation)
            }
            ConversationMsg::IdleCheck { generation } => state.on_idle_check(generation),
            ConversationMsg::ConfigChanged => state.reconfigure(&myself),
            ConversationMsg::Shutdown { reason } => state.begin_stop(&myself, reason),
            ConversationMsg::Moved => {
                if state.stopping != Some(StopReason::NodeLost) {
                    state.moved(&myself, "its lease was lost");
                }
                return Ok(());
            }
            ConversationMsg::Proxy(_) => {}
        }
        state.settle_fanout(&myself);
        // One write in flight at a time, unless the batch is full: paced
        // output goes at once, and a burst gathers while the write before
        // it commits (this used to be a `Flush` message sent to itself,
        // one more message per event).
        if state.stopping.is_some()
            || state.log.batch_len() >= MAX_BATCH_EVENTS
            || state.log.nothing_in_flight()
        {
            state.flush(&myself);
        }
        state.wake_on_commit(&myself);
        if state.stopping.is_none() {
            state.rearm_timers(&myself);
        }
        state.publish_gauge();
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ConversationMsg>,
        state: &mut Box<State>,
    ) -> Result<(), ActorProcessingErr> {
        state.session.close();
        state.agent_inbox.close();
        // However it stopped, a write still in flight sends nothing more
        // from here: its connections were (or are being) told it stopped.
        if let Some(fanout) = state.fanout.take() {
            fanout.close();
        }
        for attachment in state.attachments.values() {
            attachment.stop_replay();
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
        let Some((conn, req)) = message.recording_request() else {
            return false;
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

    fn publish_gauge(&mut self) {
        self.gauge.publish(
            self.status(),
            self.attachments.len(),
            self.last_activity.into_std(),
        );
        self.gauge.publish_holding(Holding {
            queued: self.queue.len(),
            buffer_events: self.log.buffer().len(),
            buffer_bytes: self.log.buffer().bytes(),
        });
        let turn = self.turn.as_ref();
        if turn.map(|t| &t.id) != self.gauge_turn.as_ref() {
            self.gauge_turn = turn.map(|t| t.id.clone());
            self.gauge.set_turn(turn.map(|t| TurnStamp {
                id: t.id.clone(),
                started: t.started_at,
            }));
        }
    }

    fn reply_to(&self, conn: ConnId, frame: &ServerFrame) {
        if let Some(attachment) = self.attachments.get(&conn) {
            attachment.conn.outbound.reply(frame);
        } else if let Some(departed) = self.departed.iter().find(|d| d.id == conn) {
            departed.outbound.reply(frame);
        }
    }

    /// Acks a request that recorded nothing.
    fn ack_now(&self, conn: ConnId, req: Option<ReqId>) {
        self.reply_to(
            conn,
            &ServerFrame::Ack {
                req,
                conversation_id: self.id.to_string(),
                seq: None,
                duplicate: None,
            },
        );
    }

    /// Answers a client's frame with an error about this conversation.
    fn refuse(&self, conn: ConnId, req: Option<ReqId>, code: ErrorCode, message: String) {
        self.reply_to(
            conn,
            &ServerFrame::error(req, code, message, Some(self.id.to_string())),
        );
    }

    /// Acks a frame once the event it recorded (`seq`) is committed.
    fn ack_when_committed(
        &mut self,
        conn: ConnId,
        req: Option<ReqId>,
        seq: u64,
        duplicate: Option<bool>,
    ) {
        let frame = ServerFrame::Ack {
            req: req.clone(),
            conversation_id: self.id.to_string(),
            seq: Some(seq),
            duplicate,
        };
        self.defer(DeferredReply {
            seq,
            conn,
            req,
            frame,
        });
    }

    fn defer(&mut self, reply: DeferredReply) {
        if let Some(reply) = self.log.reply_when_committed(reply) {
            self.reply_to(reply.conn, &reply.frame);
        }
    }
}

//! The connection actor: one per websocket. It parses and validates client
//! frames and turns them into messages to the supervisor and conversation
//! actors. Of its attachments it keeps only where to route their frames
//! (the conversation actor per id): the conversation owns the mode and
//! judges control rights. On socket loss it detaches every attachment and
//! stops. It never blocks a conversation: replies and events reach the
//! socket through [`Outbound`].

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::Semaphore;
use tracing::{debug, info};

use super::conversation::{Announce, ConversationMsg, DetachCause};
use super::outbound::Outbound;
use super::supervisor::{
    activation_reply, create_conversation, ActivateError, Activated, SupervisorMsg, CALL_TIMEOUT,
};
use crate::config::{LimitsConfig, LiveConfig};
use crate::event::StartReason;
use crate::protocol::{self, ClientFrame, ErrorCode, Mode, ReqId, ServerFrame};

pub type ConnId = u64;

/// What a conversation needs to reach one connection.
#[derive(Clone)]
pub struct ConnectionHandle {
    pub id: ConnId,
    pub user: Arc<str>,
    pub outbound: Outbound,
    pub actor: ActorRef<ConnectionMsg>,
}

pub enum ConnectionMsg {
    /// A text frame from the socket.
    Text(String),
    /// A binary frame: not part of the protocol.
    Binary,
    /// The conversation detached this connection (stop, close, eviction).
    DetachedBy {
        conversation_id: Arc<str>,
        actor: ractor::ActorId,
    },
    /// The socket is gone.
    SocketClosed,
}

pub struct ConnectionArgs {
    pub id: ConnId,
    pub user: Arc<str>,
    pub outbound: Outbound,
    pub supervisor: ActorRef<SupervisorMsg>,
    /// Read at each frame: a reload applies from the next one on.
    pub config: LiveConfig,
    /// Frames read but not yet handled; the reader takes a permit per frame,
    /// the actor returns it, so a flooding client is slowed by TCP.
    pub inflight: Arc<Semaphore>,
}

pub struct Connection;

/// A limiter of `limits.messages_per_second` with burst
/// `limits.messages_burst`, and the pair it was built from.
fn rate_limiter(limits: &LimitsConfig) -> (DefaultDirectRateLimiter, (u32, u32)) {
    let quota =
        Quota::per_second(NonZeroU32::new(limits.messages_per_second).unwrap_or(NonZeroU32::MIN))
            .allow_burst(NonZeroU32::new(limits.messages_burst).unwrap_or(NonZeroU32::MIN));
    (
        RateLimiter::direct(quota),
        (limits.messages_per_second, limits.messages_burst),
    )
}

pub struct State {
    handle: ConnectionHandle,
    /// `limits.messages_per_second` with burst `limits.messages_burst`.
    limiter: DefaultDirectRateLimiter,
    /// The (rate, burst) the limiter was built with: rebuilt when a reload
    /// changes them.
    limiter_quota: (u32, u32),
    supervisor: ActorRef<SupervisorMsg>,
    config: LiveConfig,
    inflight: Arc<Semaphore>,
    /// The conversation actor each attached conversation's frames go to.
    /// Dropped on `detach`, or when the conversation detaches us
    /// (`DetachedBy`).
    routes: HashMap<Arc<str>, ActorRef<ConversationMsg>>,
}

impl Actor for Connection {
    type Msg = ConnectionMsg;
    type State = State;
    type Arguments = ConnectionArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ConnectionMsg>,
        args: ConnectionArgs,
    ) -> Result<State, ActorProcessingErr> {
        info!(connection = args.id, user = %args.user, "connection opened");
        let config = args.config.get();
        let (limiter, limiter_quota) = rate_limiter(&config.limits);
        Ok(State {
            limiter,
            limiter_quota,
            handle: ConnectionHandle {
                id: args.id,
                user: args.user,
                outbound: args.outbound,
                actor: myself,
            },
            supervisor: args.supervisor,
            config: args.config,
            inflight: args.inflight,
            routes: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<ConnectionMsg>,
        message: ConnectionMsg,
        state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            ConnectionMsg::Text(text) => {
                state.inflight.add_permits(1);
                state.follow_rate_limits();
                match ClientFrame::parse(&text) {
                    Ok(frame) if state.limiter.check().is_err() => {
                        state.reply(&ServerFrame::error(
                            frame.req().cloned(),
                            ErrorCode::RateLimited,
                            format!(
                                "more than {} frames per second (limits.messages_per_second)",
                                state.limiter_quota.0
                            ),
                            frame.conversation_id().map(str::to_owned),
                        ));
                    }
                    Ok(frame) => state.handle_frame(frame).await,
                    Err(e) => state.reply(&ServerFrame::error(
                        e.req,
                        ErrorCode::BadRequest,
                        e.message,
                        e.conversation_id,
                    )),
                }
            }
            ConnectionMsg::Binary => {
                state.inflight.add_permits(1);
                state.reply(&ServerFrame::error(
                    None,
                    ErrorCode::BadRequest,
                    "binary frames are not part of the protocol: send JSON text frames",
                    None,
                ));
            }
            ConnectionMsg::DetachedBy {
                conversation_id,
                actor,
            } => {
                // Only if still attached to that actor, not to a newer
                // activation of the same conversation.
                if state
                    .routes
                    .get(&conversation_id)
                    .is_some_and(|route| route.get_id() == actor)
                {
                    state.routes.remove(&conversation_id);
                }
            }
            ConnectionMsg::SocketClosed => {
                state.detach_all();
                myself.stop(Some("socket closed".into()));
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ConnectionMsg>,
        state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        state.detach_all();
        info!(connection = state.handle.id, user = %state.handle.user, "connection closed");
        Ok(())
    }
}

impl State {
    /// The socket is gone: every conversation lets this connection go.
    fn detach_all(&mut self) {
        for (_, route) in self.routes.drain() {
            let _ = route.cast(ConversationMsg::Detach {
                conn: self.handle.id,
                cause: DetachCause::SocketGone,
            });
        }
    }

    /// A reload changed the rate limits: a fresh limiter (a full bucket)
    /// applies them from this frame on, without closing anything.
    fn follow_rate_limits(&mut self) {
        let config = self.config.get();
        let limits = &config.limits;
        if (limits.messages_per_second, limits.messages_burst) != self.limiter_quota {
            (self.limiter, self.limiter_quota) = rate_limiter(limits);
        }
    }

    fn reply(&self, frame: &ServerFrame) {
        self.handle.outbound.reply(frame);
    }

    fn error(&self, req: Option<ReqId>, code: ErrorCode, message: impl Into<String>, id: &str) {
        self.reply(&ServerFrame::error(req, code, message, Some(id.to_owned())));
    }

    async fn handle_frame(&mut self, frame: ClientFrame) {
        if let Err(e) = protocol::check_limits(&frame) {
            self.reply(&ServerFrame::error(
                frame.req().cloned(),
                ErrorCode::BadRequest,
                e,
                None,
            ));
            return;
        }
        match frame {
            ClientFrame::Ping { req } => self.reply(&ServerFrame::Pong { req }),
            // Create and attach are boxed: ractor keeps each actor's
            // handler future in one allocation for the actor's life, sized
            // by its largest await, and these two (supervisor calls) are
            // far larger than every other path of a connection, and rarer.
            ClientFrame::Create {
                req,
                title,
                close_delay,
            } => Box::pin(self.create(req, title, close_delay)).await,
            ClientFrame::Attach {
                req,
                conversation_id,
                last_seq,
                mode,
                compact,
            } => {
                Box::pin(self.attach(
                    req,
                    conversation_id,
                    last_seq.unwrap_or(0),
                    mode.unwrap_or_default(),
                    compact.unwrap_or(false),
                ))
                .await
            }
            ClientFrame::Detach {
                req,
                conversation_id,
            } => match self.routes.remove(conversation_id.as_str()) {
                Some(route) => {
                    let _ = route.cast(ConversationMsg::Detach {
                        conn: self.handle.id,
                        cause: DetachCause::Client { req },
                    });
                }
                None => self.error(
                    req,
                    ErrorCode::NotAttached,
                    format!("not attached to {conversation_id}"),
                    &conversation_id,
                ),
            },
            ClientFrame::Message {
                req,
                conversation_id,
                text,
                client_msg_id,
            } => {
                let conn = self.handle.id;
                self.steer(req.clone(), &conversation_id, |req| {
                    ConversationMsg::UserMessage {
                        conn,
                        text,
                        client_msg_id,
                        req,
                    }
                });
            }
            ClientFrame::ToolResult {
                req,
                conversation_id,
                call_id,
                output,
                is_error,
            } => {
                let conn = self.handle.id;
                self.steer(req, &conversation_id, |req| ConversationMsg::ToolResult {
                    conn,
                    call_id,
                    output,
                    is_error: is_error.unwrap_or(false),
                    req,
                });
            }
            ClientFrame::Stop {
                req,
                conversation_id,
            } => {
                let conn = self.handle.id;
                self.steer(req, &conversation_id, |req| ConversationMsg::StopTurn {
                    conn,
                    req,
                });
            }
            ClientFrame::Close {
                req,
                conversation_id,
            } => {
                let conn = self.handle.id;
                self.steer(req, &conversation_id, |req| ConversationMsg::Close {
                    conn,
                    req,
                });
            }
        }
    }

    /// Forwards a steering frame to the conversation, which judges the
    /// control rights and replies itself.
    fn steer(
        &mut self,
        req: Option<ReqId>,
        id: &str,
        message: impl FnOnce(Option<ReqId>) -> ConversationMsg,
    ) {
        let Some(route) = self.routes.get(id) else {
            self.error(
                req,
                ErrorCode::NotAttached,
                format!("attach to {id} before sending"),
                id,
            );
            return;
        };
        if route.cast(message(req.clone())).is_err() {
            self.routes.remove(id);
            self.error(
                req,
                ErrorCode::NotAttached,
                format!("{id} has stopped; attach again"),
                id,
            );
        }
    }

    async fn create(
        &mut self,
        req: Option<ReqId>,
        title: Option<String>,
        close_delay: Option<String>,
    ) {
        let close_delay = match protocol::parse_close_delay(close_delay.as_deref()) {
            Ok(d) => d,
            Err(e) => {
                self.reply(&ServerFrame::error(
                    req,
                    ErrorCode::BadRequest,
                    e.to_string(),
                    None,
                ));
                return;
            }
        };
        let result = create_conversation(
            &self.supervisor,
            &self.config.get().store.path,
            self.handle.user.clone(),
            title.unwrap_or_default(),
            close_delay,
            StartReason::Created,
        )
        .await;
        match result {
            // The conversation answers `created` once it is committed.
            Ok(activated) => {
                self.start_attachment(activated, Mode::Control, 0, false, req, Announce::Created)
            }
            Err(e) => self.reply(&ServerFrame::error(req, e.code(), e.to_string(), None)),
        }
    }

    async fn attach(
        &mut self,
        req: Option<ReqId>,
        id: String,
        last_seq: u64,
        mode: Mode,
        compact: bool,
    ) {
        let user = self.handle.user.clone();
        let result = self
            .supervisor
            .call(
                |reply| SupervisorMsg::Activate {
                    id: id.clone(),
                    user,
                    mode,
                    local_only: false,
                    reply,
                },
                Some(CALL_TIMEOUT),
            )
            .await;
        match activation_reply(result) {
            Ok(activated) => {
                self.start_attachment(activated, mode, last_seq, compact, req, Announce::Attached)
            }
            Err(e) => {
                debug!(connection = self.handle.id, conversation = %id, error = %e, "attach refused");
                let message = match &e {
                    ActivateError::NotFound => format!("no conversation {id}"),
                    other => other.to_string(),
                };
                self.error(req, e.code(), message, &id);
            }
        }
    }

    fn start_attachment(
        &mut self,
        activated: Activated,
        mode: Mode,
        last_seq: u64,
        compact: bool,
        req: Option<ReqId>,
        announce: Announce,
    ) {
        let message = ConversationMsg::Attach {
            conn: self.handle.clone(),
            mode,
            last_seq,
            compact,
            req: req.clone(),
            announce,
        };
        if activated.actor.cast(message).is_err() {
            match announce {
                // A new conversation gone before its creator attached: its
                // first write failed (nothing else stops it that early).
                Announce::Created => self.reply(&ServerFrame::error(
                    req,
                    ErrorCode::StoreUnavailable,
                    "the conversation could not be created: its first write failed; retry later",
                    None,
                )),
                Announce::Attached => self.error(
                    req,
                    ErrorCode::NotFound,
                    "the conversation stopped while attaching; attach again",
                    &activated.id,
                ),
            }
            return;
        }
        self.routes.insert(activated.id, activated.actor);
    }
}

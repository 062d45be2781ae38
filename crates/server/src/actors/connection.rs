//! A connection: one per websocket, run by the socket's own task (see
//! `gateway/ws.rs`), which hands it each frame in turn. It parses and
//! validates client frames and turns them into messages to the supervisor
//! and conversation actors. Of its attachments it keeps only where to route
//! their frames (the conversation actor per id, in [`Routes`]): the
//! conversation owns the mode and judges control rights. On socket loss it
//! detaches every attachment. It never blocks a conversation: replies and
//! events reach the socket through [`Outbound`].
//!
//! It is not a ractor actor: it has one source of input (its socket, read
//! one frame at a time) and one message from outside (a conversation
//! letting it go, which only edits [`Routes`]), so a mailbox and an actor
//! cell would add about 6 KiB per open socket and nothing it uses
//! (ARCHITECTURE.md, "Connections").

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use governor::clock::QuantaClock;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use ractor::{ActorId, ActorRef};
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

/// How a conversation tells a connection that it let it go on its own
/// (a stop, a close, an eviction, a failed first write), so that the
/// connection stops routing that conversation's frames to it.
pub trait DetachNotice: Send + Sync {
    /// `conversation` is the actor that let go: a route to a newer
    /// activation of the same conversation is kept.
    fn detached_by(&self, conversation_id: &Arc<str>, conversation: ActorId);
}

/// What a conversation needs to reach one connection.
#[derive(Clone)]
pub struct ConnectionHandle {
    pub id: ConnId,
    pub user: Arc<str>,
    pub outbound: Outbound,
    pub notice: Arc<dyn DetachNotice>,
}

impl ConnectionHandle {
    /// Tells the connection that `conversation` let it go.
    pub fn detached_by(&self, conversation_id: &Arc<str>, conversation: ActorId) {
        self.notice.detached_by(conversation_id, conversation);
    }
}

/// The conversation actor each attached conversation's frames go to,
/// shared by the connection and the conversations it is attached to (which
/// drop their own route when they let it go).
#[derive(Default)]
pub struct Routes(Mutex<HashMap<Arc<str>, ActorRef<ConversationMsg>>>);

impl Routes {
    fn lock(&self) -> MutexGuard<'_, HashMap<Arc<str>, ActorRef<ConversationMsg>>> {
        // A panic while the map was held cannot leave it half-changed: every
        // use is one insert, get or remove.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn get(&self, id: &str) -> Option<ActorRef<ConversationMsg>> {
        self.lock().get(id).cloned()
    }

    fn insert(&self, id: Arc<str>, actor: ActorRef<ConversationMsg>) {
        self.lock().insert(id, actor);
    }

    fn remove(&self, id: &str) -> Option<ActorRef<ConversationMsg>> {
        self.lock().remove(id)
    }

    fn take_all(&self) -> Vec<ActorRef<ConversationMsg>> {
        self.lock().drain().map(|(_, route)| route).collect()
    }
}

impl DetachNotice for Routes {
    fn detached_by(&self, conversation_id: &Arc<str>, conversation: ActorId) {
        let mut routes = self.lock();
        // Only if still attached to that actor, not to a newer activation
        // of the same conversation.
        if routes
            .get(conversation_id)
            .is_some_and(|route| route.get_id() == conversation)
        {
            routes.remove(conversation_id);
        }
    }
}

pub struct ConnectionArgs {
    pub id: ConnId,
    pub user: Arc<str>,
    pub outbound: Outbound,
    pub supervisor: ActorRef<SupervisorMsg>,
    /// Read at each frame: a reload applies from the next one on.
    pub config: LiveConfig,
}

/// A limiter of `limits.messages_per_second` with burst
/// `limits.messages_burst`, and the pair it was built from.
fn rate_limiter(limits: &LimitsConfig) -> (DefaultDirectRateLimiter, (u32, u32)) {
    let quota =
        Quota::per_second(NonZeroU32::new(limits.messages_per_second).unwrap_or(NonZeroU32::MIN))
            .allow_burst(NonZeroU32::new(limits.messages_burst).unwrap_or(NonZeroU32::MIN));
    (
        RateLimiter::direct_with_clock(quota, LIMITER_CLOCK.clone()),
        (limits.messages_per_second, limits.messages_burst),
    )
}

/// The clock every limiter reads, made once: making one probes the CPU's
/// counters (`cpuid`), which was about 14 µs of each connection's set-up
/// (1.6 % of the server's CPU over 10,000 connections and their turns).
static LIMITER_CLOCK: LazyLock<QuantaClock> = LazyLock::new(QuantaClock::default);

/// One websocket's connection. Dropping it (the socket is gone, or its
/// task ended any other way) detaches it from every conversation.
pub struct Connection {
    handle: ConnectionHandle,
    /// `limits.messages_per_second` with burst `limits.messages_burst`.
    limiter: DefaultDirectRateLimiter,
    /// The (rate, burst) the limiter was built with: rebuilt when a reload
    /// changes them.
    limiter_quota: (u32, u32),
    supervisor: ActorRef<SupervisorMsg>,
    config: LiveConfig,
    /// Dropped on `detach`, or when the conversation detaches us.
    routes: Arc<Routes>,
}

impl Connection {
    pub fn open(args: ConnectionArgs) -> Connection {
        info!(connection = args.id, user = %args.user, "connection opened");
        let config = args.config.get();
        let (limiter, limiter_quota) = rate_limiter(&config.limits);
        let routes = Arc::new(Routes::default());
        Connection {
            limiter,
            limiter_quota,
            handle: ConnectionHandle {
                id: args.id,
                user: args.user,
                outbound: args.outbound,
                notice: routes.clone(),
            },
            supervisor: args.supervisor,
            config: args.config,
            routes,
        }
    }

    /// A text frame from the socket.
    pub async fn text(&mut self, text: &str) {
        self.follow_rate_limits();
        match ClientFrame::parse(text) {
            Ok(frame) if self.limiter.check().is_err() => {
                self.reply(&ServerFrame::error(
                    frame.req().cloned(),
                    ErrorCode::RateLimited,
                    format!(
                        "more than {} frames per second (limits.messages_per_second)",
                        self.limiter_quota.0
                    ),
                    frame.conversation_id().map(str::to_owned),
                ));
            }
            Ok(frame) => self.handle_frame(frame).await,
            Err(e) => self.reply(&ServerFrame::error(
                e.req,
                ErrorCode::BadRequest,
                e.message,
                e.conversation_id,
            )),
        }
    }

    /// A binary frame: not part of the protocol.
    pub fn binary(&self) {
        self.reply(&ServerFrame::error(
            None,
            ErrorCode::BadRequest,
            "binary frames are not part of the protocol: send JSON text frames",
            None,
        ));
    }

    /// The socket is gone: every conversation lets this connection go.
    fn detach_all(&self) {
        for route in self.routes.take_all() {
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
            // Create and attach are boxed: the socket's task is one
            // allocation for the connection's life, sized by its largest
            // await, and these two (supervisor calls) are far larger than
            // every other path of a connection, and rarer.
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
            } => match self.routes.remove(&conversation_id) {
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
        // Routed before the conversation can see the attach: it may let
        // this connection go (`detached_by`) as soon as it does.
        self.routes
            .insert(activated.id.clone(), activated.actor.clone());
        if activated.actor.cast(message).is_err() {
            self.routes
                .detached_by(&activated.id, activated.actor.get_id());
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
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.detach_all();
        info!(connection = self.handle.id, user = %self.handle.user, "connection closed");
    }
}

#[cfg(test)]
mod tests {
    use ractor::{Actor, ActorProcessingErr};

    use super::*;

    /// A conversation actor stand-in that ignores what it is sent.
    struct Sink;

    impl Actor for Sink {
        type Msg = ConversationMsg;
        type State = ();
        type Arguments = ();

        async fn pre_start(
            &self,
            _myself: ActorRef<ConversationMsg>,
            _args: (),
        ) -> Result<(), ActorProcessingErr> {
            Ok(())
        }
    }

    /// A stopped activation's late notice leaves the route to the newer
    /// activation of the same conversation; the newer one's notice drops it.
    #[tokio::test]
    async fn a_conversation_lets_go_only_of_its_own_route() {
        let (older, _) = Actor::spawn(None, Sink, ()).await.expect("sink");
        let (newer, _) = Actor::spawn(None, Sink, ()).await.expect("sink");
        let routes = Routes::default();
        let id: Arc<str> = Arc::from("c1");
        routes.insert(id.clone(), newer.clone());

        routes.detached_by(&id, older.get_id());
        let kept = routes.get("c1").map(|route| route.get_id());
        assert_eq!(kept, Some(newer.get_id()));

        routes.detached_by(&id, newer.get_id());
        assert!(routes.get("c1").is_none());
        older.stop(None);
        newer.stop(None);
    }
}

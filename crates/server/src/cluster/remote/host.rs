//! The owner's side of remote attachments: [`Host`] answers attach requests
//! from other nodes, hands their commands to the conversation actors, and
//! publishes each attachment's frames back to the socket's node.
//!
//! Each remote attachment (a *route*) gets what a local connection has: an
//! id from the node's connection counter, a bounded [`Outbound`] (drained
//! by a task that publishes to the route's subject) and a small
//! [`RouteLink`] actor that hears `DetachedBy` from the conversation and
//! ends the route behind the last frame. A route stays known until its
//! end has been published, so that a socket node asking about a route is
//! answered "gone" only once nothing more of it can follow.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_nats::HeaderMap;
use bytes::Bytes;
use futures_util::StreamExt;
use ractor::rpc::CallResult;
use ractor::{ActorId, ActorRef};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::wire::{Alive, AttachReply, AttachRequest, Command, RouteCommand, StopRequest};
use super::{Subjects, COUNTER, KEEPALIVE_EVERY, MOVED, ROUTE_TIMEOUT};
use crate::actors::connection::{ConnId, ConnectionHandle, DetachNotice};
use crate::actors::conversation::{Announce, ConversationMsg, DetachCause};
use crate::actors::outbound::{self, Outbound, OutboundReceiver};
use crate::actors::supervisor::{list_active, ActivateError, SupervisorMsg, CALL_TIMEOUT};
use crate::config::LiveConfig;
use crate::protocol::ErrorCode;

/// Header on a route's last message when the owner closed the connection
/// (a slow consumer, say) rather than detached it: the close code.
pub const CLOSE: &str = "Linger-Close";

/// The close reason of a route ended with a [`MOVED`] header.
const MOVED_REASON: &str = "moved";

struct Route {
    conn: ConnId,
    conversation: ActorRef<ConversationMsg>,
    outbound: Outbound,
    last_heard: Instant,
    /// Commands received in order (the number of the last one).
    commands: u64,
}

type Routes = Arc<Mutex<HashMap<String, Route>>>;

/// Serves this node's conversations to the other nodes.
#[derive(Clone)]
pub struct Host {
    client: async_nats::Client,
    subjects: Subjects,
    node: String,
    supervisor: ActorRef<SupervisorMsg>,
    config: LiveConfig,
    next_connection: Arc<AtomicU64>,
    routes: Routes,
}

impl Host {
    pub fn new(
        client: async_nats::Client,
        subjects: Subjects,
        node: String,
        supervisor: ActorRef<SupervisorMsg>,
        config: LiveConfig,
        next_connection: Arc<AtomicU64>,
    ) -> Host {
        Host {
            client,
            subjects,
            node,
            supervisor,
            config,
            next_connection,
            routes: Arc::default(),
        }
    }

    fn routes(&self) -> std::sync::MutexGuard<'_, HashMap<String, Route>> {
        self.routes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Answers the other nodes until the subscription ends (the NATS
    /// client closed); detaches routes whose socket node went silent.
    pub async fn serve(self) {
        let mut requests = match self
            .client
            .subscribe(self.subjects.node_all(&self.node))
            .await
        {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "cannot serve other nodes: subscribing failed");
                return;
            }
        };
        let mut sweep = tokio::time::interval(KEEPALIVE_EVERY);
        loop {
            tokio::select! {
                message = requests.next() => {
                    let Some(message) = message else { return };
                    self.dispatch(message);
                }
                _ = sweep.tick() => self.sweep(),
            }
        }
    }

    fn dispatch(&self, message: async_nats::Message) {
        let kind = message.subject.rsplit('.').next().unwrap_or("");
        match kind {
            "attach" => {
                let host = self.clone();
                tokio::spawn(async move { host.attach(message).await });
            }
            "cmd" => match serde_json::from_slice::<RouteCommand>(&message.payload) {
                Ok(command) => self.command(command),
                Err(e) => warn!(error = %e, "a malformed command from another node"),
            },
            "alive" => match serde_json::from_slice::<Alive>(&message.payload) {
                Ok(alive) => self.alive(alive),
                Err(e) => warn!(error = %e, "a malformed keepalive from another node"),
            },
            "stop" => {
                let host = self.clone();
                tokio::spawn(async move { host.stop(message).await });
            }
            "list" => {
                let host = self.clone();
                tokio::spawn(async move { host.list(message).await });
            }
            other => debug!(subject = other, "unknown node-to-node subject"),
        }
    }

    async fn respond(&self, message: &async_nats::Message, body: Vec<u8>) {
        if let Some(reply) = &message.reply {
            if let Err(e) = self.client.publish(reply.clone(), body.into()).await {
                debug!(error = %e, "answering another node failed");
            }
        }
    }

    async fn attach(&self, message: async_nats::Message) {
        let reply = match serde_json::from_slice::<AttachRequest>(&message.payload) {
            Ok(request) => self.attach_route(request).await,
            Err(e) => AttachReply::Refused {
                code: ErrorCode::Internal,
                message: format!("a malformed attach from another node: {e}"),
            },
        };
        let body = serde_json::to_vec(&reply).unwrap_or_default();
        self.respond(&message, body).await;
    }

    async fn attach_route(&self, request: AttachRequest) -> AttachReply {
        let user: Arc<str> = Arc::from(request.user.as_str());
        let mode = request.mode;
        let called = self
            .supervisor
            .call(
                |reply| SupervisorMsg::Activate {
                    id: request.conversation.clone(),
                    user: user.clone(),
                    mode,
                    local_only: true,
                    reply,
                },
                Some(CALL_TIMEOUT),
            )
            .await;
        let activated = match called {
            Ok(CallResult::Success(Ok(activated))) => activated,
            Ok(CallResult::Success(Err(ActivateError::Elsewhere))) => return AttachReply::NotHere,
            Ok(CallResult::Success(Err(e))) => {
                return AttachReply::Refused {
                    code: e.code(),
                    message: e.to_string(),
                }
            }
            _ => return AttachReply::NotHere,
        };
        let config = self.config.get();
        let limits = &config.limits;
        let (outbound, receiver) =
            outbound::channel(limits.max_outbound_frames, limits.slow_consumer_patience);
        let subject = self.subjects.route(&request.socket_node, &request.route);
        let link = Arc::new(RouteLink {
            outbound: outbound.clone(),
            ended: AtomicBool::new(false),
        });
        tokio::spawn(pump(
            self.client.clone(),
            subject,
            receiver,
            self.routes.clone(),
            request.route.clone(),
        ));
        let conn = self.next_connection.fetch_add(1, Ordering::Relaxed);
        let handle = ConnectionHandle {
            id: conn,
            user,
            outbound: outbound.clone(),
            notice: link,
        };
        self.routes().insert(
            request.route.clone(),
            Route {
                conn,
                conversation: activated.actor.clone(),
                outbound: outbound.clone(),
                last_heard: Instant::now(),
                commands: 0,
            },
        );
        let attached = activated.actor.cast(ConversationMsg::Attach {
            conn: handle,
            mode,
            last_seq: request.last_seq,
            compact: request.compact,
            req: request.req,
            announce: Announce::Attached,
        });
        if attached.is_err() {
            self.routes().remove(&request.route);
            outbound.close(outbound::close_code::GOING_AWAY, "moved", false);
            return AttachReply::NotHere;
        }
        info!(conversation = %request.conversation, route = %request.route,
            socket_node = %request.socket_node, connection = conn, "remote attachment");
        AttachReply::Attached
    }

    fn command(&self, command: RouteCommand) {
        let gone_socket = matches!(
            command.command,
            Command::Detach {
                cause: DetachCause::SocketGone
            }
        );
        let mut routes = self.routes();
        let Some(route) = routes.get_mut(&command.route) else {
            // Its socket node hears that it is gone at its next `alive`.
            debug!(route = %command.route, "a command for a route that is gone");
            return;
        };
        if command.n != route.commands + 1 {
            let expected = route.commands + 1;
            if let Some(route) = routes.remove(&command.route) {
                drop(routes);
                lost(&command.route, route, expected, command.n);
            }
            return;
        }
        route.commands = command.n;
        let conn = route.conn;
        let message = match command.command {
            Command::Message {
                text,
                client_msg_id,
                req,
            } => ConversationMsg::UserMessage {
                conn,
                text,
                client_msg_id,
                req,
            },
            Command::ToolResult {
                call_id,
                output,
                is_error,
                req,
            } => ConversationMsg::ToolResult {
                conn,
                call_id,
                output,
                is_error,
                req,
            },
            Command::Stop { req } => ConversationMsg::StopTurn { conn, req },
            Command::Close { req } => ConversationMsg::Close { conn, req },
            Command::Detach { cause } => ConversationMsg::Detach { conn, cause },
        };
        let _ = route.conversation.cast(message);
        if let Some(route) = gone_socket.then(|| routes.remove(&command.route)).flatten() {
            // Nobody reads this route any more.
            route
                .outbound
                .close(outbound::close_code::GOING_AWAY, "gone", false);
        }
    }

    async fn stop(&self, message: async_nats::Message) {
        if let Ok(request) = serde_json::from_slice::<StopRequest>(&message.payload) {
            let _ = self
                .supervisor
                .call(
                    |reply| SupervisorMsg::Stop {
                        id: request.conversation.clone(),
                        reason: request.reason.reason(),
                        reply: Some(reply),
                    },
                    Some(CALL_TIMEOUT),
                )
                .await;
        }
        self.respond(&message, b"{}".to_vec()).await;
    }

    /// The conversations this node runs, for another node's admin list.
    /// Unanswered when the supervisor cannot say in time: the asking node
    /// then names this one as not answering, which is the truth.
    async fn list(&self, message: async_nats::Message) {
        match list_active(&self.supervisor).await {
            Ok(list) => match serde_json::to_vec(&list) {
                Ok(body) => self.respond(&message, body).await,
                Err(e) => warn!(error = %e, "the admin list could not be written"),
            },
            Err(e) => debug!(error = %e, "no admin list for another node"),
        }
    }

    /// A socket node's routes: those it still holds are kept; one whose
    /// commands did not all arrive is ended moved; one it believes
    /// attached and this node does not know any more (its end was lost)
    /// is answered moved on its subject.
    fn alive(&self, alive: Alive) {
        let now = Instant::now();
        let mut lost_routes = Vec::new();
        let mut unknown = Vec::new();
        {
            let mut routes = self.routes();
            for mark in alive.routes {
                match routes.get_mut(&mark.route) {
                    Some(route) if mark.commands > route.commands => {
                        let expected = route.commands + 1;
                        if let Some(route) = routes.remove(&mark.route) {
                            lost_routes.push((mark.route, route, expected, mark.commands));
                        }
                    }
                    Some(route) => route.last_heard = now,
                    None if mark.attached => unknown.push(mark.route),
                    None => {}
                }
            }
        }
        for (name, route, expected, sent) in lost_routes {
            lost(&name, route, expected, sent);
        }
        for name in unknown {
            info!(route = %name, socket_node = %alive.node,
                "a remote attachment this node does not have: its client attaches again");
            let client = self.client.clone();
            let subject = self.subjects.route(&alive.node, &name);
            tokio::spawn(async move {
                let mut headers = HeaderMap::new();
                headers.insert(MOVED, "1");
                let _ = client
                    .publish_with_headers(subject, headers, Bytes::new())
                    .await;
            });
        }
    }

    /// Detaches the routes whose socket node stopped naming them.
    fn sweep(&self) {
        let now = Instant::now();
        let mut routes = self.routes();
        let silent: Vec<String> = routes
            .iter()
            .filter(|(_, r)| now.duration_since(r.last_heard) > ROUTE_TIMEOUT)
            .map(|(name, _)| name.clone())
            .collect();
        for name in silent {
            if let Some(route) = routes.remove(&name) {
                info!(route = %name, connection = route.conn,
                    "remote attachment's node went silent: detaching it");
                let _ = route.conversation.cast(ConversationMsg::Detach {
                    conn: route.conn,
                    cause: DetachCause::SocketGone,
                });
                route
                    .outbound
                    .close(outbound::close_code::GOING_AWAY, "gone", false);
            }
        }
    }
}

/// A command of `name` (the `expected`th or a later one, `got`) never
/// arrived: what follows it must not run out of order, so the route ends
/// and its client attaches again (`detached moved`), finding in the
/// replay what was recorded.
fn lost(name: &str, route: Route, expected: u64, got: u64) {
    warn!(route = %name, connection = route.conn, expected, got,
        "a command from another node was lost on the way: the client attaches again");
    let _ = route.conversation.cast(ConversationMsg::Detach {
        conn: route.conn,
        cause: DetachCause::SocketGone,
    });
    route
        .outbound
        .close(outbound::close_code::GOING_AWAY, MOVED_REASON, false);
}

/// Publishes one route's frames in order, numbered; ends the route when
/// the conversation detached it (an empty frame), or its queue was closed
/// (with the close code, and [`MOVED`] when the client is to attach
/// again). The route is forgotten once its end is out.
async fn pump(
    client: async_nats::Client,
    subject: String,
    receiver: OutboundReceiver,
    routes: Routes,
    name: String,
) {
    publish_route(&client, subject, receiver).await;
    routes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&name);
}

async fn publish_route(
    client: &async_nats::Client,
    subject: String,
    mut receiver: OutboundReceiver,
) {
    let mut n: u64 = 0;
    let headers = |n: u64| {
        let mut h = HeaderMap::new();
        h.insert(COUNTER, n.to_string().as_str());
        h
    };
    let close = receiver.close.clone();
    loop {
        let frame = tokio::select! {
            biased;
            frame = receiver.rx.recv() => frame,
            _ = close.cancelled() => None,
        };
        n += 1;
        match frame {
            Some(frame) if !frame.is_empty() => {
                let sent = client
                    .publish_with_headers(subject.clone(), headers(n), Bytes::from(frame))
                    .await;
                if sent.is_err() {
                    return;
                }
            }
            end => {
                let mut h = headers(n);
                if end.is_none() {
                    if let Some(request) = receiver.close_request() {
                        h.insert(CLOSE, request.code.to_string().as_str());
                        if request.reason == MOVED_REASON {
                            h.insert(MOVED, "1");
                        }
                    }
                }
                let _ = client.publish_with_headers(subject, h, Bytes::new()).await;
                return;
            }
        }
    }
}

/// Stands in for the socket's connection on the owner: when the
/// conversation lets the route go, ends it behind the frames already queued
/// (the `detached` frame among them), once.
struct RouteLink {
    outbound: Outbound,
    ended: AtomicBool,
}

impl DetachNotice for RouteLink {
    fn detached_by(&self, _conversation_id: &Arc<str>, _conversation: ActorId) {
        if self.ended.swap(true, Ordering::AcqRel) {
            return;
        }
        let outbound = self.outbound.clone();
        // Behind the frames queued before it, whatever room is left.
        tokio::spawn(async move {
            let _ = outbound
                .send(tokio_tungstenite::tungstenite::Utf8Bytes::from_static(""))
                .await;
        });
    }
}

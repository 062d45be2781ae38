//! The owner's side of remote attachments: [`Host`] answers attach requests
//! from other nodes, hands their commands to the conversation actors, and
//! publishes each attachment's frames back to the socket's node.
//!
//! Each remote attachment (a *route*) gets what a local connection has: an
//! id from the node's connection counter, a bounded [`Outbound`] (drained
//! by a task that publishes to the route's subject) and a small
//! [`RouteLink`] actor that hears `DetachedBy` from the conversation and
//! ends the route behind the last frame.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_nats::HeaderMap;
use bytes::Bytes;
use futures_util::StreamExt;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::wire::{
    detach_cause, Alive, AttachReply, AttachRequest, Command, RouteCommand, StopRequest,
};
use super::{Subjects, COUNTER, KEEPALIVE_EVERY, ROUTE_TIMEOUT};
use crate::actors::connection::{ConnId, ConnectionHandle, ConnectionMsg};
use crate::actors::conversation::{Announce, ConversationMsg, DetachCause};
use crate::actors::outbound::{self, Outbound, OutboundReceiver};
use crate::actors::supervisor::{ActivateError, SupervisorMsg, CALL_TIMEOUT};
use crate::config::LiveConfig;
use crate::protocol::ErrorCode;

/// Header on a route's last message when the owner closed the connection
/// (a slow consumer, say) rather than detached it: the close code.
pub const CLOSE: &str = "Linger-Close";

struct Route {
    conn: ConnId,
    conversation: ActorRef<ConversationMsg>,
    outbound: Outbound,
    last_heard: Instant,
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
                Ok(alive) => {
                    let now = Instant::now();
                    let mut routes = self.routes();
                    for name in alive.routes {
                        if let Some(route) = routes.get_mut(&name) {
                            route.last_heard = now;
                        }
                    }
                }
                Err(e) => warn!(error = %e, "a malformed keepalive from another node"),
            },
            "stop" => {
                let host = self.clone();
                tokio::spawn(async move { host.stop(message).await });
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
        let link = match Actor::spawn(
            None,
            RouteLink,
            (request.route.clone(), self.routes.clone(), outbound.clone()),
        )
        .await
        {
            Ok((link, _)) => link,
            Err(e) => {
                return AttachReply::Refused {
                    code: ErrorCode::Internal,
                    message: e.to_string(),
                }
            }
        };
        tokio::spawn(pump(self.client.clone(), subject, receiver));
        let conn = self.next_connection.fetch_add(1, Ordering::Relaxed);
        let handle = ConnectionHandle {
            id: conn,
            user,
            outbound: outbound.clone(),
            actor: link.clone(),
        };
        self.routes().insert(
            request.route.clone(),
            Route {
                conn,
                conversation: activated.actor.clone(),
                outbound: outbound.clone(),
                last_heard: Instant::now(),
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
            link.stop(None);
            outbound.close(outbound::close_code::GOING_AWAY, "moved", false);
            return AttachReply::NotHere;
        }
        info!(conversation = %request.conversation, route = %request.route,
            socket_node = %request.socket_node, connection = conn, "remote attachment");
        AttachReply::Attached
    }

    fn command(&self, command: RouteCommand) {
        let gone_socket = matches!(command.command, Command::Detach { req: None });
        let mut routes = self.routes();
        let Some(route) = routes.get(&command.route) else {
            debug!(route = %command.route, "a command for a route that is gone");
            return;
        };
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
            Command::Detach { req } => ConversationMsg::Detach {
                conn,
                cause: detach_cause(req),
            },
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

/// Publishes one route's frames in order, numbered; ends the route when
/// the conversation detached it (an empty frame), or its queue was closed
/// (with the close code).
async fn pump(client: async_nats::Client, subject: String, mut receiver: OutboundReceiver) {
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
                    }
                }
                let _ = client.publish_with_headers(subject, h, Bytes::new()).await;
                return;
            }
        }
    }
}

/// Stands in for the socket's connection actor on the owner: when the
/// conversation detaches the route, ends it behind the frames already
/// queued (the `detached` frame among them).
struct RouteLink;

impl Actor for RouteLink {
    type Msg = ConnectionMsg;
    type State = (String, Routes, Outbound);
    type Arguments = (String, Routes, Outbound);

    async fn pre_start(
        &self,
        _myself: ActorRef<ConnectionMsg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        myself: ActorRef<ConnectionMsg>,
        message: ConnectionMsg,
        (route, routes, outbound): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let ConnectionMsg::DetachedBy { .. } = message {
            routes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(route.as_str());
            let outbound = outbound.clone();
            // Behind the frames queued before it, whatever room is left.
            tokio::spawn(async move {
                let _ = outbound
                    .send(axum::extract::ws::Utf8Bytes::from_static(""))
                    .await;
            });
            myself.stop(None);
        }
        Ok(())
    }
}

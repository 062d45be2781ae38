//! The socket's side of remote attachments: [`RemoteConversation`] stands
//! in for a conversation owned by another node. Connection actors send it
//! the `ConversationMsg`s they send a local conversation; it forwards them
//! to the owner and copies each route's frames into the connection's
//! outbound queue, checking that none was lost on the way.
//!
//! Commands are published in order by one task per proxy. Commands for an
//! attachment whose attach has not been answered yet wait for the answer,
//! so the owner never sees a message before the attach that allows it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::Utf8Bytes;
use bytes::Bytes;
use futures_util::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, info};

use super::host::CLOSE;
use super::wire::{
    Alive, AttachReply, AttachRequest, Command, RouteCommand, StopKind, StopRequest,
};
use super::{Subjects, COUNTER, KEEPALIVE_EVERY};
use crate::actors::connection::{ConnId, ConnectionHandle, ConnectionMsg};
use crate::actors::conversation::ConversationMsg;
use crate::actors::outbound::close_code;
use crate::cluster::lease::Leases;
use crate::protocol::{DetachReason, ErrorCode, Mode, ReqId, ServerFrame};

/// How long an attach or stop waits for the owner: it may have to read the
/// conversation, or let a turn end, first.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// What a proxy hears from its own tasks.
pub enum ProxyEvent {
    /// The owner has the attachment: queued commands may go.
    Ready { conn: ConnId, route: String },
    /// A route ended (detached by the owner, refused, lost, or its socket
    /// gone).
    RouteEnded { conn: ConnId, route: String },
    /// Time to name the routes to the owner, and now and then to check
    /// that it still holds the lease.
    Tick,
    /// Who holds the lease now (`None`: nobody).
    Holder(Option<String>),
}

pub struct ProxyArgs {
    pub id: Arc<str>,
    pub owner: String,
    pub node: String,
    pub client: async_nats::Client,
    pub subjects: Subjects,
    pub leases: Leases,
    pub lease_ttl: Duration,
}

pub struct RemoteConversation;

struct Link {
    route: String,
    conn: ConnectionHandle,
    /// Commands waiting for the owner's answer to the attach.
    waiting: Option<Vec<Command>>,
    /// The client detached; the route ends when the owner lets it go.
    detaching: bool,
    task: JoinHandle<()>,
}

pub struct State {
    args: ProxyArgs,
    links: HashMap<ConnId, Link>,
    next_route: u64,
    outgoing: mpsc::UnboundedSender<(String, Bytes)>,
    ticks: u64,
}

impl Actor for RemoteConversation {
    type Msg = ConversationMsg;
    type State = State;
    type Arguments = ProxyArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ConversationMsg>,
        args: ProxyArgs,
    ) -> Result<State, ActorProcessingErr> {
        let (outgoing, mut queue) = mpsc::unbounded_channel::<(String, Bytes)>();
        let client = args.client.clone();
        tokio::spawn(async move {
            while let Some((subject, body)) = queue.recv().await {
                if client.publish(subject, body).await.is_err() {
                    return;
                }
            }
        });
        myself.send_interval(KEEPALIVE_EVERY, || ConversationMsg::Proxy(ProxyEvent::Tick));
        info!(conversation = %args.id, owner = %args.owner, "reaching a conversation through its owner");
        Ok(State {
            args,
            links: HashMap::new(),
            next_route: 0,
            outgoing,
            ticks: 0,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<ConversationMsg>,
        message: ConversationMsg,
        state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            ConversationMsg::Attach {
                conn,
                mode,
                last_seq,
                req,
                ..
            } => state.attach(&myself, conn, mode, last_seq, req),
            ConversationMsg::Detach { conn, req } => {
                let socket_gone = req.is_none();
                state.command(conn, Command::Detach { req });
                if let Some(link) = state.links.get_mut(&conn) {
                    if socket_gone {
                        link.task.abort();
                        state.links.remove(&conn);
                    } else {
                        link.detaching = true;
                    }
                }
            }
            ConversationMsg::UserMessage {
                conn,
                text,
                client_msg_id,
                req,
            } => state.command(
                conn,
                Command::Message {
                    text,
                    client_msg_id,
                    req,
                },
            ),
            ConversationMsg::ToolResult {
                conn,
                call_id,
                output,
                is_error,
                req,
            } => state.command(
                conn,
                Command::ToolResult {
                    call_id,
                    output,
                    is_error,
                    req,
                },
            ),
            ConversationMsg::StopTurn { conn, req } => state.command(conn, Command::Stop { req }),
            ConversationMsg::Shutdown { reason } => {
                state.detach_all(&myself, reason.detach_reason());
            }
            ConversationMsg::Moved => state.detach_all(&myself, DetachReason::Moved),
            ConversationMsg::Proxy(event) => state.event(&myself, event),
            // The rest are a local conversation's own messages.
            _ => {}
        }
        if state.links.is_empty() {
            myself.stop(None);
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ConversationMsg>,
        state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        for (_, link) in state.links.drain() {
            link.task.abort();
        }
        Ok(())
    }
}

impl State {
    fn publish<T: serde::Serialize>(&self, subject: String, body: &T) {
        match serde_json::to_vec(body) {
            Ok(body) => {
                let _ = self.outgoing.send((subject, body.into()));
            }
            Err(e) => debug!(error = %e, "cannot encode a message for another node"),
        }
    }

    fn attach(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        conn: ConnectionHandle,
        mode: Mode,
        last_seq: u64,
        req: Option<ReqId>,
    ) {
        if let Some(old) = self.links.remove(&conn.id) {
            old.task.abort();
            self.send_command(&old.route, Command::Detach { req: None });
        }
        self.next_route += 1;
        let route = format!("{}_{}_{}", self.args.node, conn.id, self.next_route);
        let request = AttachRequest {
            conversation: self.args.id.to_string(),
            socket_node: self.args.node.clone(),
            route: route.clone(),
            user: conn.user.to_string(),
            mode,
            last_seq,
            req,
        };
        let task = tokio::spawn(forward(
            self.args.client.clone(),
            self.args.subjects.clone(),
            self.args.owner.clone(),
            request,
            conn.clone(),
            myself.clone(),
        ));
        self.links.insert(
            conn.id,
            Link {
                route,
                conn,
                waiting: Some(Vec::new()),
                detaching: false,
                task,
            },
        );
    }

    fn send_command(&self, route: &str, command: Command) {
        self.publish(
            self.args.subjects.cmd(&self.args.owner),
            &RouteCommand {
                route: route.to_owned(),
                command,
            },
        );
    }

    fn command(&mut self, conn: ConnId, command: Command) {
        let Some(link) = self.links.get_mut(&conn) else {
            return;
        };
        if link.detaching {
            return;
        }
        match &mut link.waiting {
            Some(waiting) => waiting.push(command),
            None => {
                let route = link.route.clone();
                self.send_command(&route, command);
            }
        }
    }

    fn event(&mut self, myself: &ActorRef<ConversationMsg>, event: ProxyEvent) {
        match event {
            ProxyEvent::Ready { conn, route } => {
                let Some(link) = self.links.get_mut(&conn) else {
                    return;
                };
                if link.route != route {
                    return;
                }
                let waiting = link.waiting.take().unwrap_or_default();
                for command in waiting {
                    self.send_command(&route, command);
                }
            }
            ProxyEvent::RouteEnded { conn, route } => {
                if self.links.get(&conn).is_some_and(|l| l.route == route) {
                    if let Some(link) = self.links.remove(&conn) {
                        if !link.detaching {
                            let _ = link.conn.actor.cast(ConnectionMsg::DetachedBy {
                                conversation_id: self.args.id.clone(),
                                actor: myself.get_id(),
                            });
                        }
                    }
                }
            }
            ProxyEvent::Tick => {
                self.ticks += 1;
                let routes: Vec<String> = self
                    .links
                    .values()
                    .filter(|l| !l.detaching)
                    .map(|l| l.route.clone())
                    .collect();
                self.publish(
                    self.args.subjects.alive(&self.args.owner),
                    &Alive { routes },
                );
                let every = (self.args.lease_ttl / 2)
                    .max(Duration::from_millis(500))
                    .as_millis()
                    .div_ceil(KEEPALIVE_EVERY.as_millis())
                    .max(1) as u64;
                if self.ticks.is_multiple_of(every) {
                    let leases = self.args.leases.clone();
                    let id = self.args.id.clone();
                    let me = myself.clone();
                    tokio::spawn(async move {
                        if let Ok(holder) = leases.holder(&id).await {
                            let _ = me.cast(ConversationMsg::Proxy(ProxyEvent::Holder(
                                holder.map(|h| h.node),
                            )));
                        }
                    });
                }
            }
            ProxyEvent::Holder(holder) => {
                if holder.as_deref() != Some(self.args.owner.as_str()) {
                    info!(conversation = %self.args.id, owner = %self.args.owner,
                        holder = holder.as_deref().unwrap_or("none"),
                        "the owner lost the conversation: its clients here attach again");
                    self.detach_all(myself, DetachReason::Moved);
                }
            }
        }
    }

    /// Tells every client here that it is detached, and forgets them.
    fn detach_all(&mut self, myself: &ActorRef<ConversationMsg>, reason: DetachReason) {
        let links: Vec<Link> = self.links.drain().map(|(_, l)| l).collect();
        for link in links {
            link.task.abort();
            if !link.detaching {
                self.send_command(&link.route, Command::Detach { req: None });
                link.conn.outbound.reply(&ServerFrame::Detached {
                    req: None,
                    conversation_id: self.args.id.to_string(),
                    reason,
                });
                let _ = link.conn.actor.cast(ConnectionMsg::DetachedBy {
                    conversation_id: self.args.id.clone(),
                    actor: myself.get_id(),
                });
            }
        }
    }
}

/// Attaches one connection on the owner and copies the route's frames to
/// it until the route ends.
async fn forward(
    client: async_nats::Client,
    subjects: Subjects,
    owner: String,
    request: AttachRequest,
    conn: ConnectionHandle,
    proxy: ActorRef<ConversationMsg>,
) {
    let route = request.route.clone();
    let conversation = request.conversation.clone();
    let req = request.req.clone();
    run_route(
        &client,
        &subjects,
        &owner,
        request,
        &conn,
        &proxy,
        req,
        &conversation,
    )
    .await;
    let _ = proxy.cast(ConversationMsg::Proxy(ProxyEvent::RouteEnded {
        conn: conn.id,
        route,
    }));
}

#[allow(clippy::too_many_arguments)]
async fn run_route(
    client: &async_nats::Client,
    subjects: &Subjects,
    owner: &str,
    request: AttachRequest,
    conn: &ConnectionHandle,
    proxy: &ActorRef<ConversationMsg>,
    req: Option<ReqId>,
    conversation: &str,
) {
    let refuse = |code: ErrorCode, message: String| {
        conn.outbound.reply(&ServerFrame::error(
            req.clone(),
            code,
            message,
            Some(conversation.to_owned()),
        ));
    };
    let moved = || {
        conn.outbound.reply(&ServerFrame::Detached {
            req: req.clone(),
            conversation_id: conversation.to_owned(),
            reason: DetachReason::Moved,
        });
    };
    let mut frames = match client
        .subscribe(subjects.route(&request.socket_node, &request.route))
        .await
    {
        Ok(s) => s,
        Err(e) => {
            refuse(
                ErrorCode::StoreUnavailable,
                format!("NATS: {e}; retry later"),
            );
            return;
        }
    };
    let body = match serde_json::to_vec(&request) {
        Ok(b) => b,
        Err(e) => {
            refuse(ErrorCode::Internal, e.to_string());
            return;
        }
    };
    let answer = client
        .send_request(
            subjects.attach(owner),
            async_nats::Request::new()
                .payload(body.into())
                .timeout(Some(REQUEST_TIMEOUT)),
        )
        .await;
    let reply = answer
        .ok()
        .and_then(|m| serde_json::from_slice::<AttachReply>(&m.payload).ok());
    match reply {
        Some(AttachReply::Attached) => {}
        Some(AttachReply::Refused { code, message }) => {
            refuse(code, message);
            return;
        }
        // The owner is gone or no longer runs it: attach again, anywhere.
        Some(AttachReply::NotHere) | None => {
            moved();
            return;
        }
    }
    let _ = proxy.cast(ConversationMsg::Proxy(ProxyEvent::Ready {
        conn: conn.id,
        route: request.route.clone(),
    }));
    let mut expected: u64 = 1;
    while let Some(message) = frames.next().await {
        let n = message
            .headers
            .as_ref()
            .and_then(|h| h.get(COUNTER))
            .and_then(|v| v.as_str().parse::<u64>().ok());
        if n != Some(expected) {
            // A frame was lost between the nodes: a gap must never reach
            // the client, so it resumes from what it has.
            info!(conversation, route = %request.route, expected, got = ?n,
                "frames lost between nodes: closing the socket as a slow consumer");
            conn.outbound
                .close(close_code::SLOW_CONSUMER, "slow consumer", false);
            return;
        }
        expected += 1;
        if message.payload.is_empty() {
            let code = message
                .headers
                .as_ref()
                .and_then(|h| h.get(CLOSE))
                .and_then(|v| v.as_str().parse::<u16>().ok());
            if let Some(code) = code {
                let reason = if code == close_code::SLOW_CONSUMER {
                    "slow consumer"
                } else {
                    "closed by the conversation's node"
                };
                conn.outbound.close(code, reason, true);
            }
            return;
        }
        let Ok(frame) = Utf8Bytes::try_from(message.payload) else {
            return;
        };
        if conn.outbound.send(frame).await.is_err() {
            return;
        }
    }
    moved();
}

/// Stops a conversation on its owner (`close`, delete) and waits until it
/// has stopped (or the owner cannot answer).
pub async fn stop_on_owner(
    client: &async_nats::Client,
    subjects: &Subjects,
    owner: &str,
    conversation: &str,
    kind: StopKind,
) {
    let body = serde_json::to_vec(&StopRequest {
        conversation: conversation.to_owned(),
        reason: kind,
    })
    .unwrap_or_default();
    let request = async_nats::Request::new()
        .payload(body.into())
        .timeout(Some(REQUEST_TIMEOUT));
    if let Err(e) = client.send_request(subjects.stop(owner), request).await {
        debug!(conversation, owner, error = %e, "stopping a conversation on its owner failed");
    }
}

//! The socket's side of remote attachments: [`RemoteConversation`] stands
//! in for a conversation owned by another node. Connections send it
//! the `ConversationMsg`s they send a local conversation; it forwards them
//! to the owner and copies each route's frames into the connection's
//! outbound queue, checking that none was lost on the way.
//!
//! Commands are published in order by one task per proxy. Commands for an
//! attachment whose attach has not been answered yet wait for the answer,
//! so the owner never sees a message before the attach that allows it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Utf8Bytes;
use tracing::{debug, info};

use super::host::CLOSE;
use super::owed::{unanswered, Owed};
use super::wire::{
    Alive, AliveRoute, AttachReply, AttachRequest, Command, RouteCommand, StopKind, StopRequest,
};
use super::{Subjects, COUNTER, KEEPALIVE_EVERY, MOVED};
use crate::actors::connection::{ConnId, ConnectionHandle};
use crate::actors::conversation::{ConversationMsg, DetachCause};
use crate::actors::outbound::close_code;
use crate::actors::outbound::Outbound;
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
    /// Requests a route's connection sent before it stopped routing to
    /// this proxy have all been answered: it is forgotten.
    Forget { conn: ConnId },
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
    /// Commands published on the route (the owner checks the count).
    sent: u64,
    /// The client detached; the route ends when the owner lets it go.
    /// Shared with the route's task: the end of a route the client left
    /// closes nothing.
    detaching: Arc<AtomicBool>,
    /// The requests sent that the owner has not answered yet; shared with
    /// the route's task, which answers them if the route ends first.
    owed: Arc<Owed>,
    task: JoinHandle<()>,
}

pub struct State {
    args: ProxyArgs,
    links: HashMap<ConnId, Link>,
    /// Connections whose route ended, until the requests they sent before
    /// they stopped routing here have been answered (`not_attached`): as
    /// the conversation actor's `departed`.
    departed: HashMap<ConnId, Outbound>,
    /// The proxy is done (no client left, the owner lost the conversation,
    /// or this node stops): what is already in the mailbox is answered,
    /// then it stops.
    draining: bool,
    to_owner: ToOwner,
    ticks: u64,
}

/// What the proxy publishes to the owner, in order: one task drains the
/// queue onto the NATS connection.
struct ToOwner {
    queue: mpsc::UnboundedSender<(String, Bytes)>,
    /// `<p>.node.<owner>.cmd`, named once.
    commands: String,
}

impl ToOwner {
    fn publish<T: serde::Serialize>(&self, subject: String, body: &T) {
        match serde_json::to_vec(body) {
            Ok(body) => {
                let _ = self.queue.send((subject, body.into()));
            }
            Err(e) => debug!(error = %e, "cannot encode a message for another node"),
        }
    }

    /// Publishes the route's next command, numbered.
    fn command(&self, link: &mut Link, command: Command) {
        link.sent += 1;
        self.publish(
            self.commands.clone(),
            &RouteCommand {
                route: link.route.clone(),
                n: link.sent,
                command,
            },
        );
    }
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
        let to_owner = ToOwner {
            queue: outgoing,
            commands: args.subjects.cmd(&args.owner),
        };
        Ok(State {
            args,
            links: HashMap::new(),
            departed: HashMap::new(),
            draining: false,
            to_owner,
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
                compact,
                req,
                ..
            } => state.attach(&myself, conn, mode, last_seq, compact, req),
            ConversationMsg::Detach { conn, cause } => {
                let socket_gone = cause == DetachCause::SocketGone;
                state.command(conn, Command::Detach { cause });
                if let Some(link) = state.links.get_mut(&conn) {
                    if socket_gone {
                        link.task.abort();
                        state.links.remove(&conn);
                    } else {
                        link.detaching.store(true, Ordering::Relaxed);
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
            ConversationMsg::Close { conn, req } => state.command(conn, Command::Close { req }),
            ConversationMsg::Shutdown { reason } => {
                state.detach_all(&myself, reason.detach_reason());
            }
            ConversationMsg::Moved => state.detach_all(&myself, DetachReason::Moved),
            ConversationMsg::Proxy(event) => state.event(&myself, event),
            // The rest are a local conversation's own messages.
            _ => {}
        }
        if state.links.is_empty() && state.departed.is_empty() {
            // Drained, not stopped: an attach already in the mailbox is
            // answered (`detached moved`: attach again) rather than dropped.
            state.drain(&myself);
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
    fn attach(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        conn: ConnectionHandle,
        mode: Mode,
        last_seq: u64,
        compact: bool,
        req: Option<ReqId>,
    ) {
        if self.draining {
            // This proxy is done with the conversation: attach again, to
            // whichever node serves it now.
            conn.outbound.reply(&ServerFrame::Detached {
                req,
                conversation_id: self.args.id.to_string(),
                reason: DetachReason::Moved,
            });
            conn.detached_by(&self.args.id, myself.get_id());
            return;
        }
        self.departed.remove(&conn.id);
        if let Some(mut old) = self.links.remove(&conn.id) {
            old.task.abort();
            old.owed.end_answering(&old.conn.outbound, &self.args.id);
            self.to_owner.command(
                &mut old,
                Command::Detach {
                    cause: DetachCause::SocketGone,
                },
            );
        }
        // Never reused, not even by the next proxy for this conversation
        // or by this node's next run: a late frame or end of an earlier
        // route must not land in this one.
        let route = format!("{}_{}", self.args.node, ulid::Ulid::new());
        let request = AttachRequest {
            conversation: self.args.id.to_string(),
            socket_node: self.args.node.clone(),
            route: route.clone(),
            user: conn.user.to_string(),
            mode,
            last_seq,
            compact,
            req,
        };
        let detaching = Arc::new(AtomicBool::new(false));
        let owed = Arc::new(Owed::default());
        let task = tokio::spawn(
            RouteTask {
                client: self.args.client.clone(),
                subjects: self.args.subjects.clone(),
                owner: self.args.owner.clone(),
                leases: self.args.leases.clone(),
                lease_ttl: self.args.lease_ttl,
                request,
                conn: conn.clone(),
                proxy: myself.clone(),
                detaching: detaching.clone(),
                owed: owed.clone(),
            }
            .run(),
        );
        self.links.insert(
            conn.id,
            Link {
                route,
                conn,
                waiting: Some(Vec::new()),
                sent: 0,
                detaching,
                owed,
                task,
            },
        );
    }

    fn command(&mut self, conn: ConnId, command: Command) {
        let Some(link) = self.links.get_mut(&conn) else {
            if let (Some(outbound), Some(req)) =
                (self.departed.get(&conn), command.recording_request())
            {
                outbound.reply(&unanswered(req.cloned(), &self.args.id));
            }
            return;
        };
        if link.detaching.load(Ordering::Relaxed) {
            return;
        }
        // Cut off from NATS, a command would wait in the client's buffer
        // with its sender hearing nothing; nothing can be recorded anyway
        // (protocol §10.6), so it is refused here and now.
        if let Some(req) = command.recording_request() {
            if self.args.client.connection_state() != async_nats::connection::State::Connected {
                link.conn.outbound.reply(&ServerFrame::error(
                    req.cloned(),
                    ErrorCode::StoreUnavailable,
                    "NATS cannot be reached from this node: nothing was recorded; retry",
                    Some(self.args.id.to_string()),
                ));
                return;
            }
            if !link.owed.expect(req) {
                // The route ended (its task told the client): nothing is
                // sent on it any more.
                link.conn
                    .outbound
                    .reply(&unanswered(req.cloned(), &self.args.id));
                return;
            }
        }
        match &mut link.waiting {
            Some(waiting) => waiting.push(command),
            None => self.to_owner.command(link, command),
        }
    }

    fn event(&mut self, myself: &ActorRef<ConversationMsg>, event: ProxyEvent) {
        match event {
            ProxyEvent::Ready { conn, route } => {
                let Some(link) = self.links.get_mut(&conn) else {
                    return;
                };
                if link.route == route {
                    for command in link.waiting.take().unwrap_or_default() {
                        self.to_owner.command(link, command);
                    }
                }
            }
            ProxyEvent::RouteEnded { conn, route } => {
                if self.links.get(&conn).is_some_and(|l| l.route == route) {
                    if let Some(link) = self.links.remove(&conn) {
                        if !link.detaching.load(Ordering::Relaxed) {
                            link.conn.detached_by(&self.args.id, myself.get_id());
                        }
                        // Behind whatever the connection sent before it
                        // stopped routing here.
                        self.departed.insert(conn, link.conn.outbound);
                        let _ = myself.cast(ConversationMsg::Proxy(ProxyEvent::Forget { conn }));
                    }
                }
            }
            ProxyEvent::Tick => {
                self.ticks += 1;
                let routes: Vec<AliveRoute> = self
                    .links
                    .values()
                    .filter(|l| !l.detaching.load(Ordering::Relaxed) && !l.task.is_finished())
                    .map(|l| AliveRoute {
                        route: l.route.clone(),
                        attached: l.waiting.is_none(),
                        commands: l.sent,
                    })
                    .collect();
                self.to_owner.publish(
                    self.args.subjects.alive(&self.args.owner),
                    &Alive {
                        node: self.args.node.clone(),
                        routes,
                    },
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
            ProxyEvent::Forget { conn } => {
                self.departed.remove(&conn);
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

    /// Tells every client here that it is detached, and stops once the
    /// requests already sent to this proxy are answered.
    fn detach_all(&mut self, myself: &ActorRef<ConversationMsg>, reason: DetachReason) {
        let links: Vec<(ConnId, Link)> = self.links.drain().collect();
        for (conn, mut link) in links {
            link.task.abort();
            link.owed.end_answering(&link.conn.outbound, &self.args.id);
            self.departed.insert(conn, link.conn.outbound.clone());
            if !link.detaching.load(Ordering::Relaxed) {
                self.to_owner.command(
                    &mut link,
                    Command::Detach {
                        cause: DetachCause::SocketGone,
                    },
                );
                link.conn.outbound.reply(&ServerFrame::Detached {
                    req: None,
                    conversation_id: self.args.id.to_string(),
                    reason,
                });
                link.conn.detached_by(&self.args.id, myself.get_id());
            }
        }
        self.drain(myself);
    }

    /// Stops once what is already in the mailbox is handled; attaches
    /// among it are answered `detached moved`.
    fn drain(&mut self, myself: &ActorRef<ConversationMsg>) {
        if self.draining {
            return;
        }
        self.draining = true;
        if myself.drain().is_err() {
            myself.stop(None);
        }
    }
}

/// One attachment through the owner: attaches the connection there and
/// copies the route's frames to it until the route ends.
struct RouteTask {
    client: async_nats::Client,
    subjects: Subjects,
    owner: String,
    leases: Leases,
    lease_ttl: Duration,
    request: AttachRequest,
    conn: ConnectionHandle,
    proxy: ActorRef<ConversationMsg>,
    detaching: Arc<AtomicBool>,
    owed: Arc<Owed>,
}

impl RouteTask {
    async fn run(self) {
        let route = self.request.route.clone();
        self.attach_and_copy().await;
        self.settle();
        let _ = self
            .proxy
            .cast(ConversationMsg::Proxy(ProxyEvent::RouteEnded {
                conn: self.conn.id,
                route,
            }));
    }

    /// Ends the route for the requests sent on it: those the owner has not
    /// answered are answered here, before whatever tells the client the
    /// attachment ended; later ones are answered by the proxy.
    fn settle(&self) {
        self.owed
            .end_answering(&self.conn.outbound, &self.request.conversation);
    }

    fn refuse(&self, code: ErrorCode, message: String) {
        self.settle();
        self.conn.outbound.reply(&ServerFrame::error(
            self.request.req.clone(),
            code,
            message,
            Some(self.request.conversation.clone()),
        ));
    }

    /// `detached moved`: attach again, on any node.
    fn moved(&self, req: Option<ReqId>) {
        self.settle();
        self.conn.outbound.reply(&ServerFrame::Detached {
            req,
            conversation_id: self.request.conversation.clone(),
            reason: DetachReason::Moved,
        });
    }

    /// The owner did not answer at all (its node is gone): waits until its
    /// lease has expired or moved (at most `lease_ttl` and a little), so
    /// that the client, told to attach again, finds the conversation
    /// claimable rather than still held by the dead node.
    async fn wait_for_lease_change(&self) {
        let deadline = tokio::time::Instant::now() + self.lease_ttl + Duration::from_secs(1);
        while tokio::time::Instant::now() < deadline {
            match self.leases.holder(&self.request.conversation).await {
                Ok(Some(holder)) if holder.node == self.owner => {}
                _ => return,
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn attach_and_copy(&self) {
        let request = &self.request;
        let mut frames = match self
            .client
            .subscribe(self.subjects.route(&request.socket_node, &request.route))
            .await
        {
            Ok(s) => s,
            Err(e) => {
                self.refuse(
                    ErrorCode::StoreUnavailable,
                    format!("NATS: {e}; retry later"),
                );
                return;
            }
        };
        let body = match serde_json::to_vec(request) {
            Ok(b) => b,
            Err(e) => {
                self.refuse(ErrorCode::Internal, e.to_string());
                return;
            }
        };
        let answer = self
            .client
            .send_request(
                self.subjects.attach(&self.owner),
                async_nats::Request::new()
                    .payload(body.into())
                    .timeout(Some(REQUEST_TIMEOUT)),
            )
            .await;
        let reply = match answer {
            Ok(m) => serde_json::from_slice::<AttachReply>(&m.payload).ok(),
            Err(e) => {
                debug!(conversation = %request.conversation, owner = %self.owner, error = %e,
                    "the owner did not answer an attach");
                self.wait_for_lease_change().await;
                None
            }
        };
        match reply {
            Some(AttachReply::Attached) => {}
            Some(AttachReply::Refused { code, message }) => {
                self.refuse(code, message);
                return;
            }
            // The owner is gone or no longer runs it: attach again, anywhere.
            Some(AttachReply::NotHere) | None => {
                self.moved(request.req.clone());
                return;
            }
        }
        let _ = self.proxy.cast(ConversationMsg::Proxy(ProxyEvent::Ready {
            conn: self.conn.id,
            route: request.route.clone(),
        }));
        let mut expected: u64 = 1;
        while let Some(message) = frames.next().await {
            if message
                .headers
                .as_ref()
                .is_some_and(|h| h.get(MOVED).is_some())
            {
                // The owner no longer serves this attachment as sent (a
                // command lost on the way, or the route's end): whatever
                // the counter says, the client resumes from what it has.
                info!(conversation = %request.conversation, route = %request.route,
                    "the owner ended this attachment: the client attaches again");
                if !self.detaching.load(Ordering::Relaxed) {
                    self.moved(None);
                }
                return;
            }
            let n = message
                .headers
                .as_ref()
                .and_then(|h| h.get(COUNTER))
                .and_then(|v| v.as_str().parse::<u64>().ok());
            if n != Some(expected) {
                // A frame was lost between the nodes: a gap must never
                // reach the client, so it resumes from what it has.
                info!(conversation = %request.conversation, route = %request.route, expected,
                    got = ?n, "frames lost between nodes: closing the socket as a slow consumer");
                self.settle();
                self.conn
                    .outbound
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
                // A route the client left ends without touching its socket.
                if let (Some(code), false) = (code, self.detaching.load(Ordering::Relaxed)) {
                    let reason = if code == close_code::SLOW_CONSUMER {
                        "slow consumer"
                    } else {
                        "closed by the conversation's node"
                    };
                    self.settle();
                    self.conn.outbound.close(code, reason, true);
                }
                return;
            }
            let Ok(frame) = Utf8Bytes::try_from(message.payload) else {
                return;
            };
            self.owed.answered_in(frame.as_str());
            if self.conn.outbound.send(frame).await.is_err() {
                return;
            }
        }
        // The subscription ended: the NATS client is closing.
        self.moved(None);
    }
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

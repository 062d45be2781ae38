//! Node-to-node traffic: a client attached on one node to a conversation
//! owned by another.
//!
//! # Which node serves an attachment
//! The owner does. The node holding the socket runs a
//! [`proxy::RemoteConversation`] in place of the conversation actor; the
//! connection cannot tell the difference. The proxy forwards the
//! attach and every command to the owner over core NATS, where
//! [`host::Host`] turns them into the same `ConversationMsg`s a local
//! connection sends, with an outbound queue whose frames are published back
//! to the socket's node. So `attached`, replay, live events, acks, control
//! rights and every lifecycle rule (a remote attachment counts as attached:
//! no idle close, no detach grace) come from the one conversation actor,
//! through the one replay-then-live path; nothing about a conversation is
//! decided in two places. The price is one NATS hop per frame between the
//! owner and the socket's node; the alternative (each node reading the
//! JetStream subject for its own sockets) would put a second copy of the
//! attach, replay and control logic on every node.
//!
//! # Subjects (`<p>` is the lower-case prefix, `linger`)
//! - `<p>.node.<owner>.attach`: request; answered once the owner's
//!   conversation has the attachment (or why not).
//! - `<p>.node.<owner>.cmd`: a client frame for a route (message,
//!   tool_result, stop, close, detach), numbered per route.
//! - `<p>.node.<owner>.alive`: the routes a socket node still holds, each
//!   with how many commands it sent, every [`KEEPALIVE_EVERY`]; a route
//!   not named for [`ROUTE_TIMEOUT`] is detached by the owner (its socket
//!   node died).
//! - `<p>.node.<owner>.stop`: request; stops the conversation there
//!   (`close`, delete) and answers once it has stopped.
//! - `<p>.node.<node>.list`: request; answered with the conversations
//!   that node runs, for the cluster-wide admin list ([`listing`]).
//! - `<p>.route.<socket node>.<route>`: the frames of one attachment, in
//!   order, each with a [`COUNTER`] header; an empty payload ends the
//!   route (the owner detached it).
//!
//! # When the other node is slow, gone or lying
//! - **Slow socket node**: core NATS drops what a subscriber cannot take;
//!   the counter shows the gap and the proxy closes that socket as a slow
//!   consumer (4008) instead of sending a gap; the client resumes.
//! - **Owner gone**: the proxy checks the lease every half `lease_ttl`; a
//!   different (or no) holder means the owner is gone or lost the
//!   conversation: its clients get `detached moved` and attach again (the
//!   new owner, or this node, serves them).
//! - **Socket node gone**: its routes stop being named in `alive`; the
//!   owner detaches them after [`ROUTE_TIMEOUT`], so a dead node's clients
//!   never keep a conversation attached.
//! - **A command lost on the way** (core NATS drops what a slow owner
//!   cannot take): the owner sees the gap in the commands' numbers, at
//!   the next command or at the next `alive` (which says how many were
//!   sent), so within [`KEEPALIVE_EVERY`]. It detaches the route and ends
//!   it with a [`MOVED`] header; the client gets `detached moved`,
//!   attaches again and finds in the replay what was recorded (a
//!   `message` resent with its `client_msg_id` is not recorded twice).
//!   Commands after a gap are dropped, never run out of order.
//! - **A request whose answer never comes** (its command lost or dropped,
//!   the route ended before the owner answered): the proxy notes each
//!   request it sends and strikes it off when the owner's `ack` or
//!   `error` passes ([`owed`]); when the route ends, each one still owed
//!   is answered `not_attached` before the client hears why, and one sent
//!   after is answered by the proxy. A proxy that is done (no client left,
//!   the owner gone) drains rather than stops, so an attach already in its
//!   mailbox is answered `detached moved`. A client never waits forever.
//! - **A route end lost on the way**: `alive` names the route as
//!   attached, the owner no longer has it and answers on the route's
//!   subject with a [`MOVED`] notice: `detached moved` again.
//! - **Lying**: a message that does not parse is logged and dropped; a
//!   route frame that is not UTF-8 ends the route.

pub mod host;
pub mod listing;
pub mod owed;
pub mod proxy;
pub mod wire;

use std::time::Duration;

/// How often a socket node names its routes to their owners.
pub const KEEPALIVE_EVERY: Duration = Duration::from_secs(2);
/// A route its socket node has not named for this long is detached.
pub const ROUTE_TIMEOUT: Duration = Duration::from_secs(10);
/// Header with the number of a route's frame (1, 2, ...).
pub const COUNTER: &str = "Linger-N";
/// Header on a route's last message when the owner no longer serves the
/// attachment as its socket node believes (a command lost, a route it
/// does not know): the client is told `detached moved`, whatever the
/// frame counter says.
pub const MOVED: &str = "Linger-Moved";

/// Subject names of node-to-node traffic.
#[derive(Debug, Clone)]
pub struct Subjects {
    prefix: String,
}

impl Subjects {
    pub fn new(prefix: &str) -> Subjects {
        Subjects {
            prefix: prefix.to_ascii_lowercase(),
        }
    }
    pub fn attach(&self, owner: &str) -> String {
        format!("{}.node.{owner}.attach", self.prefix)
    }
    pub fn cmd(&self, owner: &str) -> String {
        format!("{}.node.{owner}.cmd", self.prefix)
    }
    pub fn alive(&self, owner: &str) -> String {
        format!("{}.node.{owner}.alive", self.prefix)
    }
    pub fn stop(&self, owner: &str) -> String {
        format!("{}.node.{owner}.stop", self.prefix)
    }
    /// Asks `node` for the conversations it runs (the admin list).
    pub fn list(&self, node: &str) -> String {
        format!("{}.node.{node}.list", self.prefix)
    }
    /// Everything addressed to `node` as owner.
    pub fn node_all(&self, node: &str) -> String {
        format!("{}.node.{node}.*", self.prefix)
    }
    pub fn route(&self, socket_node: &str, route: &str) -> String {
        format!("{}.route.{socket_node}.{route}", self.prefix)
    }
}

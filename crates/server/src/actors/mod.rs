//! The actor tree: one [`supervisor::Supervisor`], one
//! [`conversation::Conversation`] per active conversation (linked children of
//! the supervisor), and one [`connection::Connection`] per websocket (not
//! an actor: its socket's task runs it).

pub mod active_view;
pub mod connection;
pub mod conversation;
pub mod eviction;
pub mod gauge;
pub mod outbound;
pub mod replay;
pub mod supervision_log;
pub mod supervisor;

#[cfg(test)]
mod rule_tests;

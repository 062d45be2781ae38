//! linger: keeps AI-agent conversations alive when their websocket goes away.
//! The protocol is described in `docs/protocol.md`; "protocol §N" in
//! comments means its section N.
//!
//! This is the server library (package `linger-server`); the `linger`
//! executable that serves it, the terminal client, the load generator and
//! the relay are the workspace's other crates (ARCHITECTURE.md, code map).
//!
//! # Layout
//! - [`protocol`]: wire types of protocol v1; [`event`]: sequenced events,
//!   serialized once.
//! - [`actors`]: the supervisor, one conversation actor per active
//!   conversation, one connection per websocket (run by the socket's task).
//! - [`agent`]: turn runners (the demo agent; the command agent).
//! - [`store`]: the history store trait and its embedded SQLite default;
//!   [`recovery`]: start-up recovery after a crash; [`cluster`]: the NATS
//!   JetStream foundation of cluster mode (log, fence, leases, summaries).
//! - [`gateway`]: axum routes: `/v1/ws`, REST, `/healthz`, `/metrics`,
//!   `/v1/openapi.json`.
//! - [`config`]: the TOML file, its env overrides and the running
//!   configuration; [`reload`]: changing it live (SIGHUP,
//!   `POST /v1/admin/reload`); [`logging`]: stderr logs whose level and
//!   format a reload changes; [`server`]: start and graceful shutdown;
//!   [`metrics`]: Prometheus names; [`heap`]: freed memory given back.

pub mod actors;
pub mod agent;
pub mod cluster;
pub mod config;
pub mod event;
pub mod frame_arena;
pub mod gateway;
pub mod heap;
pub mod logging;
pub mod metrics;
pub mod protocol;
pub mod recovery;
pub mod reload;
pub mod server;
pub mod store;

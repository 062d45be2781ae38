//! The HTTP side: `/v1/ws`, the REST endpoints, the web page (`/`),
//! `/healthz`, `/metrics` and `/v1/openapi.json`, all sharing one
//! [`AppState`]. The routes but the web page's are registered in
//! [`openapi::api_routes`], which describes each as it adds it.

pub mod admin;
pub mod auth;
pub mod connections;
mod fragment;
pub mod openapi;
pub mod rest;
pub mod web;
pub mod ws;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use ractor::ActorRef;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::actors::supervision_log::SupervisionLog;
use crate::actors::supervisor::SupervisorMsg;
use crate::cluster::node::ClusterNode;
use crate::config::LiveConfig;
use crate::reload::Reloader;
use crate::store::Store;

#[derive(Clone)]
pub struct AppState {
    /// Read at each request: a reload applies from the next one on.
    pub config: LiveConfig,
    pub store: Arc<dyn Store>,
    pub supervisor: ActorRef<SupervisorMsg>,
    /// Cancelled when the server shuts down: closes every socket with 1001.
    pub shutdown: CancellationToken,
    /// Every upgraded socket's task: axum's graceful shutdown does not wait
    /// for them, so the server does, or the process would exit before the
    /// 1001 close frames are written.
    pub sockets: TaskTracker,
    pub next_connection: Arc<AtomicU64>,
    pub connections: connections::ConnectionCounter,
    pub auth: Arc<auth::Authenticator>,
    /// Cluster mode: this node (its id is shown by `/healthz`; the admin
    /// list asks the other nodes through it).
    pub cluster: Option<Arc<ClusterNode>>,
    /// The recent supervision decisions (`GET /v1/admin/supervision`).
    pub decisions: Arc<SupervisionLog>,
    /// `POST /v1/admin/reload`.
    pub reloader: Arc<Reloader>,
}

pub fn router(state: AppState) -> Router {
    let (api, _) = openapi::api_routes().split_for_parts();
    Router::new()
        .route("/", get(web::index))
        .route("/web/{*file}", get(web::asset))
        .merge(api)
        .with_state(state)
}

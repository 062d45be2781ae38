//! The operators' endpoints (protocol §2), admins only: everyone else gets
//! 404, as if they did not exist. What runs now
//! (`GET /v1/admin/conversations`, on every node in cluster mode), the
//! recent supervision decisions
//! (`GET /v1/admin/supervision`), and a live reload of the configuration
//! (`POST /v1/admin/reload`).

use axum::extract::{Query, State};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use utoipa::IntoParams;

use super::auth::Caller;
use super::openapi::ErrorBody;
use super::rest::ApiError;
use super::AppState;
use crate::actors::active_view::ActiveConversation;
use crate::actors::supervision_log::Page;
use crate::actors::supervisor::list_active;
use crate::cluster::remote::listing;
use crate::reload::{ReloadError, ReloadOutcome, Trigger};

/// Response header of a cluster-wide admin list that lacks the
/// conversations of some live nodes: their ids, comma-separated.
pub const UNANSWERED_NODES: &str = "linger-unanswered-nodes";

/// Most decisions one `/v1/admin/supervision` call returns.
const MAX_DECISIONS_PAGE: usize = 1000;

fn admin_only(caller: &Caller) -> Result<(), ApiError> {
    if caller.admin {
        Ok(())
    } else {
        Err(ApiError::NotFound)
    }
}

/// Every active conversation, with what an operator needs to see: status,
/// attached connections, last activity, the running turn and its age,
/// queued messages, the replay buffer and (cluster mode) the node that runs
/// it. In cluster mode the node asked lists every live node's
/// conversations: it asks the others, waits at most
/// [`listing::LIST_TIMEOUT`] for each, and names those that did not answer
/// in the `Linger-Unanswered-Nodes` header. Admins only.
#[utoipa::path(get, path = "/v1/admin/conversations", tag = "admin",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The active conversations (in cluster mode, on every live \
            node), by user then id",
            body = Vec<ActiveConversation>,
            headers(("Linger-Unanswered-Nodes" = String,
                description = "Cluster mode, when some live nodes did not answer within 2 s: \
                    their ids, comma-separated; their conversations are not in the list"))),
        (status = 401, description = "Missing or invalid token", body = ErrorBody),
        (status = 404, description = "The caller is not an admin", body = ErrorBody),
    ))]
pub async fn conversations(
    State(app): State<AppState>,
    caller: Caller,
) -> Result<Response, ApiError> {
    admin_only(&caller)?;
    let own = list_active(&app.supervisor).await?;
    let Some(cluster) = &app.cluster else {
        return Ok(Json(own).into_response());
    };
    let list = listing::gather(cluster, own).await;
    let mut response = Json(list.conversations).into_response();
    if !list.unanswered.is_empty() {
        if let Ok(value) = HeaderValue::from_str(&list.unanswered.join(",")) {
            response.headers_mut().insert(UNANSWERED_NODES, value);
        }
    }
    Ok(response)
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SupervisionQuery {
    /// Return decisions numbered after this one (default 0: every one
    /// still held); poll with the `head` of the last answer.
    #[serde(default)]
    since: u64,
    /// Most decisions in the answer: default and maximum 1000.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<usize>,
}

/// The recent supervision decisions (rule, inputs, outcome), oldest first,
/// from an in-memory ring of the last 1000. Admins only.
#[utoipa::path(get, path = "/v1/admin/supervision", tag = "admin",
    security(("bearer" = [])),
    params(SupervisionQuery),
    responses(
        (status = 200, description = "Decisions numbered after `since`", body = Page),
        (status = 400, description = "`since` or `limit` is not a number", body = String,
            content_type = "text/plain"),
        (status = 401, description = "Missing or invalid token", body = ErrorBody),
        (status = 404, description = "The caller is not an admin", body = ErrorBody),
    ))]
pub async fn supervision(
    State(app): State<AppState>,
    caller: Caller,
    Query(query): Query<SupervisionQuery>,
) -> Result<Json<Page>, ApiError> {
    admin_only(&caller)?;
    let limit = query
        .limit
        .unwrap_or(MAX_DECISIONS_PAGE)
        .clamp(1, MAX_DECISIONS_PAGE);
    Ok(Json(app.decisions.since(query.since, limit)))
}

/// Re-reads the configuration file and environment (as SIGHUP does): the
/// keys that may change live take effect from the next decision on; the
/// others are refused by name and keep their running values. A file with
/// an error changes nothing. Admins only.
#[utoipa::path(post, path = "/v1/admin/reload", tag = "admin",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "What changed and what was refused", body = ReloadOutcome),
        (status = 400, description = "The server has no configuration file to re-read",
            body = ErrorBody),
        (status = 401, description = "Missing or invalid token", body = ErrorBody),
        (status = 404, description = "The caller is not an admin", body = ErrorBody),
        (status = 422, description = "The configuration has an error (named by key); nothing \
            changed", body = ErrorBody),
    ))]
pub async fn reload(
    State(app): State<AppState>,
    caller: Caller,
) -> Result<Json<ReloadOutcome>, ApiError> {
    admin_only(&caller)?;
    match app.reloader.reload(Trigger::Admin(caller.user)).await {
        Ok(outcome) => Ok(Json(outcome)),
        Err(e @ ReloadError::Invalid(_)) => Err(ApiError::ConfigInvalid(e.to_string())),
        Err(e @ ReloadError::NoSource) => Err(ApiError::BadRequest(e.to_string())),
    }
}

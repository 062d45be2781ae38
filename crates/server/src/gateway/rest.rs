//! The REST endpoints of protocol §2 (docs/protocol.md): list, get, events,
//! create, delete, observers (the admins' are in [`super::admin`]). Reads come from the store and never activate a
//! conversation. Each handler's `#[utoipa::path]` is its entry in
//! `/v1/openapi.json` ([`super::openapi`]); every one that uses the store
//! lists `StoreUnavailable`, its 503.

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::{IntoParams, ToSchema};

use super::auth::Caller;
use super::openapi::{status_schema, ErrorBody, EventsPage, StoreUnavailable};
use super::AppState;
use crate::actors::supervisor::{
    create_conversation, ActivateError, SupervisorMsg, Unanswered, CALL_TIMEOUT,
};
use crate::event::StartReason;
use crate::protocol::{self, FieldError};
use crate::store::{ConversationMeta, StoreError};

/// Most events one `/events` call returns.
const MAX_EVENTS_PAGE: usize = 10_000;
const DEFAULT_EVENTS_PAGE: usize = 1_000;
/// A page of `/events` stops growing past this many bytes (it holds at
/// least one event): events can be large (a message may be 256 KiB of text,
/// more once JSON-escaped), and `limit` alone would let one request load
/// gigabytes. Clients page on with `after` until `head_seq`.
const EVENTS_PAGE_BYTES: usize = 4 * 1024 * 1024;
/// Events read from the store at a time while building a page.
const EVENTS_READ_CHUNK: usize = 32;

/// A REST failure: an HTTP status and a protocol error code.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("no such conversation")]
    NotFound,
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    LimitReached(String),
    #[error("{0}")]
    StoreUnavailable(String),
    /// A reload found an error in the configuration (names the key).
    #[error("{0}")]
    ConfigInvalid(String),
    #[error("{0}")]
    Internal(String),
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(_) => ApiError::NotFound,
            e if e.is_unavailable() => ApiError::StoreUnavailable(e.to_string()),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> Self {
        ApiError::BadRequest(e.to_string())
    }
}

impl From<Unanswered> for ApiError {
    fn from(e: Unanswered) -> Self {
        ActivateError::from(e).into()
    }
}

impl From<ActivateError> for ApiError {
    fn from(e: ActivateError) -> Self {
        match e {
            ActivateError::NotFound | ActivateError::ObserveOnly => ApiError::NotFound,
            e @ ActivateError::LimitReached { .. } => ApiError::LimitReached(e.to_string()),
            ActivateError::Store(e) => e.into(),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

pub fn error_response(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        Json(json!({"error": {"code": code, "message": message}})),
    )
        .into_response()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = match &self {
            ApiError::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            ApiError::LimitReached(_) => (StatusCode::TOO_MANY_REQUESTS, "limit_reached"),
            ApiError::StoreUnavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "store_unavailable"),
            ApiError::ConfigInvalid(_) => (StatusCode::UNPROCESSABLE_ENTITY, "config_invalid"),
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        error_response(status, code, &self.to_string())
    }
}

/// A conversation as REST shows it.
#[derive(Debug, Serialize, ToSchema)]
pub struct Summary {
    #[schema(example = "c_01JDX9Q8ZK3M4T5V6W7X8Y9Z0A")]
    pub id: String,
    pub title: String,
    #[schema(schema_with = status_schema)]
    pub status: &'static str,
    /// The seq of its last event (0 before the first).
    pub head_seq: u64,
    /// RFC 3339, UTC, milliseconds.
    #[schema(example = "2026-11-30T10:00:00.123Z")]
    pub created_at: String,
    /// When its last event was recorded (RFC 3339, UTC).
    #[schema(example = "2026-11-30T10:04:31.870Z")]
    pub last_activity_at: String,
}

impl From<&ConversationMeta> for Summary {
    fn from(meta: &ConversationMeta) -> Self {
        Summary {
            id: meta.id.clone(),
            title: meta.title.clone(),
            status: meta.status.as_str(),
            head_seq: meta.head_seq,
            created_at: meta.created_at.clone(),
            last_activity_at: meta.last_activity_at.clone(),
        }
    }
}

/// Reads a conversation the caller may see (owner or observer).
async fn visible(app: &AppState, caller: &Caller, id: &str) -> Result<ConversationMeta, ApiError> {
    let meta = app.store.get(id).await?.ok_or(ApiError::NotFound)?;
    if meta.user == caller.user || meta.observers.contains(&caller.user) {
        Ok(meta)
    } else {
        Err(ApiError::NotFound)
    }
}

/// Reads a conversation the caller owns.
async fn owned(app: &AppState, caller: &Caller, id: &str) -> Result<ConversationMeta, ApiError> {
    let meta = app.store.get(id).await?.ok_or(ApiError::NotFound)?;
    if meta.user == caller.user {
        Ok(meta)
    } else {
        Err(ApiError::NotFound)
    }
}

/// The caller's own conversations (not those they observe).
#[utoipa::path(get, path = "/v1/conversations", tag = "conversations",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The caller's conversations", body = Vec<Summary>),
        (status = 401, description = "Missing or invalid token", body = ErrorBody),
        StoreUnavailable,
    ))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
) -> Result<Json<Vec<Summary>>, ApiError> {
    let metas = app.store.list(Some(&caller.user)).await?;
    Ok(Json(metas.iter().map(Summary::from).collect()))
}

/// One conversation the caller owns or observes.
#[utoipa::path(get, path = "/v1/conversations/{id}", tag = "conversations",
    security(("bearer" = [])),
    params(("id" = String, Path, description = "The conversation id")),
    responses(
        (status = 200, description = "Its summary", body = Summary),
        (status = 401, description = "Missing or invalid token", body = ErrorBody),
        (status = 404, description = "No such conversation, or another user's", body = ErrorBody),
        StoreUnavailable,
    ))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Summary>, ApiError> {
    let meta = visible(&app, &caller, &id).await?;
    Ok(Json(Summary::from(&meta)))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Return events with a seq greater than this (default 0: from the start).
    #[serde(default)]
    after: u64,
    /// Most events in the page: default 1000, at most 10000.
    #[param(minimum = 1, maximum = 10000)]
    limit: Option<usize>,
}

/// Stored events of a conversation the caller owns or observes, oldest
/// first. Never activates the conversation.
#[utoipa::path(get, path = "/v1/conversations/{id}/events", tag = "conversations",
    security(("bearer" = [])),
    params(("id" = String, Path, description = "The conversation id"), EventsQuery),
    responses(
        (status = 200, description = "A page of events", body = EventsPage),
        (status = 400, description = "`after` or `limit` is not a number", body = String,
            content_type = "text/plain"),
        (status = 401, description = "Missing or invalid token", body = ErrorBody),
        (status = 404, description = "No such conversation, or another user's", body = ErrorBody),
        StoreUnavailable,
    ))]
pub async fn events(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<EventsQuery>,
) -> Result<Response, ApiError> {
    let meta = visible(&app, &caller, &id).await?;
    let limit = query
        .limit
        .unwrap_or(DEFAULT_EVENTS_PAGE)
        .clamp(1, MAX_EVENTS_PAGE);
    // The stored frames are already JSON: splice them instead of re-encoding.
    // Read in small chunks and stop at the byte budget, so that memory per
    // request stays bounded whatever the events' sizes.
    let mut body = String::from("{\"events\":[");
    let mut after = query.after;
    let mut count = 0;
    'pages: while count < limit {
        let want = (limit - count).min(EVENTS_READ_CHUNK);
        let chunk = app.store.events(&id, after, want).await?;
        for event in &chunk {
            if count > 0 && body.len() + event.frame.len() > EVENTS_PAGE_BYTES {
                break 'pages;
            }
            if count > 0 {
                body.push(',');
            }
            body.push_str(event.frame.as_str());
            after = event.seq;
            count += 1;
        }
        if chunk.len() < want {
            break;
        }
    }
    body.push_str(&format!("],\"head_seq\":{}}}", meta.head_seq));
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        Body::from(body),
    )
        .into_response())
}

#[derive(Debug, Deserialize, Default, ToSchema)]
pub struct CreateBody {
    /// At most 200 characters; default empty.
    title: Option<String>,
    /// A humantime duration (`90s`, `2h`) replacing `conversations.close_delay`
    /// for this conversation, capped at `conversations.max_close_delay`.
    #[schema(example = "2h")]
    close_delay: Option<String>,
}

/// Creates a conversation and activates it (`agent_started {reason: "rest"}`).
#[utoipa::path(post, path = "/v1/conversations", tag = "conversations",
    security(("bearer" = [])),
    request_body(content = Option<CreateBody>, description = "Optional; `{}` or no body at all \
        creates an untitled conversation", content_type = "application/json"),
    responses(
        (status = 201, description = "Created and active", body = Summary),
        (status = 400, description = "Title too long, or a bad close_delay", body = ErrorBody),
        (status = 401, description = "Missing or invalid token", body = ErrorBody),
        (status = 429, description = "conversations.on_limit = \"reject\" and the caller is at \
            conversations.max_per_user", body = ErrorBody),
        StoreUnavailable,
    ))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    body: Option<Json<CreateBody>>,
) -> Result<Response, ApiError> {
    let body = body.map(|Json(b)| b).unwrap_or_default();
    let title = body.title.unwrap_or_default();
    protocol::check_title(&title)?;
    let close_delay = protocol::parse_close_delay(body.close_delay.as_deref())?;
    let activated = create_conversation(
        &app.supervisor,
        &app.config.get().store.path,
        std::sync::Arc::from(caller.user.as_str()),
        title,
        close_delay,
        StartReason::Rest,
    )
    .await?;
    app.store.flush().await?;
    let meta = match app.store.get(&activated.id).await? {
        Some(meta) => meta,
        // Its first append failed: the store says why.
        None => {
            return Err(match app.store.health() {
                Err(reason) => ApiError::StoreUnavailable(format!(
                    "the conversation could not be created: store unavailable: {reason}"
                )),
                Ok(()) => ApiError::Internal("the conversation was not recorded".into()),
            })
        }
    };
    Ok((StatusCode::CREATED, Json(Summary::from(&meta))).into_response())
}

/// Stops a conversation the caller owns (`agent_stopped {reason: "deleted"}`,
/// its clients get `detached {reason: "deleted"}`) and deletes its history
/// and workspace.
#[utoipa::path(delete, path = "/v1/conversations/{id}", tag = "conversations",
    security(("bearer" = [])),
    params(("id" = String, Path, description = "The conversation id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 401, description = "Missing or invalid token", body = ErrorBody),
        (status = 404, description = "No such conversation, or not the caller's own",
            body = ErrorBody),
        StoreUnavailable,
    ))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    owned(&app, &caller, &id).await?;
    let deleted = app
        .supervisor
        .call(
            |reply| SupervisorMsg::Delete {
                id: id.clone(),
                reply,
            },
            Some(CALL_TIMEOUT),
        )
        .await;
    match Unanswered::check(deleted)? {
        Ok(true) => Ok(StatusCode::NO_CONTENT),
        Ok(false) => Err(ApiError::NotFound),
        Err(e) => Err(e.into()),
    }
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct ObserverBody {
    /// The user who may attach in `observe` mode (1 to 64 bytes).
    #[schema(example = "bob")]
    user: String,
}

/// Lets another user read a conversation the caller owns: attach with
/// `mode: "observe"`, and the REST reads.
#[utoipa::path(post, path = "/v1/conversations/{id}/observers", tag = "conversations",
    security(("bearer" = [])),
    params(("id" = String, Path, description = "The conversation id")),
    request_body(content = ObserverBody, content_type = "application/json"),
    responses(
        (status = 204, description = "Granted"),
        (status = 400, description = "A bad user name", body = ErrorBody),
        (status = 401, description = "Missing or invalid token", body = ErrorBody),
        (status = 404, description = "No such conversation, or not the caller's own",
            body = ErrorBody),
        StoreUnavailable,
    ))]
pub async fn add_observer(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(body): Json<ObserverBody>,
) -> Result<StatusCode, ApiError> {
    owned(&app, &caller, &id).await?;
    protocol::check_user_name(&body.user)?;
    app.store.add_observer(&id, &body.user).await?;
    let _ = app.supervisor.cast(SupervisorMsg::ObserverAdded {
        id,
        user: body.user,
    });
    Ok(StatusCode::NO_CONTENT)
}

/// 200 while serving; 503 with the reason while the store cannot write
/// (reads still work, but nothing new can be recorded). No token needed.
#[utoipa::path(get, path = "/healthz", tag = "service",
    responses(
        (status = 200, description = "Serving", body = String, content_type = "text/plain",
            example = "ok\n"),
        (status = 503, description = "The store cannot write now; says why", body = String,
            content_type = "text/plain"),
    ))]
pub async fn healthz(State(app): State<AppState>) -> Response {
    // Cluster mode names the node, so that an operator behind a load
    // balancer knows which one answered.
    let node = app
        .cluster
        .as_ref()
        .map(|c| format!("node {}\n", c.node))
        .unwrap_or_default();
    match app.store.health() {
        Ok(()) => format!("ok\n{node}").into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("store unavailable: {reason}\n{node}"),
        )
            .into_response(),
    }
}

/// Prometheus metrics (aggregate counters, no ids or user names). No token
/// needed.
#[utoipa::path(get, path = "/metrics", tag = "service",
    responses((status = 200, description = "Prometheus text exposition format", body = String,
        content_type = "text/plain; version=0.0.4")))]
pub async fn metrics() -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::metrics::render(),
    )
        .into_response()
}

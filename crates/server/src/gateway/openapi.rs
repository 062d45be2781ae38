//! The machine-readable description of the HTTP API (OpenAPI 3.1), served at
//! `GET /v1/openapi.json`. It is built from the same route table the server
//! runs: every route registered here with `routes!` is both served and
//! described, from the `#[utoipa::path]` attribute on its handler, so the
//! document cannot name a route the server lacks or miss one it has.
//! docs/protocol.md is the reference in prose.

use std::sync::LazyLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use strum::{VariantArray, VariantNames};
use utoipa::openapi::schema::{Object, ObjectBuilder, Type};
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{IntoResponses, Modify, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{admin, rest, ws, AppState};
use crate::event::EventKind;
use crate::protocol::Status;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "linger",
        description = "REST endpoints of linger, the server that keeps AI-agent conversations \
            alive when their websocket goes away. The websocket protocol itself (frames, event \
            kinds, error codes, guarantees) is described in docs/protocol.md."
    ),
    modifiers(&Auth),
    tags(
        (name = "conversations", description = "The caller's conversations and their history"),
        (name = "admin", description = "Admins only; 404 for everyone else"),
        (name = "websocket", description = "The protocol v1 websocket (docs/protocol.md)"),
        (name = "service", description = "Health, metrics and this document; no token needed"),
    )
)]
struct ApiDoc;

/// The two ways a caller presents its token (docs/protocol.md §2).
struct Auth;

impl Modify for Auth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "In auth.mode = \"dev\" the token is the user name; \"tokens\" and \
                         \"jwt\" check it (docs/protocol.md §2)",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "token_query",
            SecurityScheme::ApiKey(ApiKey::Query(ApiKeyValue::with_description(
                "token",
                "The same token as `?token=`, for clients that cannot set headers \
                 (browsers opening a websocket)",
            ))),
        );
    }
}

/// Every route of the HTTP API but the web page's static files.
pub fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(ws::upgrade))
        .routes(routes!(rest::list, rest::create))
        .routes(routes!(rest::get, rest::delete))
        .routes(routes!(rest::events))
        .routes(routes!(rest::add_observer))
        .routes(routes!(admin::conversations))
        .routes(routes!(admin::supervision))
        .routes(routes!(admin::reload))
        .routes(routes!(rest::healthz))
        .routes(routes!(rest::metrics))
        .routes(routes!(serve))
}

/// The OpenAPI document of [`api_routes`].
pub fn document() -> utoipa::openapi::OpenApi {
    api_routes().into_openapi()
}

/// Built once: the document never changes while the server runs.
static DOCUMENT_JSON: LazyLock<String> = LazyLock::new(|| {
    document()
        .to_pretty_json()
        .unwrap_or_else(|e| format!(r#"{{"error":"the OpenAPI document: {e}"}}"#))
});

/// This document.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    tag = "service",
    responses((status = 200, description = "The OpenAPI 3.1 document of these endpoints",
        content_type = "application/json", body = Object))
)]
pub async fn serve() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        DOCUMENT_JSON.as_str(),
    )
        .into_response()
}

/// A string schema whose values are `names`.
fn one_of(names: impl IntoIterator<Item = String>, description: &str) -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(names))
        .description(Some(description))
        .build()
}

/// `status` of a summary: every [`Status`], named as the wire names it.
pub(super) fn status_schema() -> Object {
    let names = Status::VARIANTS.iter().map(|s| s.as_str().to_owned());
    one_of(
        names,
        "running: a turn is working; waiting: a turn waits on a client tool result; \
         idle: active, no turn; stopped: only the stored history remains",
    )
}

fn kind_schema() -> Object {
    let names = EventKind::VARIANTS.iter().map(|k| (*k).to_owned());
    one_of(
        names,
        "The event's kind; docs/protocol.md §4 describes each",
    )
}

fn event_type_schema() -> Object {
    one_of(["event".to_owned()], "Always `event`")
}

/// One stored event, exactly the frame a websocket is sent for it.
// Never built: the events page is spliced from stored frames; this type only
// describes them.
#[allow(dead_code)]
#[derive(ToSchema)]
pub(super) struct Event {
    #[schema(rename = "type", schema_with = event_type_schema)]
    kind_of_frame: String,
    #[schema(example = "c_01JDX9Q8ZK3M4T5V6W7X8Y9Z0A")]
    conversation_id: String,
    #[schema(minimum = 1)]
    seq: u64,
    #[schema(example = "2026-11-30T10:00:00.123Z")]
    ts: String,
    #[schema(schema_with = kind_schema)]
    kind: String,
    /// The kind's payload (docs/protocol.md §4).
    data: Value,
}

/// A page of stored events, oldest first.
#[allow(dead_code)]
#[derive(ToSchema)]
pub(super) struct EventsPage {
    /// Events with seq greater than `after`, at most `limit` of them and
    /// about 4 MiB; page on with `after` = the last seq until `head_seq`.
    events: Vec<Event>,
    /// The conversation's last seq.
    head_seq: u64,
}

/// Every REST error body: `{"error": {"code", "message"}}`.
#[allow(dead_code)]
#[derive(ToSchema)]
pub(super) struct ErrorBody {
    error: ErrorDetail,
}

#[allow(dead_code)]
#[derive(ToSchema)]
pub(super) struct ErrorDetail {
    /// `unauthorized` (401), `forbidden` (403), `bad_request` (400),
    /// `not_found` (404), `limit_reached` (429), `config_invalid` (422),
    /// `store_unavailable` (503) or `internal` (500).
    #[schema(example = "not_found")]
    code: String,
    /// What went wrong, for people.
    message: String,
}

/// The 503 of every route that reads or writes the store
/// (`ApiError::StoreUnavailable`, from a `StoreError` that `is_unavailable`),
/// listed in each such route's `responses(...)`.
#[allow(dead_code)]
#[derive(IntoResponses)]
#[response(
    status = 503,
    description = "`store_unavailable`: the store cannot be read or written now (disk full, \
        an I/O error, a locked or corrupt database; in cluster mode NATS without quorum). \
        Nothing was recorded; retry later"
)]
pub(super) struct StoreUnavailable(ErrorBody);

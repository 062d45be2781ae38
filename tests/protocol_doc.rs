//! docs/protocol.md and `/v1/openapi.json` stay true to the code.
//!
//! The reference page marks each table of names with `<!-- names: SET -->`.
//! Every frame type, event kind, reason, status, mode, error code and
//! configuration key the code knows (taken from the code itself: derived
//! variant lists, serde, the serialized default `Config`) must be a row of
//! its table, and every row must be a name the code knows, unless the row is
//! marked `*coming*` in a cell of its own (protocol v1.1, not implemented
//! yet), in which case the code must not know it yet. The OpenAPI document is checked against a
//! real server: every operation it lists answers there with a status it
//! documents, every method it does not list is refused with 405, the route
//! table has nothing it leaves out, real bodies match their schemas, and
//! with a failing store exactly the routes that document 503 answer it.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::{json, Value};
use strum::{VariantArray, VariantNames};

use common::faulty_store::Fault;
use common::TestServer;
use linger::config::{AuthMode, Config, TokenEntry};
use linger::event::{EventKind, EventRecord, StartReason, ToolTarget, TurnStatus};
use linger::protocol::{
    ClientFrame, ClientFrameType, DetachReason, ErrorCode, Mode, ServerFrameType, Status,
    StopReason,
};

const DOC: &str = include_str!("../docs/protocol.md");
const ROUTER_SOURCE: &str = include_str!("../crates/server/src/gateway/mod.rs");

/// One named table of the reference page.
#[derive(Debug, Default)]
struct Table {
    /// Names the server has today, with their whole row.
    current: BTreeMap<String, String>,
    /// Names marked `*coming*`.
    coming: BTreeSet<String>,
}

/// Reads every `<!-- names: SET -->` table: the first backticked word of each
/// row's first cell is the name.
fn doc_tables() -> BTreeMap<String, Table> {
    let mut tables = BTreeMap::new();
    let mut lines = DOC.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(set) = line
            .trim()
            .strip_prefix("<!-- names:")
            .and_then(|rest| rest.strip_suffix("-->"))
        else {
            continue;
        };
        let mut table = Table::default();
        while lines.peek().is_some_and(|l| l.trim().is_empty()) {
            lines.next();
        }
        let rows: Vec<&str> =
            std::iter::from_fn(|| lines.next_if(|l| l.starts_with('|'))).collect();
        assert!(rows.len() > 2, "the table of `{}` is empty", set.trim());
        for row in &rows[2..] {
            let first = row.split('|').nth(1).unwrap_or_default();
            let name = first
                .split('`')
                .nth(1)
                .unwrap_or_else(|| panic!("no `name` in the first cell of {row}"))
                .to_owned();
            if row
                .split('|')
                .any(|cell| cell.trim().starts_with("*coming*"))
            {
                table.coming.insert(name);
            } else {
                table.current.insert(name, (*row).to_owned());
            }
        }
        let previous = tables.insert(set.trim().to_owned(), table);
        assert!(previous.is_none(), "two tables of `{}`", set.trim());
    }
    tables
}

/// The wire names of a fieldless enum, as serde writes them.
fn wire_names<T: Serialize + 'static>(variants: &[T]) -> BTreeSet<String> {
    variants
        .iter()
        .map(|v| match serde_json::to_value(v) {
            Ok(Value::String(name)) => name,
            other => panic!("a variant did not serialize to a string: {other:?}"),
        })
        .collect()
}

fn strings(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

/// Every leaf of the serialized default config as `section.key`.
fn config_keys() -> BTreeSet<String> {
    fn walk(prefix: &str, value: &Value, keys: &mut BTreeSet<String>) {
        match value {
            Value::Object(map) => {
                for (key, value) in map {
                    let path = if prefix.is_empty() {
                        key.clone()
                    } else {
                        format!("{prefix}.{key}")
                    };
                    walk(&path, value, keys);
                }
            }
            _ => {
                keys.insert(prefix.to_owned());
            }
        }
    }
    let mut keys = BTreeSet::new();
    let defaults = serde_json::to_value(Config::default()).expect("the default config serializes");
    walk("", &defaults, &mut keys);
    keys
}

/// Every set of names the code knows, by table name.
fn code_names() -> BTreeMap<&'static str, BTreeSet<String>> {
    let client_frames = strings(ClientFrameType::VARIANTS);
    for name in &client_frames {
        // The derived names are serde's: a frame of each type parses past
        // its `type` (it fails on a missing field, if any, not on the type).
        if let Err(e) = ClientFrame::parse(&json!({ "type": name }).to_string()) {
            assert!(
                !e.message.contains("unknown variant"),
                "`{name}` is not a client frame type serde accepts: {}",
                e.message
            );
        }
    }
    let mut server_frames = strings(ServerFrameType::VARIANTS);
    let event = EventRecord::from_parts("c_1", 1, "ts", linger::event::intern_kind("kind"), "{}");
    let event: Value = serde_json::from_str(event.frame.as_str()).expect("an event frame is JSON");
    server_frames.insert(event["type"].as_str().expect("a type").to_owned());
    BTreeMap::from([
        ("client_frames", client_frames),
        ("server_frames", server_frames),
        ("event_kinds", strings(EventKind::VARIANTS)),
        ("statuses", wire_names(Status::VARIANTS)),
        ("modes", wire_names(Mode::VARIANTS)),
        ("start_reasons", wire_names(StartReason::VARIANTS)),
        ("tool_targets", wire_names(ToolTarget::VARIANTS)),
        ("turn_statuses", wire_names(TurnStatus::VARIANTS)),
        ("stop_reasons", wire_names(StopReason::VARIANTS)),
        ("detach_reasons", wire_names(DetachReason::VARIANTS)),
        ("error_codes", wire_names(ErrorCode::VARIANTS)),
        ("config_keys", config_keys()),
    ])
}

#[test]
fn every_name_in_the_code_is_documented_and_every_documented_name_exists() {
    let tables = doc_tables();
    let code = code_names();
    let mut problems = Vec::new();
    for (set, known) in &code {
        let Some(table) = tables.get(*set) else {
            problems.push(format!(
                "docs/protocol.md has no `<!-- names: {set} -->` table"
            ));
            continue;
        };
        for name in known {
            if table.coming.contains(name) {
                problems.push(format!(
                    "{set}: `{name}` is implemented now; drop its *coming* mark in docs/protocol.md"
                ));
            } else if !table.current.contains_key(name) {
                problems.push(format!(
                    "{set}: `{name}` is in the code but not in docs/protocol.md"
                ));
            }
        }
        for name in table.current.keys() {
            if !known.contains(name) {
                problems.push(format!(
                    "{set}: docs/protocol.md lists `{name}`, which the code does not know \
                     (mark it *coming* if it is planned)"
                ));
            }
        }
    }
    for set in tables.keys() {
        if !code.contains_key(set.as_str()) {
            problems.push(format!(
                "docs/protocol.md has a table `{set}` this test does not know"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The default column of the configuration table is TOML: read back, it
/// gives exactly the built-in defaults.
#[test]
fn documented_config_defaults_are_the_real_ones() {
    let tables = doc_tables();
    let mut toml = String::new();
    let mut section = "";
    for (key, row) in &tables["config_keys"].current {
        let (sect, name) = key.split_once('.').expect("keys are section.key");
        if sect != section {
            toml.push_str(&format!("[{sect}]\n"));
            section = sect;
        }
        let default = row.split('|').nth(2).expect("a default column").trim();
        let value = default
            .strip_prefix('`')
            .and_then(|d| d.strip_suffix('`'))
            .unwrap_or_else(|| panic!("the default of {key} is not one `value`: {default}"));
        toml.push_str(&format!("{name} = {value}\n"));
    }
    let documented = Config::from_toml(&toml)
        .unwrap_or_else(|e| panic!("the documented defaults do not load: {e}\n{toml}"));
    assert_eq!(
        documented,
        Config::default(),
        "documented defaults:\n{toml}"
    );
}

/// The "on reload" column says what the code decides for each key
/// (`config::keys::reloadability`).
#[test]
fn documented_reloadability_is_the_real_one() {
    use linger::config::keys::{reloadability, Reloadability};
    let tables = doc_tables();
    for (key, row) in &tables["config_keys"].current {
        let column = row.split('|').nth(4).expect("an on-reload column").trim();
        let real = match reloadability(key) {
            Reloadability::Live => "live",
            Reloadability::Restart(_) => "restart",
        };
        assert_eq!(
            column, real,
            "docs/protocol.md §7 says {key} is `{column}` on reload; the code says `{real}`"
        );
    }
}

/// Operations of an OpenAPI document: (path, lowercase method) → operation.
fn operations(document: &Value) -> BTreeMap<(String, String), Value> {
    let mut operations = BTreeMap::new();
    let paths = document["paths"].as_object().expect("paths");
    for (path, item) in paths {
        for (method, operation) in item.as_object().expect("a path item") {
            operations.insert((path.clone(), method.clone()), operation.clone());
        }
    }
    operations
}

/// Checks `body` against a response schema of the document (refs resolved
/// within the document).
fn check_schema(document: &Value, operation: &Value, status: u16, body: &Value, what: &str) {
    let content = &operation["responses"][status.to_string()]["content"];
    let Some(schema) = content["application/json"].get("schema") else {
        return;
    };
    let mut schema = schema.clone();
    schema["components"] = document["components"].clone();
    if let Err(e) = jsonschema::validate(&schema, body) {
        panic!("{what}: the {status} body does not match its schema: {e}\n{body:#}");
    }
}

#[tokio::test]
async fn the_openapi_document_matches_the_real_routes() {
    let fault = Fault::default();
    let server = TestServer::start_wrapping(
        |config| {
            config.auth.mode = AuthMode::Tokens;
            config.auth.tokens = vec![TokenEntry {
                token: "alice-token".into(),
                user: "alice".into(),
                admin: true,
            }];
        },
        |store| fault.wrap(store),
    )
    .await;
    let token = Some("alice-token");

    let (status, served) = server.get("/v1/openapi.json", None).await;
    assert_eq!(status, 200, "GET /v1/openapi.json needs no token: {served}");
    let built = serde_json::to_value(linger::gateway::openapi::document()).expect("serializes");
    assert_eq!(served, built, "the served document is the built one");
    assert!(served["openapi"]
        .as_str()
        .is_some_and(|v| v.starts_with("3.")));

    // Real conversations for the `{id}` routes: one kept, one to delete.
    let (status, kept) = server
        .call(
            "POST",
            "/v1/conversations",
            token,
            Some(json!({"title": "kept"})),
        )
        .await;
    assert_eq!(status, 201, "{kept}");
    let kept = kept["id"].as_str().expect("an id").to_owned();
    let (status, doomed) = server
        .call("POST", "/v1/conversations", token, Some(json!({})))
        .await;
    assert_eq!(status, 201, "{doomed}");
    let doomed = doomed["id"].as_str().expect("an id").to_owned();

    let operations = operations(&served);
    // DELETE last, so that the other calls see the conversations.
    let mut order: Vec<_> = operations.keys().cloned().collect();
    order.sort_by_key(|(_, method)| method == "delete");
    for (path, method) in &order {
        let operation = &operations[&(path.clone(), method.clone())];
        let what = format!("{} {path}", method.to_uppercase());
        let documented: BTreeSet<u16> = operation["responses"]
            .as_object()
            .expect("responses")
            .keys()
            .map(|s| s.parse().expect("numeric statuses"))
            .collect();
        if path == "/v1/ws" {
            // A real upgrade: the documented 101.
            assert!(documented.contains(&101), "{what} documents 101");
            let client = server.connect("alice-token").await;
            drop(client);
            continue;
        }
        let id = if method == "delete" { &doomed } else { &kept };
        let url = path.replace("{id}", id);
        let body = match (method.as_str(), path.as_str()) {
            ("post", "/v1/conversations/{id}/observers") => Some(json!({"user": "bob"})),
            ("post", _) => Some(json!({"title": "from the OpenAPI test"})),
            _ => None,
        };
        let (status, response) = server.call(&method.to_uppercase(), &url, token, body).await;
        assert!(
            documented.contains(&status),
            "{what} answered {status}, which its operation does not document ({documented:?}): {response}"
        );
        assert!(status < 300, "{what} failed: {status} {response}");
        check_schema(&served, operation, status, &response, &what);

        // Without a token, a route that documents 401 gives it, with the
        // documented error body.
        if documented.contains(&401) {
            let (status, response) = server.call(&method.to_uppercase(), &url, None, None).await;
            assert_eq!(status, 401, "{what} without a token: {response}");
            check_schema(&served, operation, status, &response, &what);
        }
    }

    // A conversation another user cannot see: the documented 404 body.
    let get = &operations[&("/v1/conversations/{id}".to_owned(), "get".to_owned())];
    let (status, response) = server
        .call("GET", "/v1/conversations/c_nope", token, None)
        .await;
    assert_eq!(status, 404);
    check_schema(
        &served,
        get,
        status,
        &response,
        "GET /v1/conversations/{id}",
    );

    // Every method a path does not document is refused by the router: the
    // document misses no method of a path it knows.
    for path in served["paths"].as_object().expect("paths").keys() {
        let url = path.replace("{id}", &kept);
        for method in ["GET", "POST", "PUT", "PATCH", "DELETE"] {
            if operations.contains_key(&(path.clone(), method.to_lowercase())) {
                continue;
            }
            let (status, response) = server.call(method, &url, token, None).await;
            assert_eq!(
                status, 405,
                "{method} {path} is not documented, yet it answered: {response}"
            );
        }
    }

    // With a store that can neither be read nor written, every route that
    // documents 503 answers it with the documented error body, and no
    // other route does (the document misses no route's 503).
    fault.fail_reads(true);
    fault.fail_writes(true);
    for ((path, method), operation) in &operations {
        let what = format!("{} {path} with the store failing", method.to_uppercase());
        if path == "/v1/ws" {
            continue;
        }
        let url = path.replace("{id}", &kept);
        let body = match (method.as_str(), path.as_str()) {
            ("post", "/v1/conversations/{id}/observers") => Some(json!({"user": "carol"})),
            ("post", _) => Some(json!({"title": "while the store fails"})),
            _ => None,
        };
        let (status, response) = server.call(&method.to_uppercase(), &url, token, body).await;
        if operation["responses"].get("503").is_some() {
            assert_eq!(status, 503, "{what}: {response}");
            check_schema(&served, operation, status, &response, &what);
            if path != "/healthz" {
                assert_eq!(response["error"]["code"], "store_unavailable", "{what}");
            }
        } else {
            assert!(
                status < 300,
                "{what} answered {status}, undocumented: {response}"
            );
        }
    }
    fault.fail_reads(false);
    fault.fail_writes(false);

    // Routes added outside the documented table (`.route("...")` in the
    // router) are the web page's only.
    for route in ROUTER_SOURCE.split(".route(").skip(1) {
        let path = route
            .trim_start()
            .strip_prefix('"')
            .and_then(|r| r.split('"').next())
            .expect("a route path literal");
        assert!(
            path == "/" || path.starts_with("/web/") || served["paths"].get(path).is_some(),
            "the route {path} is not in /v1/openapi.json: register it in \
             gateway::openapi::api_routes with a #[utoipa::path]"
        );
    }
    server.shutdown().await;
}

//! The operators' endpoints: `GET /v1/admin/conversations` shows every
//! conversation active now with its turn, queue and buffer;
//! `GET /v1/admin/supervision?since=N` pages the recent decisions; both are
//! admins only (404 for everyone else, as if they did not exist).

mod common;

use common::{eventually, TestServer};
use linger::config::{AuthMode, TokenEntry};
use serde_json::{json, Value};

async fn server() -> TestServer {
    TestServer::start_with(|c| {
        c.auth.mode = AuthMode::Tokens;
        c.auth.tokens = ["alice", "bob", "root"]
            .iter()
            .map(|user| TokenEntry {
                token: format!("tok-{user}"),
                user: (*user).to_owned(),
                admin: *user == "root",
            })
            .collect();
        c.conversations.max_per_user = 1;
    })
    .await
}

/// Polls the admin list until `done` holds; returns it.
async fn active_until(
    server: &TestServer,
    what: &str,
    done: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    eventually(&format!("the admin list to show {what}"), || async {
        let (status, list) = server
            .get("/v1/admin/conversations", Some("tok-root"))
            .await;
        assert_eq!(status, 200, "{list}");
        match list.as_array() {
            Some(all) if done(all) => Ok(all.clone()),
            _ => Err(list),
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admins_see_what_runs_now_and_why_things_stopped() {
    let server = server().await;
    // alice: a streaming turn with a message queued behind it.
    let mut alice = common::Client::connect(&server.ws_url("tok-alice"), "alice").await;
    let a = alice.create().await;
    alice.send_message(&a, "/stream 400 50").await;
    let started = alice.events_until_kind(&a, "turn_started").await;
    let turn_id = started.last().unwrap()["data"]["turn_id"].clone();
    alice.send_message(&a, "next").await;
    // bob: created over REST, nobody attached.
    let (status, b) = server
        .call(
            "POST",
            "/v1/conversations",
            Some("tok-bob"),
            Some(json!({})),
        )
        .await;
    assert_eq!(status, 201, "{b}");
    let b = b["id"].as_str().unwrap().to_owned();

    let list = active_until(&server, "alice's queued message", |l| {
        l.len() == 2 && l[0]["queued"] == 1
    })
    .await;
    let (mine, bobs) = (&list[0], &list[1]);
    assert_eq!(mine["id"], a.as_str(), "sorted by user: {list:#?}");
    assert_eq!(mine["user"], "alice");
    assert_eq!(mine["status"], "running");
    assert_eq!(mine["stopping"], Value::Null);
    assert_eq!(mine["attached"], 1);
    assert_eq!(mine["turn"]["id"], turn_id, "{mine:#}");
    assert!(mine["turn"]["age_ms"].is_u64(), "{mine:#}");
    assert!(humantime::parse_rfc3339(mine["turn"]["started_at"].as_str().unwrap()).is_ok());
    assert!(humantime::parse_rfc3339(mine["last_activity_at"].as_str().unwrap()).is_ok());
    assert!(
        mine["replay_buffer"]["events"].as_u64().unwrap() >= 4,
        "{mine:#}"
    );
    assert!(
        mine["replay_buffer"]["bytes"].as_u64().unwrap() > 0,
        "{mine:#}"
    );
    assert_eq!(mine["node"], Value::Null, "single mode names no node");
    assert_eq!(bobs["id"], b.as_str());
    assert_eq!(bobs["user"], "bob");
    assert_eq!(bobs["status"], "idle");
    assert_eq!(bobs["attached"], 0);
    assert_eq!(bobs["turn"], Value::Null);
    assert_eq!(bobs["queued"], 0);

    // Only admins: everyone else is told the route does not exist.
    for path in ["/v1/admin/conversations", "/v1/admin/supervision"] {
        let (status, body) = server.get(path, Some("tok-alice")).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert_eq!(body["error"]["code"], "not_found");
        let (status, _) = server.get(path, None).await;
        assert_eq!(status, 401, "{path}");
    }
    let (status, _) = server
        .call("POST", "/v1/admin/reload", Some("tok-bob"), None)
        .await;
    assert_eq!(status, 404);

    // A second conversation of alice's evicts the first (max_per_user = 1):
    // the decision, its inputs and its outcome.
    let (_, before) = server.get("/v1/admin/supervision", Some("tok-root")).await;
    let head = before["head"].as_u64().unwrap();
    let second = alice.create().await;
    let evicted = eventually("the eviction's decision", || async {
        let path = format!("/v1/admin/supervision?since={head}");
        let (status, page) = server.get(&path, Some("tok-root")).await;
        assert_eq!(status, 200, "{page}");
        let found = page["decisions"]
            .as_array()
            .and_then(|d| d.iter().find(|d| d["rule"] == "user_limit").cloned());
        found.ok_or(page)
    })
    .await;
    assert_eq!(evicted["conversation"], a.as_str(), "{evicted:#}");
    assert_eq!(evicted["user"], "alice");
    assert_eq!(evicted["outcome"], "stopped");
    assert_eq!(
        evicted["inputs"]["class"], "running_attached",
        "{evicted:#}"
    );
    assert_eq!(evicted["inputs"]["max_per_user"], 1);
    assert_eq!(evicted["inputs"]["activating"], second.as_str());
    assert_eq!(evicted["inputs"]["reason"], "user_limit");
    assert!(evicted["seq"].as_u64().unwrap() > head);
    let list = active_until(&server, "the second only", |l| {
        l.iter().filter(|c| c["user"] == "alice").count() == 1
    })
    .await;
    assert!(list.iter().any(|c| c["id"] == second.as_str()));

    // Paging: `since` is exclusive, `limit` takes the oldest first.
    let seq = evicted["seq"].as_u64().unwrap();
    let (_, page) = server
        .get(
            &format!("/v1/admin/supervision?since={}&limit=1", seq - 1),
            Some("tok-root"),
        )
        .await;
    assert_eq!(page["decisions"].as_array().map(Vec::len), Some(1));
    assert_eq!(page["decisions"][0]["seq"], seq);
    assert_eq!(page["oldest"], 1);
    let (_, page) = server
        .get(
            &format!("/v1/admin/supervision?since={}", page["head"]),
            Some("tok-root"),
        )
        .await;
    assert_eq!(page["decisions"], json!([]), "{page}");
    server.shutdown().await;
}

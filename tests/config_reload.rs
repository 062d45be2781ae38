//! Live configuration over the real binary: `SIGHUP` and
//! `POST /v1/admin/reload` re-read the config file while conversations run.
//! The per-user limit and the close delay change without a connection or a
//! conversation being dropped; a broken file changes nothing and names the
//! key; a key that cannot change live is refused by name while the others
//! apply; the log's level and format change too.
//!
//! Waits are on the supervision log (`GET /v1/admin/supervision`), the
//! admin list, the process's log lines or frames, each bounded by
//! `RECV_TIMEOUT`.

mod common;

use common::process::{rewrite_config, temp_store, write_config_verbatim, ServerProcess};
use common::{assert_contiguous, eventually, is_event};
use serde_json::{json, Value};

/// Tokens equal to the user names, so that `ServerProcess::connect(user)`
/// works; `ops` is an admin.
const TOKENS: &str = r#"
[auth]
mode = "tokens"
tokens = [{ token = "alice", user = "alice" }, { token = "ops", user = "ops", admin = true }]
"#;

fn with_conversations(keys: &str) -> String {
    format!("{TOKENS}\n[conversations]\n{keys}\n")
}

/// Polls the supervision log until a decision matches; returns it.
async fn decision(server: &ServerProcess, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    eventually(&format!("a {what} decision"), || async {
        let (status, page) = server.get("/v1/admin/supervision", Some("ops")).await;
        assert_eq!(status, 200, "{page}");
        let found = page["decisions"]
            .as_array()
            .and_then(|all| all.iter().find(|d| pred(d)).cloned());
        found.ok_or(page)
    })
    .await
}

/// Polls the admin list until `done` holds for it; returns it.
async fn active_until(
    server: &ServerProcess,
    what: &str,
    done: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    eventually(&format!("{what} active"), || async {
        let (status, list) = server.get("/v1/admin/conversations", Some("ops")).await;
        assert_eq!(status, 200, "{list}");
        match list.as_array() {
            Some(all) if done(all) => Ok(all.clone()),
            _ => Err(list),
        }
    })
    .await
}

fn ids(list: &[Value]) -> Vec<&str> {
    list.iter().filter_map(|c| c["id"].as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_changes_the_user_limit_and_close_delay_while_conversations_run() {
    let (_dir, store) = temp_store();
    let mut server = ServerProcess::spawn(
        &store,
        &with_conversations("max_per_user = 3\nclose_delay = \"1h\""),
    );
    let mut alice = server.connect("alice").await;
    let mut ids_created = Vec::new();
    for _ in 0..3 {
        let id = alice.create().await;
        alice.events(&id, 2).await;
        ids_created.push(id);
    }
    // A turn streams across the reload.
    let streaming = ids_created[2].clone();
    alice.send_message(&streaming, "/stream 40 50").await;
    let started = alice.events_until_kind(&streaming, "turn_started").await;
    let started = started.last().unwrap().clone();
    assert!(is_event(&started, "turn_started"), "{started}");

    rewrite_config(
        &store,
        &with_conversations("max_per_user = 1\nclose_delay = \"300ms\""),
    );
    server.signal("HUP");
    let reload = decision(&server, "config_reload", |d| d["rule"] == "config_reload").await;
    assert_eq!(reload["outcome"], "applied", "{reload:#}");
    assert_eq!(reload["inputs"]["trigger"], "SIGHUP", "{reload:#}");
    let changed = &reload["inputs"]["changed"];
    assert_eq!(
        changed["conversations.max_per_user"],
        json!({"from": 3, "to": 1}),
        "{reload:#}"
    );
    assert_eq!(
        changed["conversations.close_delay"],
        json!({"from": "1h", "to": "300ms"}),
        "{reload:#}"
    );
    let line = server.wait_for_log(|l| l.contains("configuration reloaded"));
    assert!(line.contains("conversations.max_per_user"), "{line}");

    // Nothing was stopped or dropped: the turn ends on the same socket,
    // every event once, and all three are still active.
    let turn = alice.events_until_turn_finished(&streaming).await;
    assert_eq!(turn.last().unwrap()["data"]["status"], "completed");
    assert_contiguous(&turn, common::seq(&started) + 1);
    let active = active_until(&server, "three", |l| l.len() == 3).await;
    assert!(active
        .iter()
        .all(|c| c["user"] == "alice" && c["attached"] == 1));

    // The next activation applies the new limit: the three make room.
    let fourth = alice.create().await;
    for id in &ids_created {
        let evicted = decision(&server, "user_limit", |d| {
            d["rule"] == "user_limit" && d["conversation"] == id.as_str()
        })
        .await;
        assert_eq!(evicted["outcome"], "stopped", "{evicted:#}");
        assert_eq!(evicted["inputs"]["max_per_user"], 1, "{evicted:#}");
    }
    let left = active_until(&server, "only the fourth", |l| l.len() == 1).await;
    assert_eq!(ids(&left), [fourth.as_str()]);

    // The new close delay: nobody attached, closed after 300ms idle.
    alice.drop_abruptly();
    let idle = decision(&server, "idle_close", |d| {
        d["rule"] == "idle_close" && d["conversation"] == fourth.as_str()
    })
    .await;
    assert_eq!(idle["inputs"]["close_delay"], "300ms", "{idle:#}");
    active_until(&server, "none", |l| l.is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_file_keeps_the_running_values_and_names_the_key() {
    let (_dir, store) = temp_store();
    let mut server = ServerProcess::spawn(
        &store,
        &with_conversations("max_per_user = 2\nclose_delay = \"1h\""),
    );
    rewrite_config(
        &store,
        &with_conversations("max_per_user = 1\nclose_delay = \"soon\""),
    );
    server.signal("HUP");
    let line = server.wait_for_log(|l| l.contains("configuration not reloaded"));
    assert!(line.contains("conversations.close_delay"), "{line}");
    let invalid = decision(&server, "invalid reload", |d| d["outcome"] == "invalid").await;
    assert!(
        invalid["inputs"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("conversations.close_delay")),
        "{invalid:#}"
    );

    // Over REST: 422, the key named; only an admin may ask.
    let (status, body) = server
        .call("POST", "/v1/admin/reload", Some("ops"), None)
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["code"], "config_invalid", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("conversations.close_delay")),
        "{body}"
    );
    let (status, _) = server
        .call("POST", "/v1/admin/reload", Some("alice"), None)
        .await;
    assert_eq!(status, 404);
    // Counted for alerts (README, "Metrics").
    let (_, metrics) = server.get("/metrics", None).await;
    assert!(
        metrics
            .as_str()
            .is_some_and(|m| m.contains("linger_config_reloads_total{outcome=\"invalid\"} 2")),
        "{metrics}"
    );

    // The running limit is still 2: two conversations stay active.
    let mut alice = server.connect("alice").await;
    let first = alice.create().await;
    let second = alice.create().await;
    let active = active_until(&server, "two", |l| l.len() == 2).await;
    let mut listed = ids(&active);
    listed.sort();
    let mut want = vec![first.as_str(), second.as_str()];
    want.sort();
    assert_eq!(listed, want);

    // Fixed, the file applies, from the values that ran all along.
    rewrite_config(
        &store,
        &with_conversations("max_per_user = 2\nclose_delay = \"5m\""),
    );
    let (status, outcome) = server
        .call("POST", "/v1/admin/reload", Some("ops"), None)
        .await;
    assert_eq!(status, 200, "{outcome}");
    assert_eq!(
        outcome["applied"],
        json!([{"key": "conversations.close_delay", "from": "1h", "to": "5m"}]),
        "{outcome:#}"
    );
    assert_eq!(outcome["refused"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_that_cannot_change_live_are_refused_by_name_and_the_others_apply() {
    let (_dir, store) = temp_store();
    let mut server = ServerProcess::spawn(&store, &with_conversations("max_per_user = 3"));
    // A full file: another port, another retention, cluster mode, a log
    // level (LINGER_LOG is set for the test binary, so it wins), and one
    // key that may change.
    write_config_verbatim(
        &store,
        &format!(
            "[server]\nlisten = \"127.0.0.1:1\"\n[store]\npath = {:?}\nretain = \"1d\"\n\
             [cluster]\nmode = \"nats\"\n[log]\nlevel = \"debug\"\n{}",
            store.display().to_string(),
            with_conversations("max_per_user = 1")
        ),
    );
    server.signal("HUP");
    let reload = decision(&server, "config_reload", |d| d["rule"] == "config_reload").await;
    assert_eq!(reload["outcome"], "partly applied", "{reload:#}");
    assert_eq!(
        reload["inputs"]["changed"],
        json!({"conversations.max_per_user": {"from": 3, "to": 1}}),
        "{reload:#}"
    );
    let refused = reload["inputs"]["refused"]
        .as_object()
        .expect("refused keys");
    let mut keys: Vec<&str> = refused.keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(
        keys,
        ["cluster.mode", "log.level", "server.listen", "store.retain"],
        "{reload:#}"
    );
    for key in ["cluster.mode", "server.listen", "store.retain"] {
        let message = refused[key].as_str().unwrap_or_default();
        assert!(
            message.contains(key) && message.contains("restart"),
            "{key}: {message}"
        );
    }
    assert!(
        refused["log.level"]
            .as_str()
            .is_some_and(|m| m.contains("LINGER_LOG")),
        "{reload:#}"
    );
    let warned = server.wait_for_log(|l| l.contains("server.listen cannot change"));
    assert!(warned.contains("WARN"), "{warned}");

    // Still serving where it was, with the new limit in force.
    let (status, _) = server.get("/healthz", None).await;
    assert_eq!(status, 200);
    let mut alice = server.connect("alice").await;
    let first = alice.create().await;
    let second = alice.create().await;
    let left = active_until(&server, "only the second", |l| l.len() == 1).await;
    assert_eq!(ids(&left), [second.as_str()]);
    let _ = first;

    // A reload with nothing new says so; refused keys stay refused.
    let (status, outcome) = server
        .call("POST", "/v1/admin/reload", Some("ops"), None)
        .await;
    assert_eq!(status, 200, "{outcome}");
    assert_eq!(outcome["applied"], json!([]));
    assert_eq!(outcome["refused"].as_array().map(Vec::len), Some(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_level_and_format_change_live() {
    let (_dir, store) = temp_store();
    let quiet =
        format!("{TOKENS}\n[log]\nlevel = \"warn,linger::server=info\"\nformat = \"pretty\"\n");
    // Without LINGER_LOG, log.level decides.
    let mut server = ServerProcess::spawn_with(&store, &quiet, |command| {
        command.env_remove("LINGER_LOG");
    });
    // Before the reload: a conversation, whose actor outlives the format
    // change.
    let mut alice = server.connect("alice").await;
    let id = alice.create().await;
    alice.events(&id, 2).await;

    rewrite_config(
        &store,
        &format!("{TOKENS}\n[log]\nlevel = \"info\"\nformat = \"json\"\n"),
    );
    server.signal("HUP");
    let reloaded = server.wait_for_log(|l| {
        serde_json::from_str::<Value>(l).is_ok_and(|v| v["message"] == "configuration reloaded")
    });
    let reloaded: Value = serde_json::from_str(&reloaded).unwrap();
    assert_eq!(reloaded["rule"], "config_reload", "{reloaded}");

    // Info lines now, as JSON, also from the actors started before.
    alice.send_message(&id, "hello").await;
    alice.events_until_turn_finished(&id).await;
    let turn = server.wait_for_log(|l| {
        serde_json::from_str::<Value>(l)
            .is_ok_and(|v| v["message"] == "turn finished" && v["conversation"] == id.as_str())
    });
    assert!(turn.contains("\"completed\""), "{turn}");
    let mut bob = server.connect("ops").await;
    bob.request(json!({"type": "ping"})).await;
    server.wait_for_log(|l| {
        serde_json::from_str::<Value>(l).is_ok_and(|v| v["message"] == "connection opened")
    });
    // Under the old level, no info line of the actors was written at all.
    for line in server.log() {
        if line.contains("connection opened") || line.contains("turn finished") {
            assert!(
                serde_json::from_str::<Value>(&line).is_ok(),
                "an info line under the old level: {line}"
            );
        }
    }
    // The process is healthy after the switch (no formatter panicked).
    let (status, _) = server.get("/healthz", None).await;
    assert_eq!(status, 200);
}

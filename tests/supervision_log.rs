//! Every supervision decision leaves a JSON log line with its rule and
//! inputs, and `/metrics` counts it (the real binary, `log.format = "json"`).

mod common;

use common::is_event;
use common::process::{temp_store, ServerProcess};
use serde_json::Value;

const CONFIG: &str = r#"
[conversations]
max_per_user = 1
close_delay = "300ms"
detach_grace = "300ms"
[agent]
turn_timeout = "1s"
[log]
format = "json"
"#;

fn decision(server: &mut ServerProcess, rule: &str, conversation: &str) -> Value {
    let line = server.wait_for_log(|l| {
        serde_json::from_str::<Value>(l)
            .is_ok_and(|v| v["rule"] == rule && v["conversation"] == conversation)
    });
    serde_json::from_str(&line).unwrap()
}

fn metric(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_are_logged_as_json_and_counted() {
    let (_dir, store) = temp_store();
    let mut server = ServerProcess::spawn(&store, CONFIG);

    // user limit: the second conversation evicts the first.
    let mut alice = server.connect("alice").await;
    let first = alice.create().await;
    alice.events(&first, 2).await;
    let second = alice.create().await;
    let evicted = decision(&mut server, "user_limit", &first);
    assert_eq!(evicted["user"], "alice");
    assert_eq!(evicted["class"], "idle_attached");
    assert_eq!(evicted["active_for_user"], 1);
    assert_eq!(evicted["max_per_user"], 1);

    // turn timeout
    alice.send_message(&second, "/sleep 30s").await;
    let turn = alice.events_until_turn_finished(&second).await;
    assert_eq!(turn.last().unwrap()["data"]["status"], "failed");
    let timed_out = decision(&mut server, "turn_timeout", &second);
    assert_eq!(timed_out["user"], "alice");

    // idle close once nobody is attached
    alice.drop_abruptly();
    let idle = decision(&mut server, "idle_close", &second);
    assert_eq!(idle["reason"], "idle");
    assert!(idle["idle_for"].is_string() && idle["close_delay"] == "300ms");

    // detach grace
    let mut bob = server.connect("bob").await;
    let running = bob.create().await;
    bob.send_message(&running, "/stream 5000 20").await;
    bob.recv_until(|f| is_event(f, "text_delta")).await;
    bob.drop_abruptly();
    let abandoned = decision(&mut server, "detach_grace", &running);
    assert_eq!(abandoned["user"], "bob");

    // Every line of the log is one JSON object; actor starts and stops and
    // attach/detach are there with their fields.
    let log = server.log();
    for line in &log {
        serde_json::from_str::<Value>(line)
            .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
    }
    let has = |message: &str, conversation: &str| {
        log.iter().any(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            v["message"] == message && v["conversation"] == conversation
        })
    };
    assert!(has("conversation actor started", &first));
    assert!(has("conversation actor stopped", &first));
    assert!(has("attached", &second));
    assert!(has("detached", &second));
    assert!(has("turn finished", &second));

    let body = reqwest::get(format!("http://{}/metrics", server.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metric(
            &body,
            r#"linger_conversations_stopped_total{reason="user_limit"}"#
        ) >= 1.0
    );
    assert!(
        metric(
            &body,
            r#"linger_conversations_stopped_total{reason="idle"}"#
        ) >= 1.0
    );
    assert!(metric(&body, r#"linger_turns_finished_total{status="failed"}"#) >= 1.0);
    assert!(metric(&body, r#"linger_turns_finished_total{status="abandoned"}"#) >= 1.0);
    assert!(metric(&body, r#"linger_events_appended_total{kind="text_delta"}"#) >= 1.0);
    assert!(body.contains("linger_turn_duration_seconds_bucket"));
    // Appends per commit are counted in powers of two, up to the writer's
    // largest group (4,096), not in the seconds of the other histograms.
    let groups = metric(&body, "linger_store_commit_group_size_count");
    assert!(groups >= 1.0);
    assert_eq!(
        metric(&body, r#"linger_store_commit_group_size_bucket{le="4096"}"#),
        groups
    );
    assert!(!body.contains(r#"linger_store_commit_group_size_bucket{le="0.0005"}"#));
    assert!(body.contains("linger_active_conversations{status=\"idle\"}"));
    let health = reqwest::get(format!("http://{}/healthz", server.addr))
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 200);
}

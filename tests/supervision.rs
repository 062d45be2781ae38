//! Supervision policies of protocol §6 with short configured durations:
//! the per-user limit and its eviction order, idle close, detach grace,
//! reject mode and the turn timeout.

mod common;

use std::time::{Duration, SystemTime};

use common::{is_event, kind, seq, TestServer};
use serde_json::{json, Value};

fn ts(event: &Value) -> SystemTime {
    humantime::parse_rfc3339(event["ts"].as_str().expect("ts")).expect("RFC 3339 ts")
}

fn stopped_with(events: &[Value], reason: &str) -> bool {
    events
        .last()
        .is_some_and(|e| is_event(e, "agent_stopped") && e["data"]["reason"] == reason)
}

/// OpenHands' multi-conversation scenario: the fourth conversation of a user
/// evicts the least recently active one; coming back to it evicts the next.
#[tokio::test]
async fn fourth_conversation_evicts_the_least_recently_active() {
    let server = TestServer::start_with(|c| c.conversations.max_per_user = 3).await;
    let mut clients = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let mut client = server.connect("alice").await;
        let id = client.create().await;
        client.events(&id, 2).await;
        ids.push(id);
        clients.push(client);
    }
    let mut fourth = server.connect("alice").await;
    let id4 = fourth.create().await;
    fourth.events(&id4, 2).await;

    // The first one is stopped for the limit, and its connection told so.
    let first = &mut clients[0];
    let stopped = first.next_event(&ids[0]).await;
    assert!(is_event(&stopped, "agent_stopped"), "{stopped}");
    assert_eq!(stopped["data"]["reason"], "user_limit");
    assert_eq!(seq(&stopped), 3);
    let (detached, _) = first.recv_until(|f| f["type"] == "detached").await;
    assert_eq!(detached["reason"], "user_limit");
    assert_eq!(detached["conversation_id"], ids[0].as_str());

    // Coming back: attach and send. History and seq are intact.
    let attached = first.attach(&ids[0], 3).await;
    assert_eq!(attached["replay_from"], 4);
    let restarted = first.next_event(&ids[0]).await;
    assert_eq!(seq(&restarted), 4);
    assert_eq!(restarted["data"]["reason"], "attach");
    let ack = first.send_message(&ids[0], "back again").await;
    assert_eq!(ack["seq"], 5);
    let turn = first.events_until_turn_finished(&ids[0]).await;
    common::assert_contiguous(&turn, 5);
    let history = server.stored_events(&ids[0], "alice", 0).await;
    common::assert_contiguous(&history, 1);

    // The least recently active of the others (the second) made room.
    let second = &mut clients[1];
    let stopped = second.next_event(&ids[1]).await;
    assert_eq!(stopped["data"]["reason"], "user_limit");
    let (detached, _) = second.recv_until(|f| f["type"] == "detached").await;
    assert_eq!(detached["reason"], "user_limit");
    let third = &mut clients[2];
    let ping = third.request(json!({"type": "ping"})).await;
    assert_eq!(ping["type"], "pong");
    assert!(
        third.skipped.iter().all(|f| f["type"] != "detached"),
        "the third conversation was not the least recently active"
    );
}

#[tokio::test]
async fn eviction_takes_an_idle_conversation_before_an_older_running_one() {
    let server = TestServer::start_with(|c| c.conversations.max_per_user = 2).await;
    let mut runner = server.connect("alice").await;
    let running = runner.create().await;
    runner.send_message(&running, "/stream 2000 20").await;
    runner
        .recv_until(|f| is_event(f, "text_delta") && f["conversation_id"] == running.as_str())
        .await;
    let mut idler = server.connect("alice").await;
    let idle = idler.create().await;
    idler.events(&idle, 2).await;

    let mut newcomer = server.connect("alice").await;
    let fresh = newcomer.create().await;
    newcomer.events(&fresh, 2).await;

    let stopped = idler.next_event(&idle).await;
    assert_eq!(stopped["data"]["reason"], "user_limit");
    // The older, running conversation keeps streaming.
    let more = runner.next_event(&running).await;
    assert_eq!(kind(&more), "text_delta", "{more}");
    let stop = runner
        .request(json!({"type": "stop", "conversation_id": running}))
        .await;
    assert_eq!(stop["type"], "ack");
}

#[tokio::test]
async fn idle_close_fires_within_the_margin() {
    let server = TestServer::start_with(|c| {
        c.conversations.close_delay = Duration::from_millis(300);
    })
    .await;
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    client.send_message(&id, "hello").await;
    client.events_until_turn_finished(&id).await;
    drop(client);

    let events = server
        .wait_for_stored(&id, "alice", "agent_stopped idle", |e| {
            stopped_with(e, "idle")
        })
        .await;
    let n = events.len();
    let quiet = ts(&events[n - 1])
        .duration_since(ts(&events[n - 2]))
        .expect("ts grows");
    assert!(
        quiet >= Duration::from_millis(300),
        "closed after {quiet:?}"
    );
    // The upper margin of §6 is checked in virtual time, where a busy
    // machine cannot break it (`actors::rule_tests`).
    let (status, summary) = server
        .get(&format!("/v1/conversations/{id}"), Some("alice"))
        .await;
    assert_eq!(status, 200);
    assert_eq!(summary["status"], "stopped");
}

#[tokio::test]
async fn attached_and_running_conversations_are_not_idle_closed() {
    let server = TestServer::start_with(|c| {
        c.conversations.close_delay = Duration::from_millis(200);
    })
    .await;
    let mut watcher = server.connect("alice").await;
    let attached = watcher.create().await;
    watcher.events(&attached, 2).await;

    let mut worker = server.connect("alice").await;
    let running = worker.create().await;
    worker.send_message(&running, "/sleep 1500ms").await;
    worker.next_event(&running).await;
    worker.drop_abruptly();

    let mut other = server.connect("bob").await;
    let witness = other.create().await;
    drop(other);
    // The witness is idle and detached: its close proves close_delay passed.
    server
        .wait_for_stored(&witness, "bob", "idle close", |e| stopped_with(e, "idle"))
        .await;

    let events = server
        .wait_for_stored(&running, "alice", "the sleeping turn to finish", |e| {
            e.iter().any(|e| is_event(e, "turn_finished"))
        })
        .await;
    let finished = events
        .iter()
        .position(|e| is_event(e, "turn_finished"))
        .unwrap();
    assert_eq!(events[finished]["data"]["status"], "completed");
    assert!(
        events[..finished]
            .iter()
            .all(|e| !is_event(e, "agent_stopped")),
        "a running conversation was stopped: {events:#?}"
    );

    let ping = watcher.request(json!({"type": "ping"})).await;
    assert_eq!(ping["type"], "pong");
    let history = server.stored_events(&attached, "alice", 0).await;
    assert!(
        history.iter().all(|e| !is_event(e, "agent_stopped")),
        "an attached conversation was idle-closed"
    );
}

#[tokio::test]
async fn a_conversations_own_close_delay_wins() {
    let server = TestServer::start_with(|c| {
        c.conversations.close_delay = Duration::from_millis(100);
    })
    .await;
    let mut client = server.connect("alice").await;
    let reply = client
        .request(json!({"type": "create", "close_delay": "700ms"}))
        .await;
    let id = reply["conversation_id"].as_str().unwrap().to_owned();
    client.events(&id, 2).await;
    drop(client);
    let events = server
        .wait_for_stored(&id, "alice", "idle close", |e| stopped_with(e, "idle"))
        .await;
    let quiet = ts(&events[2]).duration_since(ts(&events[1])).unwrap();
    assert!(
        quiet >= Duration::from_millis(700),
        "closed after {quiet:?}"
    );
}

#[tokio::test]
async fn detach_grace_abandons_an_unattended_turn() {
    let server = TestServer::start_with(|c| {
        c.conversations.detach_grace = Duration::from_millis(300);
        c.conversations.close_delay = Duration::from_millis(300);
    })
    .await;
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    client.send_message(&id, "/stream 5000 20").await;
    client.recv_until(|f| is_event(f, "text_delta")).await;
    client.drop_abruptly();
    let events = server
        .wait_for_stored(&id, "alice", "abandoned, then idle close", |e| {
            stopped_with(e, "idle")
        })
        .await;
    let finished = events
        .iter()
        .find(|e| is_event(e, "turn_finished"))
        .expect("turn_finished");
    assert_eq!(finished["data"]["status"], "abandoned");
}

#[tokio::test]
async fn reject_mode_refuses_the_fourth() {
    let server = TestServer::start_with(|c| {
        c.conversations.max_per_user = 3;
        c.conversations.on_limit = linger::config::OnLimit::Reject;
    })
    .await;
    let mut client = server.connect("alice").await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(client.create().await);
    }
    let refused = client.request(json!({"type": "create"})).await;
    assert_eq!(refused["type"], "error");
    assert_eq!(refused["code"], "limit_reached");
    let response = reqwest::Client::new()
        .post(server.http_url("/v1/conversations"))
        .bearer_auth("alice")
        .json(&json!({"title": "one too many"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 429);
    // Nothing was stopped to make room.
    for id in &ids {
        let history = server.stored_events(id, "alice", 0).await;
        assert!(history.iter().all(|e| !is_event(e, "agent_stopped")));
    }
}

#[tokio::test]
async fn a_turn_timeout_fails_the_turn() {
    let server = TestServer::start_with(|c| {
        c.agent.turn_timeout = Duration::from_millis(300);
    })
    .await;
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    client.send_message(&id, "/sleep 30s").await;
    let turn = client.events_until_turn_finished(&id).await;
    let finished = turn.last().unwrap();
    assert_eq!(finished["data"]["status"], "failed");
    let error = finished["data"]["error"].as_str().unwrap_or("");
    assert!(error.contains("timed out"), "error: {error}");
    client.send_message(&id, "next").await;
    let turn = client.events_until_turn_finished(&id).await;
    assert_eq!(turn.last().unwrap()["data"]["status"], "completed");
}

//! Durability of the real binary: history survives SIGKILL (protocol §5.4),
//! and SIGTERM shuts down gracefully (protocol §6).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::process::{temp_store, ServerProcess};
use common::{is_event, kind, seq};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_loses_nothing_that_was_seen() {
    let (_dir, store) = temp_store();
    let mut server = ServerProcess::spawn(&store, "");
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    client.send_message(&id, "/stream 3000 5").await;
    let mut seen: BTreeMap<u64, Value> = BTreeMap::new();
    loop {
        let event = client.next_event(&id).await;
        seen.insert(seq(&event), event.clone());
        if kind(&event) == "text_delta" && seen.len() >= 40 {
            break;
        }
    }
    let workspace = store.join("workspaces").join(&id);
    std::fs::write(workspace.join("notes.txt"), "written before the crash").unwrap();
    server.kill9();
    drop(client);

    let mut server = ServerProcess::spawn(&store, "");
    server.wait_for_log(|l| l.contains("recovered conversation after restart"));
    assert_eq!(
        std::fs::read_to_string(workspace.join("notes.txt")).unwrap(),
        "written before the crash",
        "the workspace survives a crash"
    );
    let mut client = server.connect("alice").await;
    let attached = client.attach(&id, 0).await;
    assert_eq!(attached["replay_from"], 1);
    assert_eq!(attached["replay_incomplete"], false);
    // Attaching re-activates it, so `agent_started` may already be part of
    // the replay (it is committed before or after the attach is handled).
    let mut replay = client
        .events(&id, attached["head_seq"].as_u64().unwrap() as usize)
        .await;
    if kind(replay.last().unwrap()) != "agent_started" {
        replay.push(client.next_event(&id).await);
    }
    common::assert_contiguous(&replay, 1);
    for event in &replay {
        if let Some(before) = seen.get(&seq(event)) {
            assert_eq!(before, event, "seq {} changed across the crash", seq(event));
        }
    }
    let last_seen = *seen.keys().last().unwrap();
    let n = replay.len();
    assert!(
        n as u64 > last_seen + 2,
        "events seen up to {last_seen} were lost"
    );
    let (finished, stopped, started) = (&replay[n - 3], &replay[n - 2], &replay[n - 1]);
    assert_eq!(kind(finished), "turn_finished");
    assert_eq!(finished["data"]["status"], "interrupted");
    assert_eq!(kind(stopped), "agent_stopped");
    assert_eq!(stopped["data"]["reason"], "restart_recovery");
    assert!(is_event(started, "agent_started"));
    assert_eq!(started["data"]["reason"], "attach");

    // The next message works and seq continues.
    let head = seq(started);
    let ack = client.send_message(&id, "still here").await;
    assert_eq!(ack["seq"], head + 1);
    let turn = client.events_until_turn_finished(&id).await;
    common::assert_contiguous(&turn, head + 1);
    assert_eq!(turn.last().unwrap()["data"]["status"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_shuts_down_gracefully() {
    let (_dir, store) = temp_store();
    let mut server = ServerProcess::spawn(&store, "");
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    client.send_message(&id, "/stream 3000 5").await;
    loop {
        let event = client.next_event(&id).await;
        if kind(&event) == "text_delta" {
            break;
        }
    }
    server.signal("TERM");
    let (frames, code) = client.until_closed().await;
    assert_eq!(
        code,
        Some(1001),
        "sockets close with 1001; frames: {frames:?}"
    );
    let finished = frames
        .iter()
        .position(|f| is_event(f, "turn_finished"))
        .expect("turn_finished before the close");
    assert_eq!(frames[finished]["data"]["status"], "interrupted");
    let stopped = frames
        .iter()
        .position(|f| is_event(f, "agent_stopped"))
        .expect("agent_stopped before the close");
    assert_eq!(frames[stopped]["data"]["reason"], "shutdown");
    assert_eq!(seq(&frames[stopped]), seq(&frames[finished]) + 1);
    let detached = frames
        .iter()
        .position(|f| f["type"] == "detached")
        .expect("detached before the close");
    assert_eq!(frames[detached]["reason"], "shutdown");
    assert!(detached > stopped);
    let status = server.wait_exit(Duration::from_secs(15));
    assert_eq!(status.code(), Some(0), "exit status {status:?}");

    // The store was flushed: a restart finds the history closed by the
    // shutdown itself, with nothing left to recover.
    let last = seq(&frames[stopped]);
    let mut server = ServerProcess::spawn(&store, "");
    let mut client = server.connect("alice").await;
    let attached = client.attach(&id, last).await;
    assert_eq!(attached["replay_from"], last + 1);
    let started = client.next_event(&id).await;
    assert_eq!(seq(&started), last + 1);
    assert_eq!(started["data"]["reason"], "attach");
    assert!(!server
        .log()
        .iter()
        .any(|l| l.contains("recovered conversation after restart")));
    let reply = client.request(json!({"type": "ping"})).await;
    assert_eq!(reply["type"], "pong");
    server.signal("TERM");
    assert_eq!(server.wait_exit(Duration::from_secs(15)).code(), Some(0));
}

/// Protocol §11: with `agent.resume_interrupted`, a turn cut by a crash is
/// run again, once, when its conversation is next active, for the same user
/// message (`turn_started.resumed_from`); a resumed turn cut again is not
/// resumed a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_turn_is_resumed_once() {
    let (_dir, store) = temp_store();
    let config = "[agent]\nresume_interrupted = true\n";
    let mut server = ServerProcess::spawn(&store, config);
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    let ack = client.send_message(&id, "/stream 100000 20").await;
    let message_seq = ack["seq"].as_u64().unwrap();
    let started = client.events_until_kind(&id, "text_delta").await;
    let first_turn = started
        .iter()
        .find(|e| is_event(e, "turn_started"))
        .map(|e| e["data"]["turn_id"].clone())
        .unwrap();
    server.kill9();

    // Next activation: the same message runs again, as a resumed turn.
    let mut server = ServerProcess::spawn(&store, config);
    let mut client = server.connect("alice").await;
    client.attach(&id, 0).await;
    let (resumed, _) = client
        .recv_until(|f| is_event(f, "turn_started") && f["data"]["turn_id"] != first_turn)
        .await;
    assert_eq!(resumed["data"]["message_seq"], message_seq, "{resumed}");
    assert_eq!(resumed["data"]["resumed_from"], first_turn, "{resumed}");
    client.events_until_kind(&id, "text_delta").await;
    server.kill9();

    // Cut again: not resumed a second time.
    let server = ServerProcess::spawn(&store, config);
    let mut client = server.connect("alice").await;
    let attached = client.attach(&id, 0).await;
    let head = attached["head_seq"].as_u64().unwrap();
    let mut replay = client.events(&id, head as usize).await;
    if kind(replay.last().unwrap()) != "agent_started" {
        replay.push(client.next_event(&id).await);
    }
    common::assert_contiguous(&replay, 1);
    let starts: Vec<&Value> = replay
        .iter()
        .filter(|e| is_event(e, "turn_started"))
        .collect();
    assert_eq!(
        starts.len(),
        2,
        "one turn and its one resumption: {starts:#?}"
    );
    assert_eq!(kind(replay.last().unwrap()), "agent_started");
    // And it stays idle: a new message is the next thing that runs.
    let ack = client.send_message(&id, "hello").await;
    assert_eq!(ack["seq"], seq(replay.last().unwrap()) + 1);
}

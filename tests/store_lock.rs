//! One process per store: a second `linger serve` on a store in use is
//! refused before it reads or writes anything, naming the holder, whether
//! or not its own port is free; and the port is bound before start-up
//! recovery writes a word.

mod common;

use std::time::Duration;

use common::process::{serve_refused, temp_store, ServerProcess};
use common::{assert_contiguous, kind, seq, stream_text};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_server_on_a_store_in_use_is_refused_and_changes_nothing() {
    let (_dir, store) = temp_store();
    let mut first = ServerProcess::spawn(&store, "");
    let mut client = first.connect("alice").await;
    let id = client.create().await;
    let turn = client.send_message(&id, "/stream 200 20").await;
    let from = seq(&turn);
    let mut seen = Vec::new();
    while seen.is_empty() {
        let event = client.next_event(&id).await;
        if seq(&event) >= from {
            seen.push(event);
        }
    }

    // On a free port of its own, and on the first one's port: refused
    // either way, and the message names who holds the store.
    for listen in ["127.0.0.1:0".to_owned(), first.addr.to_string()] {
        let (status, stderr) = serve_refused(&store, &listen);
        assert!(!status.success(), "a second server started on {listen}");
        assert!(
            stderr.contains("in use by another linger")
                && stderr.contains(&format!("pid {}", first.pid))
                && stderr.contains(&format!("listening on {}", first.addr)),
            "the refusal names the holder; stderr: {stderr}"
        );
        assert!(
            !stderr.contains("recovered"),
            "nothing was recovered; stderr: {stderr}"
        );
    }

    // The first server's turn was never touched: it completes, contiguous.
    loop {
        let event = client.next_event(&id).await;
        let done = kind(&event) == "turn_finished";
        seen.push(event);
        if done {
            break;
        }
    }
    assert_contiguous(&seen, from);
    let finished = seen.last().unwrap();
    assert_eq!(finished["data"]["status"], "completed", "{finished}");
    let text: String = seen
        .iter()
        .filter(|e| kind(e) == "text_delta")
        .map(|e| e["data"]["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, stream_text(200));

    // Once the first server is gone, the store is free again.
    first.signal("TERM");
    assert_eq!(first.wait_exit(Duration::from_secs(15)).code(), Some(0));
    let second = ServerProcess::spawn(&store, "");
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_port_is_found_before_recovery_writes_anything() {
    let (_dir, store) = temp_store();
    let mut server = ServerProcess::spawn(&store, "");
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    client.send_message(&id, "/stream 3000 5").await;
    loop {
        if kind(&client.next_event(&id).await) == "text_delta" {
            break;
        }
    }
    server.kill9();
    drop(client);

    // The store needs recovery, but the port is taken: the start fails,
    // says how to choose another port, and leaves the store as it was.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (status, stderr) = serve_refused(&store, &taken.local_addr().unwrap().to_string());
    assert!(!status.success());
    assert!(
        stderr.contains("cannot listen on") && stderr.contains("LINGER__SERVER__LISTEN"),
        "stderr: {stderr}"
    );
    assert!(!stderr.contains("recovered"), "stderr: {stderr}");
    drop(taken);

    // The next real start recovers the turn, exactly once.
    let mut server = ServerProcess::spawn(&store, "");
    server.wait_for_log(|l| l.contains("recovered conversation after restart"));
    let events = server_events(&server, &id).await;
    let interrupted = events
        .iter()
        .filter(|e| kind(e) == "turn_finished" && e["data"]["status"] == "interrupted")
        .count();
    let recovered = events
        .iter()
        .filter(|e| kind(e) == "agent_stopped" && e["data"]["reason"] == "restart_recovery")
        .count();
    assert_eq!(
        (interrupted, recovered),
        (1, 1),
        "recovered once: {events:?}"
    );
    assert_contiguous(&events, 1);
}

/// Every stored event of a conversation, over REST.
async fn server_events(server: &ServerProcess, id: &str) -> Vec<serde_json::Value> {
    let url = format!(
        "http://{}/v1/conversations/{id}/events?after=0&limit=100000",
        server.addr
    );
    let body: serde_json::Value = reqwest::Client::new()
        .get(url)
        .bearer_auth("alice")
        .send()
        .await
        .expect("GET events")
        .json()
        .await
        .expect("JSON body");
    body["events"].as_array().expect("events").clone()
}

//! The server's log when nobody reads its stderr (a stuck pipe, a paused
//! terminal): conversations go on, the lines that do not fit in the log's
//! queue are dropped and counted, and a warning says so once the log flows.

mod common;

use common::process::{temp_store, ServerProcess};
use common::Client;
use linger::logging::QUEUED_LINES;
use std::time::Duration;

/// Users opening connections side by side, each one at a time.
const USERS: usize = 16;
/// Connections each user opens and closes: two log lines each ("connection
/// opened", "connection closed"), 19,200 in all, more than the log's queue
/// (16,384 lines) and the pipe (64 KiB) hold together.
const CONNECTIONS_PER_USER: usize = 600;

/// How long the dropped lines may take to be warned of: the server looks
/// every 5 seconds.
const WARNED_WITHIN: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_whose_log_nobody_reads_keeps_serving_and_counts_what_it_dropped() {
    let (_dir, store) = temp_store();
    let mut server = ServerProcess::spawn(&store, "");
    server.stop_reading_log();

    let opened = futures_util::future::join_all((0..USERS).map(|u| {
        let url = server.ws_url(&format!("logger-{u}"));
        async move {
            for _ in 0..CONNECTIONS_PER_USER {
                let mut client = Client::connect(&url, "logger").await;
                // Answered: the server has set the connection up.
                let pong = client.request(serde_json::json!({"type": "ping"})).await;
                assert_eq!(pong["type"], "pong");
                drop(client);
            }
        }
    }));
    opened.await;

    // Still unread: a conversation runs a whole turn.
    let mut client = server.connect("writer").await;
    let id = client.create().await;
    client.attach(&id, 0).await;
    client.send_message(&id, "/stream 5 0").await;
    let events = client.events_until_turn_finished(&id).await;
    assert_eq!(common::text_deltas(&events).len(), 5);

    // Counted first, then said: once the log flows, the warning comes
    // (while the queue is full it is dropped too, and counted in the next).
    server.resume_reading_log();
    server.wait_for_log_within(WARNED_WITHIN, |l| {
        l.contains("log: lines were dropped, stderr took them slower than they came")
    });
    let dropped = server.metric("linger_log_lines_dropped_total").await;
    assert!(dropped > 0.0, "no dropped log line counted");
    assert!(
        dropped < (2 * USERS * CONNECTIONS_PER_USER) as f64,
        "every line dropped ({dropped}): none queued"
    );
    // The queue's lines reached stderr before the warning, in order: the
    // first connections' (the last ones' came when it was full).
    let opened = server
        .log()
        .iter()
        .filter(|l| l.contains("connection opened"))
        .count();
    assert!(
        opened >= QUEUED_LINES / 2,
        "{opened} connections' openings logged: the queue's lines were lost"
    );
}

//! Protocol §5.6: a client that stops reading during a long turn slows
//! neither the agent nor another client of the same conversation, the
//! server's memory stays bounded, and the slow client is then either caught
//! up from the log (every event, contiguous) or closed with 4008.
//!
//! The server is the real binary in its own process, so that its peak
//! memory (`VmHWM` in `/proc/PID/status`) is its own, not the test's.

mod common;

use serde_json::json;

use common::process::{temp_store, ServerProcess};
use common::*;

/// Events in each turn: enough that what the server may hold for a while
/// whatever a client misses (up to about 7 MiB, see below) is well under
/// a third of what the slow client misses.
const EVENTS: u64 = 200_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_slows_nobody_and_memory_stays_bounded() {
    let (_dir, store) = temp_store();
    let server = ServerProcess::spawn(&store, "[limits]\nmax_outbound_frames = 64\n");
    let url = server.ws_url("alice");
    // The slow client has a small socket buffer, so the server's writes to
    // it block soon after it stops reading.
    let mut slow = Client::connect_small_buffer(&url, "alice", 4096).await;
    let id = slow.create().await;
    let mut fast = server.connect("alice").await;
    let attached = fast.attach(&id, 0).await;
    assert_eq!(attached["replay_from"], 1, "{attached}");
    let opening = fast.events(&id, 2).await;
    assert_contiguous(&opening, 1);

    // Two turns with both clients reading bring the server to its working
    // size (allocator, the store's page cache, which one turn's events do
    // not fill, and the sockets' write buffers, which keep the size the
    // turn's last message grew them to): the baseline.
    let mut warm = 3;
    for _ in 0..2 {
        fast.send_message(&id, &format!("/stream {EVENTS} 0")).await;
        let (next, deltas, _, _) = fast.read_turn(&id, warm).await;
        assert_eq!(deltas, EVENTS);
        let from = if warm == 3 { 1 } else { warm };
        let (caught, _, _, _) = slow.read_turn(&id, from).await;
        assert_eq!(caught, next);
        warm = next;
    }
    let (peak_before, rss_before) = server.memory_kib();

    // From here on the slow client reads nothing until the turn is over.
    let ack = fast.send_message(&id, &format!("/stream {EVENTS} 0")).await;
    assert_eq!(seq(&ack), warm, "{ack}");
    let (after_turn, deltas, bytes, finished) = fast.read_turn(&id, warm).await;
    assert_eq!(deltas, EVENTS, "the reading client missed deltas");
    assert_eq!(finished["data"]["status"], "completed", "{finished}");
    let (peak_after, rss_after) = server.memory_kib();
    let growth = peak_after.saturating_sub(peak_before);
    println!(
        "slow consumer: server VmHWM {peak_before} KiB -> {peak_after} KiB (+{growth} KiB), \
         VmRSS {rss_before} KiB -> {rss_after} KiB, while one client read nothing of a turn of \
         {} events ({} KiB of JSON)",
        after_turn - warm,
        bytes / 1024
    );
    // Had the server queued the slow client's frames, its peak would have
    // grown by more than their size; it holds at most
    // `max_outbound_frames` of them (and the replay's page). What its peak
    // does grow by (in some runs, up to about 7 MiB: a fold of the store's
    // journal holds up to 32,768 events, and the agent's in-flight
    // credits) does not depend on how much the client missed.
    assert!(
        (growth as usize) * 1024 < bytes / 3,
        "the server's peak memory grew by {growth} KiB while a client read nothing of {} KiB \
         of events",
        bytes / 1024
    );

    // The slow client now reads: either everything, contiguous, or a 4008.
    let mut next = warm;
    let mut outcome = None;
    while next < after_turn {
        match slow.recv_or_close().await {
            Ok(frame) if frame["type"] == "event" && frame["conversation_id"] == id => {
                assert_eq!(
                    seq(&frame),
                    next,
                    "the slow client: gap or duplicate: {frame}"
                );
                next += 1;
            }
            Ok(frame) => assert!(
                frame["type"] != "error",
                "the slow client got an error: {frame}"
            ),
            Err(code) => {
                outcome = Some(code);
                break;
            }
        }
    }
    match outcome {
        None => {
            println!(
                "slow consumer: caught up, {} events contiguous",
                next - warm
            );
            // Caught up, it is live again: the next turn reaches both.
            fast.send_message(&id, "/stream 3 0").await;
            let (end_fast, _, _, _) = fast.read_turn(&id, after_turn).await;
            let (end_slow, _, _, _) = slow.read_turn(&id, after_turn).await;
            assert_eq!(end_fast, end_slow);
        }
        Some(code) => {
            println!(
                "slow consumer: closed with {code:?} after {} events",
                next - warm
            );
            assert_eq!(
                code,
                Some(4008),
                "a lagging client is closed with 4008 only"
            );
            // Its conversation carried on: a new connection resumes exactly.
            let mut again = server.connect("alice").await;
            let attached = again.attach(&id, next - 1).await;
            assert_eq!(attached["replay_from"], next, "{attached}");
            let (end, _, _, _) = again.read_turn(&id, next).await;
            assert_eq!(end, after_turn);
        }
    }
}

/// A client that reads nothing for `limits.slow_consumer_patience` (here
/// 2 s) while frames wait for it is closed with 4008, and that close reaches
/// it when it reads again; the conversation and its other client carry on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_for_its_patience_is_closed_with_4008() {
    let (_dir, store) = temp_store();
    let mut server = ServerProcess::spawn(
        &store,
        "[limits]\nmax_outbound_frames = 16\nslow_consumer_patience = \"2s\"\n",
    );
    let url = server.ws_url("alice");
    let mut slow = Client::connect_small_buffer(&url, "alice", 4096).await;
    let id = slow.create().await;
    let mut fast = server.connect("alice").await;
    fast.attach(&id, 0).await;
    fast.events(&id, 2).await;
    // 20,000 events (about 4 MB) fill the slow client's socket buffers and
    // queue many times over.
    fast.send_message(&id, "/stream 20000 0").await;
    let (after_turn, _, _, _) = fast.read_turn(&id, 3).await;
    // The server gives up on the slow client after its patience without
    // progress: wait for it to say so (no client reads meanwhile).
    let line = server.wait_for_log_within(std::time::Duration::from_secs(90), |l| {
        l.contains("connection closed")
    });
    println!("{line}");
    let mut next = 1;
    let code = loop {
        match slow.recv_or_close().await {
            Ok(frame) if frame["type"] == "event" => {
                assert_eq!(
                    seq(&frame),
                    next,
                    "gap or duplicate before the close: {frame}"
                );
                next += 1;
            }
            Ok(_) => {}
            Err(code) => break code,
        }
    };
    println!("the slow client read {} events, then {code:?}", next - 1);
    assert!(next < after_turn, "the slow client was not behind");
    assert_eq!(
        code,
        Some(4008),
        "closed without the slow-consumer close code"
    );
    // The other client and the conversation are fine.
    fast.send_message(&id, "/stream 3 0").await;
    let (end, deltas, _, _) = fast.read_turn(&id, after_turn).await;
    assert_eq!(deltas, 3);
    let mut again = server.connect("alice").await;
    let attached = again.attach(&id, next - 1).await;
    assert_eq!(attached["replay_from"], next, "{attached}");
    let resumed = again.events(&id, (end - next) as usize).await;
    assert_contiguous(&resumed, next);
    let _ = json!({});
    // Counted for operators (README, "Metrics").
    let closes = server.metric("linger_slow_consumer_closes_total").await;
    assert!(closes >= 1.0, "{closes} slow-consumer closes counted");
}

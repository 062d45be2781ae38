//! What the server keeps in memory is bounded by its configuration, not by
//! the traffic (README, "Memory"): long turns, one after the other, leave
//! its resident memory where the first ones brought it.
//!
//! The server is the real binary in its own process, so that its memory
//! (`/proc/PID/status`) is its own and its allocator is set up as `linger
//! serve` sets it up.

mod common;

use common::process::{temp_store, ServerProcess};
use common::*;

/// Tokens in each turn: the demo agent ends such a turn with one assistant
/// message of about 3.3 MB, the size of a long answer's whole text and
/// far over any allocator's threshold for a mapping of its own.
const TOKENS: u64 = 300_000;

/// Turns run before the baseline is taken: they bring the store's page
/// cache and the allocator's heaps to their working size.
const WARM_TURNS: usize = 2;

/// Turns run after the baseline.
const MEASURED_TURNS: usize = 5;

/// How much the resident memory may grow over the measured turns: each
/// turn writes about 60 MB of events and sends as much, so this is far
/// below anything that grows with them. (glibc's allocator left as it
/// is, with its heap per thread and its threshold for a mapping raised by
/// each long message freed, grew by 9 to 17 MiB here, from a baseline
/// twice as high.)
const SLACK_KIB: u64 = 4 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_turns_one_after_the_other_leave_memory_where_it_was() {
    let (_dir, store) = temp_store();
    let server = ServerProcess::spawn(&store, "");
    // Two clients (a laptop and a phone) follow the conversation.
    let mut laptop = server.connect("alice").await;
    let id = laptop.create().await;
    let mut phone = server.connect("alice").await;
    let attached = phone.attach(&id, 0).await;
    assert_eq!(attached["replay_from"], 1, "{attached}");
    for client in [&mut laptop, &mut phone] {
        let opening = client.events(&id, 2).await;
        assert_contiguous(&opening, 1);
    }
    let mut next = 3;

    let stream = format!("/stream {TOKENS} 0");
    let mut turn = async |next| {
        laptop.send_message(&id, &stream).await;
        let (on_laptop, on_phone) =
            tokio::join!(laptop.read_turn(&id, next), phone.read_turn(&id, next));
        let (end, _, _, finished) = on_laptop;
        assert_eq!(finished["data"]["status"], "completed", "{finished}");
        assert_eq!(end, on_phone.0);
        end
    };
    for _ in 0..WARM_TURNS {
        next = turn(next).await;
    }
    let (_, baseline) = server.memory_kib();
    let mut resident = Vec::new();
    for _ in 0..MEASURED_TURNS {
        next = turn(next).await;
        resident.push(server.memory_kib().1);
    }
    println!("resident KiB after {WARM_TURNS} turns: {baseline}, then after each: {resident:?}");
    let most = resident.iter().copied().max().unwrap_or(baseline);
    assert!(
        most <= baseline + SLACK_KIB,
        "the server's resident memory grew from {baseline} KiB to {most} KiB over \
         {MEASURED_TURNS} turns of {TOKENS} tokens (after each: {resident:?})"
    );
}

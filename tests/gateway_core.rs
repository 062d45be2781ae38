//! The gateway's core promises (protocol §3–§5), driven over real sockets
//! against an in-process server running the demo agent.

mod common;

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use common::*;

/// Reads events of `id` on `client` until it has seen `deltas` text deltas.
async fn read_until_deltas(client: &mut Client, id: &str, deltas: usize) -> Vec<Value> {
    let mut events = Vec::new();
    let mut seen = 0;
    while seen < deltas {
        let event = client.next_event(id).await;
        assert_ne!(
            kind(&event),
            "turn_finished",
            "the turn ended before {deltas} deltas: {event}"
        );
        if kind(&event) == "text_delta" {
            seen += 1;
        }
        events.push(event);
    }
    events
}

/// Checks that the text deltas of one `/stream N` turn, merged by seq, are
/// `tok1 ` .. `tokN ` each exactly once and in order.
fn assert_stream_tokens(events: &[Value], n: u64) {
    let mut by_seq = BTreeMap::new();
    for (s, text) in text_deltas(events) {
        if let Some(old) = by_seq.insert(s, text.clone()) {
            assert_eq!(old, text, "seq {s} carried two different texts");
        }
    }
    let tokens: Vec<String> = by_seq.into_values().collect();
    let want: Vec<String> = (1..=n).map(|i| format!("tok{i} ")).collect();
    assert_eq!(tokens.len(), want.len(), "number of distinct text deltas");
    assert_eq!(tokens, want, "text deltas by seq");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_survives_client_disconnect_mid_stream() {
    let server = TestServer::start().await;
    let mut c1 = server.connect("alice").await;
    let id = c1.create().await;
    c1.send_message(&id, "/stream 200 5").await;
    let before = read_until_deltas(&mut c1, &id, 10).await;
    assert_contiguous(&before, 1);
    let s = seq(before.last().unwrap());
    assert_eq!(kind(before.last().unwrap()), "text_delta");
    c1.drop_abruptly();

    // Nobody is attached: the turn must finish on its own. REST reads the
    // store without activating or attaching anything.
    let stored = server
        .wait_for_stored(&id, "alice", "a turn_finished", |events| {
            events.iter().any(|e| kind(e) == "turn_finished")
        })
        .await;
    let finished = stored.last().unwrap();
    assert_eq!(kind(finished), "turn_finished", "{finished}");
    assert_eq!(finished["data"]["status"], "completed", "{finished}");
    let head = seq(finished);

    let mut c2 = server.connect("alice").await;
    let attached = c2.attach(&id, s).await;
    assert_eq!(attached["replay_from"], s + 1, "{attached}");
    assert_eq!(attached["replay_incomplete"], false, "{attached}");
    assert_eq!(attached["head_seq"], head, "{attached}");
    assert_eq!(attached["status"], "idle", "{attached}");
    assert_eq!(attached["pending_calls"], json!([]), "{attached}");
    let replay = c2.events_until_turn_finished(&id).await;
    assert_contiguous(&replay, s + 1);
    assert_eq!(seq(replay.last().unwrap()), head, "events past head_seq");
    assert_eq!(
        replay,
        stored[s as usize..].to_vec(),
        "the replay differs from the stored history"
    );
    let last = replay.last().unwrap();
    assert_eq!(kind(last), "turn_finished");
    assert_eq!(last["data"]["status"], "completed");

    let mut all = before.clone();
    all.extend(replay.iter().cloned());
    assert_stream_tokens(&all, 200);
    let reply = the_one(&all, "assistant_message");
    assert_eq!(reply["data"]["text"], stream_text(200));

    // The same attachment carries on live after its replay, without a gap.
    let ack = c2.send_message(&id, "/stream 3 1").await;
    assert_eq!(ack["seq"], head + 1, "{ack}");
    let live = c2.events_until_turn_finished(&id).await;
    assert_contiguous(&live, head + 1);
    assert_eq!(live.last().unwrap()["data"]["status"], "completed");
    assert_eq!(
        the_one(&live, "assistant_message")["data"]["text"],
        stream_text(3)
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reattach_while_running_gets_replay_then_live() {
    let server = TestServer::start().await;
    let mut c1 = server.connect("alice").await;
    let id = c1.create().await;
    // 200 deltas 20 ms apart: about four seconds, far longer than a reconnect.
    c1.send_message(&id, "/stream 200 20").await;
    let before = read_until_deltas(&mut c1, &id, 5).await;
    assert_contiguous(&before, 1);
    let s = seq(before.last().unwrap());
    c1.drop_abruptly();

    let mut c2 = server.connect("alice").await;
    let attached = c2.attach(&id, s).await;
    assert_eq!(attached["replay_from"], s + 1, "{attached}");
    assert_eq!(attached["replay_incomplete"], false, "{attached}");
    assert_eq!(attached["status"], "running", "{attached}");
    let head = attached["head_seq"].as_u64().unwrap();
    assert!(
        head >= s,
        "head_seq {head} is behind a seq already seen ({s})"
    );
    let after = c2.events_until_turn_finished(&id).await;
    assert_contiguous(&after, s + 1);
    // The turn was running at attach, so its end is live, past head_seq.
    assert!(seq(after.last().unwrap()) > head);
    assert_eq!(after.last().unwrap()["data"]["status"], "completed");

    let mut all = before;
    all.extend(after);
    assert_stream_tokens(&all, 200);
    assert_eq!(
        the_one(&all, "assistant_message")["data"]["text"],
        stream_text(200)
    );
    server.shutdown().await;
}

/// Merges a segment of events into the events seen so far, checking that a
/// seq seen twice carried the same frame.
fn merge(by_seq: &mut BTreeMap<u64, Value>, segment: &[Value]) {
    for event in segment {
        if let Some(old) = by_seq.insert(seq(event), event.clone()) {
            assert_eq!(
                &old,
                event,
                "seq {} was sent as two different events",
                seq(event)
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_random_reconnects_during_a_long_stream() {
    let seed: u64 = std::env::var("LINGER_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("twenty_random_reconnects: LINGER_TEST_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);

    let server = TestServer::start().await;
    let mut c0 = server.connect("alice").await;
    let id = c0.create().await;
    c0.send_message(&id, "/stream 2000 1").await;
    let first = c0.events(&id, rng.random_range(5..=50)).await;
    assert_contiguous(&first, 1);
    c0.drop_abruptly();

    let mut by_seq = BTreeMap::new();
    merge(&mut by_seq, &first);
    let mut max_seen = seq(first.last().unwrap());
    let mut finished_at: Option<u64> = None;

    for round in 0..20 {
        let last_seq = rng.random_range(0..=max_seen);
        let mut client = server.connect("alice").await;
        let attached = client.attach(&id, last_seq).await;
        assert_eq!(
            attached["replay_from"],
            last_seq + 1,
            "round {round}: {attached}"
        );
        assert_eq!(
            attached["replay_incomplete"], false,
            "round {round}: {attached}"
        );
        let head = attached["head_seq"].as_u64().unwrap();
        assert!(
            head >= max_seen,
            "round {round}: head_seq {head} is behind seq {max_seen}, already seen"
        );
        // Read a random number of events, but never wait past the end.
        let mut want = rng.random_range(1..=200u64);
        if let Some(end) = finished_at {
            want = want.min(end - last_seq);
        }
        let mut segment = Vec::new();
        while (segment.len() as u64) < want {
            let event = client.next_event(&id).await;
            let done = kind(&event) == "turn_finished";
            segment.push(event);
            if done {
                finished_at = Some(seq(segment.last().unwrap()));
                break;
            }
        }
        assert_contiguous(&segment, last_seq + 1);
        merge(&mut by_seq, &segment);
        if let Some(last) = segment.last() {
            max_seen = max_seen.max(seq(last));
        }
        client.drop_abruptly();
    }

    // A last connection reads whatever is left.
    if finished_at.is_none() {
        let mut client = server.connect("alice").await;
        let attached = client.attach(&id, max_seen).await;
        assert_eq!(attached["replay_from"], max_seen + 1, "{attached}");
        let rest = client.events_until_turn_finished(&id).await;
        assert_contiguous(&rest, max_seen + 1);
        merge(&mut by_seq, &rest);
    }

    let all: Vec<Value> = by_seq.into_values().collect();
    assert_contiguous(&all, 1);
    let last = all.last().unwrap();
    assert_eq!(kind(last), "turn_finished", "{last}");
    assert_eq!(last["data"]["status"], "completed", "{last}");
    assert_stream_tokens(&all, 2000);
    assert_eq!(
        the_one(&all, "assistant_message")["data"]["text"],
        stream_text(2000)
    );
    // The store holds exactly what was sent.
    let stored = server.stored_events(&id, "alice", 0).await;
    assert_eq!(stored, all, "the stored history differs from what was sent");
    server.shutdown().await;
}

/// While a turn streams, a commit's events go to the live connections from
/// the store's side (the fanout). A connection that stays attached must see
/// every seq once and in order while others attach (and join the live
/// stream), detach (and must be sent nothing after `detached`) and drop,
/// and the same goes for each of them from where it attached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_sees_every_event_once_while_others_come_and_go() {
    let server = TestServer::start().await;
    let mut watcher = server.connect("alice").await;
    let id = watcher.create().await;
    watcher.send_message(&id, "/stream 3000 2").await;
    let mut seen = watcher.events(&id, 20).await;
    for round in 0..12u64 {
        let mut other = server.connect("alice").await;
        let from = seq(seen.last().unwrap()).saturating_sub(round * 7);
        let attached = other.attach(&id, from).await;
        assert_eq!(
            attached["replay_from"],
            from + 1,
            "round {round}: {attached}"
        );
        let mut segment = other.events(&id, 30).await;
        if round % 2 == 0 {
            // Politely: nothing may follow `detached`, which attaching
            // again on the same connection would show as a gap or a repeat.
            other
                .send(json!({"type": "detach", "req": "d", "conversation_id": id}))
                .await;
            let (detached, before) = other.recv_until(|f| f["type"] == "detached").await;
            assert_eq!(detached["reason"], "client", "round {round}: {detached}");
            segment.extend(before.into_iter().filter(|f| f["type"] == "event"));
            assert_contiguous(&segment, from + 1);
            let last = seq(segment.last().unwrap());
            let again = other.attach(&id, last).await;
            assert_eq!(again["replay_from"], last + 1, "round {round}: {again}");
            let more = other.events(&id, 10).await;
            assert_contiguous(&more, last + 1);
        } else {
            assert_contiguous(&segment, from + 1);
            other.drop_abruptly();
        }
        seen.extend(watcher.events(&id, 40).await);
    }
    seen.extend(watcher.events_until_turn_finished(&id).await);
    assert_contiguous(&seen, 1);
    assert_stream_tokens(&seen, 3000);
    let stored = server.stored_events(&id, "alice", 0).await;
    assert_eq!(
        stored, seen,
        "the stored history differs from what was sent"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_client_tool_call_survives_a_disconnect() {
    let server = TestServer::start().await;
    let mut c1 = server.connect("alice").await;
    let id = c1.create().await;
    c1.send_message(&id, r#"/ask confirm {"x":1}"#).await;
    let events = c1.events_until_kind(&id, "tool_call").await;
    assert_contiguous(&events, 1);
    let call = events.last().unwrap().clone();
    assert_eq!(call["data"]["target"], "client", "{call}");
    assert_eq!(call["data"]["name"], "confirm", "{call}");
    assert_eq!(call["data"]["args"], json!({"x": 1}), "{call}");
    let call_id = call["data"]["call_id"].as_str().unwrap().to_owned();
    c1.drop_abruptly();

    let mut c2 = server.connect("alice").await;
    let attached = c2.attach(&id, 0).await;
    assert_eq!(attached["status"], "waiting", "{attached}");
    assert_eq!(attached["pending_calls"], json!([call_id]), "{attached}");
    assert_eq!(attached["replay_from"], 1, "{attached}");
    let head = attached["head_seq"].as_u64().unwrap();
    assert_eq!(head, seq(&call), "nothing may follow the pending call yet");
    let replay = c2.events(&id, head as usize).await;
    assert_contiguous(&replay, 1);
    assert_eq!(
        replay.last().unwrap(),
        &call,
        "the replay must hold the tool_call"
    );

    let ack = c2
        .request(
            json!({"type": "tool_result", "req": 11, "conversation_id": id,
            "call_id": call_id, "output": {"ok": true}}),
        )
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    assert_eq!(ack["conversation_id"], id, "{ack}");
    assert_eq!(ack["seq"], head + 1, "{ack}");
    let rest = c2.events_until_turn_finished(&id).await;
    assert_contiguous(&rest, head + 1);
    let result = &rest[0];
    assert_eq!(kind(result), "tool_result", "{result}");
    assert_eq!(result["data"]["call_id"], call_id, "{result}");
    assert_eq!(result["data"]["output"], json!({"ok": true}), "{result}");
    assert_eq!(result["data"]["is_error"], false, "{result}");
    assert_eq!(
        the_one(&rest, "assistant_message")["data"]["text"],
        r#"confirm returned {"ok":true}"#
    );
    assert_eq!(rest.last().unwrap()["data"]["status"], "completed");

    let again = c2
        .request(
            json!({"type": "tool_result", "req": 12, "conversation_id": id,
            "call_id": call_id, "output": {"ok": false}}),
        )
        .await;
    assert_eq!(again["type"], "error", "{again}");
    assert_eq!(again["code"], "unknown_call", "{again}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_from_a_later_connection_aborts_a_detached_turn() {
    let server = TestServer::start().await;
    let mut c1 = server.connect("alice").await;
    let id = c1.create().await;
    // 1000 deltas 20 ms apart: twenty seconds unless stopped.
    c1.send_message(&id, "/stream 1000 20").await;
    let before = read_until_deltas(&mut c1, &id, 1).await;
    let s = seq(before.last().unwrap());
    let turn_id = before.last().unwrap()["data"]["turn_id"].clone();
    c1.drop_abruptly();

    let mut c2 = server.connect("alice").await;
    let attached = c2.attach(&id, s).await;
    assert_eq!(attached["status"], "running", "{attached}");
    let ack = c2
        .request(json!({"type": "stop", "conversation_id": id}))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    assert_eq!(ack["conversation_id"], id, "{ack}");
    let after = c2.events_until_turn_finished(&id).await;
    assert_contiguous(&after, s + 1);
    let finished = after.last().unwrap();
    assert_eq!(finished["data"]["status"], "stopped", "{finished}");
    assert_eq!(finished["data"]["turn_id"], turn_id, "{finished}");
    let deltas = text_deltas(&before).len() + text_deltas(&after).len();
    assert!(deltas < 1000, "the turn ran to its end ({deltas} deltas)");

    // The next turn runs, and nothing of the stopped one comes after it.
    let next = c2.send_message(&id, "after the stop").await;
    assert_eq!(next["seq"], seq(finished) + 1, "{next}");
    let events = c2.events_until_turn_finished(&id).await;
    assert_contiguous(&events, seq(finished) + 1);
    assert!(
        events.iter().all(|e| e["data"]["turn_id"] != turn_id),
        "the stopped turn still produced events: {events:#?}"
    );
    assert_eq!(events.last().unwrap()["data"]["status"], "completed");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seq_continues_across_turns_duplicates_and_queued_messages() {
    let server = TestServer::start().await;
    let mut c = server.connect("alice").await;
    let id = c.create().await;
    let opening = c.events(&id, 2).await;
    assert_contiguous(&opening, 1);

    let msg = |text: &str, client_msg_id: &str| {
        json!({"type": "message", "conversation_id": id, "text": text,
            "client_msg_id": client_msg_id})
    };

    // Turn 1.
    let ack1 = c.request(msg("hello world", "m1")).await;
    assert_eq!(ack1["type"], "ack", "{ack1}");
    assert_eq!(ack1["seq"], 3, "{ack1}");
    assert_eq!(ack1["duplicate"], false, "{ack1}");
    let turn1 = c.events_until_turn_finished(&id).await;
    assert_contiguous(&turn1, 3);
    assert_eq!(kind(&turn1[0]), "user_message");
    assert_eq!(turn1[0]["data"]["text"], "hello world");
    assert_eq!(turn1[0]["data"]["client_msg_id"], "m1");
    let started1 = the_one(&turn1, "turn_started");
    assert_eq!(started1["data"]["message_seq"], 3);
    assert_eq!(
        the_one(&turn1, "assistant_message")["data"]["text"],
        "hello world"
    );
    assert_eq!(turn1.last().unwrap()["data"]["status"], "completed");
    let head1 = seq(turn1.last().unwrap());

    // Turn 2: seq goes on.
    let ack2 = c.request(msg("second turn", "m2")).await;
    assert_eq!(ack2["seq"], head1 + 1, "{ack2}");
    let turn2 = c.events_until_turn_finished(&id).await;
    assert_contiguous(&turn2, head1 + 1);
    let started2 = the_one(&turn2, "turn_started");
    assert_eq!(started2["data"]["message_seq"], head1 + 1);
    assert_ne!(started2["data"]["turn_id"], started1["data"]["turn_id"]);
    assert_eq!(turn2.last().unwrap()["data"]["status"], "completed");
    let head2 = seq(turn2.last().unwrap());

    // A repeated client_msg_id: acked as a duplicate of the first, and it
    // records nothing: the next message gets the very next seq.
    let dup = c.request(msg("something else", "m1")).await;
    assert_eq!(dup["type"], "ack", "{dup}");
    assert_eq!(dup["seq"], 3, "{dup}");
    assert_eq!(dup["duplicate"], true, "{dup}");
    let ack3 = c.request(msg("/stream 2 1", "m3")).await;
    assert_eq!(
        ack3["seq"],
        head2 + 1,
        "the duplicate recorded something: {ack3}"
    );
    let turn3 = c.events_until_turn_finished(&id).await;
    assert_contiguous(&turn3, head2 + 1);
    assert_eq!(kind(&turn3[0]), "user_message");
    assert_eq!(turn3[0]["data"]["text"], "/stream 2 1");
    assert_eq!(
        the_one(&turn3, "turn_started")["data"]["message_seq"],
        head2 + 1
    );
    let head3 = seq(turn3.last().unwrap());

    // A message during a running turn is queued: recorded at once, started
    // after the running turn ends. `/ask` holds the turn open for sure.
    let ack4 = c.send_message(&id, "/ask hold").await;
    assert_eq!(ack4["seq"], head3 + 1, "{ack4}");
    let held = c.events_until_kind(&id, "tool_call").await;
    assert_contiguous(&held, head3 + 1);
    let call_id = held.last().unwrap()["data"]["call_id"].clone();
    let head4 = seq(held.last().unwrap());
    let ack5 = c.send_message(&id, "queued words").await;
    let queued_seq = head4 + 1;
    assert_eq!(ack5["seq"], queued_seq, "{ack5}");
    let recorded = c.next_event(&id).await;
    assert_eq!(seq(&recorded), queued_seq, "{recorded}");
    assert_eq!(kind(&recorded), "user_message", "{recorded}");
    assert_eq!(recorded["data"]["text"], "queued words");

    // Another connection sees it queued behind the waiting turn.
    let mut other = server.connect("alice").await;
    let attached = other.attach(&id, queued_seq).await;
    assert_eq!(attached["status"], "waiting", "{attached}");
    assert_eq!(attached["queued_messages"], 1, "{attached}");
    assert_eq!(attached["head_seq"], queued_seq, "{attached}");
    other.drop_abruptly();

    let ack = c
        .request(
            json!({"type": "tool_result", "conversation_id": id, "call_id": call_id,
            "output": "fine"}),
        )
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    let end4 = c.events_until_turn_finished(&id).await;
    assert_contiguous(&end4, queued_seq + 1);
    assert_eq!(end4.last().unwrap()["data"]["status"], "completed");
    assert!(
        end4.iter().all(|e| kind(e) != "turn_started"),
        "the queued turn started before the running one ended: {end4:#?}"
    );
    let turn5 = c.events_until_turn_finished(&id).await;
    assert_contiguous(&turn5, seq(end4.last().unwrap()) + 1);
    assert_eq!(kind(&turn5[0]), "turn_started", "{}", turn5[0]);
    assert_eq!(turn5[0]["data"]["message_seq"], queued_seq);
    assert_eq!(
        the_one(&turn5, "assistant_message")["data"]["text"],
        "queued words"
    );
    assert_eq!(turn5.last().unwrap()["data"]["status"], "completed");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attachments_control_observe_and_other_users() {
    let server = TestServer::start().await;
    let mut c1 = server.connect("alice").await;
    let id = c1.create().await;
    let mut c2 = server.connect("alice").await;
    let a2 = c2.attach(&id, 0).await;
    assert_eq!(a2["replay_from"], 1, "{a2}");
    let mut obs = server.connect("alice").await;
    let a3 = obs.attach_with(&id, 0, "observe").await;
    assert_eq!(a3["replay_from"], 1, "{a3}");

    c1.send_message(&id, "/stream 20 2").await;
    let e1 = c1.events_until_turn_finished(&id).await;
    let e2 = c2.events_until_turn_finished(&id).await;
    let e3 = obs.events_until_turn_finished(&id).await;
    assert_contiguous(&e1, 1);
    assert_eq!(e1, e2, "two control connections saw different events");
    assert_eq!(e1, e3, "the observer saw different events");

    // The second control connection steers too; both see its turn.
    c2.send_message(&id, "from two").await;
    let f2 = c2.events_until_turn_finished(&id).await;
    let f1 = c1.events_until_turn_finished(&id).await;
    assert_contiguous(&f1, seq(e1.last().unwrap()) + 1);
    assert_eq!(f1, f2);
    assert_eq!(f1.last().unwrap()["data"]["status"], "completed");

    // The observer reads only.
    for frame in [
        json!({"type": "message", "req": 1, "conversation_id": id, "text": "hi"}),
        json!({"type": "stop", "req": 2, "conversation_id": id}),
        json!({"type": "close", "req": 3, "conversation_id": id}),
        json!({"type": "tool_result", "req": 4, "conversation_id": id, "call_id": "call_x",
            "output": 1}),
    ] {
        let reply = obs.request(frame.clone()).await;
        assert_eq!(reply["type"], "error", "{frame} -> {reply}");
        assert_eq!(reply["code"], "read_only", "{frame} -> {reply}");
    }

    // Another user: the conversation does not exist for bob.
    let mut bob = server.connect("bob").await;
    for mode in ["control", "observe"] {
        let reply = bob
            .request(json!({"type": "attach", "conversation_id": id, "mode": mode}))
            .await;
        assert_eq!(reply["type"], "error", "{reply}");
        assert_eq!(
            reply["code"], "not_found",
            "bob attaching ({mode}): {reply}"
        );
    }
    let reply = bob
        .request(json!({"type": "message", "conversation_id": id, "text": "let me in"}))
        .await;
    assert_eq!(reply["type"], "error", "{reply}");
    assert_eq!(reply["code"], "not_attached", "{reply}");

    // Nothing bob or the observer did reached the history.
    let head = seq(f1.last().unwrap());
    let stored = server.stored_events(&id, "alice", 0).await;
    assert_eq!(
        stored.iter().map(seq).collect::<Vec<_>>(),
        (1..=head).collect::<Vec<_>>(),
        "{:#?}",
        stored.iter().skip(head as usize).collect::<Vec<_>>()
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_get_bad_request_and_the_connection_lives() {
    let server = TestServer::start().await;
    let mut c = server.connect("alice").await;
    let cases: Vec<(&str, Value)> = vec![
        ("{not json", Value::Null),
        ("[1,2,3]", Value::Null),
        (r#"{"req":1}"#, json!(1)),
        (r#"{"type":"frobnicate","req":2}"#, json!(2)),
        (r#"{"type":7,"req":3}"#, json!(3)),
        (r#"{"type":"attach","req":"r4"}"#, json!("r4")),
        (r#"{"type":"attach","req":5,"conversation_id":5}"#, json!(5)),
        (
            r#"{"type":"attach","req":6,"conversation_id":"c_x","last_seq":"x"}"#,
            json!(6),
        ),
        (
            r#"{"type":"message","req":7,"conversation_id":"c_x","text":["a"]}"#,
            json!(7),
        ),
        (
            r#"{"type":"tool_result","req":8,"conversation_id":"c_x"}"#,
            json!(8),
        ),
    ];
    for (text, req) in &cases {
        c.send_text(text).await;
        let reply = c.recv().await;
        assert_eq!(reply["type"], "error", "{text} -> {reply}");
        assert_eq!(reply["code"], "bad_request", "{text} -> {reply}");
        assert!(reply["message"].is_string(), "{text} -> {reply}");
        if req.is_null() {
            assert!(reply.get("req").is_none(), "{text} -> {reply}");
        } else {
            assert_eq!(&reply["req"], req, "{text} -> {reply}");
        }
    }
    c.send_binary(b"{\"type\":\"ping\"}".to_vec()).await;
    let reply = c.recv().await;
    assert_eq!(reply["type"], "error", "binary -> {reply}");
    assert_eq!(reply["code"], "bad_request", "binary -> {reply}");

    let pong = c
        .request(json!({"type": "ping", "req": "still-there"}))
        .await;
    assert_eq!(pong["type"], "pong", "{pong}");
    // And the connection still works for real.
    let id = c.create().await;
    c.send_message(&id, "fine").await;
    let events = c.events_until_turn_finished(&id).await;
    assert_eq!(events.last().unwrap()["data"]["status"], "completed");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_and_panicking_agents_fail_only_their_turn() {
    let server = TestServer::start().await;
    let mut c = server.connect("alice").await;
    let id = c.create().await;
    let mut next = 1;
    for bad in ["/panic", "/fail"] {
        let ack = c.send_message(&id, bad).await;
        let failed = c.events_until_turn_finished(&id).await;
        assert_contiguous(&failed, next);
        assert_eq!(seq(&failed[failed.len() - 3]), ack["seq"].as_u64().unwrap());
        let finished = failed.last().unwrap();
        assert_eq!(finished["data"]["status"], "failed", "{bad}: {finished}");
        let error = finished["data"]["error"].as_str().unwrap_or("");
        assert!(!error.is_empty(), "{bad}: no error string: {finished}");

        let ok = c.send_message(&id, "still alive").await;
        assert_eq!(ok["seq"], seq(finished) + 1, "{ok}");
        let events = c.events_until_turn_finished(&id).await;
        assert_contiguous(&events, seq(finished) + 1);
        assert_eq!(
            events.last().unwrap()["data"]["status"],
            "completed",
            "after {bad}"
        );
        assert_eq!(
            the_one(&events, "assistant_message")["data"]["text"],
            "still alive"
        );
        next = seq(events.last().unwrap()) + 1;
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_frames_created_detach_and_close() {
    let server = TestServer::start().await;
    let mut c = server.connect("alice").await;
    let id = c.create_titled("my title").await;
    let opening = c.events(&id, 2).await;
    assert_contiguous(&opening, 1);
    assert_eq!(kind(&opening[0]), "conversation_created", "{}", opening[0]);
    assert_eq!(opening[0]["data"]["user"], "alice");
    assert_eq!(opening[0]["data"]["title"], "my title");
    assert!(opening[0]["ts"].is_string(), "{}", opening[0]);
    assert_eq!(kind(&opening[1]), "agent_started", "{}", opening[1]);
    assert_eq!(opening[1]["data"]["reason"], "created");

    let detached = c
        .request(json!({"type": "detach", "req": 41, "conversation_id": id}))
        .await;
    assert_eq!(detached["type"], "detached", "{detached}");
    assert_eq!(detached["conversation_id"], id, "{detached}");
    assert_eq!(detached["reason"], "client", "{detached}");
    let refused = c
        .request(json!({"type": "message", "conversation_id": id, "text": "hi"}))
        .await;
    assert_eq!(refused["code"], "not_attached", "{refused}");

    // Close during a running turn.
    let attached = c.attach(&id, 2).await;
    assert_eq!(attached["replay_from"], 3, "{attached}");
    assert_eq!(attached["head_seq"], 2, "{attached}");
    c.send_message(&id, "/stream 1000 20").await;
    let running = read_until_deltas(&mut c, &id, 1).await;
    assert_contiguous(&running, 3);
    let ack = c
        .request(json!({"type": "close", "req": 42, "conversation_id": id}))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    assert_eq!(ack["conversation_id"], id, "{ack}");
    let (detached, skipped) = c.recv_until(|f| f["type"] == "detached").await;
    assert_eq!(detached["reason"], "closed", "{detached}");
    assert_eq!(detached["conversation_id"], id, "{detached}");
    let events: Vec<Value> = skipped
        .into_iter()
        .filter(|f| f["type"] == "event")
        .collect();
    assert_contiguous(&events, seq(running.last().unwrap()) + 1);
    let n = events.len();
    assert!(n >= 2, "{events:#?}");
    assert!(
        is_event(&events[n - 2], "turn_finished"),
        "{:#?}",
        &events[n - 2..]
    );
    assert_eq!(events[n - 2]["data"]["status"], "stopped");
    assert!(
        is_event(&events[n - 1], "agent_stopped"),
        "{}",
        events[n - 1]
    );
    assert_eq!(events[n - 1]["data"]["reason"], "closed");
    let closed_at = seq(&events[n - 1]);
    let (status, summary) = server
        .get(&format!("/v1/conversations/{id}"), Some("alice"))
        .await;
    assert_eq!(status, 200, "{summary}");
    assert_eq!(summary["status"], "stopped", "{summary}");
    assert_eq!(summary["head_seq"], closed_at, "{summary}");
    let refused = c
        .request(json!({"type": "message", "conversation_id": id, "text": "hi"}))
        .await;
    assert_eq!(refused["code"], "not_attached", "{refused}");

    // Attaching brings it back; seq goes on. Closing an idle one records no
    // turn_finished.
    let attached = c.attach(&id, closed_at).await;
    assert_eq!(attached["replay_from"], closed_at + 1, "{attached}");
    let started = c.next_event(&id).await;
    assert_eq!(seq(&started), closed_at + 1, "{started}");
    assert_eq!(kind(&started), "agent_started", "{started}");
    assert_eq!(started["data"]["reason"], "attach", "{started}");
    let ack = c
        .request(json!({"type": "close", "conversation_id": id}))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    let (detached, skipped) = c.recv_until(|f| f["type"] == "detached").await;
    assert_eq!(detached["reason"], "closed", "{detached}");
    let events: Vec<Value> = skipped
        .into_iter()
        .filter(|f| f["type"] == "event")
        .collect();
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(seq(&events[0]), closed_at + 2);
    assert!(is_event(&events[0], "agent_stopped"), "{}", events[0]);
    assert_eq!(events[0]["data"]["reason"], "closed");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_smoke() {
    let server = TestServer::start().await;
    let mut c = server.connect("alice").await;
    let id = c.create_titled("rest").await;
    c.send_message(&id, "two words").await;
    let seen = c.events_until_turn_finished(&id).await;
    // Everything sent so far (the creator got seq 1 and 2 first).
    assert_contiguous(&seen, 1);
    let head = seq(seen.last().unwrap());

    let (status, list) = server.get("/v1/conversations", Some("alice")).await;
    assert_eq!(status, 200, "{list}");
    let mine: Vec<&Value> = list
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .filter(|s| s["id"] == id)
        .collect();
    assert_eq!(mine.len(), 1, "{list}");
    assert_eq!(mine[0]["title"], "rest", "{list}");
    assert_eq!(mine[0]["head_seq"], head, "{list}");
    assert_eq!(mine[0]["status"], "idle", "{list}");
    assert!(mine[0]["created_at"].is_string(), "{list}");
    assert!(mine[0]["last_activity_at"].is_string(), "{list}");

    let (status, list) = server.get("/v1/conversations", Some("bob")).await;
    assert_eq!(status, 200, "{list}");
    assert!(
        list.as_array().unwrap().iter().all(|s| s["id"] != id),
        "bob sees alice's conversation: {list}"
    );

    let path = format!("/v1/conversations/{id}/events?after=0");
    let (status, body) = server.get(&path, Some("alice")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["head_seq"], head, "{body}");
    let stored = body["events"].as_array().unwrap().clone();
    assert_contiguous(&stored, 1);
    assert_eq!(stored, seen, "REST events differ from the websocket's");

    let (status, body) = server
        .get(
            &format!("/v1/conversations/{id}/events?after=3&limit=2"),
            Some("alice"),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let page = body["events"].as_array().unwrap();
    assert_eq!(page.len(), 2, "{body}");
    assert_contiguous(page, 4);

    for path in [
        format!("/v1/conversations/{id}"),
        format!("/v1/conversations/{id}/events?after=0"),
    ] {
        let (status, body) = server.get(&path, Some("bob")).await;
        assert_eq!(status, 404, "bob GET {path}: {body}");
        let (status, body) = server.get(&path, None).await;
        assert_eq!(status, 401, "anonymous GET {path}: {body}");
    }
    let (status, body) = server.get("/v1/conversations", None).await;
    assert_eq!(status, 401, "{body}");

    // The websocket refuses a missing token before the upgrade.
    let url = format!("ws://{}/v1/ws", server.addr);
    match tokio_tungstenite::connect_async(&url).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status().as_u16(), 401)
        }
        Err(e) => panic!("connecting without a token: unexpected error {e}"),
        Ok(_) => panic!("connecting without a token was accepted"),
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_replay_buffer_keeps_delivery_contiguous() {
    // One event of buffer: replays come from the store, and one commit of
    // several events (turn_finished + the queued turn's turn_started) is
    // larger than the buffer.
    let server = TestServer::start_with(|c| c.conversations.replay_buffer_events = 1).await;
    let mut c1 = server.connect("alice").await;
    let id = c1.create().await;
    let mut c2 = server.connect("alice").await;
    c2.attach(&id, 0).await;
    c1.send_message(&id, "/ask hold").await;
    let mut e1 = c1.events_until_kind(&id, "tool_call").await;
    let call_id = e1.last().unwrap()["data"]["call_id"].clone();
    c1.send_message(&id, "queued words").await;
    let ack = c1
        .request(
            json!({"type": "tool_result", "conversation_id": id, "call_id": call_id,
            "output": 1}),
        )
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    for _ in 0..2 {
        e1.extend(c1.events_until_turn_finished(&id).await);
    }
    let mut e2 = Vec::new();
    for _ in 0..2 {
        e2.extend(c2.events_until_turn_finished(&id).await);
    }
    assert_contiguous(&e1, 1);
    assert_contiguous(&e2, 1);
    assert_eq!(e1, e2);
    let stored = server.stored_events(&id, "alice", 0).await;
    assert_eq!(stored, e1);
    server.shutdown().await;
}

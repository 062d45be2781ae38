//! Durable history (protocol §5.2, §5.4): replay from the store when the
//! buffer does not hold the range, compact replays (§11), REST history,
//! delete, rehydration of stopped conversations, the window of
//! `client_msg_id`s, retention, and workspaces.

mod common;

use std::time::Duration;

use common::{assert_contiguous, is_event, kind, seq, TestServer};
use serde_json::{json, Value};

async fn post(server: &TestServer, path: &str, user: &str, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(server.http_url(path))
        .bearer_auth(user)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn delete(server: &TestServer, path: &str, user: &str) -> u16 {
    reqwest::Client::new()
        .delete(server.http_url(path))
        .bearer_auth(user)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test]
async fn a_small_buffer_replays_everything_from_the_store() {
    let server = TestServer::start_with(|c| c.conversations.replay_buffer_events = 10).await;
    let mut writer = server.connect("alice").await;
    let id = writer.create().await;
    writer.send_message(&id, "/stream 500 0").await;
    let turn = writer.events_until_turn_finished(&id).await;
    let head = seq(turn.last().unwrap());
    assert!(head > 500);

    let mut reader = server.connect("alice").await;
    let attached = reader.attach(&id, 1).await;
    assert_eq!(attached["replay_from"], 2);
    assert_eq!(attached["replay_incomplete"], false);
    assert_eq!(attached["head_seq"], head);
    let replay = reader.events(&id, (head - 1) as usize).await;
    assert_contiguous(&replay, 2);
    let text: String = common::text_deltas(&replay)
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    assert_eq!(text, common::stream_text(500));
}

#[tokio::test]
async fn rest_create_get_events_delete_and_observers() {
    let server = TestServer::start().await;
    let (status, created) = post(
        &server,
        "/v1/conversations",
        "alice",
        json!({"title": "via rest"}),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    assert_eq!(created["title"], "via rest");
    assert_eq!(created["head_seq"], 2);
    assert_eq!(created["status"], "idle");
    let workspace = server.store_path().join("workspaces").join(&id);
    assert!(
        workspace.is_dir(),
        "no workspace at {}",
        workspace.display()
    );

    let events = server.stored_events(&id, "alice", 0).await;
    assert_eq!(kind(&events[0]), "conversation_created");
    assert_eq!(events[1]["data"]["reason"], "rest");

    let (status, one) = server
        .get(&format!("/v1/conversations/{id}"), Some("alice"))
        .await;
    assert_eq!(status, 200);
    assert_eq!(one["id"], id.as_str());
    for user in ["bob"] {
        let (status, _) = server
            .get(&format!("/v1/conversations/{id}"), Some(user))
            .await;
        assert_eq!(status, 404);
        assert_eq!(
            delete(&server, &format!("/v1/conversations/{id}"), user).await,
            404
        );
        let (status, _) = post(
            &server,
            &format!("/v1/conversations/{id}/observers"),
            user,
            json!({"user": "bob"}),
        )
        .await;
        assert_eq!(status, 404);
    }

    // An observer granted through REST may watch, not steer.
    let (status, _) = post(
        &server,
        &format!("/v1/conversations/{id}/observers"),
        "alice",
        json!({"user": "carol"}),
    )
    .await;
    assert_eq!(status, 204);
    let mut carol = server.connect("carol").await;
    let refused = carol
        .request(json!({"type": "attach", "conversation_id": id, "mode": "control"}))
        .await;
    assert_eq!(refused["type"], "error", "{refused}");
    carol.attach_with(&id, 0, "observe").await;
    let (status, _) = server
        .get(&format!("/v1/conversations/{id}"), Some("carol"))
        .await;
    assert_eq!(status, 200);

    // Delete: 204, the attached observer is told, history and workspace go.
    assert_eq!(
        delete(&server, &format!("/v1/conversations/{id}"), "alice").await,
        204
    );
    let (detached, _) = carol.recv_until(|f| f["type"] == "detached").await;
    assert_eq!(detached["reason"], "deleted");
    assert!(
        !workspace.exists(),
        "workspace still at {}",
        workspace.display()
    );
    let (status, _) = server
        .get(&format!("/v1/conversations/{id}"), Some("alice"))
        .await;
    assert_eq!(status, 404);
    let (status, _) = server
        .get(
            &format!("/v1/conversations/{id}/events?after=0"),
            Some("alice"),
        )
        .await;
    assert_eq!(status, 404);
    let mut alice = server.connect("alice").await;
    let gone = alice
        .request(json!({"type": "attach", "conversation_id": id}))
        .await;
    assert_eq!(gone["code"], "not_found", "{gone}");
}

#[tokio::test]
async fn reading_events_never_activates() {
    let server = TestServer::start().await;
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    let ack = client
        .request(json!({"type": "close", "conversation_id": id}))
        .await;
    assert_eq!(ack["type"], "ack");
    client.recv_until(|f| f["type"] == "detached").await;
    let before = server.stored_events(&id, "alice", 0).await;
    for _ in 0..3 {
        let (status, summary) = server
            .get(&format!("/v1/conversations/{id}"), Some("alice"))
            .await;
        assert_eq!(status, 200);
        assert_eq!(summary["status"], "stopped");
    }
    let after = server.stored_events(&id, "alice", 0).await;
    assert_eq!(before, after);
}

#[tokio::test]
async fn a_stopped_conversation_keeps_its_queue_and_message_ids() {
    let server = TestServer::start().await;
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    let first = client
        .request(json!({"type": "message", "conversation_id": id, "text": "/sleep 30s", "client_msg_id": "m-1"}))
        .await;
    assert_eq!(first["duplicate"], false);
    client.next_event(&id).await; // user_message
    client.next_event(&id).await; // turn_started
    let queued = client
        .request(json!({"type": "message", "conversation_id": id, "text": "after the close", "client_msg_id": "m-2"}))
        .await;
    let queued_seq = queued["seq"].as_u64().unwrap();
    client
        .request(json!({"type": "close", "conversation_id": id}))
        .await;
    let closing = client.events_until_kind(&id, "agent_stopped").await;
    assert_eq!(closing.last().unwrap()["data"]["reason"], "closed");
    client.recv_until(|f| f["type"] == "detached").await;

    // Back again: the queued message runs, and ids are still known.
    let attached = client.attach(&id, seq(closing.last().unwrap())).await;
    let from = attached["replay_from"].as_u64().unwrap();
    let events = client.events_until_turn_finished(&id).await;
    assert_contiguous(&events, from);
    assert_eq!(events[0]["data"]["reason"], "attach");
    let started = events.iter().find(|e| is_event(e, "turn_started")).unwrap();
    assert_eq!(started["data"]["message_seq"], queued_seq);
    assert_eq!(events.last().unwrap()["data"]["status"], "completed");
    let again = client
        .request(json!({"type": "message", "conversation_id": id, "text": "/sleep 30s", "client_msg_id": "m-1"}))
        .await;
    assert_eq!(again["duplicate"], true);
    assert_eq!(again["seq"], first["seq"]);
}

/// `message` with a `client_msg_id`; returns the `ack`.
async fn message_with_id(client: &mut common::Client, id: &str, text: &str, cid: &str) -> Value {
    let ack = client
        .request(
            json!({"type": "message", "conversation_id": id, "text": text, "client_msg_id": cid}),
        )
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    ack
}

/// Closes `id` and waits until it is stopped and detached; returns the
/// last seq.
async fn close(client: &mut common::Client, id: &str) -> u64 {
    client
        .request(json!({"type": "close", "conversation_id": id}))
        .await;
    let closing = client.events_until_kind(id, "agent_stopped").await;
    client.recv_until(|f| f["type"] == "detached").await;
    seq(closing.last().unwrap())
}

#[tokio::test]
async fn message_ids_older_than_the_window_are_forgotten_across_stops() {
    let server = TestServer::start_with(|c| c.conversations.client_msg_id_window = 2).await;
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    let mut acks = Vec::new();
    for i in 1..=3 {
        let ack = message_with_id(&mut client, &id, "hi", &format!("m-{i}")).await;
        assert_eq!(ack["duplicate"], false, "{ack}");
        acks.push(ack);
        client.events_until_turn_finished(&id).await;
    }
    let last = close(&mut client, &id).await;

    // Back from the store: the window's ids (m-2, m-3) are still known.
    client.attach(&id, last).await;
    let again = message_with_id(&mut client, &id, "hi", "m-3").await;
    assert_eq!(again["duplicate"], true, "{again}");
    assert_eq!(again["seq"], acks[2]["seq"]);
    // m-1 left the window: resent, it is a new message with a new seq.
    let old = message_with_id(&mut client, &id, "hi", "m-1").await;
    assert_eq!(old["duplicate"], false, "{old}");
    assert!(old["seq"].as_u64() > acks[2]["seq"].as_u64(), "{old}");
    client.events_until_turn_finished(&id).await;
    // Which pushed m-2 out (the window is m-3, m-1), here and in the store.
    let last = close(&mut client, &id).await;
    client.attach(&id, last).await;
    let m2 = message_with_id(&mut client, &id, "hi", "m-2").await;
    assert_eq!(m2["duplicate"], false, "{m2}");
    let m1 = message_with_id(&mut client, &id, "hi", "m-1").await;
    assert_eq!(
        (m1["duplicate"].clone(), m1["seq"].clone()),
        (json!(true), old["seq"].clone())
    );
}

/// The store format this release writes (`PRAGMA user_version`), which
/// every store of an earlier release is upgraded to.
const STORE_FORMAT: i64 = 5;

/// The format of the store at `db`, read beside the running server (WAL:
/// what is committed is visible).
fn store_format(db: &std::path::Path) -> i64 {
    rusqlite::Connection::open(db)
        .unwrap()
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap()
}

/// A store written by linger 0.1.0 (commit e3352e6, the release before the
/// store's format version and the `client_msg_id` window), by its own
/// binary: alice's conversation [`FIXTURE_ID`], five messages with ids
/// m-1..m-5 (seqs 3, 6, 7, 8, 9), each answered, then closed (head 33).
const FIXTURE: &str = "tests/fixtures/store-0.1.0/linger.db";
const FIXTURE_ID: &str = "c_01M8SQM66J668TDFWA8RXJ02W7";

#[tokio::test]
async fn a_store_written_by_the_previous_release_is_migrated_and_keeps_its_history() {
    let store = tempfile::tempdir().unwrap();
    let db = store.path().join("linger.db");
    std::fs::copy(FIXTURE, &db).unwrap();
    let path = store.path().to_path_buf();
    let server = TestServer::start_with(move |c| {
        c.store.path = path;
        c.conversations.client_msg_id_window = 2;
    })
    .await;
    let (status, summary) = server
        .get(&format!("/v1/conversations/{FIXTURE_ID}"), Some("alice"))
        .await;
    assert_eq!(
        (status, &summary["head_seq"]),
        (200, &json!(33)),
        "{summary}"
    );

    // Its whole history replays, and it runs again.
    let mut client = server.connect("alice").await;
    let attached = client.attach(FIXTURE_ID, 0).await;
    assert_eq!(attached["replay_from"], 1, "{attached}");
    let events = client.events(FIXTURE_ID, 34).await;
    assert_contiguous(&events, 1);
    assert!(is_event(&events[32], "agent_stopped"), "{}", events[32]);
    assert!(is_event(&events[33], "agent_started"), "{}", events[33]);
    // Its ids were loaded bounded: the window's two are duplicates...
    let m5 = message_with_id(&mut client, FIXTURE_ID, "again", "m-5").await;
    assert_eq!(
        (&m5["duplicate"], &m5["seq"]),
        (&json!(true), &json!(9)),
        "{m5}"
    );
    let m4 = message_with_id(&mut client, FIXTURE_ID, "again", "m-4").await;
    assert_eq!(
        (&m4["duplicate"], &m4["seq"]),
        (&json!(true), &json!(8)),
        "{m4}"
    );
    // ...an older one is recorded again, and the store forgets the rest.
    let m1 = message_with_id(&mut client, FIXTURE_ID, "again", "m-1").await;
    assert_eq!(m1["duplicate"], false, "{m1}");
    client.events_until_turn_finished(FIXTURE_ID).await;
    // Read beside the running server (WAL: committed is visible).
    assert_eq!(store_format(&db), STORE_FORMAT);
    let conn = rusqlite::Connection::open(&db).unwrap();
    let mut stmt = conn
        .prepare("SELECT client_msg_id, seq FROM client_msgs ORDER BY seq")
        .unwrap();
    let ids: Vec<(String, u64)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(ids, [("m-5".to_owned(), 9), ("m-1".to_owned(), seq(&m1))]);
}

/// A store written by the release before event runs (store format 1,
/// commit f8b6101), by its own binary and CLI: alice's conversation
/// [`FORMAT_1_ID`], "hello", "/stream 300 0" and "bye", each answered, then
/// the server stopped (head 317).
const FORMAT_1: &str = "tests/fixtures/store-format-1/linger.db";
const FORMAT_1_ID: &str = "c_01M8T2HCN1T2RG919EDJTX596W";

/// The same, written by the release before the journal (store format 2,
/// commit 09aba78), by its own binary and CLI.
const FORMAT_2: &str = "tests/fixtures/store-format-2/linger.db";
const FORMAT_2_ID: &str = "c_01M8VNPEG8WPFTX3Y148S6WAXF";

/// The same, written by the release before the journal of one row per
/// commit (store format 3, commit c099091), by its own binary and CLI.
const FORMAT_3: &str = "tests/fixtures/store-format-3/linger.db";
const FORMAT_3_ID: &str = "c_01M8XD857CXE45WD8M9SQ5229Z";

/// The same, written by the release before the journal's binary index
/// (store format 4, commit d7d48e8), by its own binary and CLI.
const FORMAT_4: &str = "tests/fixtures/store-format-4/linger.db";
const FORMAT_4_ID: &str = "c_01M971N7APRJV3SCV752VMA0Y6";

/// A store of format 4 as a crash left it, by that release's binary and
/// CLI: two conversations of alice's, "crashed with a journal A" (hello,
/// then "/stream 40 20") and "... B" ("/stream 40 20" beside A's), each
/// turn finished, and the server killed (SIGKILL) a third of a second
/// later, before its fold: all their events (A's 51, B's 46) are in the
/// journal, with its JSON index. (The WAL was then checkpointed into the
/// file, which changes no row.)
const FORMAT_4_CRASHED: &str = "tests/fixtures/store-format-4-crashed/linger.db";
const FORMAT_4_CRASHED_IDS: [(&str, u64); 2] = [
    ("c_01M971NE53QSH498PN2PCH9CT8", 51),
    ("c_01M971NE59M8VWQFFBPVBM787C", 46),
];

#[tokio::test]
async fn a_store_of_format_1_is_migrated_to_event_runs_and_keeps_its_history() {
    migrated_store_keeps_its_history(FORMAT_1, FORMAT_1_ID, "written by format 1").await;
}

#[tokio::test]
async fn a_store_of_format_2_is_migrated_to_the_journal_and_keeps_its_history() {
    migrated_store_keeps_its_history(FORMAT_2, FORMAT_2_ID, "written by format 2").await;
}

#[tokio::test]
async fn a_store_of_format_3_is_migrated_to_a_journal_row_per_commit_and_keeps_its_history() {
    migrated_store_keeps_its_history(FORMAT_3, FORMAT_3_ID, "written by format 3").await;
}

#[tokio::test]
async fn a_store_of_format_4_is_migrated_to_a_binary_journal_index_and_keeps_its_history() {
    migrated_store_keeps_its_history(FORMAT_4, FORMAT_4_ID, "written by format 4").await;
}

#[tokio::test]
async fn a_journal_left_by_a_crash_of_format_4_is_carried_over_and_reads_whole() {
    let store = tempfile::tempdir().unwrap();
    let db = store.path().join("linger.db");
    std::fs::copy(FORMAT_4_CRASHED, &db).unwrap();
    let journal_rows = |db: &std::path::Path| -> i64 {
        rusqlite::Connection::open(db)
            .unwrap()
            .query_row("SELECT count(*) FROM event_journal", [], |r| r.get(0))
            .unwrap()
    };
    assert!(
        journal_rows(&db) > 40,
        "the fixture holds its events in the journal"
    );
    let path = store.path().to_path_buf();
    let server = TestServer::start_with(move |c| c.store.path = path).await;

    for (id, head) in FORMAT_4_CRASHED_IDS {
        let (status, summary) = server
            .get(&format!("/v1/conversations/{id}"), Some("alice"))
            .await;
        assert_eq!(status, 200, "{summary}");
        assert!(summary["head_seq"].as_u64() >= Some(head), "{summary}");
        let mut client = server.connect("alice").await;
        let attached = client.attach(id, 0).await;
        assert_eq!(attached["replay_from"], 1, "{attached}");
        let events = client.events(id, head as usize).await;
        assert_contiguous(&events, 1);
        let last = &events[head as usize - 1];
        assert!(is_event(last, "turn_finished"), "{last}");
        let streamed: String = events
            .iter()
            .filter(|e| is_event(e, "text_delta"))
            .filter_map(|e| e["data"]["text"].as_str())
            .collect();
        assert!(
            streamed.contains("tok1 ") && streamed.contains("tok40 "),
            "{streamed}"
        );
    }
    assert_eq!(store_format(&db), STORE_FORMAT);
    server.shutdown().await;
}

/// A copy of `fixture` (conversation `id`, head 317, as described above)
/// opened by this release: its summary, its whole history replayed in
/// order, a new turn after it, and the store at this release's format.
async fn migrated_store_keeps_its_history(fixture: &str, id: &str, title: &str) {
    let store = tempfile::tempdir().unwrap();
    let db = store.path().join("linger.db");
    std::fs::copy(fixture, &db).unwrap();
    let path = store.path().to_path_buf();
    let server = TestServer::start_with(move |c| c.store.path = path).await;
    let (status, summary) = server
        .get(&format!("/v1/conversations/{id}"), Some("alice"))
        .await;
    assert_eq!(
        (status, &summary["head_seq"], &summary["title"]),
        (200, &json!(317), &json!(title)),
        "{summary}"
    );
    // The whole history replays from the store, in order, across runs.
    let mut client = server.connect("alice").await;
    let attached = client.attach(id, 0).await;
    assert_eq!(attached["replay_from"], 1, "{attached}");
    let events = client.events(id, 318).await;
    assert_contiguous(&events, 1);
    let streamed: String = events
        .iter()
        .filter(|e| is_event(e, "text_delta"))
        .filter_map(|e| e["data"]["text"].as_str())
        .collect();
    assert!(streamed.contains("tok1 ") && streamed.contains("tok300 "));
    assert!(is_event(&events[316], "agent_stopped"), "{}", events[316]);
    assert!(is_event(&events[317], "agent_started"), "{}", events[317]);
    // It goes on, and what it adds is read back after what was migrated.
    client.send_message(id, "again").await;
    let turn = client.events_until_turn_finished(id).await;
    assert_contiguous(&turn, 319);
    let mut reader = server.connect("alice").await;
    reader.attach(id, 310).await;
    let tail = reader.events(id, turn.len() + 8).await;
    assert_contiguous(&tail, 311);
    assert_eq!(store_format(&db), STORE_FORMAT);
    server.shutdown().await;
}

#[tokio::test]
async fn retention_makes_old_replays_incomplete() {
    let server = TestServer::start_with(|c| c.store.retain = Duration::from_secs(1)).await;
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    client.send_message(&id, "hello").await;
    client.events_until_turn_finished(&id).await;
    client
        .request(json!({"type": "close", "conversation_id": id}))
        .await;
    let closing = client.events_until_kind(&id, "agent_stopped").await;
    let head = seq(closing.last().unwrap());
    client.recv_until(|f| f["type"] == "detached").await;
    server
        .wait_for_stored(&id, "alice", "the history pruned", |e| e.is_empty())
        .await;
    let attached = client.attach(&id, 0).await;
    assert_eq!(attached["replay_incomplete"], true, "{attached}");
    assert_eq!(attached["replay_from"], head + 1);
    let next = client.next_event(&id).await;
    assert_eq!(seq(&next), head + 1, "seq continues after pruning");
    assert_eq!(kind(&next), "agent_started");
}

#[tokio::test]
async fn workspaces_survive_stop_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let start = || {
        let mut config = linger::config::Config::default();
        config.server.listen = "127.0.0.1:0".parse().unwrap();
        config.store.path = dir.path().to_path_buf();
        linger::server::Server::start(config)
    };
    let server = start().await.unwrap();
    let mut client =
        common::Client::connect(&format!("ws://{}/v1/ws?token=alice", server.addr), "alice").await;
    let id = client.create().await;
    let workspace = dir.path().join("workspaces").join(&id);
    std::fs::write(workspace.join("notes.txt"), "kept").unwrap();
    client
        .request(json!({"type": "close", "conversation_id": id}))
        .await;
    client.recv_until(|f| f["type"] == "detached").await;
    server.shutdown().await;
    let server = start().await.unwrap();
    assert_eq!(
        std::fs::read_to_string(workspace.join("notes.txt")).unwrap(),
        "kept"
    );
    let mut client =
        common::Client::connect(&format!("ws://{}/v1/ws?token=alice", server.addr), "alice").await;
    client.attach(&id, 0).await;
    server.shutdown().await;
}

/// Protocol §11: a compact attach leaves out the `text_delta`s of finished
/// turns, from the buffer and from the store alike, sends every other event
/// in seq order and every event of the running turn, says `compact: true`,
/// and goes on live without a gap.
#[tokio::test]
async fn a_compact_replay_leaves_out_finished_turns_deltas_only() {
    for buffer in [10_000, 5] {
        let server =
            TestServer::start_with(|c| c.conversations.replay_buffer_events = buffer).await;
        let mut writer = server.connect("alice").await;
        let id = writer.create().await;
        writer.send_message(&id, "/stream 40 0").await;
        writer.events_until_turn_finished(&id).await;
        writer.send_message(&id, "/stream 100000 20").await;
        let mut running = writer.events_until_kind(&id, "text_delta").await;
        running.extend(writer.events(&id, 3).await);
        let running_turn = running
            .iter()
            .find(|e| is_event(e, "turn_started"))
            .map(|e| e["data"]["turn_id"].clone());

        let mut reader = server.connect("alice").await;
        let attached = reader
            .request(
                json!({"type": "attach", "conversation_id": id, "last_seq": 0, "compact": true}),
            )
            .await;
        assert_eq!(attached["type"], "attached", "{attached}");
        assert_eq!(attached["compact"], true, "{attached}");
        let head = attached["head_seq"].as_u64().unwrap();
        let stored = server.stored_events(&id, "alice", 0).await;
        let finished_turn = stored
            .iter()
            .find(|e| is_event(e, "turn_started"))
            .map(|e| e["data"]["turn_id"].clone())
            .unwrap();
        let expected = common::compact_of(&stored, head, &finished_turn);
        assert!(
            expected.len() < head as usize,
            "the finished turn had deltas"
        );
        let replay = reader.events(&id, expected.len()).await;
        for (got, want) in replay.iter().zip(&expected) {
            assert_eq!(got, *want, "buffer {buffer}: the compact replay differs");
        }
        assert!(
            replay
                .iter()
                .any(|e| kind(e) == "text_delta"
                    && Some(&e["data"]["turn_id"]) == running_turn.as_ref()),
            "the running turn's deltas are all sent"
        );
        // Live after the replay: contiguous from head + 1.
        let live = reader.events(&id, 5).await;
        assert_contiguous(&live, head + 1);

        // A plain attach says nothing of compact and leaves nothing out.
        let mut plain = server.connect("alice").await;
        let attached = plain.attach(&id, 0).await;
        assert!(attached.get("compact").is_none(), "{attached}");
        server.shutdown().await;
    }
}

//! The SQLite store against a real database in a temporary directory.

use super::*;
use crate::event::EventData;
use crate::store::{ConversationState, NewConversation};

fn ts(secs: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_secs(secs)).to_string()
}

fn record(id: &str, seq: u64, ts: String, data: &EventData) -> Arc<EventRecord> {
    let json = serde_json::to_string(data).unwrap();
    Arc::new(EventRecord::from_parts(
        id,
        seq,
        &ts,
        crate::event::intern_kind(data.kind()),
        &json,
    ))
}

fn delta(id: &str, seq: u64, text: &str) -> Arc<EventRecord> {
    record(
        id,
        seq,
        crate::event::now_rfc3339(),
        &EventData::TextDelta {
            turn_id: "t_1".into(),
            text: text.into(),
        },
    )
}

fn state(status: Status, head_seq: u64) -> ConversationState {
    ConversationState {
        status,
        head_seq,
        // As the conversation actor sends it: the last event's time.
        last_activity_at: None,
        current_turn_id: None,
        last_turn_message_seq: 0,
    }
}

fn create_batch(id: &str, user: &str) -> AppendBatch {
    let ev = record(
        id,
        1,
        crate::event::now_rfc3339(),
        &EventData::ConversationCreated {
            user: user.into(),
            title: "hello".into(),
        },
    );
    AppendBatch {
        conversation_id: Arc::from(id),
        create: Some(NewConversation {
            user: user.into(),
            title: "hello".into(),
            created_at: ev.ts().to_owned(),
            close_delay: Some(Duration::from_secs(90)),
        }),
        events: vec![ev],
        state: state(Status::Idle, 1),
        client_msg_ids: vec![],
        forget_client_msg_ids_before: 0,
    }
}

fn events_batch(id: &str, events: Vec<Arc<EventRecord>>, st: ConversationState) -> AppendBatch {
    AppendBatch {
        conversation_id: Arc::from(id),
        create: None,
        events,
        state: st,
        client_msg_ids: vec![],
        forget_client_msg_ids_before: 0,
    }
}

/// Stops the writer at the next command it takes until the returned
/// sender is sent to (or dropped).
fn hold_writer(store: &SqliteStore) -> std::sync::mpsc::Sender<()> {
    let (gate, until) = std::sync::mpsc::channel();
    store.send(Command::Hold { until });
    gate
}

/// Queues a one-token append of `c_1` at `seq`, without waiting for it.
fn queue_token(store: &SqliteStore, seq: u64, done: CommitCallback) {
    store.append(
        events_batch(
            "c_1",
            vec![delta("c_1", seq, "tok ")],
            state(Status::Running, seq),
        ),
        done,
    );
}

/// Callbacks that report their commit's outcome under a name, in the order
/// they run.
type NamedOutcomes = tokio::sync::mpsc::UnboundedReceiver<(&'static str, Result<(), StoreError>)>;

fn named_callbacks() -> (impl Fn(&'static str) -> CommitCallback, NamedOutcomes) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let named = move |name: &'static str| -> CommitCallback {
        let tx = tx.clone();
        Box::new(move |r, _| {
            let _ = tx.send((name, r));
        })
    };
    (named, rx)
}

/// Appends and waits for the callback.
async fn append(store: &SqliteStore, batch: AppendBatch) -> Result<(), StoreError> {
    let (tx, rx) = oneshot::channel();
    store.append(
        batch,
        Box::new(move |r, _| {
            let _ = tx.send(r);
        }),
    );
    rx.await.unwrap()
}

/// The commit callback is handed the append's own events (what the
/// conversation's fanout sends on), not a copy of them.
#[tokio::test]
async fn a_commit_callback_gets_its_own_events() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    let evs: Vec<_> = (2..=4).map(|s| delta("c_1", s, "tok")).collect();
    let sent = evs.clone();
    let (tx, rx) = oneshot::channel();
    store.append(
        events_batch("c_1", evs, state(Status::Running, 4)),
        Box::new(move |r, events| {
            let same = events.len() == sent.len()
                && events.iter().zip(&sent).all(|(a, b)| Arc::ptr_eq(a, b));
            let _ = tx.send((r, same));
        }),
    );
    let (result, same) = rx.await.unwrap();
    result.unwrap();
    assert!(same, "the callback sees the very events appended, in order");
}

/// The thread an append's callback ran on.
fn callback_thread(store: &SqliteStore) -> std::sync::mpsc::Receiver<Option<String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    store.append(
        create_batch("c_1", "alice"),
        Box::new(move |r, _| {
            r.unwrap();
            let _ = tx.send(std::thread::current().name().map(str::to_owned));
        }),
    );
    rx
}

/// Opened on an async runtime, the store answers its appends there, not
/// on its writer thread (`answers.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn callbacks_run_on_the_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    let ran_on = callback_thread(&store);
    let ran_on = tokio::task::spawn_blocking(move || ran_on.recv().unwrap())
        .await
        .unwrap();
    assert_ne!(ran_on.as_deref(), Some("linger-store-writer"));
}

/// However the appends fall into groups, their callbacks run in the order
/// the appends were committed: the fanout sends a conversation's events
/// from them, in seq order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callbacks_run_in_commit_order() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let n = 2_000u64;
    for seq in 2..=n + 1 {
        let tx = tx.clone();
        queue_token(
            &store,
            seq,
            Box::new(move |r, events| {
                r.unwrap();
                let _ = tx.send(events[0].seq);
            }),
        );
        if seq % 100 == 0 {
            // Let the writer commit what is queued, so that there are
            // many groups.
            tokio::task::yield_now().await;
        }
    }
    let mut heard = Vec::new();
    for _ in 0..n {
        heard.push(rx.recv().await.unwrap());
    }
    assert_eq!(heard, (2..=n + 1).collect::<Vec<_>>());
}

/// Opened without a runtime, the writer answers its appends itself.
#[test]
fn without_a_runtime_the_writer_answers() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    let ran_on = callback_thread(&store).recv().unwrap();
    assert_eq!(ran_on.as_deref(), Some("linger-store-writer"));
}

#[tokio::test]
async fn append_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    let evs: Vec<_> = (2..=4).map(|s| delta("c_1", s, "tok")).collect();
    let last_ts = evs[2].ts().to_owned();
    let mut st = state(Status::Running, 4);
    st.current_turn_id = Some("t_1".into());
    append(&store, events_batch("c_1", evs, st.clone()))
        .await
        .unwrap();

    let meta = store.get("c_1").await.unwrap().unwrap();
    assert_eq!(meta.user, "alice");
    assert_eq!(meta.title, "hello");
    assert_eq!(meta.status, Status::Running);
    assert_eq!(meta.head_seq, 4);
    assert_eq!(meta.close_delay, Some(Duration::from_secs(90)));
    assert_eq!(meta.current_turn_id.as_deref(), Some("t_1"));
    // The row was rewritten (the status changed) with the time of the
    // append's last event.
    assert_eq!(meta.last_activity_at, last_ts);
    assert!(store.get("c_nope").await.unwrap().is_none());

    let all = store.events("c_1", 0, 100).await.unwrap();
    assert_eq!(all.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!(&*all[0].kind, "conversation_created");
    assert_eq!(&*all[1].kind, "text_delta");
    let v: serde_json::Value = serde_json::from_str(all[1].frame.as_str()).unwrap();
    assert_eq!(v["conversation_id"], "c_1");
    assert_eq!(v["seq"], 2);
    assert_eq!(v["data"]["text"], "tok");
    let some = store.events("c_1", 1, 2).await.unwrap();
    assert_eq!(some.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3]);
    assert!(store.events("c_1", 4, 10).await.unwrap().is_empty());
}

#[tokio::test]
async fn callback_fires_after_commit() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    // Inside the callback, another connection must already see the
    // events: it could not if the callback ran before the commit.
    let path = store.path().to_owned();
    let (tx, rx) = oneshot::channel();
    let evs = (2..=11).map(|s| delta("c_1", s, "x")).collect();
    store.append(
        events_batch("c_1", evs, state(Status::Running, 11)),
        Box::new(move |r, _| {
            let conn =
                Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
            let in_runs: usize = conn
                .query_row(
                    "SELECT coalesce(sum(n), 0) FROM event_runs WHERE conversation_id = 'c_1'",
                    [],
                    |row| row.get(0),
                )
                .unwrap();
            let in_journal: usize = journal_runs(&conn)
                .iter()
                .filter(|run| run.0 == "c_1")
                .map(|run| run.3)
                .sum();
            let n = in_runs + in_journal;
            let _ = tx.send((r, n));
        }),
    );
    let (r, n) = rx.await.unwrap();
    r.unwrap();
    assert_eq!(n, 11);
    assert_eq!(store.events("c_1", 0, 100).await.unwrap().len(), 11);
}

#[tokio::test]
async fn group_commit_groups() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    // Hold the writer while the appends queue up, so that the grouping
    // does not depend on how the threads race.
    let gate_tx = hold_writer(&store);
    let before = store.commits();
    let n = 10_000u64;
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    for seq in 2..=n + 1 {
        let done_tx = done_tx.clone();
        queue_token(
            &store,
            seq,
            Box::new(move |r, _| {
                let _ = done_tx.send(r);
            }),
        );
    }
    gate_tx.send(()).unwrap();
    for _ in 0..n {
        done_rx.recv().await.unwrap().unwrap();
    }
    store.flush().await.unwrap();
    let commits = store.commits() - before;
    assert!(commits <= 5, "{commits} commits for {n} appends");
    assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, n + 1);
    assert_eq!(
        store.events("c_1", 0, usize::MAX).await.unwrap().len() as u64,
        n + 1
    );
}

#[tokio::test]
async fn a_bad_append_fails_alone() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    let gate_tx = hold_writer(&store);
    let (cb, mut rx) = named_callbacks();
    // All of these land in one group.
    store.append(
        events_batch("c_1", vec![delta("c_1", 2, "a")], state(Status::Running, 2)),
        cb("good1"),
    );
    // A gap: seq 4 where 3 is next.
    store.append(
        events_batch("c_1", vec![delta("c_1", 4, "b")], state(Status::Running, 4)),
        cb("gap"),
    );
    store.append(
        events_batch(
            "c_nope",
            vec![delta("c_nope", 2, "b")],
            state(Status::Running, 2),
        ),
        cb("missing"),
    );
    store.append(create_batch("c_1", "alice"), cb("recreate"));
    store.append(
        events_batch("c_1", vec![delta("c_1", 3, "c")], state(Status::Idle, 3)),
        cb("good2"),
    );
    gate_tx.send(()).unwrap();
    let mut got = std::collections::HashMap::new();
    for _ in 0..5 {
        let (name, r) = rx.recv().await.unwrap();
        got.insert(name, r);
    }
    assert!(got["good1"].is_ok());
    assert!(got["good2"].is_ok());
    assert!(matches!(got["gap"], Err(StoreError::Backend(_))));
    assert!(matches!(got["missing"], Err(StoreError::NotFound(_))));
    assert!(matches!(got["recreate"], Err(StoreError::Backend(_))));
    let seqs: Vec<u64> = store
        .events("c_1", 0, 10)
        .await
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seqs, [1, 2, 3]);
    assert_eq!(
        store.get("c_1").await.unwrap().unwrap().status,
        Status::Idle
    );
    assert!(store.get("c_nope").await.unwrap().is_none());
}

#[tokio::test]
async fn snapshot_has_tail_queue_and_client_msg_ids() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    let now = crate::event::now_rfc3339;
    let msg = |seq: u64, text: &str, cid: &str| {
        record(
            "c_1",
            seq,
            now(),
            &EventData::UserMessage {
                text: text.into(),
                client_msg_id: Some(cid.into()),
            },
        )
    };
    // 2: message m1, 3: turn for it, 4: delta, 5 and 6: two more
    // messages queued behind the running turn.
    let evs = vec![
        msg(2, "first", "m1"),
        record(
            "c_1",
            3,
            now(),
            &EventData::TurnStarted {
                resumed_from: None,
                turn_id: "t_1".into(),
                message_seq: 2,
            },
        ),
        delta("c_1", 4, "fi"),
        msg(5, "second", "m2"),
        msg(6, "third \"quoted\"", "m3"),
    ];
    let mut st = state(Status::Running, 6);
    st.current_turn_id = Some("t_1".into());
    st.last_turn_message_seq = 2;
    let mut batch = events_batch("c_1", evs, st);
    batch.client_msg_ids = vec![("m1".into(), 2), ("m2".into(), 5), ("m3".into(), 6)];
    append(&store, batch).await.unwrap();

    let snap = store.snapshot("c_1", 3, 100).await.unwrap().unwrap();
    assert_eq!(snap.meta.head_seq, 6);
    assert_eq!(snap.meta.last_turn_message_seq, 2);
    assert_eq!(
        snap.tail.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [4, 5, 6]
    );
    assert_eq!(
        snap.queued,
        [
            QueuedMessage {
                seq: 5,
                text: "second".into()
            },
            QueuedMessage {
                seq: 6,
                text: "third \"quoted\"".into()
            },
        ]
    );
    assert_eq!(
        snap.client_msg_ids,
        [
            ("m1".to_string(), 2),
            ("m2".to_string(), 5),
            ("m3".to_string(), 6)
        ]
    );
    let all = store.snapshot("c_1", 100, 100).await.unwrap().unwrap();
    assert_eq!(all.tail.len(), 6);
    assert!(store.snapshot("c_nope", 10, 10).await.unwrap().is_none());
    // Bounded: the newest ids only.
    let newest = store.snapshot("c_1", 0, 2).await.unwrap().unwrap();
    assert_eq!(
        newest.client_msg_ids,
        [("m2".to_string(), 5), ("m3".to_string(), 6)]
    );

    // An append that moves the window forgets the ids before it.
    let mut st = state(Status::Running, 7);
    st.current_turn_id = Some("t_1".into());
    st.last_turn_message_seq = 2;
    let mut batch = events_batch("c_1", vec![msg(7, "fourth", "m4")], st);
    batch.client_msg_ids = vec![("m4".into(), 7)];
    batch.forget_client_msg_ids_before = 6;
    append(&store, batch).await.unwrap();
    let after = store.snapshot("c_1", 0, 100).await.unwrap().unwrap();
    assert_eq!(
        after.client_msg_ids,
        [("m3".to_string(), 6), ("m4".to_string(), 7)]
    );
}

#[test]
fn a_store_of_the_release_before_versions_is_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linger.db");
    // As that release left it: its tables, user_version 0. Conversation c_1
    // has 600 events (more than two runs' worth), c_2 three.
    let old = Connection::open(&path).unwrap();
    old.execute_batch(migrate::V0_SCHEMA).unwrap();
    for (id, n) in [("c_1", 600u64), ("c_2", 3)] {
        old.execute(
            "INSERT INTO conversations (id, user, title, status, created_at, last_activity_at, \
             head_seq) VALUES (?1, 'alice', '', 'idle', ?2, ?2, ?3)",
            params![id, ts(n), n],
        )
        .unwrap();
        for seq in 1..=n {
            let text = format!("say \"{seq}\"\n\u{e9}");
            let data = serde_json::json!({"turn_id": "t", "text": text}).to_string();
            old.execute(
                "INSERT INTO events (conversation_id, seq, ts, kind, data) \
                 VALUES (?1, ?2, ?3, 'text_delta', ?4)",
                params![id, seq, ts(seq), data],
            )
            .unwrap();
        }
    }
    old.execute(
        "INSERT INTO client_msgs (conversation_id, client_msg_id, seq) VALUES ('c_1', 'm1', 3)",
        [],
    )
    .unwrap();
    assert_eq!(migrate::version(&old), 0);
    drop(old);

    let mut conn = open_writer(&path).unwrap();
    assert_eq!(migrate::version(&conn), migrate::VERSION);
    let plan: String = conn
        .query_row(
            "EXPLAIN QUERY PLAN SELECT seq FROM client_msgs \
             WHERE conversation_id = 'c_1' AND seq < 5",
            [],
            |row| row.get(3),
        )
        .unwrap();
    assert!(plan.contains("client_msgs_by_seq"), "{plan}");
    let kept: u64 = conn
        .query_row(
            "SELECT seq FROM client_msgs WHERE client_msg_id = 'm1'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(kept, 3, "the ids are kept");
    let runs: Vec<(String, u64, u64, u64)> = conn
        .prepare("SELECT conversation_id, first_seq, last_seq, n FROM event_runs ORDER BY rowid")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let c1 = |first, last| ("c_1".to_owned(), first, last, last - first + 1);
    assert_eq!(
        runs,
        [
            c1(1, 256),
            c1(257, 512),
            c1(513, 600),
            ("c_2".to_owned(), 1, 3, 3)
        ]
    );
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_schema WHERE name LIKE 'events%'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert!(tables.is_empty(), "the per-event table is gone: {tables:?}");
    // Every event reads back as it was written, whichever run holds it.
    let read = queries::events(&mut conn, &JournalMembers::anyone(), "c_1", 250, 10).unwrap();
    assert_eq!(
        read.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (251..=260).collect::<Vec<_>>()
    );
    let data: serde_json::Value = serde_json::from_str(read[6].data()).unwrap();
    assert_eq!(data["text"], "say \"257\"\n\u{e9}");
    assert_eq!(read[6].ts(), ts(257));
    assert_eq!(
        queries::get_meta(&conn, "c_1", true)
            .unwrap()
            .unwrap()
            .head_seq,
        600
    );
    drop(conn);
    // Opened again: nothing to do.
    assert_eq!(
        migrate::version(&open_writer(&path).unwrap()),
        migrate::VERSION
    );

    // A newer release's store is refused, not misread.
    let newer = Connection::open(&path).unwrap();
    newer
        .pragma_update(None, "user_version", migrate::VERSION + 1)
        .unwrap();
    drop(newer);
    let refused = open_writer(&path).err().map(|e| e.to_string());
    assert!(refused.is_some_and(|e| e.contains("newer linger")));
}

#[test]
fn a_store_of_format_1_is_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linger.db");
    let old = Connection::open(&path).unwrap();
    old.execute_batch(migrate::V0_SCHEMA).unwrap();
    old.execute_batch(
        "CREATE INDEX client_msgs_by_seq ON client_msgs (conversation_id, seq); \
         PRAGMA user_version = 1;",
    )
    .unwrap();
    old.execute(
        "INSERT INTO events (conversation_id, seq, ts, kind, data) \
         VALUES ('c_1', 1, '2026-01-01T00:00:00.000Z', 'text_delta', '{\"text\":\"x\"}')",
        [],
    )
    .unwrap();
    drop(old);
    let mut conn = open_writer(&path).unwrap();
    assert_eq!(migrate::version(&conn), migrate::VERSION);
    let read = queries::events(&mut conn, &JournalMembers::anyone(), "c_1", 0, 10).unwrap();
    assert_eq!(read.len(), 1);
    assert_eq!(read[0].data(), r#"{"text":"x"}"#);
}

/// Runs of deltas `first..=last` of `id`, as a commit writes them.
fn put_run(conn: &Connection, table: runs::RunTable, id: &str, first: u64, last: u64) {
    let events: Vec<_> = (first..=last)
        .map(|seq| record(id, seq, ts(seq), &delta_data(seq)))
        .collect();
    runs::insert_run(
        conn,
        table,
        id,
        events.iter().map(|ev| runs::RunEvent::from(&**ev)),
    )
    .unwrap();
}

/// One commit into the journal: a row holding, for each `(id, seqs)`, the
/// run of those events of `id`.
fn put_commit(conn: &Connection, runs: &[(&str, std::ops::RangeInclusive<u64>)]) {
    let events: Vec<Vec<Arc<EventRecord>>> = runs
        .iter()
        .map(|(id, seqs)| {
            seqs.clone()
                .map(|seq| record(id, seq, ts(seq), &delta_data(seq)))
                .collect()
        })
        .collect();
    let mut row = runs::JournalRow::default();
    for ((id, _), events) in runs.iter().zip(&events) {
        row.add(id, events.iter().map(|ev| runs::RunEvent::from(&**ev)))
            .unwrap();
    }
    row.insert(conn).unwrap();
}

/// A conversations row for `id`, as the writer's create makes it.
fn put_conversation(conn: &Connection, id: &str) {
    conn.execute(
        "INSERT INTO conversations (id, user, title, status, created_at, last_activity_at, \
         head_seq) VALUES (?1, 'alice', 't', 'idle', ?2, ?2, 0)",
        params![id, ts(0)],
    )
    .unwrap();
}

fn delta_data(seq: u64) -> EventData {
    EventData::TextDelta {
        turn_id: "t_1".into(),
        text: format!("say \"{seq}\""),
    }
}

fn seqs(events: &[Arc<EventRecord>]) -> Vec<u64> {
    events.iter().map(|e| e.seq).collect()
}

/// `(conversation_id, first_seq, last_seq)` of every run, in rowid order.
/// `table`: `event_runs`, or `event_journal` (its commits' runs in order).
fn stored_runs(conn: &Connection, table: &str) -> Vec<(String, u64, u64)> {
    if table == "event_journal" {
        return journal_runs(conn)
            .into_iter()
            .map(|(id, first, last, _)| (id, first, last))
            .collect();
    }
    conn.prepare(&format!(
        "SELECT conversation_id, first_seq, last_seq FROM {table} ORDER BY rowid"
    ))
    .unwrap()
    .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

/// `(conversation_id, first_seq, last_seq, n)` of every run in the
/// journal, in commit order.
fn journal_runs(conn: &Connection) -> Vec<(String, u64, u64, usize)> {
    let mut stmt = conn
        .prepare("SELECT id, runs FROM event_journal ORDER BY id")
        .unwrap();
    let mut rows = stmt.query([]).unwrap();
    let mut found = Vec::new();
    while let Some(row) = rows.next().unwrap() {
        let runs = row.get_ref(1).unwrap().as_blob().unwrap();
        for entry in runs::journal_entries(row.get(0).unwrap(), runs).unwrap() {
            found.push((entry.0.into_owned(), entry.1, entry.2, entry.3));
        }
    }
    found
}

/// Opens the store an earlier release left in `dir`, and a connection of
/// its own beside it; asserts that it is at this release's format and that
/// its journal was folded at open.
fn open_migrated_and_folded(dir: &std::path::Path) -> (SqliteStore, Connection) {
    let store = SqliteStore::open(dir).unwrap();
    let conn = Connection::open(store.path()).unwrap();
    assert_eq!(migrate::version(&conn), migrate::VERSION);
    assert_eq!(stored_runs(&conn, "event_journal"), []);
    (store, conn)
}

#[tokio::test]
async fn a_store_of_format_3_is_migrated_with_what_its_journal_held() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linger.db");
    // Format 3: a run per journal row, as a crash left it: c_1 has runs in
    // both tables.
    let old = Connection::open(&path).unwrap();
    old.execute_batch(SCHEMA).unwrap();
    old.execute_batch(EVENT_RUNS).unwrap();
    migrate::journal(&old).unwrap();
    old.execute_batch(
        "PRAGMA user_version = 3; \
         INSERT INTO conversations (id, user, title, status, created_at, last_activity_at, \
         head_seq) VALUES ('c_1', 'alice', 'hello', 'idle', '2026-01-01T00:00:00.000Z', \
         '2026-01-01T00:00:00.000Z', 1);",
    )
    .unwrap();
    put_run(&old, runs::RunTable::Runs, "c_1", 1, 3);
    let events: Vec<_> = (4..=7)
        .map(|seq| record("c_1", seq, ts(seq), &delta_data(seq)))
        .collect();
    for part in [&events[..2], &events[2..]] {
        let run = runs::encode(part.iter().map(|ev| runs::RunEvent::from(&**ev))).unwrap();
        old.execute(
            "INSERT INTO event_journal (conversation_id, first_seq, last_seq, n, min_ts, \
             max_ts, events) VALUES ('c_1', ?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                run.first_seq,
                run.last_seq,
                run.n,
                run.min_ts,
                run.max_ts,
                run.json
            ],
        )
        .unwrap();
    }
    drop(old);

    // Opening folded what the journal held: its two rows, as one run.
    let (store, conn) = open_migrated_and_folded(dir.path());
    assert_eq!(
        stored_runs(&conn, "event_runs"),
        [("c_1".to_owned(), 1, 3), ("c_1".to_owned(), 4, 7)]
    );
    let read = store.events("c_1", 0, 10).await.unwrap();
    assert_eq!(seqs(&read), [1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(read[5].frame, events[2].frame, "read back as written");
    assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, 7);
}

#[tokio::test]
async fn a_store_of_format_4_is_migrated_with_what_its_journal_held() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linger.db");
    // Format 4: the journal's index is JSON text, as that release wrote
    // it. c_1 has runs in both tables; a commit holds runs of c_1 and c_2.
    let old = Connection::open(&path).unwrap();
    old.execute_batch(SCHEMA).unwrap();
    old.execute_batch(EVENT_RUNS).unwrap();
    old.execute_batch(migrate::EVENT_JOURNAL_4).unwrap();
    old.execute_batch("PRAGMA user_version = 4;").unwrap();
    put_conversation(&old, "c_1");
    put_conversation(&old, "c_2");
    put_run(&old, runs::RunTable::Runs, "c_1", 1, 3);
    let run_of = |id: &str, seqs: std::ops::RangeInclusive<u64>| {
        let events: Vec<_> = seqs
            .map(|seq| record(id, seq, ts(seq), &delta_data(seq)))
            .collect();
        runs::encode(events.iter().map(|ev| runs::RunEvent::from(&**ev))).unwrap()
    };
    let commits = [
        vec![("c_1", run_of("c_1", 4..=5)), ("c_2", run_of("c_2", 1..=2))],
        vec![("c_1", run_of("c_1", 6..=7))],
    ];
    for commit in &commits {
        let mut index = Vec::new();
        let mut events = String::new();
        for (id, run) in commit {
            index.push(serde_json::json!([
                id,
                run.first_seq,
                run.last_seq,
                run.n,
                run.min_ts,
                run.max_ts,
                events.len(),
                run.json.len()
            ]));
            events.push_str(&run.json);
        }
        old.execute(
            "INSERT INTO event_journal (runs, events) VALUES (?1, ?2)",
            params![
                serde_json::Value::from(index).to_string(),
                events.as_bytes()
            ],
        )
        .unwrap();
    }
    drop(old);

    // Opening carried the journal over and folded it.
    let (store, conn) = open_migrated_and_folded(dir.path());
    assert_eq!(
        stored_runs(&conn, "event_runs"),
        [
            ("c_1".to_owned(), 1, 3),
            ("c_1".to_owned(), 4, 7),
            ("c_2".to_owned(), 1, 2)
        ]
    );
    let c_1 = store.events("c_1", 0, 10).await.unwrap();
    assert_eq!(seqs(&c_1), [1, 2, 3, 4, 5, 6, 7]);
    let want = record("c_1", 6, ts(6), &delta_data(6));
    assert_eq!(c_1[5].frame, want.frame, "read back as written");
    assert_eq!(seqs(&store.events("c_2", 0, 10).await.unwrap()), [1, 2]);
    assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, 7);
}

#[tokio::test]
async fn a_store_of_format_2_is_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linger.db");
    // Format 2 is this release's tables without the journal.
    let old = Connection::open(&path).unwrap();
    old.execute_batch(SCHEMA).unwrap();
    old.execute_batch(EVENT_RUNS).unwrap();
    old.execute_batch(
        "PRAGMA user_version = 2; \
         INSERT INTO conversations (id, user, title, status, created_at, last_activity_at, \
         head_seq) VALUES ('c_1', 'alice', 'hello', 'idle', '2026-01-01T00:00:00.000Z', \
         '2026-01-01T00:00:00.000Z', 1);",
    )
    .unwrap();
    put_run(&old, runs::RunTable::Runs, "c_1", 1, 3);
    drop(old);

    let store = SqliteStore::open(dir.path()).unwrap();
    let conn = Connection::open(store.path()).unwrap();
    assert_eq!(migrate::version(&conn), migrate::VERSION);
    assert_eq!(seqs(&store.events("c_1", 0, 10).await.unwrap()), [1, 2, 3]);
    assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, 3);
    // Appends go on from the head the runs hold, into the journal.
    let ev = delta("c_1", 4, "more");
    append(
        &store,
        events_batch("c_1", vec![ev], state(Status::Idle, 4)),
    )
    .await
    .unwrap();
    assert_eq!(seqs(&store.events("c_1", 2, 10).await.unwrap()), [3, 4]);
    drop(store);
    let store = SqliteStore::open(dir.path()).unwrap();
    assert_eq!(
        seqs(&store.events("c_1", 0, 10).await.unwrap()),
        [1, 2, 3, 4]
    );
}

#[tokio::test]
async fn the_journal_reads_as_history_and_is_folded_into_runs() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    append(&store, create_batch("c_2", "bob")).await.unwrap();
    let path = store.path().to_owned();
    // Closing folds: both creations are runs now.
    drop(store);
    let mut conn = Connection::open(&path).unwrap();
    assert_eq!(stored_runs(&conn, "event_journal"), []);
    assert_eq!(
        stored_runs(&conn, "event_runs"),
        [("c_1".to_owned(), 1, 1), ("c_2".to_owned(), 1, 1)]
    );

    // What a crash leaves: commits in the journal, of both conversations
    // in turn, one of them longer than a run may be.
    let journal = runs::RunTable::Journal;
    put_run(&conn, journal, "c_1", 2, 201);
    put_run(&conn, journal, "c_2", 2, 3);
    put_run(&conn, journal, "c_1", 202, 301);
    put_run(&conn, journal, "c_1", 302, 310);

    // Readers see the runs and the journal as one history.
    assert_eq!(
        seqs(&queries::events(&mut conn, &JournalMembers::anyone(), "c_1", 0, 1000).unwrap()),
        (1..=310).collect::<Vec<_>>()
    );
    assert_eq!(
        seqs(&queries::events(&mut conn, &JournalMembers::anyone(), "c_1", 195, 10).unwrap()),
        (196..=205).collect::<Vec<_>>()
    );
    let tail = queries::snapshot(&mut conn, &JournalMembers::anyone(), "c_1", 12, 0)
        .unwrap()
        .unwrap();
    assert_eq!(seqs(&tail.tail), (299..=310).collect::<Vec<_>>());
    let meta = queries::get_meta(&conn, "c_1", true).unwrap().unwrap();
    assert_eq!((meta.head_seq, meta.last_activity_at), (310, ts(310)));
    let listed: Vec<(String, u64)> = queries::list(&conn, None)
        .unwrap()
        .into_iter()
        .map(|m| (m.id, m.head_seq))
        .collect();
    assert_eq!(listed, [("c_1".to_owned(), 310), ("c_2".to_owned(), 3)]);
    let before = queries::events(&mut conn, &JournalMembers::anyone(), "c_1", 0, 1000).unwrap();

    // Opening folds the journal: each conversation's consecutive runs
    // merged up to the most a run holds, in the order they came.
    let store = SqliteStore::open(dir.path()).unwrap();
    assert_eq!(stored_runs(&conn, "event_journal"), []);
    let c = |id: &str, first, last| (id.to_owned(), first, last);
    assert_eq!(
        stored_runs(&conn, "event_runs"),
        [
            c("c_1", 1, 1),
            c("c_2", 1, 1),
            c("c_1", 2, 201),
            c("c_1", 202, 310),
            c("c_2", 2, 3)
        ]
    );
    let after = store.events("c_1", 0, 1000).await.unwrap();
    assert_eq!(seqs(&after), seqs(&before));
    for (a, b) in after.iter().zip(&before) {
        assert_eq!((a.ts(), &*a.kind, a.data()), (b.ts(), &*b.kind, b.data()));
    }
    // The writer reads the head back from the folded runs.
    let stale = events_batch(
        "c_1",
        vec![delta("c_1", 300, "x")],
        state(Status::Idle, 300),
    );
    let refused = append(&store, stale).await.err().map(|e| e.to_string());
    assert!(
        refused
            .as_deref()
            .is_some_and(|e| e.contains("stored head_seq is 310")),
        "{refused:?}"
    );
    let next = events_batch(
        "c_1",
        vec![delta("c_1", 311, "x")],
        state(Status::Idle, 311),
    );
    append(&store, next).await.unwrap();
    assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, 311);
}

#[tokio::test]
async fn a_fold_left_half_done_reads_once_and_is_finished_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    drop(store);
    let mut conn = Connection::open(dir.path().join("linger.db")).unwrap();
    let journal = runs::RunTable::Journal;
    put_run(&conn, journal, "c_1", 2, 5);
    put_run(&conn, journal, "c_1", 6, 8);
    // A fold copied the first row into the runs, and stopped there.
    put_run(&conn, runs::RunTable::Runs, "c_1", 2, 5);

    let once = (1..=8).collect::<Vec<_>>();
    assert_eq!(
        seqs(&queries::events(&mut conn, &JournalMembers::anyone(), "c_1", 0, 100).unwrap()),
        once
    );
    assert_eq!(
        seqs(&queries::events(&mut conn, &JournalMembers::anyone(), "c_1", 3, 100).unwrap()),
        [4, 5, 6, 7, 8]
    );
    assert_eq!(
        seqs(&queries::events(&mut conn, &JournalMembers::anyone(), "c_1", 6, 100).unwrap()),
        [7, 8]
    );
    let snapshot = |conn: &mut Connection, n| {
        seqs(
            &queries::snapshot(conn, &JournalMembers::anyone(), "c_1", n, 0)
                .unwrap()
                .unwrap()
                .tail,
        )
    };
    assert_eq!(snapshot(&mut conn, 2), [7, 8]);
    assert_eq!(snapshot(&mut conn, 5), [4, 5, 6, 7, 8]);
    assert_eq!(snapshot(&mut conn, 100), once);
    assert_eq!(
        queries::get_meta(&conn, "c_1", true)
            .unwrap()
            .unwrap()
            .head_seq,
        8
    );

    // Opening finishes the fold without copying the first row twice.
    let store = SqliteStore::open(dir.path()).unwrap();
    let c = |first, last| ("c_1".to_owned(), first, last);
    assert_eq!(stored_runs(&conn, "event_journal"), []);
    assert_eq!(
        stored_runs(&conn, "event_runs"),
        [c(1, 1), c(2, 5), c(6, 8)]
    );
    assert_eq!(seqs(&store.events("c_1", 0, 100).await.unwrap()), once);
}

#[test]
fn a_fold_moves_a_few_conversations_per_step_and_reads_stay_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linger.db");
    let conn = open_writer(&path).unwrap();
    let mut reader = Connection::open(&path).unwrap();
    // 300 conversations with two commits each, more than one step takes.
    let ids: Vec<String> = (0..300).map(|i| format!("c_{i:03}")).collect();
    for id in &ids {
        put_conversation(&conn, id);
    }
    // Each round one commit: one journal row with a run of each.
    for round in 0..2_u64 {
        let runs: Vec<_> = ids
            .iter()
            .map(|id| (id.as_str(), round * 3 + 1..=round * 3 + 3))
            .collect();
        put_commit(&conn, &runs);
    }
    assert_eq!(stored_runs(&conn, "event_journal").len(), 600);
    // Every conversation but the last reads its six events once, whatever
    // the fold has done so far.
    let whole = |reader: &mut Connection| {
        ids[..299].iter().all(|id| {
            seqs(&queries::events(reader, &JournalMembers::anyone(), id, 0, 100).unwrap())
                == [1, 2, 3, 4, 5, 6]
                && seqs(
                    &queries::snapshot(reader, &JournalMembers::anyone(), id, 4, 0)
                        .unwrap()
                        .unwrap()
                        .tail,
                ) == [3, 4, 5, 6]
        })
    };
    assert!(whole(&mut reader));

    let mut fold = journal::Fold::start(&conn, false).unwrap().unwrap();
    // The first step reads both rows, and changes nothing. After it the
    // fold rests three times as long as the step took.
    let before = std::time::Instant::now();
    assert!(!fold.step(&conn).unwrap());
    assert!(fold.resume_at() >= before + fold.busy * (1 + journal::FOLD_REST_PER_BUSY));
    assert_eq!(fold.events, 300 * 6);
    assert_eq!(stored_runs(&conn, "event_runs").len(), 0);
    // A conversation deleted meanwhile is not brought back.
    writer::delete(&conn, "c_299").unwrap();
    fold.forget("c_299");
    let step = journal::STEP_CONVERSATIONS;
    let inserts = 300_usize.div_ceil(step);
    for k in 1..=inserts {
        assert!(!fold.step(&conn).unwrap());
        // Each conversation's two commits as one run.
        let runs = stored_runs(&conn, "event_runs").len();
        assert_eq!(runs, (k * step).min(299), "after insert step {k}");
        // The deleted conversation's runs are gone from both rows.
        assert_eq!(stored_runs(&conn, "event_journal").len(), 598);
        assert!(whole(&mut reader), "after insert step {k}");
    }
    // Then the rows go.
    assert!(fold.step(&conn).unwrap());
    assert_eq!(stored_runs(&conn, "event_runs").len(), 299);
    assert_eq!(stored_runs(&conn, "event_journal").len(), 0);
    assert!(whole(&mut reader));
    assert!(
        queries::events(&mut reader, &JournalMembers::anyone(), "c_299", 0, 100)
            .unwrap()
            .is_empty()
    );
    drop(conn);
}

#[test]
fn a_store_whose_events_are_not_json_is_not_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linger.db");
    let old = Connection::open(&path).unwrap();
    old.execute_batch(migrate::V0_SCHEMA).unwrap();
    old.execute(
        "INSERT INTO events (conversation_id, seq, ts, kind, data) \
         VALUES ('c_1', 1, '2026-01-01T00:00:00.000Z', 'text_delta', 'not json')",
        [],
    )
    .unwrap();
    drop(old);
    let refused = open_writer(&path).err().map(|e| e.to_string());
    assert!(
        refused.as_deref().is_some_and(|e| e.contains("not JSON")),
        "{refused:?}"
    );
    // Nothing was changed: the step is one transaction.
    let conn = Connection::open(&path).unwrap();
    assert_eq!(migrate::version(&conn), 1);
    let n: i64 = conn
        .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 1);
}

#[tokio::test]
async fn runs_read_back_from_any_seq_and_the_row_is_written_on_change_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    // Ten appends of 30 events, each its own commit (so its own run); text
    // with what JSON escapes.
    let text = |seq: u64| format!("[\"{seq}\"]\\\t\u{1F600}");
    let mut head = 1;
    for _ in 0..10 {
        let evs = (head + 1..=head + 30)
            .map(|s| delta("c_1", s, &text(s)))
            .collect();
        head += 30;
        append(&store, events_batch("c_1", evs, state(Status::Idle, head)))
            .await
            .unwrap();
    }
    let all = store.events("c_1", 0, 1000).await.unwrap();
    assert_eq!(
        all.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (1..=head).collect::<Vec<_>>()
    );
    // From inside a run, across runs.
    let some = store.events("c_1", 45, 40).await.unwrap();
    assert_eq!(
        some.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (46..=85).collect::<Vec<_>>()
    );
    let data: serde_json::Value = serde_json::from_str(some[0].data()).unwrap();
    assert_eq!(data["text"], text(46));
    let snapshot = store.snapshot("c_1", 45, 10).await.unwrap().unwrap();
    assert_eq!(
        snapshot.tail.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (head - 44..=head).collect::<Vec<_>>()
    );
    assert_eq!(snapshot.tail[44].frame, all[300].frame);

    // The status did not change: the row still says what the creation
    // wrote, and the head and last activity come from the newest run.
    let conn = Connection::open(store.path()).unwrap();
    let row_head: u64 = conn
        .query_row("SELECT head_seq FROM conversations", [], |r| r.get(0))
        .unwrap();
    assert_eq!(row_head, 1);
    let meta = store.get("c_1").await.unwrap().unwrap();
    assert_eq!(meta.head_seq, head);
    assert_eq!(meta.last_activity_at, all[300].ts());
    // An append must follow the head the runs hold, not the row's: as the
    // writer remembers it, and as a fresh writer reads it back.
    let stale = || events_batch("c_1", vec![delta("c_1", 2, "x")], state(Status::Idle, 2));
    let refused = append(&store, stale()).await.err().map(|e| e.to_string());
    assert!(
        refused
            .as_deref()
            .is_some_and(|e| e.contains("stored head_seq is 301")),
        "{refused:?}"
    );
    drop(store);
    let store = SqliteStore::open(dir.path()).unwrap();
    let refused = append(&store, stale()).await.err().map(|e| e.to_string());
    assert!(
        refused
            .as_deref()
            .is_some_and(|e| e.contains("stored head_seq is 301")),
        "after reopening: {refused:?}"
    );
    // A status change writes the row.
    let evs = vec![delta("c_1", head + 1, "x")];
    append(
        &store,
        events_batch("c_1", evs, state(Status::Running, head + 1)),
    )
    .await
    .unwrap();
    let (row_head, status): (u64, String) = conn
        .query_row("SELECT head_seq, status FROM conversations", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert_eq!((row_head, status.as_str()), (head + 1, "running"));
}

/// A conversation appended to, deleted and created again within one
/// group: the new one starts from nothing, not from the head the group
/// had for the old one.
#[tokio::test]
async fn a_conversation_deleted_and_created_again_in_one_group_starts_over() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    let gate = hold_writer(&store);
    let (answer, mut rx) = named_callbacks();
    let old = (2..=3).map(|seq| delta("c_1", seq, "old ")).collect();
    store.append(
        events_batch("c_1", old, state(Status::Running, 3)),
        answer("old"),
    );
    let (reply, deleted) = oneshot::channel();
    store.send(Command::Delete {
        id: "c_1".into(),
        reply,
    });
    store.append(create_batch("c_1", "bob"), answer("created"));
    store.append(
        events_batch(
            "c_1",
            vec![delta("c_1", 2, "new")],
            state(Status::Running, 2),
        ),
        answer("new"),
    );
    gate.send(()).unwrap();
    for expected in ["old", "created", "new"] {
        let (name, result) = rx.recv().await.unwrap();
        assert_eq!(name, expected);
        result.unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert!(deleted.await.unwrap().unwrap());
    let meta = store.get("c_1").await.unwrap().unwrap();
    assert_eq!((meta.user.as_str(), meta.head_seq), ("bob", 2));
    let events = store.events("c_1", 0, 10).await.unwrap();
    assert_eq!(seqs(&events), [1, 2]);
}

#[tokio::test]
async fn delete_removes_everything() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    append(&store, create_batch("c_2", "alice")).await.unwrap();
    let mut batch = events_batch(
        "c_1",
        vec![record(
            "c_1",
            2,
            crate::event::now_rfc3339(),
            &EventData::UserMessage {
                text: "hi".into(),
                client_msg_id: Some("m1".into()),
            },
        )],
        state(Status::Idle, 2),
    );
    batch.client_msg_ids = vec![("m1".into(), 2)];
    // Not awaited: the delete must still be ordered after it.
    store.append(batch, Box::new(|r, _| r.unwrap()));
    assert!(store.delete("c_1").await.unwrap());
    assert!(!store.delete("c_1").await.unwrap());
    assert!(store.get("c_1").await.unwrap().is_none());
    assert!(store.events("c_1", 0, 10).await.unwrap().is_empty());
    assert!(store.snapshot("c_1", 10, 10).await.unwrap().is_none());
    assert_eq!(store.get("c_2").await.unwrap().unwrap().head_seq, 1);
    // The id may be used again from scratch, client_msg_ids included.
    let mut batch = create_batch("c_1", "bob");
    batch.client_msg_ids = vec![("m1".into(), 1)];
    append(&store, batch).await.unwrap();
    // Nothing of the first c_1 is left, in the journal either.
    assert_eq!(seqs(&store.events("c_1", 0, 10).await.unwrap()), [1]);
    // Appending to a deleted conversation is refused.
    assert!(store.delete("c_2").await.unwrap());
    let r = append(
        &store,
        events_batch("c_2", vec![delta("c_2", 2, "x")], state(Status::Idle, 2)),
    )
    .await;
    assert!(matches!(r, Err(StoreError::NotFound(_))));
}

#[tokio::test]
async fn observers() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    store.append(create_batch("c_1", "alice"), Box::new(|r, _| r.unwrap()));
    store.add_observer("c_1", "bob").await.unwrap();
    store.add_observer("c_1", "carol").await.unwrap();
    store.add_observer("c_1", "bob").await.unwrap();
    assert_eq!(
        store.get("c_1").await.unwrap().unwrap().observers,
        ["bob", "carol"]
    );
    assert!(matches!(
        store.add_observer("c_nope", "bob").await,
        Err(StoreError::NotFound(id)) if id == "c_nope"
    ));
    // Later appends keep the observers.
    append(
        &store,
        events_batch("c_1", vec![delta("c_1", 2, "x")], state(Status::Idle, 2)),
    )
    .await
    .unwrap();
    assert_eq!(
        store.get("c_1").await.unwrap().unwrap().observers,
        ["bob", "carol"]
    );
}

#[tokio::test]
async fn prune_deletes_old_events_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    drop(store);
    // 5,000 old events in 300 runs (more than one prune step looks at), as
    // folds made over time leave them; then, through the store (into the
    // journal: a short commit), 3 new ones in the same commit as the last
    // 4 old ones.
    let day = 86_400;
    let old = 1_000 * day;
    let n_old = 5_000u64;
    let old_event = |seq: u64| {
        record(
            "c_1",
            seq,
            ts(old + seq),
            &EventData::TextDelta {
                turn_id: "t".into(),
                text: "x".into(),
            },
        )
    };
    let mut seqs = (2..n_old + 2).collect::<Vec<_>>();
    let last_chunk = seqs.split_off(seqs.len() - 4);
    assert!(last_chunk.len() + 3 < journal::DIRECT_RUN_EVENTS);
    let conn = Connection::open(dir.path().join("linger.db")).unwrap();
    for chunk in seqs.chunks(seqs.len().div_ceil(300)) {
        let evs: Vec<_> = chunk.iter().map(|&seq| old_event(seq)).collect();
        runs::insert_run(
            &conn,
            runs::RunTable::Runs,
            "c_1",
            evs.iter().map(|ev| runs::RunEvent::from(&**ev)),
        )
        .unwrap();
    }
    drop(conn);
    let store = SqliteStore::open(dir.path()).unwrap();
    let mut evs: Vec<_> = last_chunk.into_iter().map(old_event).collect();
    for seq in n_old + 2..n_old + 5 {
        evs.push(delta("c_1", seq, "new"));
    }
    append(
        &store,
        events_batch("c_1", evs, state(Status::Idle, n_old + 4)),
    )
    .await
    .unwrap();
    let runs = || {
        let conn = Connection::open(store.path()).unwrap();
        let in_runs: i64 = conn
            .query_row("SELECT count(*) FROM event_runs", [], |r| r.get(0))
            .unwrap();
        in_runs + journal_runs(&conn).len() as i64
    };
    assert!(runs() > PRUNE_CHUNK, "{}", runs());
    let before = UNIX_EPOCH + Duration::from_secs(old + 10 * day);
    assert_eq!(store.prune(before).await.unwrap(), n_old);
    let left = store.events("c_1", 0, 100).await.unwrap();
    // seq 1 was written now, so it stays.
    assert_eq!(
        left.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [1, n_old + 2, n_old + 3, n_old + 4]
    );
    assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, n_old + 4);
    assert_eq!(store.prune(before).await.unwrap(), 0);
    assert_eq!(store.prune(UNIX_EPOCH).await.unwrap(), 0);
    // seq 1 and the run the new ones share.
    assert_eq!(runs(), 2);
    // Everything is older than the far future: the head stays, although
    // only the runs held it (the status never changed, so the row was
    // last written with the creation).
    let far = UNIX_EPOCH + Duration::from_secs(400_000 * 365 * day);
    assert_eq!(store.prune(far).await.unwrap(), 4);
    assert_eq!(runs(), 0);
    assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, n_old + 4);
    let next = events_batch(
        "c_1",
        vec![delta("c_1", n_old + 5, "x")],
        state(Status::Idle, n_old + 5),
    );
    append(&store, next).await.unwrap();
}

#[tokio::test]
async fn list_and_unfinished() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    for (id, user) in [("c_a", "alice"), ("c_b", "bob"), ("c_c", "alice")] {
        append(&store, create_batch(id, user)).await.unwrap();
    }
    let at = |id: &str, head: u64, status: Status, secs: u64| {
        let mut st = state(status, head);
        st.last_activity_at = Some(ts(secs));
        events_batch(id, vec![], st)
    };
    append(&store, at("c_a", 1, Status::Stopped, 3_000))
        .await
        .unwrap();
    append(&store, at("c_b", 1, Status::Waiting, 1_000))
        .await
        .unwrap();
    append(&store, at("c_c", 1, Status::Running, 2_000))
        .await
        .unwrap();
    let ids = |v: Vec<ConversationMeta>| v.into_iter().map(|m| m.id).collect::<Vec<_>>();
    assert_eq!(
        ids(store.list(Some("alice")).await.unwrap()),
        ["c_a", "c_c"]
    );
    assert_eq!(ids(store.list(Some("bob")).await.unwrap()), ["c_b"]);
    assert!(store.list(Some("nobody")).await.unwrap().is_empty());
    assert_eq!(ids(store.list(None).await.unwrap()), ["c_a", "c_c", "c_b"]);
    assert_eq!(ids(store.unfinished().await.unwrap()), ["c_c", "c_b"]);
}

#[tokio::test]
async fn data_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = SqliteStore::open(dir.path()).unwrap();
        append(&store, create_batch("c_1", "alice")).await.unwrap();
        store.add_observer("c_1", "bob").await.unwrap();
        let mut st = state(Status::Running, 3);
        st.current_turn_id = Some("t_9".into());
        // Queued, not awaited: dropping the store finishes it.
        store.append(
            events_batch("c_1", vec![delta("c_1", 2, "a"), delta("c_1", 3, "b")], st),
            Box::new(|r, _| r.unwrap()),
        );
    }
    let store = SqliteStore::open(dir.path()).unwrap();
    let meta = store.get("c_1").await.unwrap().unwrap();
    assert_eq!(meta.head_seq, 3);
    assert_eq!(meta.status, Status::Running);
    assert_eq!(meta.observers, ["bob"]);
    assert_eq!(meta.current_turn_id.as_deref(), Some("t_9"));
    assert_eq!(store.events("c_1", 0, 10).await.unwrap().len(), 3);
    assert_eq!(store.unfinished().await.unwrap().len(), 1);
    // And it goes on from there.
    append(
        &store,
        events_batch("c_1", vec![delta("c_1", 4, "c")], state(Status::Idle, 4)),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn committed_data_is_on_disk_before_close() {
    // What a SIGKILL leaves: the files as they are while the store runs,
    // never closed. Copy them the moment the callback has fired and open
    // the copy.
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    let evs = (2..=500).map(|s| delta("c_1", s, "tok")).collect();
    append(
        &store,
        events_batch("c_1", evs, state(Status::Running, 500)),
    )
    .await
    .unwrap();
    let copy = tempfile::tempdir().unwrap();
    for name in ["linger.db", "linger.db-wal"] {
        let from = dir.path().join(name);
        if from.exists() {
            std::fs::copy(&from, copy.path().join(name)).unwrap();
        }
    }
    let recovered = SqliteStore::open(copy.path()).unwrap();
    let meta = recovered.get("c_1").await.unwrap().unwrap();
    assert_eq!(meta.head_seq, 500);
    assert_eq!(recovered.events("c_1", 0, 1000).await.unwrap().len(), 500);
    drop(store);
}

#[tokio::test]
async fn the_wal_is_checkpointed_and_truncated_when_idle() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    for seq in 2..=200 {
        let evs = vec![delta("c_1", seq, "some text to fill pages with")];
        append(
            &store,
            events_batch("c_1", evs, state(Status::Running, seq)),
        )
        .await
        .unwrap();
    }
    let wal = dir.path().join("linger.db-wal");
    assert!(std::fs::metadata(&wal).unwrap().len() > 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::fs::metadata(&wal).unwrap().len() > 0 {
        assert!(std::time::Instant::now() < deadline, "WAL never truncated");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Everything is in the database file now, and still readable.
    assert_eq!(store.events("c_1", 0, 1000).await.unwrap().len(), 200);
    append(
        &store,
        events_batch(
            "c_1",
            vec![delta("c_1", 201, "x")],
            state(Status::Idle, 201),
        ),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn a_panicking_callback_does_not_stop_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    store.append(
        create_batch("c_1", "alice"),
        Box::new(|_, _| panic!("boom")),
    );
    append(
        &store,
        events_batch("c_1", vec![delta("c_1", 2, "x")], state(Status::Idle, 2)),
    )
    .await
    .unwrap();
    assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, 2);
}

#[tokio::test]
async fn last_handle_dropped_by_a_callback() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SqliteStore::open(dir.path()).unwrap());
    // A callback that drops the last handle runs on the writer itself;
    // that must neither deadlock nor lose the callback.
    let (tx, rx) = oneshot::channel();
    let handle = store.clone();
    store.append(
        create_batch("c_1", "alice"),
        Box::new(move |r, _| {
            drop(handle);
            let _ = tx.send(r);
        }),
    );
    drop(store);
    rx.await.unwrap().unwrap();
}

#[test]
fn a_run_reads_back_exactly_what_was_written() {
    // A kind a store of another release might hold, with what JSON escapes.
    let events = [
        (
            1,
            "2026-01-01T00:00:00.000Z",
            "text_delta",
            r#"{"text":"a\"b"}"#,
        ),
        (
            2,
            "2026-01-01T00:00:01.000Z",
            "od\"d\\kind\n",
            r#"{"x":[1,{}]}"#,
        ),
    ];
    let run = encode(events.iter().map(|&(seq, ts, kind, data)| RunEvent {
        seq,
        ts,
        kind,
        data,
    }))
    .unwrap();
    assert_eq!((run.first_seq, run.last_seq, run.n), (1, 2, 2));
    assert_eq!(
        (run.min_ts.as_str(), run.max_ts.as_str()),
        (events[0].1, events[1].1)
    );
    let back = decode("c_1", &run.json).unwrap();
    let read: Vec<_> = back
        .iter()
        .map(|ev| (ev.seq(), ev.ts(), ev.kind(), ev.data()))
        .collect();
    assert_eq!(read, events);
}

#[test]
fn a_journal_index_read_back_whole_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let conn = open_writer(&dir.path().join("linger.db")).unwrap();
    put_commit(&conn, &[("c_1", 1..=2), ("c_\u{e9}\"", 1..=3)]);
    let index: Vec<u8> = conn
        .query_row("SELECT runs FROM event_journal", [], |r| r.get(0))
        .unwrap();
    let entries = runs::journal_entries(1, &index).unwrap();
    let read: Vec<_> = entries
        .iter()
        .map(|e| (&*e.0, e.1, e.2, e.3, e.6))
        .collect();
    assert_eq!(read[0], ("c_1", 1, 2, 2, 0));
    assert_eq!(read[1].0, "c_\u{e9}\"");
    assert_eq!((read[1].1, read[1].2, read[1].3), (1, 3, 3));
    // The second run's events follow the first's.
    assert_eq!(read[1].4, entries[0].7);
    // A row whose index was cut short, or is not one, is an error.
    for bad in [&index[..index.len() - 1], &[0xff_u8; 4][..]] {
        assert!(runs::journal_entries(1, bad).is_err());
    }
}

#[test]
fn each_conversation_reads_only_its_own_runs_from_a_shared_journal_row() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linger.db");
    let conn = open_writer(&path).unwrap();
    let mut reader = Connection::open(&path).unwrap();
    // An id that another one starts with, and one that JSON must escape.
    let ids = ["c_1", "c_10", "c_\"q\\"];
    for id in ids {
        put_conversation(&conn, id);
    }
    // Two commits, each one row holding a run of every conversation; c_10
    // has one event more in each.
    for round in 0..2_u64 {
        let runs: Vec<_> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let n = if i == 1 { 3 } else { 2 };
                (*id, round * n + 1..=round * n + n)
            })
            .collect();
        put_commit(&conn, &runs);
    }
    assert_eq!(stored_runs(&conn, "event_journal").len(), 6);
    for (i, id) in ids.iter().enumerate() {
        let head = if i == 1 { 6 } else { 4 };
        let all: Vec<u64> = (1..=head).collect();
        let members = JournalMembers::anyone();
        let read = queries::events(&mut reader, &members, id, 0, 100).unwrap();
        assert_eq!(seqs(&read), all, "{id}");
        let snapshot = queries::snapshot(&mut reader, &members, id, 3, 0)
            .unwrap()
            .unwrap();
        assert_eq!(seqs(&snapshot.tail), all[all.len() - 3..], "{id}");
        assert_eq!(snapshot.meta.head_seq, head, "{id}");
    }
    // The writer's head of each, read from its row and the journal.
    let known = KnownRows::default();
    let mut fill = JournalFill::default();
    for id in ids {
        fill.added(&id.into(), 1, 200, std::time::Instant::now());
    }
    let (c_1, c_10): (Arc<str>, Arc<str>) = ("c_1".into(), "c_10".into());
    let mut touched = Touched::new(&known, &fill, 1);
    assert_eq!(touched.head(&conn, &c_1).unwrap(), 4);
    assert_eq!(touched.head(&conn, &c_10).unwrap(), 6);
}

#[test]
fn a_read_skips_the_journal_only_when_its_snapshot_cannot_hold_the_conversation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("linger.db");
    let conn = open_writer(&path).unwrap();
    let mut reader = Connection::open(&path).unwrap();
    conn.execute(
        "INSERT INTO conversations (id, user, title, status, created_at, last_activity_at, \
         head_seq) VALUES ('c_1', 'alice', 't', 'idle', ?1, ?1, 0)",
        [ts(0)],
    )
    .unwrap();
    // The writer's order: mark, then commit the journal rows.
    let members = JournalMembers::default();
    members.mark(&"c_1".into());
    put_run(&conn, runs::RunTable::Journal, "c_1", 1, 3);
    let (tx, journal) = journal::begin_read(&mut reader, &members, "c_1").unwrap();
    assert!(journal);
    assert_eq!(
        seqs(&runs::events_after(&tx, "c_1", 0, 100, journal, |_| true).unwrap()),
        [1, 2, 3]
    );
    drop(tx);

    // A reader whose snapshot was taken before a fold committed its
    // deletes, and that asks after the writer narrowed the set: the epoch
    // moved, so it still looks in the journal, where its snapshot has the
    // events (its snapshot has no runs yet).
    let epoch = members.epoch();
    let tx = reader.transaction().unwrap();
    tx.query_row("SELECT count(*) FROM conversations", [], |r| {
        r.get::<_, i64>(0)
    })
    .unwrap();
    assert_eq!(journal::fold_now(&conn).unwrap(), 3);
    members.narrow_to([]);
    let journal = members.may_hold("c_1", epoch);
    assert!(journal, "the set was narrowed after this snapshot");
    assert_eq!(
        seqs(&runs::events_after(&tx, "c_1", 0, 100, journal, |_| true).unwrap()),
        [1, 2, 3]
    );
    assert_eq!(seqs(&runs::tail(&tx, "c_1", 2, journal).unwrap()), [2, 3]);
    drop(tx);

    // A read that begins after the fold skips the journal and finds the
    // events in the runs.
    let (tx, journal) = journal::begin_read(&mut reader, &members, "c_1").unwrap();
    assert!(!journal);
    assert_eq!(
        seqs(&runs::events_after(&tx, "c_1", 0, 100, journal, |_| true).unwrap()),
        [1, 2, 3]
    );
    assert_eq!(
        queries::get_meta(&tx, "c_1", journal)
            .unwrap()
            .unwrap()
            .head_seq,
        3
    );
}

#[tokio::test]
async fn a_conversation_with_events_in_the_journal_reads_whole_through_the_store() {
    // The store's own writer marks the conversation before its journal
    // rows commit: events committed a moment ago (in the journal, not yet
    // folded) read whole through every reader.
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    for seq in 2..=4 {
        // One event per commit: each goes to the journal.
        let st = state(Status::Running, seq);
        let batch = events_batch("c_1", vec![delta("c_1", seq, "tok")], st);
        append(&store, batch).await.unwrap();
    }
    let in_journal: i64 = Connection::open(dir.path().join("linger.db"))
        .unwrap()
        .query_row("SELECT count(*) FROM event_journal", [], |r| r.get(0))
        .unwrap();
    assert!(in_journal >= 3, "the events are in the journal");
    let expect = (1..=4).collect::<Vec<_>>();
    assert_eq!(seqs(&store.events("c_1", 0, 100).await.unwrap()), expect);
    assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, 4);
    let snapshot = store.snapshot("c_1", 100, 0).await.unwrap().unwrap();
    assert_eq!(seqs(&snapshot.tail), expect);
    assert_eq!(snapshot.meta.head_seq, 4);
}

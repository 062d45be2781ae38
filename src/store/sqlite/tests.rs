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
        ts,
        Arc::from(data.kind()),
        json,
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
        last_activity_at: crate::event::now_rfc3339(),
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
            created_at: ev.ts.clone(),
            close_delay: Some(Duration::from_secs(90)),
        }),
        events: vec![ev],
        state: state(Status::Idle, 1),
        client_msg_ids: vec![],
    }
}

fn events_batch(id: &str, events: Vec<Arc<EventRecord>>, st: ConversationState) -> AppendBatch {
    AppendBatch {
        conversation_id: Arc::from(id),
        create: None,
        events,
        state: st,
        client_msg_ids: vec![],
    }
}

/// Appends and waits for the callback.
async fn append(store: &SqliteStore, batch: AppendBatch) -> Result<(), StoreError> {
    let (tx, rx) = oneshot::channel();
    store.append(
        batch,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    rx.await.unwrap()
}

#[tokio::test]
async fn append_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    let evs = (2..=4).map(|s| delta("c_1", s, "tok")).collect();
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
    assert_eq!(meta.last_activity_at, st.last_activity_at);
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
        Box::new(move |r| {
            let conn =
                Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
            let n: i64 = conn
                .query_row(
                    "SELECT sum(n) FROM event_runs WHERE conversation_id = 'c_1'",
                    [],
                    |row| row.get(0),
                )
                .unwrap();
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
    // Hold the writer inside a callback while the appends queue up, so
    // that the grouping does not depend on how the threads race.
    let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
    store.append(
        create_batch("c_1", "alice"),
        Box::new(move |r| {
            r.unwrap();
            let _ = gate_rx.recv();
        }),
    );
    let before = store.commits();
    let n = 10_000u64;
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    for seq in 2..=n + 1 {
        let done_tx = done_tx.clone();
        store.append(
            events_batch(
                "c_1",
                vec![delta("c_1", seq, "tok ")],
                state(Status::Running, seq),
            ),
            Box::new(move |r| {
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
    let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
    store.append(
        create_batch("c_1", "alice"),
        Box::new(move |_| {
            let _ = gate_rx.recv();
        }),
    );
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let cb = |name: &'static str| -> CommitCallback {
        let tx = tx.clone();
        Box::new(move |r| {
            let _ = tx.send((name, r));
        })
    };
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

    let snap = store.snapshot("c_1", 3).await.unwrap().unwrap();
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
    let all = store.snapshot("c_1", 100).await.unwrap().unwrap();
    assert_eq!(all.tail.len(), 6);
    assert!(store.snapshot("c_nope", 10).await.unwrap().is_none());
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
    store.append(batch, Box::new(|r| r.unwrap()));
    assert!(store.delete("c_1").await.unwrap());
    assert!(!store.delete("c_1").await.unwrap());
    assert!(store.get("c_1").await.unwrap().is_none());
    assert!(store.events("c_1", 0, 10).await.unwrap().is_empty());
    assert!(store.snapshot("c_1", 10).await.unwrap().is_none());
    assert_eq!(store.get("c_2").await.unwrap().unwrap().head_seq, 1);
    // The id may be used again from scratch, client_msg_ids included.
    let mut batch = create_batch("c_1", "bob");
    batch.client_msg_ids = vec![("m1".into(), 1)];
    append(&store, batch).await.unwrap();
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
    store.append(create_batch("c_1", "alice"), Box::new(|r| r.unwrap()));
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
    // 5,000 old events (more than one prune chunk), then 3 new ones.
    let day = 86_400;
    let old = 1_000 * day;
    let n_old = 5_000u64;
    let mut evs: Vec<_> = (2..n_old + 2)
        .map(|seq| {
            record(
                "c_1",
                seq,
                ts(old + seq),
                &EventData::TextDelta {
                    turn_id: "t".into(),
                    text: "x".into(),
                },
            )
        })
        .collect();
    for seq in n_old + 2..n_old + 5 {
        evs.push(delta("c_1", seq, "new"));
    }
    append(
        &store,
        events_batch("c_1", evs, state(Status::Idle, n_old + 4)),
    )
    .await
    .unwrap();
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
    // Everything is older than the far future.
    let far = UNIX_EPOCH + Duration::from_secs(400_000 * 365 * day);
    assert_eq!(store.prune(far).await.unwrap(), 4);
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
        st.last_activity_at = ts(secs);
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
            Box::new(|r| r.unwrap()),
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
    store.append(create_batch("c_1", "alice"), Box::new(|_| panic!("boom")));
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
        Box::new(move |r| {
            drop(handle);
            let _ = tx.send(r);
        }),
    );
    drop(store);
    rx.await.unwrap().unwrap();
}

fn user_message(id: &str, seq: u64, text: &str, cid: &str) -> Arc<EventRecord> {
    record(
        id,
        seq,
        crate::event::now_rfc3339(),
        &EventData::UserMessage {
            text: text.into(),
            client_msg_id: Some(cid.into()),
        },
    )
}

fn seqs(events: &[Arc<EventRecord>]) -> Vec<u64> {
    events.iter().map(|e| e.seq).collect()
}

#[tokio::test]
async fn reads_by_seq_cross_runs() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    // One append longer than a run, then many one-event appends.
    let n = 2 * RUN_MAX_EVENTS as u64 + 10;
    let evs = (2..=n + 1).map(|s| delta("c_1", s, "x")).collect();
    append(
        &store,
        events_batch("c_1", evs, state(Status::Running, n + 1)),
    )
    .await
    .unwrap();
    for seq in n + 2..n + 20 {
        append(
            &store,
            events_batch(
                "c_1",
                vec![delta("c_1", seq, "y")],
                state(Status::Running, seq),
            ),
        )
        .await
        .unwrap();
    }
    let head = n + 19;
    let all = store.events("c_1", 0, 10_000).await.unwrap();
    assert_eq!(seqs(&all), (1..=head).collect::<Vec<_>>());
    let mid = RUN_MAX_EVENTS as u64 - 3;
    let some = store.events("c_1", mid, 10).await.unwrap();
    assert_eq!(seqs(&some), (mid + 1..=mid + 10).collect::<Vec<_>>());
    assert!(store.events("c_1", head, 10).await.unwrap().is_empty());
    assert!(store.events("c_1", 0, 0).await.unwrap().is_empty());
    let snap = store.snapshot("c_1", 300).await.unwrap().unwrap();
    assert_eq!(seqs(&snap.tail), (head - 299..=head).collect::<Vec<_>>());
    // The frame is rebuilt as the conversation built it.
    let frame: serde_json::Value = serde_json::from_str(all[5].frame.as_str()).unwrap();
    assert_eq!(frame["seq"], 6);
    assert_eq!(frame["conversation_id"], "c_1");
    assert_eq!(frame["data"]["text"], "x");
    let meta = store.get("c_1").await.unwrap().unwrap();
    assert_eq!(meta.head_seq, head);
    assert_eq!(meta.last_activity_at, all.last().unwrap().ts);
}

#[tokio::test]
async fn the_row_is_written_only_when_its_fields_change() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    append(&store, create_batch("c_2", "alice")).await.unwrap();
    let mut running = state(Status::Running, 2);
    running.current_turn_id = Some("t_1".into());
    append(
        &store,
        events_batch("c_1", vec![delta("c_1", 2, "a")], running.clone()),
    )
    .await
    .unwrap();
    for seq in 3..=5 {
        let mut st = running.clone();
        st.head_seq = seq;
        append(
            &store,
            events_batch("c_1", vec![delta("c_1", seq, "b")], st),
        )
        .await
        .unwrap();
    }
    let raw = |sql: &str| -> i64 {
        let conn = Connection::open(store.path()).unwrap();
        conn.query_row(sql, [], |row| row.get(0)).unwrap()
    };
    // The row still says 2; the runs say 5, and that is what is read.
    assert_eq!(
        raw("SELECT head_seq FROM conversations WHERE id = 'c_1'"),
        2
    );
    let meta = store.get("c_1").await.unwrap().unwrap();
    assert_eq!(meta.head_seq, 5);
    assert_eq!(meta.status, Status::Running);
    assert_eq!(meta.current_turn_id.as_deref(), Some("t_1"));
    let last = store.events("c_1", 4, 1).await.unwrap();
    assert_eq!(meta.last_activity_at, last[0].ts);
    // c_1 is the most recently active.
    let listed = store.list(Some("alice")).await.unwrap();
    assert_eq!(listed[0].id, "c_1");
    assert_eq!(listed[0].head_seq, 5);
    // A status change writes the row.
    append(
        &store,
        events_batch("c_1", vec![delta("c_1", 6, "c")], state(Status::Idle, 6)),
    )
    .await
    .unwrap();
    assert_eq!(
        raw("SELECT head_seq FROM conversations WHERE id = 'c_1'"),
        6
    );
    let meta = store.get("c_1").await.unwrap().unwrap();
    assert_eq!((meta.head_seq, meta.status), (6, Status::Idle));
    assert_eq!(meta.current_turn_id, None);
    // An append without events writes the row too (its state is all there is).
    let mut st = state(Status::Idle, 6);
    st.last_activity_at = ts(4_000_000_000);
    append(&store, events_batch("c_1", vec![], st))
        .await
        .unwrap();
    let meta = store.get("c_1").await.unwrap().unwrap();
    assert_eq!(meta.last_activity_at, ts(4_000_000_000));
    // Appends must follow the head the runs hold, not the row's.
    let err = append(
        &store,
        events_batch("c_1", vec![delta("c_1", 3, "x")], state(Status::Idle, 3)),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, StoreError::Backend(_)), "{err:?}");
}

#[tokio::test]
async fn a_prune_of_the_last_run_keeps_the_head() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    let evs: Vec<_> = (2..=4)
        .map(|seq| {
            record(
                "c_1",
                seq,
                ts(1000 + seq),
                &EventData::TextDelta {
                    turn_id: "t".into(),
                    text: "x".into(),
                },
            )
        })
        .collect();
    append(&store, events_batch("c_1", evs, state(Status::Idle, 4)))
        .await
        .unwrap();
    append(
        &store,
        events_batch("c_1", vec![delta("c_1", 5, "x")], state(Status::Idle, 5)),
    )
    .await
    .unwrap();
    let far = UNIX_EPOCH + Duration::from_secs(400_000 * 365 * 86_400);
    assert_eq!(store.prune(far).await.unwrap(), 5);
    assert!(store.events("c_1", 0, 10).await.unwrap().is_empty());
    let meta = store.get("c_1").await.unwrap().unwrap();
    assert_eq!(meta.head_seq, 5);
    // The history goes on from there.
    append(
        &store,
        events_batch("c_1", vec![delta("c_1", 6, "x")], state(Status::Idle, 6)),
    )
    .await
    .unwrap();
    assert_eq!(seqs(&store.events("c_1", 0, 10).await.unwrap()), [6]);
}

#[tokio::test]
async fn the_client_msg_id_ledger_keeps_a_window() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    append(&store, create_batch("c_1", "alice")).await.unwrap();
    let total = CLIENT_MSG_ID_WINDOW as u64 + 50;
    // In appends of 10 messages, as a busy client would send them.
    for chunk in (2..total + 2).collect::<Vec<_>>().chunks(10) {
        let evs = chunk
            .iter()
            .map(|&seq| user_message("c_1", seq, "hi", &format!("m{seq}")))
            .collect();
        let head = *chunk.last().unwrap();
        let mut st = state(Status::Idle, head);
        st.last_turn_message_seq = head;
        let mut batch = events_batch("c_1", evs, st);
        batch.client_msg_ids = chunk.iter().map(|&seq| (format!("m{seq}"), seq)).collect();
        append(&store, batch).await.unwrap();
    }
    let snap = store.snapshot("c_1", 1).await.unwrap().unwrap();
    assert_eq!(snap.client_msg_ids.len(), CLIENT_MSG_ID_WINDOW);
    let first = total + 2 - CLIENT_MSG_ID_WINDOW as u64;
    assert_eq!(snap.client_msg_ids[0], (format!("m{first}"), first));
    assert_eq!(
        snap.client_msg_ids.last().unwrap(),
        &(format!("m{}", total + 1), total + 1)
    );
    // Pruned on disk, not only in what the snapshot loads.
    let conn = Connection::open(store.path()).unwrap();
    let stored: i64 = conn
        .query_row("SELECT count(*) FROM client_msgs", [], |row| row.get(0))
        .unwrap();
    assert_eq!(stored, CLIENT_MSG_ID_WINDOW as i64);
}

/// Writes a store in format version 1 the way the release before format
/// versions did: its schema, its rows (a conversation's events one row
/// each, every client_msg_id).
fn write_v1_store(dir: &Path, events: u64, ids: u64) -> Vec<(String, u64, String, String, String)> {
    let conn = Connection::open(dir.join("linger.db")).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.execute_batch(schema::V1_SCHEMA).unwrap();
    let tx = conn.unchecked_transaction().unwrap();
    let mut rows = Vec::new();
    for (id, n, status, first) in [("c_1", events, "idle", 1), ("c_2", 40, "stopped", 11)] {
        tx.execute(
            "INSERT INTO conversations (id, user, title, status, created_at, last_activity_at, \
             head_seq, close_delay_ms, observers, current_turn_id, last_turn_message_seq) \
             VALUES (?1, 'alice', 'old', ?2, ?3, ?4, ?5, 90000, '[\"bob\"]', NULL, ?6)",
            params![
                id,
                status,
                ts(1_000),
                ts(2_000 + n),
                n as i64,
                (n - 1) as i64
            ],
        )
        .unwrap();
        // c_2's first ten were pruned.
        for seq in first..=n {
            let data = if seq == n {
                EventData::UserMessage {
                    text: "queued \"one\"".into(),
                    client_msg_id: Some(format!("q{id}")),
                }
            } else {
                EventData::TextDelta {
                    turn_id: "t_1".into(),
                    text: format!("tok {seq} \u{e9}\n"),
                }
            };
            let row = (
                id.to_string(),
                seq,
                ts(2_000 + seq),
                data.kind().to_string(),
                serde_json::to_string(&data).unwrap(),
            );
            tx.execute(
                "INSERT INTO events (conversation_id, seq, ts, kind, data) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![row.0, row.1 as i64, row.2, row.3, row.4],
            )
            .unwrap();
            rows.push(row);
        }
    }
    for i in 0..ids {
        tx.execute(
            "INSERT INTO client_msgs (conversation_id, client_msg_id, seq) VALUES ('c_1', ?1, ?2)",
            params![format!("m{i}"), i as i64 + 1],
        )
        .unwrap();
    }
    tx.commit().unwrap();
    rows
}

#[tokio::test]
async fn a_version_1_store_is_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let n = 3 * RUN_MAX_EVENTS as u64 + 7;
    let ids = CLIENT_MSG_ID_WINDOW as u64 + 20;
    let rows = write_v1_store(dir.path(), n, ids);
    let store = SqliteStore::open(dir.path()).unwrap();
    {
        let conn = Connection::open(store.path()).unwrap();
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |row| row.get(0))
            .unwrap();
        assert_eq!(version, schema::SCHEMA_VERSION);
        let old_table: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_schema WHERE name IN ('events', 'events_by_ts')",
                [],
                |row| row.get(0),
            )
            .unwrap();
        assert_eq!(old_table, 0);
    }
    for id in ["c_1", "c_2"] {
        let got = store.events(id, 0, 100_000).await.unwrap();
        let want: Vec<_> = rows.iter().filter(|r| r.0 == id).collect();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert_eq!(
                (g.seq, &g.ts, &*g.kind, g.data()),
                (w.1, &w.2, &*w.3, &*w.4)
            );
        }
    }
    let some = store
        .events("c_1", RUN_MAX_EVENTS as u64 - 1, 3)
        .await
        .unwrap();
    assert_eq!(
        seqs(&some),
        (RUN_MAX_EVENTS as u64..RUN_MAX_EVENTS as u64 + 3).collect::<Vec<_>>()
    );
    let c2 = store.get("c_2").await.unwrap().unwrap();
    assert_eq!((c2.head_seq, c2.status), (40, Status::Stopped));
    assert_eq!(c2.observers, ["bob"]);
    assert_eq!(c2.close_delay, Some(Duration::from_secs(90)));
    assert_eq!(c2.last_activity_at, ts(2_040));
    let snap = store.snapshot("c_1", 5).await.unwrap().unwrap();
    assert_eq!(snap.meta.head_seq, n);
    assert_eq!(seqs(&snap.tail), (n - 4..=n).collect::<Vec<_>>());
    assert_eq!(
        snap.queued,
        [QueuedMessage {
            seq: n,
            text: "queued \"one\"".into()
        }]
    );
    assert_eq!(snap.client_msg_ids.len(), CLIENT_MSG_ID_WINDOW);
    assert_eq!(snap.client_msg_ids[0], ("m20".to_string(), 21));
    assert_eq!(store.unfinished().await.unwrap().len(), 1);
    // It goes on as a version 2 store, and opens again as one.
    append(
        &store,
        events_batch(
            "c_1",
            vec![delta("c_1", n + 1, "new")],
            state(Status::Idle, n + 1),
        ),
    )
    .await
    .unwrap();
    drop(store);
    let store = SqliteStore::open(dir.path()).unwrap();
    assert_eq!(store.get("c_1").await.unwrap().unwrap().head_seq, n + 1);
    assert_eq!(
        store.events("c_1", 0, 100_000).await.unwrap().len() as u64,
        n + 1
    );
}

#[tokio::test]
async fn a_store_from_a_newer_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    {
        let conn = Connection::open(dir.path().join("linger.db")).unwrap();
        conn.pragma_update(None, "user_version", schema::SCHEMA_VERSION + 1)
            .unwrap();
    }
    let err = SqliteStore::open(dir.path()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("newer linger"), "{msg}");
    assert!(
        msg.contains(&format!("version {}", schema::SCHEMA_VERSION + 1)),
        "{msg}"
    );
}

/// A store written by the release before format versions (`linger serve`,
/// then `linger new` twice and `linger send --wait` three times, one of
/// them `/stream 300 0`; stopped by SIGTERM).
const V1_FIXTURE: &[u8] = include_bytes!("../../../tests/fixtures/store-v1.db");

#[tokio::test]
async fn the_previous_release_store_is_migrated() {
    let old = tempfile::tempdir().unwrap();
    std::fs::write(old.path().join("linger.db"), V1_FIXTURE).unwrap();
    // What the previous release stored, read with its own schema.
    type Row = (String, u64, String, String, String);
    let want: Vec<Row> = {
        let conn = Connection::open(old.path().join("linger.db")).unwrap();
        let mut stmt = conn
            .prepare("SELECT conversation_id, seq, ts, kind, data FROM events ORDER BY 1, 2")
            .unwrap();
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .unwrap();
        rows.collect::<Result<_, _>>().unwrap()
    };
    assert_eq!(want.len(), 340);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("linger.db"), V1_FIXTURE).unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    let listed = store.list(Some("alice")).await.unwrap();
    let heads: Vec<(&str, u64, Status)> = listed
        .iter()
        .map(|m| (m.id.as_str(), m.head_seq, m.status))
        .collect();
    // Both stopped in the same millisecond: then by id.
    assert_eq!(
        heads,
        [
            ("c_01M8PZR0SWASYW3E0D63V331H9", 313, Status::Stopped),
            ("c_01M8PZR0T2H9RFFAYFD5MS031E", 27, Status::Stopped),
        ]
    );
    for meta in &listed {
        let got = store.events(&meta.id, 0, 10_000).await.unwrap();
        let rows: Vec<&Row> = want.iter().filter(|r| r.0 == meta.id).collect();
        assert_eq!(got.len() as u64, meta.head_seq);
        for (g, w) in got.iter().zip(rows) {
            assert_eq!(
                (g.seq, &g.ts, &*g.kind, g.data()),
                (w.1, &w.2, &*w.3, &*w.4)
            );
        }
    }
    let snap = store
        .snapshot("c_01M8PZR0SWASYW3E0D63V331H9", 10)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(snap.meta.title, "first");
    assert_eq!(snap.meta.last_turn_message_seq, 307);
    assert!(snap.queued.is_empty());
    assert_eq!(
        snap.client_msg_ids,
        [
            ("cli-bd45684388f651cf0000170e".to_string(), 3),
            ("cli-edb4d3a9b4b8009f00001711".to_string(), 307)
        ]
    );
    assert_eq!(seqs(&snap.tail), (304..=313).collect::<Vec<_>>());
}

//! Cluster mode's foundation against real NATS servers: fenced appends,
//! finding seq N, leases, server loss and recovery, and the version floor.
//! Each test starts its own servers (tests/common/nats.rs) on free ports.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::nats::Nats;
use common::RECV_TIMEOUT;
use linger::cluster::lease::{Leases, Lookup};
use linger::cluster::liveness::{Departure, Liveness, Renewal};
use linger::cluster::log::{EventLog, Fence};
use linger::cluster::{connect, Cluster, ClusterError, ClusterOptions};
use linger::config::{ClusterMode, Config};
use linger::event::{intern_kind, EventRecord};

fn options(op_timeout: Duration, replicas: usize, lease_ttl: Duration) -> ClusterOptions {
    ClusterOptions {
        op_timeout,
        prefix: "LT".into(),
        replicas,
        lease_ttl,
        retain: Duration::from_secs(3600),
    }
}

async fn cluster(urls: Vec<String>, opts: ClusterOptions) -> Cluster {
    connect(&urls, opts)
        .await
        .unwrap_or_else(|e| panic!("connecting to NATS: {e}"))
}

fn events(conversation: &str, from: u64, n: u64, tag: &str) -> Vec<Arc<EventRecord>> {
    (from..from + n)
        .map(|seq| {
            Arc::new(EventRecord::from_parts(
                conversation,
                seq,
                "2026-01-01T00:00:00.000Z",
                intern_kind("text_delta"),
                &serde_json::json!({ "turn_id": "t", "text": format!("{tag}{seq}") }).to_string(),
            ))
        })
        .collect()
}

fn text(record: &EventRecord) -> String {
    let v: serde_json::Value = serde_json::from_str(record.data()).unwrap();
    v["text"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn a_stale_owner_is_fenced_and_the_new_owner_goes_on() {
    let nats = Nats::single().await;
    let c = cluster(
        nats.urls(),
        options(RECV_TIMEOUT, 1, Duration::from_secs(5)),
    )
    .await;
    let log = EventLog::open(&c).await.unwrap();

    let mut a = log.take_over("c_1", 1, "node-a", 0).await.unwrap();
    log.append(&mut a, &events("c_1", 1, 3, "a")).await.unwrap();
    assert_eq!(a.head_seq, 3);

    // Node B takes over with the next term; its fence message locks A out.
    let head = log.head("c_1").await.unwrap();
    assert_eq!((head.seq, head.term, head.node.as_str()), (3, 1, "node-a"));
    let mut b = log
        .take_over("c_1", head.term + 1, "node-b", 0)
        .await
        .unwrap();
    assert_eq!(b.head_seq, 3);

    // A's next append (same seq B will use) is refused.
    let stale = log.append(&mut a.clone(), &events("c_1", 4, 2, "a")).await;
    assert!(
        matches!(stale, Err(ClusterError::Fenced { ref conversation, term: 1 }) if conversation == "c_1"),
        "{stale:?}"
    );
    // B's event at seq 4 is stored: A's refused attempt is no duplicate of it.
    log.append(&mut b, &events("c_1", 4, 1, "b")).await.unwrap();
    log.append(&mut b, &events("c_1", 5, 2, "b")).await.unwrap();
    let all = log.read("c_1", 0, 100).await.unwrap();
    let texts: Vec<String> = all.iter().map(|r| text(r)).collect();
    assert_eq!(texts, ["a1", "a2", "a3", "b4", "b5", "b6"]);
    // A stays out, whatever seq it tries.
    let mut a2 = a.clone();
    a2.head_seq = 6;
    assert!(matches!(
        log.append(&mut a2, &events("c_1", 7, 1, "a")).await,
        Err(ClusterError::Fenced { .. })
    ));
    // An older term cannot take over again.
    assert!(matches!(
        log.take_over("c_1", 2, "node-c", 0).await,
        Err(ClusterError::Fenced { .. })
    ));
}

#[tokio::test]
async fn a_retried_append_is_recognized_not_duplicated() {
    let nats = Nats::single().await;
    let c = cluster(
        nats.urls(),
        options(RECV_TIMEOUT, 1, Duration::from_secs(5)),
    )
    .await;
    let log = EventLog::open(&c).await.unwrap();
    let mut f = log.take_over("c_r", 1, "n1", 0).await.unwrap();
    let before: Fence = f.clone();
    let batch = events("c_r", 1, 3, "x");
    log.append(&mut f, &batch).await.unwrap();
    // The same append again (as after a lost ack): the server answers
    // "duplicate" (dedup is checked before the expected sequence).
    let mut again = before.clone();
    log.append(&mut again, &batch).await.unwrap();
    assert_eq!(again, f);
    assert_eq!(log.read("c_r", 0, 100).await.unwrap().len(), 3);
    // A new owner's first event at the same seq as an old owner's retry is
    // not swallowed by dedup: the msg id carries the term.
    let mut g = log.take_over("c_r", 2, "n2", 0).await.unwrap();
    log.append(&mut g, &events("c_r", 4, 1, "y")).await.unwrap();
    let got = log.read("c_r", 3, 10).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(text(&got[0]), "y4");
}

#[tokio::test]
async fn seq_n_is_found_among_interleaved_conversations() {
    let nats = Nats::single().await;
    let c = cluster(
        nats.urls(),
        options(RECV_TIMEOUT, 1, Duration::from_secs(5)),
    )
    .await;
    let log = EventLog::open(&c).await.unwrap();
    let ids = ["c_a", "c_b", "c_c"];
    let mut fences = Vec::new();
    for id in ids {
        fences.push(log.take_over(id, 1, "n1", 0).await.unwrap());
    }
    // Interleaved groups of different sizes, and a takeover in the middle.
    for round in 0..12u64 {
        for (i, id) in ids.iter().enumerate() {
            let n = 1 + (round + i as u64) % 4;
            let from = fences[i].head_seq + 1;
            log.append(&mut fences[i], &events(id, from, n, id))
                .await
                .unwrap();
        }
        if round == 6 {
            fences[1] = log.take_over("c_b", 2, "n2", 0).await.unwrap();
        }
    }
    for (i, id) in ids.iter().enumerate() {
        let head = fences[i].head_seq;
        for seq in 1..=head {
            let got = log.read(id, seq - 1, 1).await.unwrap();
            assert_eq!(got.len(), 1, "{id} seq {seq}");
            assert_eq!(got[0].seq, seq);
            assert_eq!(text(&got[0]), format!("{id}{seq}"));
        }
        let rest = log.read(id, 2, usize::MAX).await.unwrap();
        assert_eq!(rest.len() as u64, head - 2);
        assert!(log.read(id, head, 10).await.unwrap().is_empty());
        assert_eq!(log.locate(id, head + 1).await.unwrap(), None);
    }
}

/// One heartbeat per node process keeps its conversations; when it ages
/// out, another node sees the departure, finds the conversation orphaned,
/// takes it with the next term, and the silent node's append is fenced.
/// A process restarted under the same node id replaces the heartbeat, and
/// the earlier process's records are orphans at once.
#[tokio::test]
async fn a_departed_node_s_conversation_is_taken_over_with_the_next_term() {
    let nats = Nats::single().await;
    let ttl = Duration::from_secs(1);
    let c = cluster(nats.urls(), options(RECV_TIMEOUT, 1, ttl)).await;
    let live_a = Liveness::open(&c, "node-a").await.unwrap();
    let live_b = Liveness::open(&c, "node-b").await.unwrap();
    let heartbeat_a = live_a.announce().await.unwrap();
    // B stays alive throughout: its heartbeat renewed as a node does.
    let mut heartbeat_b = live_b.announce().await.unwrap();
    let beating = live_b.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(ttl / 3).await;
            if let Ok(Renewal::Renewed(r) | Renewal::Restored(r)) = beating.renew(heartbeat_b).await
            {
                heartbeat_b = r;
            }
        }
    });
    let a = Leases::open(&c, live_a.clone()).await.unwrap();
    let b = Leases::open(&c, live_b.clone()).await.unwrap();
    let log = EventLog::open(&c).await.unwrap();
    // B watches heartbeats and records, as every node does.
    let (departed_tx, mut departed) = tokio::sync::mpsc::unbounded_channel();
    let watching = live_b.clone();
    tokio::spawn(async move { watching.watch(&departed_tx).await });
    let (claimed_tx, mut claimed) = tokio::sync::mpsc::unbounded_channel();
    let watching = b.clone();
    tokio::spawn(async move {
        watching
            .watch(|c, h, _| {
                let _ = claimed_tx.send((c.to_owned(), h.node.clone()));
            })
            .await
    });

    let term = log.head("c_l").await.unwrap().term + 1;
    assert_eq!(
        a.lookup("c_l").await.unwrap(),
        Lookup::Free { revision: None }
    );
    let lease = a.acquire("c_l", term, None).await.unwrap();
    let mut fence_a = log.take_over("c_l", lease.term, "node-a", 0).await.unwrap();
    log.append(&mut fence_a, &events("c_l", 1, 1, "a"))
        .await
        .unwrap();
    let heartbeat_a = match live_a.renew(heartbeat_a).await.unwrap() {
        Renewal::Renewed(r) => r,
        other => panic!("{other:?}"),
    };
    // Held by A: B cannot write the record.
    match b.lookup("c_l").await.unwrap() {
        Lookup::Held(holder) => assert_eq!(holder.node, "node-a"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        b.acquire("c_l", term + 1, None).await,
        Err(ClusterError::LeaseHeld { .. })
    ));
    let seen = tokio::time::timeout(RECV_TIMEOUT, claimed.recv())
        .await
        .expect("B's watch shows A's record");
    assert_eq!(seen, Some(("c_l".to_owned(), "node-a".to_owned())));

    // A goes silent: B sees it depart, and the conversation is an orphan.
    let departure = tokio::time::timeout(RECV_TIMEOUT, departed.recv())
        .await
        .expect("A's departure within the timeout")
        .expect("a departure");
    assert_eq!(
        departure,
        Departure {
            node: "node-a".into(),
            except: None
        }
    );
    assert_eq!(b.orphans_of(&departure), vec!["c_l".to_owned()]);
    let Lookup::Free {
        revision: Some(orphan),
    } = b.lookup("c_l").await.unwrap()
    else {
        panic!("A's record is an orphan once A departed");
    };
    let head = log.head("c_l").await.unwrap();
    let lease_b = b.acquire("c_l", head.term + 1, Some(orphan)).await.unwrap();
    assert_eq!(lease_b.term, 2);
    let mut fence_b = log
        .take_over("c_l", lease_b.term, "node-b", 0)
        .await
        .unwrap();
    log.append(&mut fence_b, &events("c_l", 2, 1, "b"))
        .await
        .unwrap();

    // A wakes up: its heartbeat is written again, but the conversation is
    // B's, and A's append is refused.
    assert!(matches!(
        live_a.renew(heartbeat_a).await.unwrap(),
        Renewal::Restored(_)
    ));
    match a.lookup("c_l").await.unwrap() {
        Lookup::Held(holder) => assert_eq!(holder.node, "node-b"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        log.append(&mut fence_a, &events("c_l", 2, 1, "a")).await,
        Err(ClusterError::Fenced { .. })
    ));
    b.release(lease_b).await.unwrap();
    assert_eq!(b.holder("c_l").await.unwrap(), None);

    // A restarts under the same node id: its new process replaces the
    // heartbeat, which B sees as the earlier process departing.
    let again = Liveness::open(&c, "node-a").await.unwrap();
    again.announce().await.unwrap();
    loop {
        let next = tokio::time::timeout(RECV_TIMEOUT, departed.recv())
            .await
            .expect("the earlier process's departure")
            .expect("a departure");
        if next.except.is_some() {
            assert_eq!(next.node, "node-a");
            assert_eq!(next.except.as_deref(), Some(again.incarnation()));
            break;
        }
    }
    assert!(!live_b
        .is_alive("node-a", live_a.incarnation())
        .await
        .unwrap());
    assert!(live_b
        .is_alive("node-a", again.incarnation())
        .await
        .unwrap());
}

#[tokio::test]
async fn appends_go_on_when_one_of_three_servers_dies() {
    let mut nats = Nats::cluster().await;
    let c = cluster(
        nats.urls(),
        options(RECV_TIMEOUT * 2, 3, Duration::from_secs(5)),
    )
    .await;
    let log = EventLog::open(&c).await.unwrap();
    let mut f = log.take_over("c_k", 1, "n1", 0).await.unwrap();
    log.append(&mut f, &events("c_k", 1, 5, "e")).await.unwrap();
    for victim in 0..3 {
        nats.kill(victim);
        let from = f.head_seq + 1;
        log.append(&mut f, &events("c_k", from, 3, "e"))
            .await
            .unwrap();
        nats.restart(victim).await;
    }
    let all = log.read("c_k", 0, 1000).await.unwrap();
    let seqs: Vec<u64> = all.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (1..=14).collect::<Vec<_>>());
}

#[tokio::test]
async fn all_servers_gone_is_unavailable_and_recovers_by_itself() {
    let mut nats = Nats::cluster().await;
    let c = cluster(
        nats.urls(),
        options(Duration::from_secs(3), 3, Duration::from_secs(5)),
    )
    .await;
    let log = EventLog::open(&c).await.unwrap();
    let mut f = log.take_over("c_u", 1, "n1", 0).await.unwrap();
    log.append(&mut f, &events("c_u", 1, 2, "e")).await.unwrap();

    nats.stop_all();
    let before = f.clone();
    match log.append(&mut f, &events("c_u", 3, 2, "e")).await {
        Err(ClusterError::Unavailable(_)) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert_eq!(f, before, "a failed append does not move the fence");
    let err: linger::store::StoreError = ClusterError::Unavailable("x".into()).into();
    assert!(matches!(err, linger::store::StoreError::Unavailable(_)));

    nats.start_all().await;
    // The same append again, until NATS is back (the client reconnects by
    // itself); then seq goes on with no gap.
    let deadline = tokio::time::Instant::now() + RECV_TIMEOUT * 3;
    loop {
        match log.append(&mut f, &events("c_u", 3, 2, "e")).await {
            Ok(()) => break,
            Err(ClusterError::Unavailable(why)) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "still unavailable: {why}"
                )
            }
            Err(e) => panic!("{e}"),
        }
    }
    let seqs: Vec<u64> = log
        .read("c_u", 0, 100)
        .await
        .unwrap()
        .iter()
        .map(|r| r.seq)
        .collect();
    assert_eq!(seqs, [1, 2, 3, 4]);
}

/// A fake server that announces an old version in its INFO line (and
/// answers the client's PING so that the handshake completes).
#[tokio::test]
async fn a_server_older_than_2_11_is_refused_with_the_reason() {
    let port = common::nats::fake_server("2.10.22").await;
    let result = connect(
        &[format!("nats://127.0.0.1:{port}")],
        options(Duration::from_secs(5), 1, Duration::from_secs(5)),
    )
    .await;
    let err = match result {
        Err(e) => e,
        Ok(_) => panic!("an old server was accepted"),
    };
    assert!(matches!(err, ClusterError::ServerTooOld { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("2.10.22") && text.contains("2.11"), "{text}");
    assert!(text.contains("two conditional appends"), "{text}");
}

#[test]
fn the_cluster_section_has_defaults_and_refuses_bad_values() {
    let c = Config::from_toml("").unwrap().cluster;
    assert_eq!(c.mode, ClusterMode::Single);
    assert_eq!(c.nats_urls, ["nats://127.0.0.1:4222"]);
    assert_eq!(c.node_id, "");
    assert_eq!(c.lease_ttl, Duration::from_secs(5));
    assert_eq!(c.replicas, 1);
    let c = Config::from_toml(
        "[cluster]\nmode = \"nats\"\nnats_urls = [\"nats://a:1\", \"nats://b:2\"]\n\
         node_id = \"node-1\"\nlease_ttl = \"2s\"\nreplicas = 3\n",
    )
    .unwrap()
    .cluster;
    assert_eq!(c.mode, ClusterMode::Nats);
    assert_eq!(c.replicas, 3);
    for (bad, key) in [
        ("[cluster]\nmode = \"raft\"\n", "cluster.mode"),
        ("[cluster]\nreplicas = 0\n", "cluster.replicas"),
        ("[cluster]\nlease_ttl = \"soon\"\n", "cluster.lease_ttl"),
        ("[cluster]\nlease_ttl = \"10ms\"\n", "cluster.lease_ttl"),
        ("[cluster]\nnode_id = \"a.b\"\n", "cluster.node_id"),
        (
            "[cluster]\nmode = \"nats\"\nnats_urls = []\n",
            "cluster.nats_urls",
        ),
        ("[cluster]\nleader = true\n", "cluster"),
    ] {
        let err = Config::from_toml(bad).unwrap_err().to_string();
        assert!(err.contains(key) || err.contains("leader"), "{bad}: {err}");
    }
}

fn batch(
    id: &str,
    from: u64,
    n: u64,
    create: bool,
    status: linger::protocol::Status,
) -> linger::store::AppendBatch {
    use linger::store::{AppendBatch, ConversationState, NewConversation};
    let evs = events(id, from, n, "s");
    AppendBatch {
        conversation_id: Arc::from(id),
        create: create.then(|| NewConversation {
            user: "alice".into(),
            title: "hello".into(),
            created_at: "2026-01-01T00:00:00.000Z".into(),
            close_delay: None,
        }),
        state: ConversationState {
            status,
            head_seq: from + n - 1,
            last_activity_at: Some("2026-01-01T00:00:01.000Z".into()),
            current_turn_id: None,
            last_turn_message_seq: 0,
        },
        events: evs,
        client_msg_ids: Vec::new(),
        forget_client_msg_ids_before: 0,
    }
}

async fn append(
    store: &linger::cluster::store::NatsStore,
    b: linger::store::AppendBatch,
) -> Result<(), linger::store::StoreError> {
    use linger::store::Store;
    let (tx, rx) = tokio::sync::oneshot::channel();
    store.append(
        b,
        Box::new(move |r, _| {
            let _ = tx.send(r);
        }),
    );
    rx.await.expect("the append is answered")
}

/// One NATS server and two nodes' stores on it (the server lives as long
/// as the first value).
async fn two_nodes_stores() -> (
    Nats,
    linger::cluster::store::NatsStore,
    linger::cluster::store::NatsStore,
) {
    use linger::cluster::store::NatsStore;
    let nats = Nats::single().await;
    let c = cluster(
        nats.urls(),
        options(RECV_TIMEOUT, 1, Duration::from_secs(5)),
    )
    .await;
    let one = NatsStore::open(&c, "node-1").await.unwrap();
    let two = NatsStore::open(&c, "node-2").await.unwrap();
    (nats, one, two)
}

#[tokio::test]
async fn the_nats_store_serves_the_store_trait_and_fences_a_moved_conversation() {
    use linger::protocol::Status;
    use linger::store::{Store, StoreError};
    let (_nats, one, two) = two_nodes_stores().await;

    // Not owned here: refused.
    assert!(matches!(
        append(&one, batch("c_s", 1, 2, true, Status::Idle)).await,
        Err(StoreError::Fenced { .. })
    ));
    assert_eq!(one.take_over("c_s", 1).await.unwrap(), 0);
    append(&one, batch("c_s", 1, 2, true, Status::Idle))
        .await
        .unwrap();
    let mut with_ids = batch("c_s", 3, 2, false, Status::Running);
    with_ids.client_msg_ids = vec![("msg-1/é".into(), 3)];
    append(&one, with_ids).await.unwrap();
    one.flush().await.unwrap();

    // Any node answers the same.
    let meta = two.get("c_s").await.unwrap().expect("a summary");
    assert_eq!(
        (meta.user.as_str(), meta.head_seq, meta.status),
        ("alice", 4, Status::Running)
    );
    assert_eq!(two.list(Some("alice")).await.unwrap().len(), 1);
    assert!(two.list(Some("bob")).await.unwrap().is_empty());
    assert_eq!(two.events("c_s", 1, 10).await.unwrap().len(), 3);
    two.add_observer("c_s", "bob").await.unwrap();
    assert_eq!(one.get("c_s").await.unwrap().unwrap().observers, ["bob"]);
    let snap = two
        .snapshot("c_s", 2, 10)
        .await
        .unwrap()
        .expect("a snapshot");
    assert_eq!(snap.tail.iter().map(|e| e.seq).collect::<Vec<_>>(), [3, 4]);
    assert_eq!(snap.client_msg_ids, [("msg-1/é".to_owned(), 3)]);
    assert_eq!(two.unfinished().await.unwrap().len(), 1);

    // Node 2 takes over (term 2); node 1's next append is fenced.
    assert_eq!(two.take_over("c_s", 2).await.unwrap(), 4);
    assert!(matches!(
        append(&one, batch("c_s", 5, 1, false, Status::Idle)).await,
        Err(StoreError::Fenced { .. })
    ));
    // Its message's id moves the window past msg-1's: msg-1 is forgotten.
    let mut moved = batch("c_s", 5, 1, false, Status::Stopped);
    moved.client_msg_ids = vec![("msg-2".into(), 5)];
    moved.forget_client_msg_ids_before = 5;
    append(&two, moved).await.unwrap();
    two.flush().await.unwrap();
    let snap = one
        .snapshot("c_s", 0, 10)
        .await
        .unwrap()
        .expect("a snapshot");
    assert_eq!(snap.client_msg_ids, [("msg-2".to_owned(), 5)]);
    let meta = one.get("c_s").await.unwrap().unwrap();
    assert_eq!((meta.head_seq, meta.status), (5, Status::Stopped));
    assert_eq!(meta.observers, ["bob"]);
    assert!(one.unfinished().await.unwrap().is_empty());

    assert!(two.delete("c_s").await.unwrap());
    assert!(one.get("c_s").await.unwrap().is_none());
    assert!(one.events("c_s", 0, 10).await.unwrap().is_empty());
    assert!(one.list(Some("alice")).await.unwrap().is_empty());
    assert!(!two.delete("c_s").await.unwrap());
}

/// Appends queued while one is in flight are merged into one publish, and
/// a summary whose head alone moved is written within a second, while a
/// change of status is written with its commit.
#[tokio::test]
async fn queued_appends_are_merged_and_the_summary_catches_up() {
    use linger::protocol::Status;
    use linger::store::Store;
    let (_nats, one, two) = two_nodes_stores().await;
    assert_eq!(one.take_over("c_m", 1).await.unwrap(), 0);
    append(&one, batch("c_m", 1, 1, true, Status::Idle))
        .await
        .unwrap();

    let mut answers = Vec::new();
    for seq in 2..=201 {
        let (tx, rx) = tokio::sync::oneshot::channel();
        one.append(
            batch("c_m", seq, 1, false, Status::Idle),
            Box::new(move |r, _| {
                let _ = tx.send(r);
            }),
        );
        answers.push(rx);
    }
    for rx in answers {
        rx.await.expect("answered").expect("committed");
    }
    let head = one.log().head("c_m").await.unwrap();
    assert_eq!(head.seq, 201);
    // The fence, the first append, then far fewer messages than appends.
    assert!(
        head.stream_seq < 100,
        "200 queued appends took {} messages",
        head.stream_seq - 2
    );
    let all = two.events("c_m", 0, 1000).await.unwrap();
    assert_eq!(
        all.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (1..=201).collect::<Vec<_>>()
    );

    // Any node's `get` has the head from the log at once; the stored
    // summary catches up by itself.
    assert_eq!(two.get("c_m").await.unwrap().unwrap().head_seq, 201);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let listed = two.list(Some("alice")).await.unwrap();
        if listed.first().map(|m| m.head_seq) == Some(201) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the summary's head stayed at {:?}",
            listed.first().map(|m| m.head_seq)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A change of status is stored with its commit.
    append(&one, batch("c_m", 202, 1, false, Status::Running))
        .await
        .unwrap();
    let listed = two.list(Some("alice")).await.unwrap();
    assert_eq!(
        (listed[0].status, listed[0].head_seq),
        (Status::Running, 202)
    );
}

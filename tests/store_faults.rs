//! A store that cannot write (disk full, I/O error): nothing uncommitted is
//! ever sent; every request that needed a write gets `store_unavailable`;
//! attached clients are told; `/healthz` answers 503 while reads keep
//! working; and once writes work again the conversation goes on by itself,
//! its history explaining the stopped turn, seq contiguous and never reused.
//!
//! Two ways in: an in-process store wrapper whose writes fail on demand
//! (`common::faulty_store`), and the real binary on a real tmpfs that the
//! test fills (skipped, saying so, where the machine allows no mount).

mod common;

use std::time::Duration;

use common::faulty_store::Fault;
use common::process::ServerProcess;
use common::{assert_contiguous, kind, seq, TestServer};
use serde_json::{json, Value};

fn is_store_error(frame: &Value) -> bool {
    frame["type"] == "error" && frame["code"] == "store_unavailable"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_store_is_reported_and_recovered_from() {
    let fault = Fault::default();
    let server = TestServer::start_wrapping(|_| {}, |store| fault.wrap(store)).await;
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    client.send_message(&id, "/stream 100000 2").await;
    // Some of the turn is out before the store fails.
    let mut seen: Vec<Value> = Vec::new();
    while seen.iter().filter(|e| kind(e) == "text_delta").count() < 5 {
        seen.push(client.next_event(&id).await);
    }

    fault.fail_writes(true);
    let (error, before) = client.recv_until(is_store_error).await;
    seen.extend(before.into_iter().filter(|f| f["type"] == "event"));
    assert_eq!(error["conversation_id"], id.as_str(), "{error}");
    let last_seen = seq(seen.last().unwrap());

    // While it fails: health says so, writes are refused at once, reads work.
    let (status, body) = server.get("/healthz", None).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.as_str().unwrap_or("").contains("store unavailable"), "{body}");
    let refused = client
        .request(json!({"type": "message", "conversation_id": id, "text": "hello"}))
        .await;
    assert!(is_store_error(&refused), "a message while writes fail: {refused}");
    let stored = server.stored_events(&id, "alice", 0).await;
    assert_eq!(
        seq(stored.last().unwrap()),
        last_seen,
        "everything sent is stored, and nothing more was sent"
    );
    let (status, body) = server
        .call("POST", "/v1/conversations", Some("alice"), Some(json!({})))
        .await;
    assert_eq!(status, 503, "REST create while writes fail: {body}");
    assert_eq!(body["error"]["code"], "store_unavailable", "{body}");
    let mut other = server.connect("alice").await;
    let created = other.request(json!({"type": "create"})).await;
    assert!(is_store_error(&created), "create while writes fail: {created}");

    // Writes work again: the conversation goes on by itself, the history
    // says the turn was stopped by the store, and seq follows on.
    fault.fail_writes(false);
    let finished = client.next_event(&id).await;
    assert_eq!(seq(&finished), last_seen + 1, "{finished}");
    assert_eq!(kind(&finished), "turn_finished", "{finished}");
    assert_eq!(finished["data"]["status"], "failed", "{finished}");
    assert!(
        finished["data"]["error"]
            .as_str()
            .unwrap_or("")
            .contains("store"),
        "{finished}"
    );
    let (status, _) = server.get("/healthz", None).await;
    assert_eq!(status, 200, "healthy once a write worked");

    let ack = client.send_message(&id, "back again").await;
    assert_eq!(seq(&ack), last_seen + 2);
    let after = client.events_until_turn_finished(&id).await;
    assert_eq!(kind(after.last().unwrap()), "turn_finished");

    let stored = server.stored_events(&id, "alice", 0).await;
    assert_contiguous(&stored, 1);
    for event in &seen {
        let at = seq(event) as usize - 1;
        assert_eq!(&stored[at], event, "what a client saw is what is stored");
    }
    let created = other.request(json!({"type": "create"})).await;
    assert_eq!(created["type"], "created", "{created}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn created_comes_after_the_commit_and_before_the_events() {
    let server = TestServer::start().await;
    let mut client = server.connect("alice").await;
    let created = client.request(json!({"type": "create", "title": "t"})).await;
    assert_eq!(created["type"], "created", "{created}");
    let id = created["conversation_id"].as_str().unwrap().to_owned();
    // Committed before the reply: the history is already readable.
    let stored = server.stored_events(&id, "alice", 0).await;
    assert!(!stored.is_empty(), "created before its commit");
    let first = client.next_event(&id).await;
    assert_eq!(seq(&first), 1);
    assert_eq!(kind(&first), "conversation_created");
}

/// A tmpfs the test mounts and fills; unmounted when dropped.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(size: &str) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().ok()?;
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        mounted.then_some(SmallDisk { dir })
    }

    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Writes a file until the disk is full.
    fn fill(&self) -> std::path::PathBuf {
        use std::io::Write;
        let path = self.path().join("filler");
        let mut file = std::fs::File::create(&path).unwrap();
        let chunk = vec![0u8; 64 * 1024];
        while file.write_all(&chunk).is_ok() {}
        let small = vec![0u8; 512];
        while file.write_all(&small).is_ok() {}
        let _ = file.sync_all();
        path
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_for_real() {
    let Some(disk) = SmallDisk::mount("32m") else {
        eprintln!("skipped: this machine allows no tmpfs mount (the in-process test covers it)");
        return;
    };
    let store = disk.path().join("store");
    let mut server = ServerProcess::spawn(&store, "");
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    client.send_message(&id, "/stream 1000000 1").await;
    let mut seen: Vec<Value> = Vec::new();
    while seen.iter().filter(|e| kind(e) == "text_delta").count() < 5 {
        seen.push(client.next_event(&id).await);
    }
    let filler = disk.fill();
    let error = loop {
        let frame = client.recv().await;
        if is_store_error(&frame) {
            break frame;
        }
        if frame["type"] == "event" && frame["conversation_id"] == id.as_str() {
            seen.push(frame);
        }
    };
    assert_eq!(error["conversation_id"], id.as_str(), "{error}");
    let http = reqwest::Client::new();
    let health = http
        .get(format!("http://{}/healthz", server.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 503);
    let body = health.text().await.unwrap();
    assert!(body.contains("full"), "the reason says the disk is full: {body}");

    std::fs::remove_file(filler).unwrap();
    let finished = client.next_event(&id).await;
    assert_eq!(kind(&finished), "turn_finished", "{finished}");
    assert_eq!(finished["data"]["status"], "failed", "{finished}");
    let last_seen = seen.last().map(seq).unwrap_or(0);
    assert_eq!(seq(&finished), last_seen + 1, "contiguous after the gap");
    let ack = client.send_message(&id, "hello").await;
    assert_eq!(seq(&ack), last_seen + 2);
    server.wait_for_log(|l| l.contains("writes work again"));
    server.signal("TERM");
    assert_eq!(server.wait_exit(Duration::from_secs(15)).code(), Some(0));
}

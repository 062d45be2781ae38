//! The admin commands of the terminal client, as real processes against an
//! in-process server: `linger ps` lists what runs, `linger reload` makes
//! the server re-read its config file and says what changed, `linger top`
//! redraws until `q`. Non-admins are told these are for admins.
//!
//! Every wait is on the child's output or its exit, bounded by
//! `RECV_TIMEOUT`.

mod common;

use std::process::{ExitStatus, Stdio};

use common::{TestServer, RECV_TIMEOUT};
use linger::config::{AuthMode, TokenEntry};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

async fn server() -> TestServer {
    TestServer::start_with(|c| {
        c.auth.mode = AuthMode::Tokens;
        c.auth.tokens = vec![
            TokenEntry {
                token: "tok-alice".into(),
                user: "alice".into(),
                admin: false,
            },
            TokenEntry {
                token: "tok-root".into(),
                user: "root".into(),
                admin: true,
            },
        ];
    })
    .await
}

fn linger(server: &TestServer, token: &str, args: &[&str]) -> Command {
    common::linger_client(&server.http_url(""), token, args)
}

/// Runs a command to its end: (status, stdout, stderr).
async fn run(server: &TestServer, token: &str, args: &[&str]) -> (ExitStatus, String, String) {
    common::run_client(&server.http_url(""), token, args).await
}

async fn create(server: &TestServer) -> String {
    let (status, body) = server
        .call(
            "POST",
            "/v1/conversations",
            Some("tok-alice"),
            Some(json!({})),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    body["id"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ps_lists_what_runs_for_admins_only() {
    let server = server().await;
    let id = create(&server).await;

    let (status, stdout, stderr) = run(&server, "tok-root", &["ps"]).await;
    assert!(status.success(), "{status}: {stderr}");
    let mut lines = stdout.lines();
    let header = lines.next().unwrap_or_default();
    for column in ["ID", "USER", "STATUS", "ATT", "IDLE", "TURN AGE", "QUEUED"] {
        assert!(header.contains(column), "{column} in {header:?}");
    }
    let row = lines.next().unwrap_or_default();
    assert!(
        row.contains(&id) && row.contains("alice") && row.contains("idle"),
        "{stdout}"
    );

    let (status, stdout, _) = run(&server, "tok-root", &["ps", "--json"]).await;
    assert!(status.success());
    let listed: Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(listed[0]["id"], id.as_str(), "{listed}");

    let (status, stdout, stderr) = run(&server, "tok-alice", &["ps"]).await;
    assert_eq!(status.code(), Some(1), "{stdout}");
    assert!(
        stderr.contains("not found") && stderr.contains("admins only"),
        "{stderr}"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_says_what_changed_and_names_a_bad_key() {
    let server = server().await;
    let file = server.config_file();
    let text = std::fs::read_to_string(&file).unwrap();
    let (status, stdout, stderr) = run(&server, "tok-root", &["reload"]).await;
    assert!(status.success(), "{stderr}");
    assert_eq!(stdout.trim(), "nothing changed");

    assert!(text.contains("max_per_user = 3"), "{text}");
    std::fs::write(&file, text.replace("max_per_user = 3", "max_per_user = 2")).unwrap();
    let (status, stdout, stderr) = run(&server, "tok-root", &["reload"]).await;
    assert!(status.success(), "{stderr}");
    assert_eq!(stdout.trim(), "conversations.max_per_user: 3 -> 2");

    std::fs::write(
        &file,
        text.replace("max_per_user = 3", "max_per_user = \"many\""),
    )
    .unwrap();
    let (status, _, stderr) = run(&server, "tok-root", &["reload"]).await;
    assert_eq!(status.code(), Some(1));
    assert!(stderr.contains("conversations.max_per_user"), "{stderr}");

    let (status, _, stderr) = run(&server, "tok-alice", &["reload"]).await;
    assert_eq!(status.code(), Some(1));
    assert!(stderr.contains("admins only"), "{stderr}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_redraws_until_q() {
    let server = server().await;
    let id = create(&server).await;
    let mut child = linger(&server, "tok-root", &["top", "--interval", "100ms"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start linger top");
    let mut stdout = child.stdout.take().unwrap();
    // Two screens, each cleared first, showing the conversation.
    let mut seen = String::new();
    let redrawn = async {
        let mut buf = [0u8; 4096];
        while seen.matches("\x1b[2J").count() < 2 || !seen.contains(&id) {
            let n = stdout.read(&mut buf).await.expect("read top's output");
            assert!(n > 0, "top ended early: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    };
    tokio::time::timeout(RECV_TIMEOUT, redrawn)
        .await
        .unwrap_or_else(|_| panic!("top did not redraw twice in {RECV_TIMEOUT:?}"));
    assert!(seen.contains("RECENT DECISIONS"), "{seen}");
    assert!(seen.contains("1 active"), "{seen}");

    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"q").await.unwrap();
    let status = tokio::time::timeout(RECV_TIMEOUT, child.wait())
        .await
        .unwrap_or_else(|_| panic!("top did not quit on q in {RECV_TIMEOUT:?}"))
        .unwrap();
    assert!(status.success(), "{status}");
    server.shutdown().await;
}

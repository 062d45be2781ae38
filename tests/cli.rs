//! The terminal client, as real processes: the `linger` binary against an
//! in-process server. `new`, `ls`, `send`, and `attach` with its stdin
//! piped: it streams a reply, detaches on end of input leaving the turn
//! running, comes back by itself after its connection is cut, and opens a
//! conversation it has shown nothing of with a compact replay.
//!
//! Every wait is on the child's output or on stored state, bounded by
//! `RECV_TIMEOUT`.

mod common;

use std::process::{ExitStatus, Stdio};

use common::proxy::Proxy;
use common::{kind, stream_text, the_one, TestServer, RECV_TIMEOUT};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::watch;

const USER: &str = "alice";

fn linger(url: &str, args: &[&str]) -> Command {
    common::linger_client(url, USER, args)
}

/// Runs a client command to its end: (status, stdout, stderr).
async fn run(url: &str, args: &[&str]) -> (ExitStatus, String, String) {
    common::run_client(url, USER, args).await
}

async fn new_conversation(url: &str, title: &str) -> String {
    let (status, stdout, stderr) = run(url, &["new", "--title", title]).await;
    assert!(status.success(), "linger new: {status}; stderr: {stderr}");
    let id = stdout.trim().to_owned();
    assert!(
        id.starts_with("c_") && !id.contains(char::is_whitespace),
        "linger new should print just the id, printed {stdout:?}"
    );
    id
}

/// Collects a child's output stream as it comes (no need for newlines:
/// streamed text is written inline).
fn collect(
    mut pipe: impl tokio::io::AsyncRead + Unpin + Send + 'static,
) -> watch::Receiver<String> {
    let (tx, rx) = watch::channel(String::new());
    tokio::spawn(async move {
        let mut buf = [0u8; 4096];
        loop {
            match pipe.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => tx.send_modify(|text| text.push_str(&String::from_utf8_lossy(&buf[..n]))),
            }
        }
    });
    rx
}

/// `linger attach` running with its stdin and stdout piped.
struct Attached {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: watch::Receiver<String>,
    stderr: watch::Receiver<String>,
}

impl Attached {
    fn spawn(url: &str, id: &str) -> Attached {
        Attached::spawn_args(url, &["attach", id])
    }

    fn spawn_args(url: &str, args: &[&str]) -> Attached {
        let mut child = linger(url, args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start linger attach");
        let stdin = child.stdin.take();
        let stdout = collect(child.stdout.take().expect("piped stdout"));
        let stderr = collect(child.stderr.take().expect("piped stderr"));
        Attached {
            child,
            stdin,
            stdout,
            stderr,
        }
    }

    async fn type_line(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin is open");
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .expect("write to linger attach");
        stdin.flush().await.expect("flush stdin");
    }

    fn output(&self) -> String {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            self.stdout.borrow().as_str(),
            self.stderr.borrow().as_str()
        )
    }

    async fn wait(rx: &mut watch::Receiver<String>, what: &str, done: impl Fn(&str) -> bool) {
        let waited = tokio::time::timeout(RECV_TIMEOUT, rx.wait_for(|text| done(text)))
            .await
            .is_ok_and(|r| r.is_ok());
        if !waited {
            panic!(
                "waited {RECV_TIMEOUT:?} for {what}; got:\n{}",
                rx.borrow().as_str()
            );
        }
    }

    async fn wait_stdout(&mut self, what: &str, done: impl Fn(&str) -> bool) {
        Attached::wait(&mut self.stdout, what, done).await
    }

    async fn wait_stderr(&mut self, what: &str, done: impl Fn(&str) -> bool) {
        Attached::wait(&mut self.stderr, what, done).await
    }

    /// Closes stdin (Ctrl-D) and checks that the process ends with success.
    async fn eof_and_succeed(&mut self) {
        let status = self.eof_and_exit().await;
        assert!(status.success(), "exit status {status}; {}", self.output());
    }

    /// Closes stdin (Ctrl-D) and waits for the process to end.
    async fn eof_and_exit(&mut self) -> ExitStatus {
        drop(self.stdin.take());
        match tokio::time::timeout(RECV_TIMEOUT, self.child.wait()).await {
            Ok(Ok(status)) => status,
            Ok(Err(e)) => panic!("waiting for linger attach: {e}"),
            Err(_) => panic!(
                "linger attach did not exit within {RECV_TIMEOUT:?} of end of input; {}",
                self.output()
            ),
        }
    }
}

/// Each of `tok1 ` .. `tokN ` appears exactly once, in order, as one run.
fn assert_stream_once(stdout: &str, n: u64) {
    let whole = stream_text(n);
    assert_eq!(
        stdout.matches(whole.as_str()).count(),
        1,
        "the reply `tok1 … tok{n}` should be shown exactly once, whole; stdout:\n{stdout}"
    );
    for i in 1..=n {
        let token = format!("tok{i} ");
        assert_eq!(
            stdout.matches(token.as_str()).count(),
            1,
            "{token:?} should be shown once; stdout:\n{stdout}"
        );
    }
}

fn completed_with(events: &[Value], text: &str) -> bool {
    events
        .iter()
        .any(|e| kind(e) == "assistant_message" && e["data"]["text"] == text)
        && events
            .iter()
            .any(|e| kind(e) == "turn_finished" && e["data"]["status"] == "completed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_ls_and_send() {
    let server = TestServer::start().await;
    let url = server.http_url("");

    let id = new_conversation(&url, "from the terminal").await;

    let (status, stdout, stderr) = run(&url, &["ls"]).await;
    assert!(status.success(), "linger ls: {stderr}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with(&id))
        .unwrap_or_else(|| panic!("linger ls should list {id}:\n{stdout}"));
    assert!(row.contains("from the terminal"), "{row}");
    assert!(stdout.starts_with("ID"), "a header line first:\n{stdout}");

    let (status, stdout, _) = run(&url, &["ls", "--json"]).await;
    assert!(status.success());
    let list: Vec<Value> = serde_json::from_str(&stdout).expect("ls --json prints JSON");
    assert!(list.iter().any(|c| c["id"] == id.as_str()), "{stdout}");

    // `send` returns once the message is recorded; the turn runs on.
    let (status, _, stderr) = run(&url, &["send", &id, "/stream 5 10"]).await;
    assert!(status.success(), "linger send: {stderr}");
    let events = server
        .wait_for_stored(&id, USER, "the streamed reply", |events| {
            completed_with(events, &stream_text(5))
        })
        .await;
    assert_eq!(
        the_one(&events, "user_message")["data"]["text"],
        "/stream 5 10"
    );

    // `send --wait` prints the reply, once.
    let (status, stdout, stderr) = run(&url, &["send", "--wait", &id, "hello there"]).await;
    assert!(status.success(), "linger send --wait: {stderr}");
    assert_eq!(stdout.trim(), "hello there", "stdout: {stdout:?}");

    // Mistakes are said plainly, with a failing status.
    let (status, _, stderr) = run(&url, &["send", "c_nope", "hi"]).await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("not found"), "{stderr}");
    let (status, _, stderr) = run(&url, &["attach", "c_nope"]).await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("not found"), "{stderr}");

    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_streams_then_detaches_on_eof_leaving_the_turn_running() {
    let server = TestServer::start().await;
    let url = server.http_url("");
    let id = new_conversation(&url, "attach").await;

    let mut attach = Attached::spawn(&url, &id);
    attach
        .wait_stderr("the attach notice", |e| e.contains("attached to"))
        .await;
    attach.type_line("/stream 100 50").await;
    attach
        .wait_stdout("the reply to start streaming", |out| {
            out.contains(&stream_text(5))
        })
        .await;

    // Ctrl-D: detach and exit 0 at once, mid-turn.
    attach.eof_and_succeed().await;
    let stdout = attach.stdout.borrow().clone();
    assert!(
        stdout.starts_with("> /stream 100 50\n"),
        "piped input is echoed from its event:\n{stdout}"
    );

    // The turn was still running when the client left...
    let mut observer = server.connect(USER).await;
    let stored = server.stored_events(&id, USER, 0).await;
    let head = stored.last().map(common::seq).unwrap_or(0);
    let attached = observer.attach(&id, head).await;
    assert_eq!(
        attached["status"], "running",
        "the turn should still run after the client detached: {attached}"
    );
    // ...and it ends, complete, with nobody needed.
    let events = server
        .wait_for_stored(&id, USER, "the completed turn", |events| {
            completed_with(events, &stream_text(100))
        })
        .await;
    assert!(
        !events.iter().any(|e| e["data"]["status"] == "abandoned"),
        "detaching is not abandoning"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_comes_back_after_a_cut_connection_without_gaps_or_repeats() {
    let server = TestServer::start().await;
    let proxy = Proxy::start(server.addr).await;
    let url = proxy.http_url();
    let id = new_conversation(&url, "cut").await;

    let mut attach = Attached::spawn(&url, &id);
    attach
        .wait_stderr("the attach notice", |e| e.contains("attached to"))
        .await;
    attach.type_line("/stream 60 40").await;
    attach
        .wait_stdout("the reply to start streaming", |out| {
            out.contains(&stream_text(5))
        })
        .await;

    // The network goes away mid-turn, with no close frame.
    proxy.cut();
    attach
        .wait_stderr("the client to notice", |e| e.contains("connection lost"))
        .await;
    proxy.heal();
    attach
        .wait_stderr("the client to come back", |e| e.contains("reconnected"))
        .await;
    attach
        .wait_stdout("the whole reply", |out| out.contains("tok60 "))
        .await;
    let stdout = attach.stdout.borrow().clone();
    assert_stream_once(&stdout, 60);

    // A tool call answered from the terminal.
    attach.type_line("/ask weather {\"city\":\"Paris\"}").await;
    attach
        .wait_stdout("the tool call", |out| out.contains("[tool call "))
        .await;
    let stdout = attach.stdout.borrow().clone();
    let call_id = stdout
        .split("[tool call ")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .unwrap_or_else(|| panic!("no call id in:\n{stdout}"))
        .to_owned();
    attach
        .type_line(&format!("/result {call_id} {{\"temp\":21}}"))
        .await;
    attach
        .wait_stdout("the agent to use the result", |out| {
            out.contains("weather returned {\"temp\":21}")
        })
        .await;

    attach.eof_and_succeed().await;
    drop(proxy);
    server.shutdown().await;
}

/// Runs `linger attach` with `args` through `proxy` until it has shown
/// `replies` whole replies `text`, then ends its input; returns its stdout
/// and the bytes the server sent it (REST call, handshake and frames).
async fn attach_and_count(
    proxy: &Proxy,
    args: &[&str],
    text: &str,
    replies: usize,
) -> (String, u64) {
    let before = proxy.downstream_bytes();
    let mut attach = Attached::spawn_args(&proxy.http_url(), args);
    attach
        .wait_stdout("every finished reply", |out| {
            out.matches(text).count() >= replies
        })
        .await;
    attach.eof_and_succeed().await;
    let stdout = attach.stdout.borrow().clone();
    (stdout, proxy.downstream_bytes() - before)
}

/// Protocol §11: `linger attach` with nothing shown yet asks for a compact
/// replay: the finished turns' `text_delta`s are not sent, and each reply is
/// still shown once, whole, from its `assistant_message`. With `--from`
/// (a seq already shown) the replay is in full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_opens_a_whole_conversation_compact_and_shows_every_reply() {
    let server = TestServer::start().await;
    let proxy = Proxy::start(server.addr).await;
    let mut writer = server.connect(USER).await;
    let id = writer.create_titled("finished turns").await;
    for _ in 0..3 {
        writer.send_message(&id, "/stream 40 1").await;
        writer.events_until_turn_finished(&id).await;
    }
    let stored = server.stored_events(&id, USER, 0).await;
    // The bytes of the frames a compact replay leaves out.
    let deltas: u64 = stored
        .iter()
        .filter(|e| kind(e) == "text_delta")
        .map(|e| e.to_string().len() as u64)
        .sum();
    assert_eq!(common::text_deltas(&stored).len(), 120);

    let reply = stream_text(40);
    let (compact_out, compact_bytes) = attach_and_count(&proxy, &["attach", &id], &reply, 3).await;
    let (full_out, full_bytes) =
        attach_and_count(&proxy, &["attach", "--from", "1", &id], &reply, 3).await;
    for (what, stdout) in [("compact", &compact_out), ("full", &full_out)] {
        assert_eq!(
            stdout.matches(reply.as_str()).count(),
            3,
            "{what}: each reply shown once, whole:\n{stdout}"
        );
        assert_eq!(
            stdout.matches("> /stream 40 1\n").count(),
            3,
            "{what}: each message shown once:\n{stdout}"
        );
    }
    // Everything but the deltas is the same in both, but for seq 1, which
    // `--from 1` does not replay: the compact open was sent at least the
    // deltas' bytes less (with a few bytes of slack for the close
    // handshake, which may pass after the process has exited).
    let created = stored[0].to_string().len() as u64;
    assert!(
        compact_bytes + deltas <= full_bytes + created + 64,
        "the first open should leave out the {deltas} bytes of deltas: \
         compact {compact_bytes} bytes, full {full_bytes} bytes"
    );
    assert!(
        compact_bytes < deltas,
        "compact {compact_bytes} bytes, the deltas alone {deltas}"
    );
    drop(proxy);
    server.shutdown().await;
}

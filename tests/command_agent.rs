//! The command agent (protocol §9) with real child processes: Python
//! scripts, the echo example and one written here, driven over the
//! websocket of an in-process server.
//!
//! Every wait is on a frame, or (for a process going away, which sends no
//! frame) a bounded poll of `/proc`; no sleep decides anything.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use common::{kind, seq, Client, TestServer, RECV_TIMEOUT};
use linger::config::AgentKind;

/// A test agent that does what the turn's text says; see the branches.
/// It records its pid in `pids.log` in its working directory (the
/// conversation's workspace) when it starts.
const TEST_AGENT: &str = r#"
import json, os, signal, subprocess, sys, time

def emit(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()

with open("pids.log", "a") as f:
    f.write(f"{os.getpid()}\n")

deaf = False
for line in sys.stdin:
    message = json.loads(line)
    if message["type"] != "turn":
        continue
    text = message["text"]
    if text == "env":
        emit(kind="assistant_message", text=" ".join([
            os.environ.get("LINGER_CONVERSATION_ID", "-"),
            os.environ.get("LINGER_USER", "-"),
            os.getcwd(),
        ]))
        emit(kind="turn_finished", status="completed")
    elif text == "die":
        emit(kind="text_delta", text="dying")
        print("some noise", file=sys.stderr, flush=True)
        print("fatal: the test agent died on purpose", file=sys.stderr, flush=True)
        os._exit(3)
    elif text == "quit":
        emit(kind="turn_finished", status="completed")
        sys.exit(0)
    elif text == "bad":
        print("this is not json", flush=True)
    elif text == "long":
        emit(kind="text_delta", text="x" * (2 * 1024 * 1024))
    elif text == "stubborn":
        # A helper in the agent's process group, then ignore everything,
        # stop included, until stdin closes.
        helper = subprocess.Popen(["sleep", "300"])
        with open("helper.pid", "w") as f:
            f.write(str(helper.pid))
        emit(kind="text_delta", text="working")
        for _ in sys.stdin:
            pass
    elif text == "polite":
        emit(kind="text_delta", text="waiting for stop")
        for other in sys.stdin:
            if json.loads(other)["type"] == "stop":
                emit(kind="turn_finished", status="completed")
                break
    elif text.startswith("flood "):
        count = int(text.split()[1])
        for i in range(count):
            sys.stdout.write(json.dumps({"kind": "text_delta", "text": f"{i} "}) + "\n")
        emit(kind="turn_finished", status="completed")
    elif text == "deaf":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        deaf = True
        emit(kind="assistant_message", text="deaf now")
        emit(kind="turn_finished", status="completed")
    elif text == "ask":
        emit(kind="tool_call", call_id="call_1", name="confirm", args={"q": "sure?"})
        for answer in sys.stdin:
            answer = json.loads(answer)
            if answer["type"] == "tool_result":
                output = json.dumps(answer["output"], sort_keys=True, separators=(",", ":"))
                emit(kind="assistant_message", text=f"got {output} is_error={answer['is_error']}")
                emit(kind="turn_finished", status="completed")
                break
    else:
        for word in text.split():
            emit(kind="text_delta", text=word + " ")
        emit(kind="assistant_message", text=text)
        emit(kind="turn_finished", status="completed")

if deaf:
    # Ignores the end of its input and SIGTERM: only SIGKILL ends it.
    time.sleep(3600)
"#;

fn echo_agent() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/agents/echo_agent.py")
}

fn write_test_agent(dir: &Path) -> PathBuf {
    let path = dir.join("test_agent.py");
    std::fs::write(&path, TEST_AGENT).expect("write the test agent");
    path
}

/// A server whose agent is `python3 script`, with its store at `store`
/// (so that a second server can start on the same store).
async fn start(store: &Path, script: &Path) -> TestServer {
    let store = store.to_path_buf();
    let script = script.display().to_string();
    TestServer::start_with(move |config| {
        config.store.path = store;
        config.agent.kind = AgentKind::Command;
        config.agent.command = vec!["python3".into(), script];
    })
    .await
}

/// A server running the test agent, alice connected, and her new
/// conversation (its agent process started on activation).
async fn with_test_agent(store: &Path) -> (TestServer, common::Client, String) {
    let script = write_test_agent(store);
    let server = start(store, &script).await;
    let mut alice = server.connect("alice").await;
    let id = alice.create().await;
    (server, alice, id)
}

fn workspace(store: &Path, id: &str) -> PathBuf {
    store.join("workspaces").join(id)
}

/// The pids the test agent recorded in this workspace, in start order.
fn agent_pids(store: &Path, id: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(workspace(store, id).join("pids.log")).unwrap_or_default();
    text.lines()
        .map(|l| l.trim().parse().expect("a pid per line"))
        .collect()
}

/// Waits until process `pid` no longer exists. With `reaped`, it must be
/// gone entirely (linger reaped it); otherwise a zombie counts as gone
/// (reaping an orphaned helper is init's job, not linger's). There is no
/// frame to wait for here, so this polls `/proc`, bounded.
async fn wait_gone(pid: u32, reaped: bool, what: &str) {
    let deadline = Instant::now() + RECV_TIMEOUT;
    loop {
        let state = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return,
            Ok(stat) => stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_owned))
                .unwrap_or_default(),
        };
        if !reaped && state == "Z" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} (pid {pid}) still exists after {RECV_TIMEOUT:?}, state {state}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn assistant_text(events: &[Value]) -> String {
    common::the_one(events, "assistant_message")["data"]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn finished(events: &[Value]) -> &Value {
    let last = events.last().expect("events");
    assert_eq!(kind(last), "turn_finished", "{events:#?}");
    &last["data"]
}

/// Sends a message and returns its events from its `user_message` on,
/// `turn_finished` last.
async fn turn(client: &mut Client, id: &str, text: &str) -> Vec<Value> {
    client.send_message(id, text).await;
    let mut events = client.events_until_turn_finished(id).await;
    let start = events
        .iter()
        .position(|e| kind(e) == "user_message")
        .unwrap_or(0);
    events.drain(..start);
    events
}

async fn close(client: &mut Client, id: &str) {
    let ack = client
        .request(json!({"type": "close", "conversation_id": id}))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    let (detached, _) = client
        .recv_until(|f| f["type"] == "detached" && f["conversation_id"] == id)
        .await;
    assert_eq!(detached["reason"], "closed", "{detached}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_agent_streams_a_turn_and_its_workspace_survives_close_and_restart() {
    let store = tempfile::tempdir().unwrap();
    let server = start(store.path(), &echo_agent()).await;
    let mut alice = server.connect("alice").await;
    let id = alice.create().await;

    let events = turn(&mut alice, &id, "hello brave world").await;
    let kinds: Vec<&str> = events.iter().map(kind).collect();
    assert_eq!(
        kinds,
        [
            "user_message",
            "turn_started",
            "text_delta",
            "text_delta",
            "text_delta",
            "assistant_message",
            "turn_finished"
        ],
        "{events:#?}"
    );
    let deltas: Vec<String> = common::text_deltas(&events)
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    assert_eq!(deltas, ["hello ", "brave ", "world"]);
    assert_eq!(assistant_text(&events), "hello brave world");
    assert_eq!(finished(&events)["status"], "completed");
    let turn_id = events[1]["data"]["turn_id"].as_str().unwrap().to_owned();
    assert!(events[2..]
        .iter()
        .all(|e| e["data"]["turn_id"] == turn_id.as_str()));

    let log = workspace(store.path(), &id).join("turns.log");
    let written = std::fs::read_to_string(&log).expect("the agent wrote turns.log");
    assert_eq!(written, format!("{turn_id}\thello brave world\n"));

    close(&mut alice, &id).await;
    assert!(
        log.exists(),
        "the workspace outlives the conversation's stop"
    );
    let head = seq(&events[events.len() - 1]) + 1; // + agent_stopped
    drop(alice);
    server.shutdown().await;

    // A new server on the same store: the conversation comes back with its
    // workspace, and a fresh process appends to the same file.
    let server = start(store.path(), &echo_agent()).await;
    assert!(log.exists(), "the workspace outlives a restart");
    let mut alice = server.connect("alice").await;
    alice.attach(&id, head).await;
    let events = turn(&mut alice, &id, "once more").await;
    assert_eq!(assistant_text(&events), "once more");
    assert_eq!(finished(&events)["status"], "completed");
    let written = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = written.lines().collect();
    assert_eq!(lines.len(), 2, "{written}");
    assert!(lines[1].ends_with("\tonce more"), "{written}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_exits_fails_its_turn_and_the_next_turn_gets_a_fresh_process() {
    let store = tempfile::tempdir().unwrap();
    let (server, mut alice, id) = with_test_agent(store.path()).await;

    // The process runs in the workspace, with the conversation and user in
    // its environment.
    let events = turn(&mut alice, &id, "env").await;
    let ws = std::fs::canonicalize(workspace(store.path(), &id)).unwrap();
    assert_eq!(
        assistant_text(&events),
        format!("{id} alice {}", ws.display())
    );

    let events = turn(&mut alice, &id, "die").await;
    assert_eq!(common::text_deltas(&events)[0].1, "dying");
    let done = finished(&events);
    assert_eq!(done["status"], "failed", "{done}");
    let error = done["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("exited during the turn") && error.contains("exit status: 3"),
        "{error}"
    );
    // Its last words on stderr tell why.
    assert!(
        error.ends_with("its last stderr line: fatal: the test agent died on purpose"),
        "{error}"
    );

    let events = turn(&mut alice, &id, "still here").await;
    assert_eq!(finished(&events)["status"], "completed", "{events:#?}");
    assert_eq!(assistant_text(&events), "still here");

    // An agent that exits between turns is replaced too.
    let events = turn(&mut alice, &id, "quit").await;
    assert_eq!(finished(&events)["status"], "completed");
    let pids = agent_pids(store.path(), &id);
    assert_eq!(pids.len(), 2, "{pids:?}");
    wait_gone(pids[1], true, "the agent that quit").await;
    let events = turn(&mut alice, &id, "and again").await;
    assert_eq!(finished(&events)["status"], "completed", "{events:#?}");
    let pids = agent_pids(store.path(), &id);
    assert_eq!(pids.len(), 3, "{pids:?}");
    wait_gone(pids[0], true, "the agent that died").await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_line_fails_the_turn_and_the_next_turn_works() {
    let store = tempfile::tempdir().unwrap();
    let (server, mut alice, id) = with_test_agent(store.path()).await;

    let events = turn(&mut alice, &id, "bad").await;
    let done = finished(&events);
    assert_eq!(done["status"], "failed", "{done}");
    let error = done["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("invalid line") && error.contains("not JSON"),
        "{error}"
    );
    let events = turn(&mut alice, &id, "fine now").await;
    assert_eq!(finished(&events)["status"], "completed", "{events:#?}");

    // A line over the limit (1 MiB) is invalid too, and never read whole.
    let events = turn(&mut alice, &id, "long").await;
    assert!(common::text_deltas(&events).is_empty(), "{events:#?}");
    let done = finished(&events);
    assert_eq!(done["status"], "failed", "{done}");
    assert!(
        done["error"]
            .as_str()
            .unwrap_or_default()
            .contains("longer than"),
        "{done}"
    );
    let events = turn(&mut alice, &id, "fine again").await;
    assert_eq!(finished(&events)["status"], "completed", "{events:#?}");

    let pids = agent_pids(store.path(), &id);
    assert_eq!(
        pids.len(),
        3,
        "a fresh process after each failure: {pids:?}"
    );
    for pid in &pids[..2] {
        wait_gone(*pid, true, "a failed agent").await;
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_ignores_stop_is_killed_with_its_group_and_none_is_left_after_close() {
    let store = tempfile::tempdir().unwrap();
    let (server, mut alice, id) = with_test_agent(store.path()).await;

    alice.send_message(&id, "stubborn").await;
    let events = alice.events_until_kind(&id, "text_delta").await;
    assert_eq!(common::text_deltas(&events)[0].1, "working");
    let agent = agent_pids(store.path(), &id)[0];
    let helper: u32 = std::fs::read_to_string(workspace(store.path(), &id).join("helper.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    let stopped_at = Instant::now();
    let ack = alice
        .request(json!({"type": "stop", "conversation_id": id}))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    let events = alice.events_until_turn_finished(&id).await;
    assert_eq!(finished(&events)["status"], "stopped");

    // The next turn waits until the stop is resolved: here, the kill after
    // two seconds. It then runs in a fresh process.
    let events = turn(&mut alice, &id, "after the stop").await;
    let waited = stopped_at.elapsed();
    assert_eq!(finished(&events)["status"], "completed", "{events:#?}");
    assert!(
        waited >= Duration::from_millis(1900),
        "the next turn ran {waited:?} after the stop"
    );
    wait_gone(agent, true, "the agent that ignored stop").await;
    wait_gone(helper, false, "the agent's helper process").await;
    let pids = agent_pids(store.path(), &id);
    assert_eq!(pids.len(), 2, "{pids:?}");

    close(&mut alice, &id).await;
    wait_gone(pids[1], true, "the agent of the closed conversation").await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_escalates_to_sigkill_for_an_agent_that_ignores_eof_and_sigterm() {
    let store = tempfile::tempdir().unwrap();
    let (server, mut alice, id) = with_test_agent(store.path()).await;

    let events = turn(&mut alice, &id, "deaf").await;
    assert_eq!(finished(&events)["status"], "completed");
    let pid = agent_pids(store.path(), &id)[0];
    let closed_at = Instant::now();
    close(&mut alice, &id).await;
    wait_gone(pid, true, "the deaf agent").await;
    let took = closed_at.elapsed();
    // Two seconds after closing stdin, then two after SIGTERM.
    assert!(took >= Duration::from_millis(3900), "gone after {took:?}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_tool_call_is_answered_after_a_reconnect_and_the_agent_gets_the_result() {
    let store = tempfile::tempdir().unwrap();
    let (server, mut alice, id) = with_test_agent(store.path()).await;

    alice.send_message(&id, "ask").await;
    let events = alice.events_until_kind(&id, "tool_call").await;
    let call = events.last().unwrap();
    assert_eq!(call["data"]["call_id"], "call_1", "{call}");
    assert_eq!(call["data"]["name"], "confirm", "{call}");
    assert_eq!(call["data"]["args"], json!({"q": "sure?"}), "{call}");
    assert_eq!(call["data"]["target"], "client", "{call}");
    let last_seen = seq(call);
    alice.drop_abruptly();

    let mut again = server.connect("alice").await;
    let attached = again.attach(&id, last_seen).await;
    assert_eq!(attached["pending_calls"], json!(["call_1"]), "{attached}");
    let ack = again
        .request(json!({
            "type": "tool_result",
            "conversation_id": id,
            "call_id": "call_1",
            "output": {"ok": true, "n": 7},
        }))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    let events = again.events_until_turn_finished(&id).await;
    assert_eq!(kind(&events[0]), "tool_result", "{events:#?}");
    assert_eq!(
        assistant_text(&events),
        r#"got {"n":7,"ok":true} is_error=False"#
    );
    assert_eq!(finished(&events)["status"], "completed");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_the_agent_honours_frees_the_same_process_for_the_next_turn() {
    let store = tempfile::tempdir().unwrap();
    let (server, mut alice, id) = with_test_agent(store.path()).await;

    alice.send_message(&id, "polite").await;
    alice.events_until_kind(&id, "text_delta").await;
    let ack = alice
        .request(json!({"type": "stop", "conversation_id": id}))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    let events = alice.events_until_turn_finished(&id).await;
    assert_eq!(finished(&events)["status"], "stopped");
    // Sent at once: it waits (inside the session) for the agent to finish
    // the stopped turn, which it does without a kill.
    let events = turn(&mut alice, &id, "next").await;
    assert_eq!(finished(&events)["status"], "completed", "{events:#?}");
    assert_eq!(assistant_text(&events), "next");
    // Not killed: the same process ran both turns (a kill would have shown
    // as a second pid, two seconds later).
    let pids = agent_pids(store.path(), &id);
    assert_eq!(pids.len(), 1, "the same process: {pids:?}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_agent_loses_nothing() {
    let store = tempfile::tempdir().unwrap();
    let (server, mut alice, id) = with_test_agent(store.path()).await;

    let count = 5000;
    let events = turn(&mut alice, &id, &format!("flood {count}")).await;
    assert_eq!(finished(&events)["status"], "completed");
    let deltas = common::text_deltas(&events);
    assert_eq!(deltas.len(), count);
    for (i, (_, text)) in deltas.iter().enumerate() {
        assert_eq!(text, &format!("{i} "));
    }
    common::assert_contiguous(&events, seq(&events[0]));
    server.shutdown().await;
}

//! Durability of the real binary: history survives SIGKILL (protocol §5.4),
//! SIGTERM shuts down gracefully (protocol §6), and an interrupted turn is
//! run again once with `agent.resume_interrupted` (protocol §11), the demo
//! agent's and a command agent's (`examples/agents/checkpoint_agent.py`,
//! which continues from the checkpoint in its workspace).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::process::{temp_store, ServerProcess};
use common::{is_event, kind, seq};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_loses_nothing_that_was_seen() {
    let (_dir, store) = temp_store();
    let mut server = ServerProcess::spawn(&store, "");
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    client.send_message(&id, "/stream 3000 5").await;
    let mut seen: BTreeMap<u64, Value> = BTreeMap::new();
    loop {
        let event = client.next_event(&id).await;
        seen.insert(seq(&event), event.clone());
        if kind(&event) == "text_delta" && seen.len() >= 40 {
            break;
        }
    }
    let workspace = store.join("workspaces").join(&id);
    std::fs::write(workspace.join("notes.txt"), "written before the crash").unwrap();
    server.kill9();
    drop(client);

    let mut server = ServerProcess::spawn(&store, "");
    server.wait_for_log(|l| l.contains("recovered conversation after restart"));
    assert_eq!(
        std::fs::read_to_string(workspace.join("notes.txt")).unwrap(),
        "written before the crash",
        "the workspace survives a crash"
    );
    let mut client = server.connect("alice").await;
    let attached = client.attach(&id, 0).await;
    assert_eq!(attached["replay_from"], 1);
    assert_eq!(attached["replay_incomplete"], false);
    // Attaching re-activates it, so `agent_started` may already be part of
    // the replay (it is committed before or after the attach is handled).
    let mut replay = client
        .events(&id, attached["head_seq"].as_u64().unwrap() as usize)
        .await;
    if kind(replay.last().unwrap()) != "agent_started" {
        replay.push(client.next_event(&id).await);
    }
    common::assert_contiguous(&replay, 1);
    for event in &replay {
        if let Some(before) = seen.get(&seq(event)) {
            assert_eq!(before, event, "seq {} changed across the crash", seq(event));
        }
    }
    let last_seen = *seen.keys().last().unwrap();
    let n = replay.len();
    assert!(
        n as u64 > last_seen + 2,
        "events seen up to {last_seen} were lost"
    );
    let (finished, stopped, started) = (&replay[n - 3], &replay[n - 2], &replay[n - 1]);
    assert_eq!(kind(finished), "turn_finished");
    assert_eq!(finished["data"]["status"], "interrupted");
    assert_eq!(kind(stopped), "agent_stopped");
    assert_eq!(stopped["data"]["reason"], "restart_recovery");
    assert!(is_event(started, "agent_started"));
    assert_eq!(started["data"]["reason"], "attach");

    // The next message works and seq continues.
    let head = seq(started);
    let ack = client.send_message(&id, "still here").await;
    assert_eq!(ack["seq"], head + 1);
    let turn = client.events_until_turn_finished(&id).await;
    common::assert_contiguous(&turn, head + 1);
    assert_eq!(turn.last().unwrap()["data"]["status"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_shuts_down_gracefully() {
    let (_dir, store) = temp_store();
    let mut server = ServerProcess::spawn(&store, "");
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    client.send_message(&id, "/stream 3000 5").await;
    loop {
        let event = client.next_event(&id).await;
        if kind(&event) == "text_delta" {
            break;
        }
    }
    server.signal("TERM");
    let (frames, code) = client.until_closed().await;
    assert_eq!(
        code,
        Some(1001),
        "sockets close with 1001; frames: {frames:?}"
    );
    let finished = frames
        .iter()
        .position(|f| is_event(f, "turn_finished"))
        .expect("turn_finished before the close");
    assert_eq!(frames[finished]["data"]["status"], "interrupted");
    let stopped = frames
        .iter()
        .position(|f| is_event(f, "agent_stopped"))
        .expect("agent_stopped before the close");
    assert_eq!(frames[stopped]["data"]["reason"], "shutdown");
    assert_eq!(seq(&frames[stopped]), seq(&frames[finished]) + 1);
    let detached = frames
        .iter()
        .position(|f| f["type"] == "detached")
        .expect("detached before the close");
    assert_eq!(frames[detached]["reason"], "shutdown");
    assert!(detached > stopped);
    let status = server.wait_exit(Duration::from_secs(15));
    assert_eq!(status.code(), Some(0), "exit status {status:?}");

    // The store was flushed: a restart finds the history closed by the
    // shutdown itself, with nothing left to recover.
    let last = seq(&frames[stopped]);
    let mut server = ServerProcess::spawn(&store, "");
    let mut client = server.connect("alice").await;
    let attached = client.attach(&id, last).await;
    assert_eq!(attached["replay_from"], last + 1);
    let started = client.next_event(&id).await;
    assert_eq!(seq(&started), last + 1);
    assert_eq!(started["data"]["reason"], "attach");
    assert!(!server
        .log()
        .iter()
        .any(|l| l.contains("recovered conversation after restart")));
    let reply = client.request(json!({"type": "ping"})).await;
    assert_eq!(reply["type"], "pong");
    server.signal("TERM");
    assert_eq!(server.wait_exit(Duration::from_secs(15)).code(), Some(0));
}

/// Protocol §11: with `agent.resume_interrupted`, a turn cut by a crash is
/// run again, once, when its conversation is next active, for the same user
/// message (`turn_started.resumed_from`); a resumed turn cut again is not
/// resumed a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_turn_is_resumed_once() {
    let (_dir, store) = temp_store();
    let config = "[agent]\nresume_interrupted = true\n";
    let mut server = ServerProcess::spawn(&store, config);
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    let ack = client.send_message(&id, "/stream 100000 20").await;
    let message_seq = ack["seq"].as_u64().unwrap();
    let started = client.events_until_kind(&id, "text_delta").await;
    let first_turn = started
        .iter()
        .find(|e| is_event(e, "turn_started"))
        .map(|e| e["data"]["turn_id"].clone())
        .unwrap();
    server.kill9();

    // Next activation: the same message runs again, as a resumed turn.
    let mut server = ServerProcess::spawn(&store, config);
    let mut client = server.connect("alice").await;
    client.attach(&id, 0).await;
    let (resumed, _) = client
        .recv_until(|f| is_event(f, "turn_started") && f["data"]["turn_id"] != first_turn)
        .await;
    assert_eq!(resumed["data"]["message_seq"], message_seq, "{resumed}");
    assert_eq!(resumed["data"]["resumed_from"], first_turn, "{resumed}");
    client.events_until_kind(&id, "text_delta").await;
    server.kill9();

    // Cut again: not resumed a second time.
    let server = ServerProcess::spawn(&store, config);
    let mut client = server.connect("alice").await;
    let attached = client.attach(&id, 0).await;
    let head = attached["head_seq"].as_u64().unwrap();
    let mut replay = client.events(&id, head as usize).await;
    if kind(replay.last().unwrap()) != "agent_started" {
        replay.push(client.next_event(&id).await);
    }
    common::assert_contiguous(&replay, 1);
    let starts: Vec<&Value> = replay
        .iter()
        .filter(|e| is_event(e, "turn_started"))
        .collect();
    assert_eq!(
        starts.len(),
        2,
        "one turn and its one resumption: {starts:#?}"
    );
    assert_eq!(kind(replay.last().unwrap()), "agent_started");
    // And it stays idle: a new message is the next thing that runs.
    let ack = client.send_message(&id, "hello").await;
    assert_eq!(ack["seq"], seq(replay.last().unwrap()) + 1);
}

/// A linger whose agent is `examples/agents/checkpoint_agent.py`, running
/// interrupted turns again (protocol §11).
fn checkpoint_agent_config() -> String {
    let agent = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/agents/checkpoint_agent.py");
    format!(
        "[agent]\nkind = \"command\"\ncommand = [\"python3\", {:?}]\nresume_interrupted = true\n",
        agent.display().to_string()
    )
}

/// The job every command-agent resume test runs: 8 steps of 300 ms.
const JOB: &str = "/steps 8 300";

/// A turn of the checkpoint agent, 3 of its steps done: the conversation,
/// the job's message seq and the turn's id.
struct Job {
    id: String,
    message_seq: u64,
    turn_id: Value,
}

async fn start_job(server: &ServerProcess) -> (common::Client, Job) {
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    let ack = client.send_message(&id, JOB).await;
    let message_seq = ack["seq"].as_u64().unwrap();
    let (started, _) = client
        .recv_until(|f| is_event(f, "turn_started") && f["data"]["message_seq"] == message_seq)
        .await;
    client
        .recv_until(|f| is_event(f, "text_delta") && f["data"]["text"] == "step 3 of 8 done\n")
        .await;
    let turn_id = started["data"]["turn_id"].clone();
    (
        client,
        Job {
            id,
            message_seq,
            turn_id,
        },
    )
}

/// Starts linger on `store`, starts the job, and SIGKILLs linger.
async fn job_cut_by_sigkill(store: &std::path::Path, config: &str) -> Job {
    let mut server = ServerProcess::spawn(store, config);
    let (client, job) = start_job(&server).await;
    server.kill9();
    drop(client);
    job
}

/// Attaches to the job's conversation after a restart and waits for its
/// turn to be run again: checks `resumed_from` and the message, and that
/// the agent continued from its checkpoint (it does so only when its turn
/// line says `"resumed": true`); returns the client, the new turn's id and
/// the last step the checkpoint held.
async fn resumed(server: &ServerProcess, job: &Job) -> (common::Client, Value, u64) {
    let mut client = server.connect("alice").await;
    client.attach(&job.id, 0).await;
    let (started, _) = client
        .recv_until(|f| is_event(f, "turn_started") && f["data"]["turn_id"] != job.turn_id)
        .await;
    assert_eq!(started["data"]["resumed_from"], job.turn_id, "{started}");
    assert_eq!(started["data"]["message_seq"], job.message_seq, "{started}");
    let first = client.next_event(&job.id).await;
    let text = first["data"]["text"].as_str().unwrap_or_default();
    let step: u64 = text
        .strip_prefix("continuing after step ")
        .and_then(|rest| rest.strip_suffix(" of 8\n"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the resumed turn should continue from its checkpoint: {first}"));
    // Step 3 was reported, so checkpointed, before the interruption.
    assert!((3..8).contains(&step), "{first}");
    (client, started["data"]["turn_id"].clone(), step)
}

/// The resumed turn goes on after `step` and completes: the steps after it
/// once each, none before it again, and the whole text as its reply.
async fn completes_after(client: &mut common::Client, job: &Job, turn_id: &Value, step: u64) {
    let events = client.events_until_turn_finished(&job.id).await;
    assert!(
        events.iter().all(|e| e["data"]["turn_id"] == *turn_id),
        "{events:#?}"
    );
    let deltas: Vec<String> = common::text_deltas(&events)
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    let expected: Vec<String> = (step + 1..=8)
        .map(|i| format!("step {i} of 8 done\n"))
        .collect();
    assert_eq!(deltas, expected);
    let reply = common::the_one(&events, "assistant_message")["data"]["text"].clone();
    assert_eq!(
        reply,
        format!("continuing after step {step} of 8\n{}", expected.concat())
    );
    assert_eq!(events.last().unwrap()["data"]["status"], "completed");
}

/// Starts linger again on `store`: the job's turn runs again, continues
/// from the checkpoint and completes; the agent was given the turn twice,
/// the second time as resumed.
async fn restart_and_complete(store: &std::path::Path, config: &str, job: &Job) {
    let server = ServerProcess::spawn(store, config);
    let (mut client, turn_id, step) = resumed(&server, job).await;
    completes_after(&mut client, job, &turn_id, step).await;
    assert_eq!(
        agent_turns(store, &job.id),
        turns(&[("new", JOB), ("resumed", JOB)])
    );
}

/// The turns the checkpoint agent was given in this conversation's
/// workspace: (`new` or `resumed`, text).
fn agent_turns(store: &std::path::Path, id: &str) -> Vec<(String, String)> {
    let log = std::fs::read_to_string(store.join("workspaces").join(id).join("turns.log"))
        .unwrap_or_default();
    log.lines()
        .filter_map(|l| {
            let mut fields = l.splitn(3, '\t').skip(1);
            Some((fields.next()?.to_owned(), fields.next()?.to_owned()))
        })
        .collect()
}

fn turns(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect()
}

/// Protocol §11 with a command agent: SIGKILL of linger mid-turn; after the
/// restart the turn runs again, the agent is told it is resumed, continues
/// from the checkpoint in its workspace, and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_agent_turn_cut_by_sigkill_is_resumed_from_its_checkpoint() {
    let (_dir, store) = temp_store();
    let config = checkpoint_agent_config();
    let job = job_cut_by_sigkill(&store, &config).await;

    restart_and_complete(&store, &config, &job).await;
}

/// The same after a graceful shutdown (SIGTERM): linger stops the turn
/// (`interrupted`) and closes the agent's input; the next activation runs
/// it again and the agent continues from its checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_agent_turn_cut_by_a_shutdown_is_resumed_from_its_checkpoint() {
    let (_dir, store) = temp_store();
    let config = checkpoint_agent_config();
    let mut server = ServerProcess::spawn(&store, &config);
    let (mut client, job) = start_job(&server).await;
    server.signal("TERM");
    let (frames, code) = client.until_closed().await;
    assert_eq!(code, Some(1001), "{frames:?}");
    let finished = frames
        .iter()
        .find(|f| is_event(f, "turn_finished"))
        .expect("turn_finished before the close");
    assert_eq!(finished["data"]["status"], "interrupted", "{finished}");
    assert_eq!(server.wait_exit(Duration::from_secs(15)).code(), Some(0));

    restart_and_complete(&store, &config, &job).await;
}

/// A resumed command-agent turn cut again is not run a third time: the
/// agent is given nothing at the next activation, and the next message is
/// a new turn that starts afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_command_agent_turn_cut_again_ends_there() {
    let (_dir, store) = temp_store();
    let config = checkpoint_agent_config();
    let job = job_cut_by_sigkill(&store, &config).await;
    let mut server = ServerProcess::spawn(&store, &config);
    let (client, _, _) = resumed(&server, &job).await;
    server.kill9();
    drop(client);

    let server = ServerProcess::spawn(&store, &config);
    let mut client = server.connect("alice").await;
    let attached = client.attach(&job.id, 0).await;
    let head = attached["head_seq"].as_u64().unwrap();
    let mut replay = client.events(&job.id, head as usize).await;
    if kind(replay.last().unwrap()) != "agent_started" {
        replay.push(client.next_event(&job.id).await);
    }
    common::assert_contiguous(&replay, 1);
    let starts = replay
        .iter()
        .filter(|e| is_event(e, "turn_started"))
        .count();
    assert_eq!(starts, 2, "the turn and its one resumption: {replay:#?}");
    // Nothing started since the activation: the next message is the next
    // event, and its turn is a new one, from step 1.
    let again = "/steps 2 10";
    let ack = client.send_message(&job.id, again).await;
    assert_eq!(ack["seq"], seq(replay.last().unwrap()) + 1);
    let events = client.events_until_turn_finished(&job.id).await;
    let deltas: Vec<String> = common::text_deltas(&events)
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    assert_eq!(deltas, ["step 1 of 2 done\n", "step 2 of 2 done\n"]);
    assert_eq!(
        agent_turns(&store, &job.id),
        turns(&[("new", JOB), ("resumed", JOB), ("new", again)])
    );
}

//! How long a command agent (protocol §9) takes to start answering: the time
//! from sending `message` to receiving the turn's first `text_delta`, over a
//! real websocket to an in-process server whose agent is
//! `python3 examples/agents/echo_agent.py`.
//!
//! - **warm**: the agent process is already running (every turn after the
//!   first on one conversation). The path: websocket → conversation actor →
//!   store commit of `user_message` and `turn_started` → the driver → the
//!   agent's stdin → Python → its stdout → the reader → store commit →
//!   websocket.
//! - **cold, create**: `message` sent the moment `created` arrives. The
//!   process is spawned on activation, so its start (fork/exec and the
//!   Python interpreter's start-up) overlaps the message and is on the path.
//! - **cold, re-attach**: the same for a stopped conversation brought back
//!   by `attach` (`message` sent the moment `attached` arrives).
//! - **demo, warm** (baseline): the built-in demo agent (`/stream 1 0`), so
//!   the difference with *warm* is what the child process and its pipes
//!   add.
//! - **bare** (baseline, no linger): the same script spawned directly and
//!   given a `turn` line on stdin; the time to its first stdout line, with
//!   the process running (warm) and from the spawn (cold). The difference
//!   with the command rows is what linger adds.
//!
//! Each turn runs to `turn_finished` before the next starts; between cold
//! samples the conversation is closed and its process given time to exit.
//! Run with `cargo bench --bench command_agent` (`-- warm`, `-- cold`,
//! `-- demo` or `-- bare` for some rows). Latency depends on what else the machine runs.

use std::path::Path;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{connect_async, MaybeTlsStream, WebSocketStream};

use linger::config::{AgentKind, Config};
use linger::server::Server;

const WARM_SAMPLES: usize = 200;
const COLD_SAMPLES: usize = 30;
/// Turns run before the warm samples, so that the process, the interpreter's
/// caches and the store are past their first-use costs.
const WARM_UP: usize = 10;
/// How long a closed conversation's process gets to exit before the next
/// cold sample (the echo agent exits at the end of its input, in a few
/// milliseconds), so that two processes never overlap.
const SETTLE: Duration = Duration::from_millis(200);
/// Any single wait; only turns a hang into a clear failure.
const WAIT: Duration = Duration::from_secs(30);

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wanted = |name: &str| only.is_empty() || only.iter().any(|w| name.contains(w.as_str()));
    let rows = runtime.block_on(async {
        let mut rows = Vec::new();
        if wanted("warm") || wanted("cold") {
            let bench = Bench::start(AgentKind::Command).await;
            if wanted("warm") {
                rows.push(("command, warm", bench.warm("hello world").await));
            }
            if wanted("cold") {
                rows.push(("command, cold: create", bench.cold_create().await));
                rows.push(("command, cold: re-attach", bench.cold_reattach().await));
            }
            bench.server.shutdown().await;
        }
        if wanted("bare") {
            rows.push(("bare pipe, warm", bare_warm().await));
            rows.push(("bare pipe, cold: spawn", bare_cold().await));
        }
        if wanted("demo") {
            let bench = Bench::start(AgentKind::Demo).await;
            rows.push(("demo, warm (baseline)", bench.warm("/stream 1 0").await));
            bench.server.shutdown().await;
        }
        rows
    });
    println!("message → first text_delta, milliseconds");
    println!(
        "{:<26} {:>7} {:>8} {:>8} {:>8} {:>8}",
        "", "samples", "p50", "p90", "p99", "max"
    );
    for (name, h) in rows {
        let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        println!(
            "{name:<26} {:>7} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
            h.len(),
            ms(0.5),
            ms(0.9),
            ms(0.99),
            h.max() as f64 / 1000.0
        );
    }
}

struct Bench {
    server: Server,
    url: String,
    _store: tempfile::TempDir,
}

impl Bench {
    async fn start(kind: AgentKind) -> Bench {
        let store = tempfile::tempdir().expect("temporary store");
        let echo = echo_agent();
        let mut config = Config::default();
        config.server.listen = "127.0.0.1:0".parse().expect("an address");
        config.store.path = store.path().to_path_buf();
        config.agent.kind = kind;
        config.agent.command = vec!["python3".into(), echo.display().to_string()];
        // One connection sends every sample; the cold rows make many
        // conversations, closed as they go.
        config.limits.messages_per_second = 100_000;
        config.limits.messages_burst = 100_000;
        config.conversations.max_per_user = 0;
        let server = Server::start(config).await.expect("the server starts");
        let url = format!("ws://{}/v1/ws?token=bench", server.addr);
        Bench {
            server,
            url,
            _store: store,
        }
    }

    async fn connect(&self) -> Client {
        let (ws, _) = tokio::time::timeout(WAIT, connect_async(self.url.as_str()))
            .await
            .expect("connecting in time")
            .expect("connecting");
        Client { ws, last_seq: 0 }
    }

    /// One conversation, its process running: `WARM_SAMPLES` turns timed.
    async fn warm(&self, text: &str) -> Histogram<u64> {
        let mut client = self.connect().await;
        let id = client.create().await;
        for _ in 0..WARM_UP {
            client.turn(&id, text).await;
        }
        let mut h = histogram();
        for _ in 0..WARM_SAMPLES {
            record(&mut h, client.turn(&id, text).await);
        }
        client.close(&id).await;
        h
    }

    /// A new conversation per sample, messaged as soon as it exists.
    async fn cold_create(&self) -> Histogram<u64> {
        let mut client = self.connect().await;
        let mut h = histogram();
        for _ in 0..COLD_SAMPLES {
            tokio::time::sleep(SETTLE).await;
            let id = client.create().await;
            record(&mut h, client.turn(&id, "hello world").await);
            client.close(&id).await;
        }
        h
    }

    /// One conversation, stopped and brought back by `attach` per sample.
    async fn cold_reattach(&self) -> Histogram<u64> {
        let mut client = self.connect().await;
        let id = client.create().await;
        client.turn(&id, "hello world").await;
        client.close(&id).await;
        let mut h = histogram();
        for _ in 0..COLD_SAMPLES {
            tokio::time::sleep(SETTLE).await;
            client
                .send(json!({"type": "attach", "conversation_id": id, "last_seq": client.last_seq}))
                .await;
            client.until(|f| f["type"] == "attached").await;
            record(&mut h, client.turn(&id, "hello world").await);
            client.close(&id).await;
        }
        h
    }
}

fn echo_agent() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/agents/echo_agent.py")
}

/// The echo agent run directly, without linger: its stdin and stdout.
struct Bare {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    dir: tempfile::TempDir,
    turns: u64,
}

impl Bare {
    fn spawn() -> Bare {
        let dir = tempfile::tempdir().expect("a working directory");
        let mut child = tokio::process::Command::new("python3")
            .arg(echo_agent())
            .current_dir(dir.path())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 starts");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        Bare {
            child,
            stdin,
            stdout: tokio::io::BufReader::new(stdout).lines(),
            dir,
            turns: 0,
        }
    }

    /// Writes a turn and reads the agent's output up to `turn_finished`;
    /// returns the time to its first line, measured from `since`.
    async fn turn(&mut self, since: Instant) -> Duration {
        self.turns += 1;
        let line =
            json!({"type": "turn", "turn_id": format!("t{}", self.turns), "text": "hello world"});
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .expect("writing a turn");
        let mut first = None;
        loop {
            let line = tokio::time::timeout(WAIT, self.stdout.next_line())
                .await
                .expect("a line in time")
                .expect("reading stdout")
                .expect("the agent runs");
            first.get_or_insert_with(|| since.elapsed());
            if line.contains("turn_finished") {
                return first.unwrap_or_default();
            }
        }
    }

    async fn end(mut self) {
        drop(self.stdin);
        let _ = tokio::time::timeout(WAIT, self.child.wait()).await;
        drop(self.dir);
    }
}

async fn bare_warm() -> Histogram<u64> {
    let mut bare = Bare::spawn();
    for _ in 0..WARM_UP {
        bare.turn(Instant::now()).await;
    }
    let mut h = histogram();
    for _ in 0..WARM_SAMPLES {
        record(&mut h, bare.turn(Instant::now()).await);
    }
    bare.end().await;
    h
}

async fn bare_cold() -> Histogram<u64> {
    let mut h = histogram();
    for _ in 0..COLD_SAMPLES {
        tokio::time::sleep(SETTLE).await;
        let spawned = Instant::now();
        let mut bare = Bare::spawn();
        record(&mut h, bare.turn(spawned).await);
        bare.end().await;
    }
    h
}

fn histogram() -> Histogram<u64> {
    // Microseconds, up to a minute, three significant figures.
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds")
}

fn record(h: &mut Histogram<u64>, d: Duration) {
    let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    h.record(us.clamp(1, 60_000_000)).expect("in bounds");
}

struct Client {
    ws: Ws,
    /// The highest seq seen, so that a re-attach replays nothing.
    last_seq: u64,
}

impl Client {
    async fn send(&mut self, frame: Value) {
        self.ws
            .send(Message::text(frame.to_string()))
            .await
            .expect("sending a frame");
    }

    /// Reads frames until one satisfies `done`, and returns it.
    async fn until(&mut self, done: impl Fn(&Value) -> bool) -> Value {
        loop {
            let message = tokio::time::timeout(WAIT, self.ws.next())
                .await
                .expect("a frame in time")
                .expect("the socket stays open")
                .expect("reading a frame");
            let Message::Text(text) = message else {
                continue;
            };
            let frame: Value = serde_json::from_str(text.as_str()).expect("a JSON frame");
            if frame["type"] == "error" {
                panic!("the server answered with an error: {frame}");
            }
            if let Some(seq) = frame["seq"].as_u64() {
                self.last_seq = self.last_seq.max(seq);
            }
            if done(&frame) {
                return frame;
            }
        }
    }

    async fn create(&mut self) -> String {
        self.send(json!({"type": "create"})).await;
        let created = self.until(|f| f["type"] == "created").await;
        created["conversation_id"]
            .as_str()
            .expect("a conversation id")
            .to_owned()
    }

    /// Sends `text` and waits for the turn to finish; returns the time to
    /// its first `text_delta`.
    async fn turn(&mut self, id: &str, text: &str) -> Duration {
        let sent = Instant::now();
        self.send(json!({"type": "message", "conversation_id": id, "text": text}))
            .await;
        self.until(|f| f["kind"] == "text_delta").await;
        let first = sent.elapsed();
        let finished = self.until(|f| f["kind"] == "turn_finished").await;
        assert_eq!(
            finished["data"]["status"], "completed",
            "the turn did not complete: {finished}"
        );
        first
    }

    /// Stops the conversation and waits until this connection is detached.
    async fn close(&mut self, id: &str) {
        self.send(json!({"type": "close", "conversation_id": id}))
            .await;
        self.until(|f| f["type"] == "detached").await;
    }
}

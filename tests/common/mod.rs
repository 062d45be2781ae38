//! Test harness for the integration tests: an in-process server on a free
//! port with its own temporary store, and a websocket client speaking
//! protocol v1 (`docs/protocol.md`).
//!
//! Synchronization is always on frames or on stored state, never on a fixed
//! sleep. Every wait is bounded by [`RECV_TIMEOUT`] and panics with what it
//! was waiting for and the last frames seen: the timeout only turns a hang
//! into a clear failure.

#![allow(dead_code)]

pub mod faulty_store;
pub mod nats;
pub mod process;
pub mod proxy;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{connect_async, MaybeTlsStream, WebSocketStream};

use linger::config::Config;
use linger::server::Server;

/// How long any single wait may take before the test fails.
pub const RECV_TIMEOUT: Duration = Duration::from_secs(20);

/// How many recent frames a failure message shows.
const HISTORY: usize = 8;

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// A server running in this test's runtime, with its store in a temporary
/// directory that lives as long as the struct.
pub struct TestServer {
    pub addr: SocketAddr,
    server: Option<Server>,
    http: reqwest::Client,
    dir: tempfile::TempDir,
    /// The config file a reload re-reads ([`TestServer::config_file`]).
    config_dir: tempfile::TempDir,
}

impl TestServer {
    pub async fn start() -> TestServer {
        TestServer::start_with(|_| {}).await
    }

    /// Starts a server with the defaults, a free loopback port, a fresh
    /// store, and whatever `tweak` changes.
    pub async fn start_with(tweak: impl FnOnce(&mut Config)) -> TestServer {
        TestServer::start_wrapping(tweak, |store| store).await
    }

    /// [`TestServer::start_with`], with the server's store wrapped.
    pub async fn start_wrapping(
        tweak: impl FnOnce(&mut Config),
        wrap: impl FnOnce(
            std::sync::Arc<dyn linger::store::Store>,
        ) -> std::sync::Arc<dyn linger::store::Store>,
    ) -> TestServer {
        init_tracing();
        let dir = tempfile::tempdir().expect("temporary store directory");
        let mut config = Config::default();
        config.server.listen = "127.0.0.1:0".parse().unwrap();
        config.store.path = dir.path().to_path_buf();
        tweak(&mut config);
        // Written out as `linger serve` would read it, so that a reload
        // (`POST /v1/admin/reload`) re-reads the same configuration.
        let config_dir = tempfile::tempdir().expect("temporary config directory");
        let file = config_dir.path().join("linger.toml");
        let text = toml::to_string(&config).expect("the config serializes as TOML");
        std::fs::write(&file, text).expect("write the config file");
        let setup = linger::server::Setup {
            source: linger::reload::ConfigSource::File(Some(file)),
            logging: None,
        };
        let server = Server::start_setup(config, setup, wrap)
            .await
            .unwrap_or_else(|e| panic!("the server did not start: {e}"));
        TestServer {
            addr: server.addr,
            server: Some(server),
            http: reqwest::Client::new(),
            dir,
            config_dir,
        }
    }

    /// The config file a reload re-reads: edit it, then reload.
    pub fn config_file(&self) -> std::path::PathBuf {
        self.config_dir.path().join("linger.toml")
    }

    /// The store directory (`store.path`).
    pub fn store_path(&self) -> &std::path::Path {
        self.dir.path()
    }

    pub fn ws_url(&self, token: &str) -> String {
        format!("ws://{}/v1/ws?token={token}", self.addr)
    }

    pub fn http_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Opens a websocket as `user` (dev auth: the token is the user name).
    pub async fn connect(&self, user: &str) -> Client {
        Client::connect(&self.ws_url(user), user).await
    }

    /// GET `path` with `token` as a bearer token (none: no Authorization);
    /// returns the status and the body as JSON (a string when not JSON).
    pub async fn get(&self, path: &str, token: Option<&str>) -> (u16, Value) {
        http_call(&self.http, &self.http_url(""), "GET", path, token, None).await
    }

    /// Any REST call: `method` on `path`, with `token` as a bearer token
    /// (none: no Authorization header) and an optional JSON body; returns
    /// the status and the body as JSON (a string when not JSON).
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        http_call(&self.http, &self.http_url(""), method, path, token, body).await
    }

    /// The stored events of a conversation after `after`, through REST
    /// (which never activates or attaches).
    pub async fn stored_events(&self, id: &str, user: &str, after: u64) -> Vec<Value> {
        stored_events_at(&self.http, &self.http_url(""), id, user, after).await
    }

    /// Waits until the stored history satisfies `done`, reading it through
    /// REST. This polls a condition on recorded state (for a conversation
    /// that nobody is attached to, there are no frames to wait on); the
    /// interval only paces the polling, it decides nothing.
    pub async fn wait_for_stored(
        &self,
        id: &str,
        user: &str,
        what: &str,
        done: impl Fn(&[Value]) -> bool,
    ) -> Vec<Value> {
        let deadline = Instant::now() + RECV_TIMEOUT;
        loop {
            let events = self.stored_events(id, user, 0).await;
            if done(&events) {
                return events;
            }
            if Instant::now() >= deadline {
                let tail: Vec<&Value> = events.iter().rev().take(HISTORY).rev().collect();
                panic!(
                    "waited {RECV_TIMEOUT:?} for the stored history of {id} to show {what}; \
                     {} events stored, the last: {tail:#?}",
                    events.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Graceful shutdown (protocol §6).
    pub async fn shutdown(mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown().await;
        }
    }
}

/// One websocket connection.
pub struct Client {
    pub user: String,
    ws: Ws,
    /// Frames read while looking for something else (a reply), handed out
    /// first by [`Client::recv`].
    backlog: VecDeque<Value>,
    /// Non-event frames skipped by the event readers.
    pub skipped: Vec<Value>,
    history: VecDeque<Value>,
    next_req: u64,
}

/// Tries a websocket upgrade with extra request headers (`Origin`,
/// `Authorization`, ...): the connection, or the HTTP status it was refused
/// with.
pub async fn try_connect(url: &str, user: &str, headers: &[(&str, &str)]) -> Result<Client, u16> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Error;
    let mut request = url
        .into_client_request()
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    for (name, value) in headers {
        request.headers_mut().insert(
            tokio_tungstenite::tungstenite::http::HeaderName::from_bytes(name.as_bytes())
                .expect("a header name"),
            value.parse().expect("a header value"),
        );
    }
    match tokio::time::timeout(RECV_TIMEOUT, connect_async(request)).await {
        Err(_) => panic!("connecting to {url}: no answer in {RECV_TIMEOUT:?}"),
        Ok(Ok((ws, _))) => Ok(Client::from_ws(ws, user)),
        Ok(Err(Error::Http(response))) => Err(response.status().as_u16()),
        Ok(Err(e)) => panic!("connecting to {url}: {e}"),
    }
}

impl Client {
    pub async fn connect(url: &str, user: &str) -> Client {
        let (ws, _) = tokio::time::timeout(RECV_TIMEOUT, connect_async(url))
            .await
            .unwrap_or_else(|_| panic!("connecting to {url}: no answer in {RECV_TIMEOUT:?}"))
            .unwrap_or_else(|e| panic!("connecting to {url}: {e}"));
        Client::from_ws(ws, user)
    }

    /// Connects with a small socket receive buffer (`SO_RCVBUF`, which also
    /// turns off the kernel's autotuning), so that a client that stops
    /// reading makes the server's writes block after little data.
    pub async fn connect_small_buffer(url: &str, user: &str, recv_buffer: u32) -> Client {
        let addr: SocketAddr = url
            .trim_start_matches("ws://")
            .split('/')
            .next()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no socket address in {url}"));
        let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
        socket
            .set_recv_buffer_size(recv_buffer)
            .expect("set SO_RCVBUF");
        let connect = async {
            let stream = socket.connect(addr).await?;
            tokio_tungstenite::client_async(url, MaybeTlsStream::Plain(stream))
                .await
                .map_err(std::io::Error::other)
        };
        let (ws, _) = tokio::time::timeout(RECV_TIMEOUT, connect)
            .await
            .unwrap_or_else(|_| panic!("connecting to {url}: no answer in {RECV_TIMEOUT:?}"))
            .unwrap_or_else(|e| panic!("connecting to {url}: {e}"));
        Client::from_ws(ws, user)
    }

    fn from_ws(ws: Ws, user: &str) -> Client {
        Client {
            user: user.to_owned(),
            ws,
            backlog: VecDeque::new(),
            skipped: Vec::new(),
            history: VecDeque::new(),
            next_req: 1,
        }
    }

    /// Sends one JSON frame.
    pub async fn send(&mut self, frame: Value) {
        self.send_text(&frame.to_string()).await;
    }

    /// Sends one text frame, verbatim.
    pub async fn send_text(&mut self, text: &str) {
        self.ws
            .send(Message::text(text.to_owned()))
            .await
            .unwrap_or_else(|e| panic!("{}: sending {text}: {e}", self.user));
    }

    pub async fn send_binary(&mut self, bytes: Vec<u8>) {
        self.ws
            .send(Message::binary(bytes))
            .await
            .unwrap_or_else(|e| panic!("{}: sending a binary frame: {e}", self.user));
    }

    fn remember(&mut self, frame: &Value) {
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(frame.clone());
    }

    fn recent(&self) -> String {
        let frames: Vec<String> = self.history.iter().map(Value::to_string).collect();
        if frames.is_empty() {
            "none".to_owned()
        } else {
            frames.join("\n  ")
        }
    }

    /// The next text frame from the socket itself (not the backlog).
    async fn recv_wire(&mut self, what: &str) -> Value {
        let started = Instant::now();
        loop {
            let left = RECV_TIMEOUT.saturating_sub(started.elapsed());
            let next = match tokio::time::timeout(left, self.ws.next()).await {
                Ok(next) => next,
                Err(_) => panic!(
                    "{}: no frame in {RECV_TIMEOUT:?} while waiting for {what}; last frames:\n  {}",
                    self.user,
                    self.recent()
                ),
            };
            let message = match next {
                Some(Ok(message)) => message,
                Some(Err(e)) => panic!(
                    "{}: socket error while waiting for {what}: {e}; last frames:\n  {}",
                    self.user,
                    self.recent()
                ),
                None => panic!(
                    "{}: socket ended while waiting for {what}; last frames:\n  {}",
                    self.user,
                    self.recent()
                ),
            };
            match message {
                Message::Text(text) => {
                    let value: Value = serde_json::from_str(text.as_str()).unwrap_or_else(|e| {
                        panic!("{}: the server sent invalid JSON ({e}): {text}", self.user)
                    });
                    self.remember(&value);
                    return value;
                }
                Message::Close(frame) => panic!(
                    "{}: the server closed the connection ({frame:?}) while waiting for {what}; \
                     last frames:\n  {}",
                    self.user,
                    self.recent()
                ),
                Message::Binary(_) => panic!("{}: the server sent a binary frame", self.user),
                Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => continue,
            }
        }
    }

    /// The next frame (backlog first), or how the connection ended: the
    /// close code (None: no close frame, the stream just ended or failed).
    /// Panics after [`RECV_TIMEOUT`] without either.
    pub async fn recv_or_close(&mut self) -> Result<Value, Option<u16>> {
        if let Some(frame) = self.backlog.pop_front() {
            return Ok(frame);
        }
        loop {
            let next = tokio::time::timeout(RECV_TIMEOUT, self.ws.next())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "{}: neither a frame nor a close in {RECV_TIMEOUT:?}; last frames:\n  {}",
                        self.user,
                        self.recent()
                    )
                });
            match next {
                Some(Ok(Message::Text(text))) => {
                    let value: Value = serde_json::from_str(text.as_str()).unwrap_or_else(|e| {
                        panic!("{}: the server sent invalid JSON ({e}): {text}", self.user)
                    });
                    self.remember(&value);
                    return Ok(value);
                }
                Some(Ok(Message::Close(frame))) => return Err(frame.map(|f| u16::from(f.code))),
                Some(Ok(Message::Binary(_))) => {
                    panic!("{}: the server sent a binary frame", self.user)
                }
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return Err(None),
            }
        }
    }

    /// The next frame (backlog first). Panics after [`RECV_TIMEOUT`].
    pub async fn recv(&mut self) -> Value {
        self.recv_for("any frame").await
    }

    async fn recv_for(&mut self, what: &str) -> Value {
        match self.backlog.pop_front() {
            Some(frame) => frame,
            None => self.recv_wire(what).await,
        }
    }

    /// Reads until a frame matches; returns it and the frames before it.
    pub async fn recv_until(&mut self, pred: impl Fn(&Value) -> bool) -> (Value, Vec<Value>) {
        let mut skipped = Vec::new();
        loop {
            let frame = self.recv_for("a frame matching a predicate").await;
            if pred(&frame) {
                return (frame, skipped);
            }
            skipped.push(frame);
        }
    }

    /// Sends `frame` with a fresh `req` (unless it has one) and returns the
    /// reply that echoes it. Frames read meanwhile stay queued for `recv`.
    pub async fn request(&mut self, mut frame: Value) -> Value {
        if frame.get("req").is_none() {
            frame["req"] = json!(format!("r{}", self.next_req));
            self.next_req += 1;
        }
        let req = frame["req"].clone();
        self.send(frame.clone()).await;
        if let Some(pos) = self.backlog.iter().position(|f| f.get("req") == Some(&req)) {
            return self.backlog.remove(pos).unwrap();
        }
        let what = format!("the reply to {frame}");
        loop {
            let reply = self.recv_wire(&what).await;
            if reply.get("req") == Some(&req) {
                return reply;
            }
            self.backlog.push_back(reply);
        }
    }

    /// `create`: returns the new conversation's id (this connection is
    /// attached to it in control mode from seq 1).
    pub async fn create(&mut self) -> String {
        self.create_titled("").await
    }

    pub async fn create_titled(&mut self, title: &str) -> String {
        let reply = self
            .request(json!({"type": "create", "title": title}))
            .await;
        assert_eq!(reply["type"], "created", "create: {reply}");
        reply["conversation_id"]
            .as_str()
            .unwrap_or_else(|| panic!("created without conversation_id: {reply}"))
            .to_owned()
    }

    /// `attach` in control mode; asserts and returns the `attached` frame.
    pub async fn attach(&mut self, id: &str, last_seq: u64) -> Value {
        self.attach_with(id, last_seq, "control").await
    }

    pub async fn attach_with(&mut self, id: &str, last_seq: u64, mode: &str) -> Value {
        let reply = self
            .request(json!({"type": "attach", "conversation_id": id, "last_seq": last_seq, "mode": mode}))
            .await;
        assert_eq!(
            reply["type"], "attached",
            "attach {id} from {last_seq}: {reply}"
        );
        assert_eq!(reply["conversation_id"], id, "{reply}");
        assert_eq!(reply["mode"], mode, "{reply}");
        reply
    }

    /// `message`; asserts and returns the `ack`.
    pub async fn send_message(&mut self, id: &str, text: &str) -> Value {
        let reply = self
            .request(json!({"type": "message", "conversation_id": id, "text": text}))
            .await;
        assert_eq!(reply["type"], "ack", "message {text:?}: {reply}");
        assert_eq!(reply["conversation_id"], id, "{reply}");
        assert!(reply["seq"].is_u64(), "ack without seq: {reply}");
        reply
    }

    /// The next event of conversation `id`. Other frames are kept in
    /// `skipped`; an `error` frame fails the test.
    pub async fn next_event(&mut self, id: &str) -> Value {
        loop {
            let frame = self.recv_for(&format!("an event of {id}")).await;
            if frame["type"] == "event" && frame["conversation_id"] == id {
                return frame;
            }
            if frame["type"] == "error" {
                panic!(
                    "{}: error frame while reading events of {id}: {frame}",
                    self.user
                );
            }
            self.skipped.push(frame);
        }
    }

    /// Exactly `n` events of conversation `id`.
    pub async fn events(&mut self, id: &str, n: usize) -> Vec<Value> {
        let mut events = Vec::with_capacity(n);
        while events.len() < n {
            events.push(self.next_event(id).await);
        }
        events
    }

    /// Events of `id` up to and including the next `turn_finished`.
    pub async fn events_until_turn_finished(&mut self, id: &str) -> Vec<Value> {
        self.events_until_kind(id, "turn_finished").await
    }

    /// Events of `id` up to and including the next one of `kind`.
    pub async fn events_until_kind(&mut self, id: &str, kind: &str) -> Vec<Value> {
        let mut events = Vec::new();
        loop {
            let event = self.next_event(id).await;
            let done = event["kind"] == kind;
            events.push(event);
            if done {
                return events;
            }
        }
    }

    /// Reads events of `id` until the next `turn_finished`, checking on the fly
    /// that their seqs go on from `next` (no gap, no duplicate), without keeping
    /// them. Returns the seq after the last one, the number of `text_delta`s,
    /// their total JSON size, and the `turn_finished` event.
    pub async fn read_turn(&mut self, id: &str, mut next: u64) -> (u64, u64, usize, Value) {
        let mut deltas = 0;
        let mut bytes = 0;
        loop {
            let event = self.next_event(id).await;
            assert_eq!(
                seq(&event),
                next,
                "{}: gap or duplicate: {event}",
                self.user
            );
            next += 1;
            bytes += event.to_string().len();
            match kind(&event) {
                "text_delta" => deltas += 1,
                "turn_finished" => return (next, deltas, bytes, event),
                _ => {}
            }
        }
    }

    /// Drops the connection without a close frame: the TCP stream just goes
    /// away, as when a laptop lid closes or a network drops.
    pub fn drop_abruptly(self) {
        drop(self.ws);
    }
}

/// An event's seq.
pub fn seq(event: &Value) -> u64 {
    event["seq"]
        .as_u64()
        .unwrap_or_else(|| panic!("not an event with a seq: {event}"))
}

pub fn kind(event: &Value) -> &str {
    event["kind"].as_str().unwrap_or("")
}

pub fn is_event(frame: &Value, kind_: &str) -> bool {
    frame["type"] == "event" && frame["kind"] == kind_
}

/// Asserts that `events` have seqs `from, from+1, ...` with no gap and no
/// duplicate.
pub fn assert_contiguous(events: &[Value], from: u64) {
    for (i, event) in events.iter().enumerate() {
        let want = from + i as u64;
        assert_eq!(
            event["seq"].as_u64(),
            Some(want),
            "event #{i} should have seq {want} (contiguous from {from}); got {event}; \
             previous: {}",
            if i > 0 {
                events[i - 1].to_string()
            } else {
                "none".into()
            }
        );
    }
}

/// The text of every `text_delta`, as (seq, text).
pub fn text_deltas(events: &[Value]) -> Vec<(u64, String)> {
    events
        .iter()
        .filter(|e| kind(e) == "text_delta")
        .map(|e| (seq(e), e["data"]["text"].as_str().unwrap_or("").to_owned()))
        .collect()
}

/// `tok1 tok2 ... tokN ` as the demo agent streams it.
pub fn stream_text(n: u64) -> String {
    (1..=n).map(|i| format!("tok{i} ")).collect()
}

/// The single event of `kind` among `events`.
pub fn the_one<'a>(events: &'a [Value], kind_: &str) -> &'a Value {
    let found: Vec<&Value> = events.iter().filter(|e| kind(e) == kind_).collect();
    assert_eq!(
        found.len(),
        1,
        "expected exactly one {kind_} event, got {}: {found:#?}",
        found.len()
    );
    found[0]
}

/// Polls `check` until it gives a value; fails the test after
/// [`RECV_TIMEOUT`], saying `what` it waited for and the last thing seen.
/// For state with no frame to wait on (an admin listing, the supervision
/// log); the interval only paces the polling, it decides nothing.
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Value>>,
{
    let deadline = Instant::now() + RECV_TIMEOUT;
    loop {
        match check().await {
            Ok(found) => return found,
            Err(last) if Instant::now() >= deadline => {
                panic!("waited {RECV_TIMEOUT:?} for {what}; last seen: {last:#}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Any REST call on the server at `base` (`http://host:port`): `method` on
/// `path`, with `token` as a bearer token (none: no Authorization header)
/// and an optional JSON body; returns the status and the body as JSON (a
/// string when not JSON).
pub async fn http_call(
    http: &reqwest::Client,
    base: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let method = reqwest::Method::from_bytes(method.as_bytes()).expect("an HTTP method");
    let mut request = http.request(method.clone(), format!("{base}{path}"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = tokio::time::timeout(RECV_TIMEOUT, request.send())
        .await
        .unwrap_or_else(|_| panic!("{method} {base}{path}: no answer in {RECV_TIMEOUT:?}"))
        .unwrap_or_else(|e| panic!("{method} {base}{path}: {e}"));
    let status = response.status().as_u16();
    let body = response
        .text()
        .await
        .unwrap_or_else(|e| panic!("{method} {base}{path}: reading the body: {e}"));
    let value = serde_json::from_str(&body).unwrap_or(Value::String(body));
    (status, value)
}

/// The stored events of a conversation after `after` on the server at
/// `base`, through REST (which never activates or attaches). Pages on
/// (`after` = the last seq) until `head_seq`, as a client must: a page may
/// hold fewer than `limit` events.
pub async fn stored_events_at(
    http: &reqwest::Client,
    base: &str,
    id: &str,
    user: &str,
    after: u64,
) -> Vec<Value> {
    let mut events: Vec<Value> = Vec::new();
    let mut cursor = after;
    loop {
        let path = format!("/v1/conversations/{id}/events?after={cursor}&limit=10000");
        let (status, body) = http_call(http, base, "GET", &path, Some(user), None).await;
        assert_eq!(status, 200, "GET {base}{path} as {user}: {body}");
        let page = body["events"]
            .as_array()
            .unwrap_or_else(|| panic!("GET {base}{path}: no `events` array in {body}"));
        let head = body["head_seq"].as_u64().unwrap_or(0);
        events.extend(page.iter().cloned());
        match page.last() {
            Some(last) if seq(last) < head => cursor = seq(last),
            _ => return events,
        }
    }
}

/// The terminal client (`linger ARGS --url URL --token TOKEN`), with the
/// user's own environment kept out.
pub fn linger_client(url: &str, token: &str, args: &[&str]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_linger"));
    command
        .args(args)
        .args(["--url", url, "--token", token])
        .env_remove("LINGER_URL")
        .env_remove("LINGER_TOKEN")
        .env("NO_COLOR", "1")
        .kill_on_drop(true);
    command
}

/// Runs a client command to its end: (status, stdout, stderr).
pub async fn run_client(
    url: &str,
    token: &str,
    args: &[&str],
) -> (std::process::ExitStatus, String, String) {
    let output = tokio::time::timeout(RECV_TIMEOUT, linger_client(url, token, args).output())
        .await
        .unwrap_or_else(|_| panic!("linger {args:?} did not finish in {RECV_TIMEOUT:?}"))
        .unwrap_or_else(|e| panic!("linger {args:?}: {e}"));
    (
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Protocol §11: what a compact replay up to `head` sends of `stored`
/// (every event but the `text_delta`s of the turn `finished`).
pub fn compact_of<'a>(stored: &'a [Value], head: u64, finished: &Value) -> Vec<&'a Value> {
    stored
        .iter()
        .filter(|e| seq(e) <= head)
        .filter(|e| !(kind(e) == "text_delta" && e["data"]["turn_id"] == *finished))
        .collect()
}

//! `relay`: the ceiling that `linger bench` measures linger against.
//!
//! A websocket server on the same stack as linger (tokio, axum, tungstenite)
//! that speaks just enough of protocol v1 for the load generator: `create`,
//! `attach {last_seq}`, `detach`, `message` with the demo agent's
//! `/stream N MS`, `ping`, and sequenced `event` frames with `seq` and `ts`
//! in linger's exact format. It has no actors, no store and no limits: one
//! mutex per conversation guards its in-memory log and its subscribers, and
//! an event is serialized once and handed to every subscriber's queue at
//! once. Whatever linger adds on top (actors, write-before-send, cursors,
//! supervision) is what the ratio to this relay measures.
//!
//! Run: `relay [--listen 127.0.0.1:7421]`; it prints `listening on ADDR` on
//! stderr and serves until killed. The executable is declared by the root
//! package (`src/bin/relay/main.rs`), beside `linger`, where the bench
//! looks for it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::extract::ws::{Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::Response;
use axum::routing::get;
use axum::serve::ListenerExt;
use axum::Router;
use clap::Parser;
use futures_util::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// Most unsent frames held per connection (linger's default
/// `limits.max_outbound_frames`); a connection that falls further behind is
/// dropped.
const OUTBOUND_FRAMES: usize = 10_000;
/// Most frames written with one flush.
const WRITE_BATCH: usize = 64;

/// The relay's command line.
#[derive(Parser)]
#[command(
    name = "relay",
    about = "Minimal websocket relay: the ceiling for `linger bench`"
)]
pub struct Args {
    /// Address to listen on (loopback only).
    #[arg(long, default_value = "127.0.0.1:7421")]
    pub listen: SocketAddr,
}

#[derive(Default)]
struct App {
    conversations: Mutex<HashMap<Arc<str>, Arc<Conversation>>>,
    next_id: AtomicU64,
    next_conn: AtomicU64,
}

struct Conversation {
    id: Arc<str>,
    /// The id as a JSON string, ready for frames.
    id_json: String,
    inner: Mutex<Log>,
}

#[derive(Default)]
struct Log {
    frames: Vec<Utf8Bytes>,
    subscribers: Vec<(u64, mpsc::Sender<Utf8Bytes>)>,
}

impl Conversation {
    fn new(id: Arc<str>) -> Conversation {
        Conversation {
            id_json: json!(id.as_ref()).to_string(),
            id,
            inner: Mutex::new(Log::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records one event and hands it to every subscriber; returns its seq.
    fn emit(&self, kind: &str, data: &str) -> u64 {
        let ts = humantime::format_rfc3339_millis(SystemTime::now());
        let mut log = self.lock();
        let seq = log.frames.len() as u64 + 1;
        let frame = Utf8Bytes::from(format!(
            r#"{{"type":"event","conversation_id":{},"seq":{seq},"ts":"{ts}","kind":"{kind}","data":{data}}}"#,
            self.id_json
        ));
        log.frames.push(frame.clone());
        log.subscribers
            .retain(|(_, tx)| tx.try_send(frame.clone()).is_ok());
        seq
    }

    /// Sends `attached` (unless `req` is None: the creator), the frames
    /// after `last_seq`, and subscribes, all under the lock: no gap and no
    /// duplicate between replay and live.
    fn attach(&self, conn: u64, tx: &mpsc::Sender<Utf8Bytes>, req: Option<&Value>, last_seq: u64) {
        let mut log = self.lock();
        let head = log.frames.len() as u64;
        let from = last_seq.min(head) + 1;
        if let Some(req) = req {
            let attached = json!({
                "type": "attached", "req": req, "conversation_id": self.id.as_ref(),
                "status": "idle", "mode": "control", "head_seq": head, "replay_from": from,
                "replay_incomplete": false, "pending_calls": [], "queued_messages": 0,
            });
            let _ = tx.try_send(Utf8Bytes::from(attached.to_string()));
        }
        for frame in &log.frames[(from - 1) as usize..] {
            if tx.try_send(frame.clone()).is_err() {
                return;
            }
        }
        log.subscribers.retain(|(c, _)| *c != conn);
        log.subscribers.push((conn, tx.clone()));
    }

    fn detach(&self, conn: u64) {
        self.lock().subscribers.retain(|(c, _)| *c != conn);
    }
}

#[derive(Deserialize)]
struct ClientFrame {
    #[serde(rename = "type")]
    ty: String,
    #[serde(default)]
    req: Value,
    conversation_id: Option<String>,
    last_seq: Option<u64>,
    text: Option<String>,
}

/// Serves on `args.listen` until the process is killed.
pub async fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.listen.ip().is_loopback(),
        "the relay listens on loopback only"
    );
    let app = Arc::new(App::default());
    let router = Router::new()
        .route("/v1/ws", get(upgrade))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(app);
    // linger's listen backlog, so that a reconnect storm meets the same
    // kernel queue.
    let socket = if args.listen.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(args.listen)?;
    let listener = socket.listen(8192)?;
    eprintln!("listening on {}", listener.local_addr()?);
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router).await?;
    Ok(())
}

async fn upgrade(State(app): State<Arc<App>>, ws: WebSocketUpgrade) -> Response {
    ws.read_buffer_size(4096)
        .on_upgrade(move |socket| serve(socket, app))
}

async fn serve(socket: WebSocket, app: Arc<App>) {
    let conn = app.next_conn.fetch_add(1, Ordering::Relaxed);
    let (mut sink, mut stream) = socket.split();
    let (tx, mut rx) = mpsc::channel::<Utf8Bytes>(OUTBOUND_FRAMES);
    let writer = tokio::spawn(async move {
        // What is queued goes out with one flush, as linger does.
        while let Some(frame) = rx.recv().await {
            let mut batch = vec![frame];
            while batch.len() < WRITE_BATCH {
                match rx.try_recv() {
                    Ok(frame) => batch.push(frame),
                    Err(_) => break,
                }
            }
            let mut sent = Ok(());
            for frame in batch {
                sent = sink.feed(Message::Text(frame)).await;
                if sent.is_err() {
                    break;
                }
            }
            if sent.is_err() || sink.flush().await.is_err() {
                break;
            }
        }
    });
    let mut attached: Vec<Arc<Conversation>> = Vec::new();
    while let Some(Ok(message)) = stream.next().await {
        let text = match message {
            Message::Text(text) => text,
            Message::Close(_) => break,
            _ => continue,
        };
        let frame: ClientFrame = match serde_json::from_str(text.as_str()) {
            Ok(frame) => frame,
            Err(e) => {
                reply(
                    &tx,
                    json!({"type":"error","code":"bad_request","message":e.to_string()}),
                );
                continue;
            }
        };
        handle(&app, conn, &tx, &mut attached, frame);
    }
    for conversation in attached {
        conversation.detach(conn);
    }
    drop(tx);
    let _ = writer.await;
}

fn reply(tx: &mpsc::Sender<Utf8Bytes>, frame: Value) {
    let _ = tx.try_send(Utf8Bytes::from(frame.to_string()));
}

fn handle(
    app: &Arc<App>,
    conn: u64,
    tx: &mpsc::Sender<Utf8Bytes>,
    attached: &mut Vec<Arc<Conversation>>,
    frame: ClientFrame,
) {
    let req = frame.req;
    let find = |id: &Option<String>| {
        let id = id.as_deref()?;
        let map = app.conversations.lock().unwrap_or_else(|e| e.into_inner());
        map.get(id).cloned()
    };
    match frame.ty.as_str() {
        "ping" => reply(tx, json!({"type":"pong","req":req})),
        "create" => {
            let n = app.next_id.fetch_add(1, Ordering::Relaxed);
            let id: Arc<str> = Arc::from(format!("c_relay{n:012}"));
            let conversation = Arc::new(Conversation::new(id.clone()));
            app.conversations
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id.clone(), conversation.clone());
            reply(
                tx,
                json!({"type":"created","req":req,"conversation_id":id.as_ref()}),
            );
            conversation.attach(conn, tx, None, 0);
            conversation.emit("conversation_created", r#"{"user":"relay","title":""}"#);
            conversation.emit("agent_started", r#"{"reason":"created"}"#);
            attached.push(conversation);
        }
        "attach" => match find(&frame.conversation_id) {
            Some(conversation) => {
                conversation.attach(conn, tx, Some(&req), frame.last_seq.unwrap_or(0));
                attached.retain(|c| c.id != conversation.id);
                attached.push(conversation);
            }
            None => not_found(tx, req, &frame.conversation_id),
        },
        "detach" => match find(&frame.conversation_id) {
            Some(conversation) => {
                conversation.detach(conn);
                attached.retain(|c| c.id != conversation.id);
                reply(
                    tx,
                    json!({"type":"detached","req":req,"conversation_id":conversation.id.as_ref(),"reason":"client"}),
                );
            }
            None => not_found(tx, req, &frame.conversation_id),
        },
        "message" => match find(&frame.conversation_id) {
            Some(conversation) => {
                let text = frame.text.unwrap_or_default();
                let data = json!({"text": text, "client_msg_id": null}).to_string();
                let seq = conversation.emit("user_message", &data);
                reply(
                    tx,
                    json!({"type":"ack","req":req,"conversation_id":conversation.id.as_ref(),"seq":seq,"duplicate":false}),
                );
                match parse_stream(&text) {
                    Some((count, every)) => {
                        tokio::spawn(stream_turn(conversation, seq, count, every));
                    }
                    None => {
                        let turn = format!("t_relay{seq}");
                        conversation.emit(
                            "turn_finished",
                            &json!({"turn_id":turn,"status":"failed","error":"the relay only knows /stream N MS"}).to_string(),
                        );
                    }
                }
            }
            None => not_found(tx, req, &frame.conversation_id),
        },
        other => reply(
            tx,
            json!({"type":"error","req":req,"code":"bad_request","message":format!("the relay does not speak `{other}`")}),
        ),
    }
}

fn not_found(tx: &mpsc::Sender<Utf8Bytes>, req: Value, id: &Option<String>) {
    reply(
        tx,
        json!({"type":"error","req":req,"code":"not_found","message":"no such conversation","conversation_id":id}),
    );
}

fn parse_stream(text: &str) -> Option<(u64, Duration)> {
    let mut words = text.split_whitespace();
    if words.next()? != "/stream" {
        return None;
    }
    let count = words.next()?.parse().ok()?;
    let ms = words.next()?.parse().ok()?;
    words
        .next()
        .is_none()
        .then(|| (count, Duration::from_millis(ms)))
}

/// The demo agent's `/stream N MS`: N deltas MS apart, then the whole reply
/// and `turn_finished completed`.
async fn stream_turn(
    conversation: Arc<Conversation>,
    message_seq: u64,
    count: u64,
    every: Duration,
) {
    let turn = format!("t_relay{message_seq}");
    conversation.emit(
        "turn_started",
        &json!({"turn_id":turn,"message_seq":message_seq}).to_string(),
    );
    let mut reply = String::new();
    for i in 1..=count {
        if i > 1 && !every.is_zero() {
            tokio::time::sleep(every).await;
        }
        // As fast as possible still yields to the scheduler now and then,
        // as the demo agent does on its credit semaphore.
        tokio::task::consume_budget().await;
        let token = format!("tok{i} ");
        reply.push_str(&token);
        conversation.emit(
            "text_delta",
            &json!({"turn_id":turn,"text":token}).to_string(),
        );
    }
    conversation.emit(
        "assistant_message",
        &json!({"turn_id":turn,"text":reply}).to_string(),
    );
    conversation.emit(
        "turn_finished",
        &json!({"turn_id":turn,"status":"completed"}).to_string(),
    );
}

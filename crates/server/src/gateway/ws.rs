//! `/v1/ws`: authenticates, upgrades, and serves one socket: its task reads
//! frames and hands each to the socket's [`Connection`], and a writer task
//! owns the socket's write half and drains the outbound queue.
//!
//! The upgrade gives a tokio-tungstenite stream rather than axum's socket,
//! whose messages cannot be written as fragments (see [`super::fragment`]).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::Response;
use futures_util::stream::SplitSink;
use futures_util::{SinkExt, Stream, StreamExt};
use hyper_tungstenite::HyperWebsocketStream as WebSocket;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::{self, Message, Utf8Bytes};
use tracing::{debug, warn};

use super::auth::Caller;
use super::connections::Slot;
use super::fragment::{Fragments, FRAGMENT_BYTES};
use super::rest;
use super::AppState;
use crate::actors::connection::{Connection, ConnectionArgs};
use crate::actors::outbound::{self, close_code, CloseRequest, OutboundReceiver};
use crate::metrics as m;
use crate::protocol::{ErrorCode, ServerFrame};

/// Frames read ahead while an earlier one is being handled (a `create` or
/// `attach` waits on the supervisor); beyond this many the socket is left
/// unread, and TCP holds the client back.
const READ_AHEAD_FRAMES: usize = 64;
/// How long a close frame may take to go out.
const CLOSE_PATIENCE: Duration = Duration::from_secs(2);
/// The websocket library's read buffer per connection (its default,
/// 128 KiB, is zero-filled on the first read: 128 KiB of RSS for every
/// connection, idle or not). Client frames are small (a message, an ack,
/// a ping: tens to hundreds of bytes); a larger one is read in several
/// steps, and the buffer then keeps the capacity it grew to.
const READ_BUFFER_BYTES: usize = 1024;
/// Most frames written with one flush (one system call) when several are
/// queued: a replay or a burst goes out in a few writes, not one per event.
const WRITE_BATCH: usize = 64;
/// The websocket library's write buffer: frames gather in it until it holds
/// this much, then go to the socket. A batch of small events (64 of a few
/// hundred bytes) fits, so it is still one write. The buffer keeps the
/// capacity it grew to, which messages sent in fragments bound: at most
/// this plus one fragment.
const WRITE_BUFFER_BYTES: usize = 32 * 1024;
/// How long the 4008 close of a slow consumer may take to go out: its socket
/// buffers are full, so the close frame reaches it only once it reads again.
/// Its queued frames are dropped first, so this holds only the socket.
const SLOW_CLOSE_PATIENCE: Duration = Duration::from_secs(15);

/// The protocol v1 websocket (docs/protocol.md §3, §4): JSON text frames.
#[utoipa::path(get, path = "/v1/ws", tag = "websocket",
    security(("bearer" = []), ("token_query" = [])),
    responses(
        (status = 101, description = "Switching to the websocket protocol"),
        (status = 401, description = "Missing or invalid token (before any upgrade)",
            body = super::openapi::ErrorBody),
        (status = 403, description = "A browser Origin not in server.allowed_origins",
            body = super::openapi::ErrorBody),
        (status = 426, description = "Not a websocket upgrade request",
            body = super::openapi::ErrorBody),
    ))]
pub async fn upgrade(
    State(app): State<AppState>,
    caller: Caller,
    mut request: Request,
) -> Response {
    let config = app.config.get();
    if let Some(origin) = request.headers().get(header::ORIGIN) {
        let allowed = &config.server.allowed_origins;
        let origin = origin.to_str().unwrap_or("");
        if !allowed.is_empty() && !allowed.iter().any(|a| a == origin) {
            warn!(user = %caller.user, origin, "websocket refused: Origin not in server.allowed_origins");
            return rest::error_response(
                StatusCode::FORBIDDEN,
                "forbidden",
                "this Origin may not open a websocket (server.allowed_origins)",
            );
        }
    }
    if !hyper_tungstenite::is_upgrade_request(&request) {
        return rest::error_response(
            StatusCode::UPGRADE_REQUIRED,
            "bad_request",
            "/v1/ws takes a websocket upgrade (Connection: Upgrade, Upgrade: websocket)",
        );
    }
    // The library's own limit is twice ours: a frame somewhat over the limit
    // is read whole and answered with a clean 1009 close; only a far larger
    // one is cut off mid-read.
    let hard_max = config.limits.max_frame_bytes.saturating_mul(2);
    let socket_config = WebSocketConfig::default()
        .max_message_size(Some(hard_max))
        .max_frame_size(Some(hard_max))
        .read_buffer_size(READ_BUFFER_BYTES)
        .write_buffer_size(WRITE_BUFFER_BYTES);
    let (response, upgraded) = match hyper_tungstenite::upgrade(&mut request, Some(socket_config)) {
        Ok(upgrade) => upgrade,
        Err(e) => {
            debug!(user = %caller.user, error = %e, "websocket upgrade refused");
            return rest::error_response(StatusCode::BAD_REQUEST, "bad_request", &e.to_string());
        }
    };
    let slot = app
        .connections
        .acquire(&caller.user, config.limits.max_connections_per_user);
    let sockets = app.sockets.clone();
    tokio::spawn(sockets.track_future(async move {
        // Resolves once the 101 response has gone out.
        let socket = match upgraded.await {
            Ok(socket) => socket,
            Err(e) => {
                debug!(user = %caller.user, error = %e, "websocket upgrade failed");
                return;
            }
        };
        match slot {
            Some(slot) => serve(socket, app, caller, slot).await,
            // Boxed: the task of every connection would otherwise be as
            // large as this rare path's future too.
            None => Box::pin(refuse_too_many(socket, &app)).await,
        }
    }));
    response.map(Body::new)
}

/// The user has `max_connections_per_user` sockets open: say so, then close.
async fn refuse_too_many(mut socket: WebSocket, app: &AppState) {
    let max = app.config.get().limits.max_connections_per_user;
    let frame = ServerFrame::error(
        None,
        ErrorCode::TooManyConnections,
        format!(
            "{max} connections are already open for this user (limits.max_connections_per_user)"
        ),
        None,
    );
    let _ = socket.send(Message::Text(frame.to_json().into())).await;
    let close = CloseFrame {
        code: CloseCode::from(close_code::POLICY),
        reason: "too many connections".into(),
    };
    let _ = tokio::time::timeout(CLOSE_PATIENCE, socket.send(Message::Close(Some(close)))).await;
}

/// Serves one socket; `slot` holds the user's connection slot until the
/// connection is done (not while its close frame waits to go out).
async fn serve(socket: WebSocket, app: AppState, caller: Caller, slot: Slot) {
    let id = app.next_connection.fetch_add(1, Ordering::Relaxed);
    let (sink, mut stream) = socket.split();
    // Sized once: a reload reaches connections opened after it.
    let limits = app.config.get().limits.clone();
    // Closed by the sockets' shutdown too, with no close request: the
    // writer then sends what is queued and the 1001 close.
    let (outbound, receiver) = outbound::channel_stopped_by(
        limits.max_outbound_frames,
        limits.slow_consumer_patience,
        &app.shutdown,
    );
    // Frames are handled one at a time, in order; while one is being
    // handled the socket is read ahead (`ReadAhead`), so that the client's
    // pings are answered and its close is seen.
    let mut connection = Connection::open(ConnectionArgs {
        id,
        user: Arc::from(caller.user.as_str()),
        outbound: outbound.clone(),
        supervisor: app.supervisor.clone(),
        config: app.config.clone(),
    });
    m::websocket_connections(1.0);
    let writer = tokio::spawn(write_loop(Writer::new(sink), receiver));
    let mut ahead = ReadAhead::default();
    loop {
        let next = match ahead.pop() {
            // A close asked for, or the shutdown, while they were read wins.
            Some(_) if outbound.is_closed() => break,
            Some(next) => next,
            None => tokio::select! {
                next = stream.next() => next,
                // A close, or the shutdown: then the writer sends what is
                // queued and the 1001 close.
                _ = outbound.closed() => break,
            },
        };
        let message = match next {
            Some(Ok(message)) => message,
            Some(Err(e)) => {
                if is_too_big(&e) {
                    outbound.close(close_code::TOO_BIG, "frame too big", false);
                }
                debug!(connection = id, error = %e, "socket read failed");
                break;
            }
            None => break,
        };
        // Read per frame, so that a reload reaches open connections too (up
        // to the library's cap, twice the value the socket opened with).
        let max = app.config.get().limits.max_frame_bytes;
        match message {
            Message::Text(text) if text.len() > max => {
                outbound.close(close_code::TOO_BIG, "frame too big", false);
                break;
            }
            Message::Binary(bytes) if bytes.len() > max => {
                outbound.close(close_code::TOO_BIG, "frame too big", false);
                break;
            }
            Message::Text(text) => {
                let handling = std::pin::pin!(connection.text(&text));
                ahead.while_handling(handling, &mut stream).await
            }
            Message::Binary(_) => connection.binary(),
            Message::Close(_) => break,
            // Reading never gives a raw frame; pings are answered as read.
            Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => continue,
        }
    }
    // Every conversation lets it go before the close goes out.
    drop(connection);
    // The socket is gone or closing: nothing queued can be delivered now,
    // unless the server is shutting down, when the writer sends what is
    // queued (`detached shutdown`) before its 1001 close.
    if !app.shutdown.is_cancelled() {
        outbound.close(close_code::GOING_AWAY, "connection closed", false);
    }
    drop(slot);
    // Keep reading (and discarding) until the client answers our close or
    // goes: closing a socket with unread input resets it, and the client
    // would lose the close frame and its code.
    let drain = async { while let Some(Ok(_)) = stream.next().await {} };
    let _ = tokio::join!(writer, tokio::time::timeout(CLOSE_PATIENCE, drain));
    m::websocket_connections(-1.0);
}

/// What reading the socket gave: a frame, a read error, or its end (`None`).
type Read = Option<Result<Message, tungstenite::Error>>;

/// The socket's frames read while an earlier one was being handled, in
/// order, to be handled after it.
#[derive(Default)]
struct ReadAhead {
    frames: VecDeque<Read>,
}

impl ReadAhead {
    fn pop(&mut self) -> Option<Read> {
        self.frames.pop_front()
    }

    /// Runs `handling` to its end, reading `stream` meanwhile (at most
    /// [`READ_AHEAD_FRAMES`], and nothing after its end or an error). Pings
    /// and pongs are not kept: the library answers a ping as it reads it.
    /// `handling` is pinned by the caller, so that the socket's task holds
    /// it once, not here a second time.
    async fn while_handling<F, S>(&mut self, mut handling: Pin<&mut F>, stream: &mut S)
    where
        F: Future<Output = ()>,
        S: Stream<Item = Result<Message, tungstenite::Error>> + Unpin,
    {
        loop {
            let room = self.frames.len() < READ_AHEAD_FRAMES && !self.ended();
            tokio::select! {
                biased;
                () = &mut handling => return,
                next = stream.next(), if room => match next {
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    next => self.frames.push_back(next),
                },
            }
        }
    }

    fn ended(&self) -> bool {
        matches!(self.frames.back(), Some(None | Some(Err(_))))
    }
}

/// A frame over twice `limits.max_frame_bytes`, the library's own limit.
fn is_too_big(error: &tungstenite::Error) -> bool {
    matches!(error, tungstenite::Error::Capacity(_))
}

/// The socket's write half, and what is left of a message it was part-way
/// through when a send was given up (a close or the shutdown came).
struct Writer {
    sink: SplitSink<WebSocket, Message>,
    unfinished: Option<Fragments>,
}

impl Writer {
    fn new(sink: SplitSink<WebSocket, Message>) -> Self {
        Writer {
            sink,
            unfinished: None,
        }
    }

    /// Hands `text` to the socket in frames (not flushed). A fragmented
    /// message given up part-way is kept: a frame counts as sent once the
    /// socket took it, and [`Self::finish`] sends the rest. A message of
    /// one frame given up is dropped, as the rest of a batch given up is.
    async fn feed(&mut self, text: Utf8Bytes) -> Result<(), tungstenite::Error> {
        self.finish().await?;
        if text.len() <= FRAGMENT_BYTES {
            // Nearly every frame: one frame, no bookkeeping.
            return self.sink.feed(Message::Text(text)).await;
        }
        self.unfinished = Some(Fragments::new(text));
        self.finish().await
    }

    /// Sends what is left of a message given up part-way: no other message
    /// may start before its last fragment.
    async fn finish(&mut self) -> Result<(), tungstenite::Error> {
        while let Some(fragments) = &mut self.unfinished {
            let Some((frame, end)) = fragments.next() else {
                self.unfinished = None;
                break;
            };
            self.sink.feed(Message::Frame(frame)).await?;
            fragments.sent_up_to(end);
        }
        Ok(())
    }

    /// Sends `text` and flushes.
    async fn send(&mut self, text: Utf8Bytes) -> Result<(), tungstenite::Error> {
        self.feed(text).await?;
        self.sink.flush().await
    }

    /// Sends the close frame (a control frame may go between fragments).
    async fn close(&mut self, code: u16, reason: &'static str) {
        let close = CloseFrame {
            code: CloseCode::from(code),
            reason: Utf8Bytes::from_static(reason),
        };
        let _ = self.sink.send(Message::Close(Some(close))).await;
        let _ = self.sink.close().await;
    }
}

async fn write_loop(mut writer: Writer, mut out: OutboundReceiver) {
    // Made once and polled again at each frame: a future made per frame
    // registered with its token's waiters and left them again each time.
    // The token is the connection's own, which the shutdown cancels too.
    let close = out.close.clone();
    let closed = close.cancelled();
    tokio::pin!(closed);
    let request = loop {
        tokio::select! {
            biased;
            // No close request: the server's shutdown closed the queue.
            _ = &mut closed => break Some(out.close_request().unwrap_or(CloseRequest {
                code: close_code::GOING_AWAY,
                reason: "server shutting down",
                drain: true,
            })),
            frame = out.rx.recv() => {
                let Some(frame) = frame else { break None };
                // The write first: when the socket takes it at once, as it
                // mostly does, the token is not polled a second time.
                let sent = tokio::select! {
                    biased;
                    sent = send_batch(&mut writer, frame, &mut out.rx) => sent.is_ok(),
                    _ = &mut closed => false,
                };
                if !sent && !close.is_cancelled() {
                    return;
                }
            }
        }
    };
    let Some(request) = request else {
        return;
    };
    let patience = if request.code == close_code::SLOW_CONSUMER {
        SLOW_CLOSE_PATIENCE
    } else {
        CLOSE_PATIENCE
    };
    if !request.drain {
        // Free what will never be sent before waiting on the close.
        out.rx.close();
        while out.rx.try_recv().is_ok() {}
    }
    let finish = async {
        if request.drain {
            if writer.finish().await.is_err() {
                return;
            }
            while let Ok(frame) = out.rx.try_recv() {
                if writer.send(frame).await.is_err() {
                    return;
                }
            }
        }
        writer.close(request.code, request.reason).await;
    };
    let _ = tokio::time::timeout(patience, finish).await;
}

/// Writes `first` and the frames already queued behind it (up to
/// [`WRITE_BATCH`]) with a single flush.
async fn send_batch(
    writer: &mut Writer,
    first: Utf8Bytes,
    rx: &mut tokio::sync::mpsc::Receiver<Utf8Bytes>,
) -> Result<(), tungstenite::Error> {
    writer.feed(first).await?;
    for _ in 1..WRITE_BATCH {
        match rx.try_recv() {
            Ok(frame) => writer.feed(frame).await?,
            Err(_) => break,
        }
    }
    writer.sink.flush().await
}

#[cfg(test)]
mod tests {
    use futures_util::stream;
    use tokio::sync::oneshot;

    use super::*;

    fn text(t: &'static str) -> Result<Message, tungstenite::Error> {
        Ok(Message::Text(Utf8Bytes::from_static(t)))
    }

    fn texts(ahead: &ReadAhead) -> Vec<String> {
        ahead
            .frames
            .iter()
            .map(|read| match read {
                Some(Ok(Message::Text(t))) => t.to_string(),
                Some(Ok(other)) => format!("{other:?}"),
                Some(Err(e)) => format!("error: {e}"),
                None => "end".to_owned(),
            })
            .collect()
    }

    /// Reads `socket` ahead while a frame's handling waits, until the
    /// handling is released (after everything ready has been read).
    async fn read_while_a_frame_waits<S>(socket: &mut S) -> ReadAhead
    where
        S: Stream<Item = Result<Message, tungstenite::Error>> + Unpin,
    {
        let mut ahead = ReadAhead::default();
        let (done, handled) = oneshot::channel::<()>();
        let handling = std::pin::pin!(async {
            let _ = handled.await;
        });
        let release = async {
            tokio::task::yield_now().await;
            let _ = done.send(());
        };
        tokio::join!(ahead.while_handling(handling, socket), release);
        ahead
    }

    /// While a frame is handled, what follows it is read in order (pings
    /// answered by the library, not kept), up to the socket's end.
    #[tokio::test]
    async fn frames_are_read_in_order_while_one_is_handled() {
        let mut socket = stream::iter(vec![
            text("a"),
            Ok(Message::Ping(Default::default())),
            text("b"),
        ]);
        let mut ahead = read_while_a_frame_waits(&mut socket).await;
        assert_eq!(texts(&ahead), ["a", "b", "end"]);
        assert!(ahead.pop().is_some_and(|read| read.is_some()));
    }

    /// At most `READ_AHEAD_FRAMES` are read ahead; the rest stays unread.
    #[tokio::test]
    async fn reading_ahead_stops_at_its_bound() {
        let mut socket = stream::iter((0..READ_AHEAD_FRAMES + 10).map(|_| text("x")));
        let ahead = read_while_a_frame_waits(&mut socket).await;
        assert_eq!(ahead.frames.len(), READ_AHEAD_FRAMES);
        assert_eq!(socket.count().await, 10);
    }
}

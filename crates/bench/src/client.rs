//! One generator client: a websocket speaking protocol v1, with every wait
//! bounded, and the bookkeeping every scenario shares (seq contiguity,
//! end-to-end latency from the event's own `ts`).

use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{anyhow, bail, Context};
use futures_util::{SinkExt, StreamExt};
use hdrhistogram::Histogram;
use serde::Deserialize;
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Semaphore};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Message, Utf8Bytes};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// How long one connection attempt may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Connection attempts before giving up.
const CONNECT_ATTEMPTS: usize = 3;

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

pub struct Client {
    ws: Ws,
}

/// The fields of a server frame the bench looks at.
#[derive(Deserialize, Debug)]
pub struct Frame<'a> {
    #[serde(rename = "type", borrow)]
    pub ty: Cow<'a, str>,
    pub seq: Option<u64>,
    #[serde(borrow)]
    pub ts: Option<Cow<'a, str>>,
    #[serde(borrow)]
    pub kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    pub conversation_id: Option<Cow<'a, str>>,
    pub head_seq: Option<u64>,
    pub replay_from: Option<u64>,
    /// `attached`: whether the replay is compact (protocol §11).
    pub compact: Option<bool>,
}

impl Frame<'_> {
    pub fn is_event(&self) -> bool {
        self.ty == "event"
    }

    pub fn kind_is(&self, kind: &str) -> bool {
        self.kind.as_deref() == Some(kind)
    }

    /// Microseconds from the event's `ts` to now (the wall clock of this
    /// machine, which the server shares). `ts` has millisecond resolution,
    /// so this reads up to 1 ms high.
    pub fn latency_us(&self) -> Option<u64> {
        latency_us(self.ts.as_deref()?)
    }
}

/// Microseconds from an event's `ts` (RFC 3339) to now.
pub fn latency_us(ts: &str) -> Option<u64> {
    let ts = humantime::parse_rfc3339(ts).ok()?;
    let d = SystemTime::now()
        .duration_since(ts)
        .unwrap_or(Duration::ZERO);
    Some(d.as_micros() as u64)
}

impl Client {
    /// Connects as `user` (dev auth: the token is the user name), retrying
    /// a refused or timed-out attempt a few times.
    pub async fn connect(url: &str, user: &str) -> anyhow::Result<Client> {
        let url = format!("{url}?token={user}");
        // Small buffers: the generator holds thousands of sockets, and
        // tungstenite zero-fills its whole read buffer on each read.
        let config = WebSocketConfig::default()
            .read_buffer_size(16 * 1024)
            .write_buffer_size(0);
        let mut last = None;
        for attempt in 0..CONNECT_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
            let connecting =
                tokio_tungstenite::connect_async_with_config(url.as_str(), Some(config), true);
            match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
                Ok(Ok((ws, _))) => return Ok(Client { ws }),
                Ok(Err(e)) => last = Some(anyhow!("{e}")),
                Err(_) => last = Some(anyhow!("timed out after {CONNECT_TIMEOUT:?}")),
            }
        }
        Err(last.unwrap_or_else(|| anyhow!("no attempt")))
            .with_context(|| format!("connecting {url}"))
    }

    /// Sets up one generator client: connects as `user` (at most as many
    /// at once as `connecting` allows), creates a conversation, and reports
    /// to `ready`. Returns the client, its conversation and the seq of the
    /// last event `create` brought, or none when it failed (reported).
    pub async fn set_up(
        url: &str,
        user: &str,
        connecting: &Semaphore,
        ready: &mpsc::UnboundedSender<Result<(), String>>,
    ) -> Option<(Client, String, u64)> {
        let setup = async {
            let _permit = connecting.acquire().await?;
            let mut client = Client::connect(url, user).await?;
            let (id, head) = client.create(super::SETUP_TIMEOUT).await?;
            anyhow::Ok((client, id, head))
        };
        match setup.await {
            Ok(ok) => {
                let _ = ready.send(Ok(()));
                Some(ok)
            }
            Err(e) => {
                let _ = ready.send(Err(format!("{e:#}")));
                None
            }
        }
    }

    pub async fn send(&mut self, frame: Value) -> anyhow::Result<()> {
        self.ws
            .send(Message::text(frame.to_string()))
            .await
            .context("sending a frame")
    }

    /// The next text frame, within `within`.
    pub async fn recv(&mut self, within: Duration) -> anyhow::Result<Utf8Bytes> {
        let deadline = tokio::time::Instant::now() + within;
        // Bounded: control frames in between are few.
        for _ in 0..64 {
            let next = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .map_err(|_| anyhow!("no frame within {within:?}"))?;
            match next {
                Some(Ok(Message::Text(text))) => return Ok(text),
                Some(Ok(Message::Close(close))) => bail!("closed by the server: {close:?}"),
                Some(Ok(_)) => continue,
                Some(Err(e)) => bail!("socket error: {e}"),
                None => bail!("socket closed"),
            }
        }
        bail!("64 control frames in a row")
    }

    /// `create`: returns the conversation id once `created` and the
    /// conversation's first `events` events have arrived.
    pub async fn create(&mut self, within: Duration) -> anyhow::Result<(String, u64)> {
        self.send(serde_json::json!({"type":"create","req":1}))
            .await?;
        let mut id = None;
        let mut head = 0;
        for _ in 0..16 {
            let text = self.recv(within).await?;
            let frame = parse(text.as_str())?;
            match frame.ty.as_ref() {
                "created" => id = frame.conversation_id.map(|c| c.into_owned()),
                "event" => head = frame.seq.unwrap_or(head),
                "error" => bail!("create refused: {}", text.as_str()),
                _ => {}
            }
            if let (Some(id), true) = (&id, head >= 2) {
                return Ok((id.clone(), head));
            }
        }
        bail!("no `created` and first events after create")
    }

    pub async fn message(&mut self, id: &str, text: &str) -> anyhow::Result<()> {
        self.send(serde_json::json!({
            "type": "message", "conversation_id": id, "text": text, "req": 2
        }))
        .await
    }

    pub async fn attach(&mut self, id: &str, last_seq: u64) -> anyhow::Result<()> {
        self.send(serde_json::json!({
            "type": "attach", "conversation_id": id, "last_seq": last_seq, "req": 3
        }))
        .await
    }

    /// Sends `attach` and reads until its answer, within `within`: events
    /// of an earlier attachment in between are skipped.
    pub async fn attach_answer(
        &mut self,
        id: &str,
        last_seq: u64,
        within: Duration,
    ) -> anyhow::Result<AttachAnswer> {
        self.attach(id, last_seq).await?;
        let deadline = tokio::time::Instant::now() + within;
        // Bounded: an answer comes after at most a few stray frames.
        for _ in 0..256 {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let text = self
                .recv(left)
                .await
                .with_context(|| format!("waiting {within:?} for the answer to attach"))?;
            let frame = parse(text.as_str())?;
            match frame.ty.as_ref() {
                "attached" => return Ok(AttachAnswer::Attached),
                "detached" | "error" => return Ok(AttachAnswer::Refused(text.to_string())),
                _ => {}
            }
        }
        bail!("no answer to attach among 256 frames")
    }

    /// Drops the connection without a close frame, as a lost network would
    /// (the kernel still ends the TCP connection).
    pub fn drop_abruptly(self) {
        drop(self.ws);
    }

    pub async fn close(mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(2), self.ws.close(None)).await;
    }
}

/// What an `attach` was answered with.
pub enum AttachAnswer {
    /// `attached`.
    Attached,
    /// `detached` (`moved`: attach again) or `error`: the frame.
    Refused(String),
}

pub fn parse(text: &str) -> anyhow::Result<Frame<'_>> {
    serde_json::from_str(text).with_context(|| format!("not a server frame: {text}"))
}

/// Checks one conversation's seqs as they arrive: each must be the one
/// after the last.
#[derive(Debug, Clone, Copy, Default)]
pub struct SeqCheck {
    pub last: u64,
    pub gaps: u64,
    pub duplicates: u64,
}

impl SeqCheck {
    pub fn starting_after(last: u64) -> SeqCheck {
        SeqCheck {
            last,
            ..SeqCheck::default()
        }
    }

    pub fn see(&mut self, seq: u64) {
        if seq <= self.last {
            self.duplicates += 1;
        } else {
            self.gaps += seq - self.last - 1;
            self.last = seq;
        }
    }
}

/// Latencies shared by many clients: each keeps a few locally and merges
/// them into one histogram now and then.
#[derive(Clone)]
pub struct Latencies {
    shared: Arc<Mutex<Histogram<u64>>>,
}

pub struct LocalLatencies {
    shared: Arc<Mutex<Histogram<u64>>>,
    pending: Vec<u64>,
}

impl Latencies {
    pub fn new() -> Latencies {
        Latencies {
            shared: Arc::new(Mutex::new(super::histogram())),
        }
    }

    pub fn local(&self) -> LocalLatencies {
        LocalLatencies {
            shared: self.shared.clone(),
            pending: Vec::with_capacity(64),
        }
    }

    pub fn snapshot(&self) -> Histogram<u64> {
        self.shared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// What was recorded since the last take (a window of a soak), leaving
    /// the histogram empty.
    pub fn take(&self) -> Histogram<u64> {
        let mut h = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *h, super::histogram())
    }
}

impl LocalLatencies {
    pub fn record(&mut self, us: u64) {
        self.pending.push(us.max(1));
        if self.pending.len() == self.pending.capacity() {
            self.flush();
        }
    }

    pub fn flush(&mut self) {
        let mut h = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        for us in self.pending.drain(..) {
            h.saturating_record(us);
        }
    }
}

impl Drop for LocalLatencies {
    fn drop(&mut self) {
        self.flush();
    }
}

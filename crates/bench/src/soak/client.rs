//! One soak client: its own user and conversation, asking the demo agent
//! for one paced turn after another for the whole run; dropped now and then
//! (churn) or cut off (a killed server), it reconnects and resumes with
//! its last seq, and checks every event it gets ([`StreamCheck`]). At the
//! end it attaches once more from the oldest event it kept and compares
//! them all.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch, Notify, Semaphore};
use tokio::time::Instant;

use super::check::{Seen, StreamCheck, Verdict, KEPT};
use super::sample::{Count, Shared};
use crate::client::{latency_us, Client};

/// The `req` of the client's `message` frames (its answers name it).
const MESSAGE_REQ: u64 = 7;
/// The `req` of its `attach` frames.
const ATTACH_REQ: u64 = 8;

/// The run's phases, as the clients see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Setup,
    Go,
    Stop,
}

/// Timings every client shares.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// How long a dropped client stays away.
    pub away: Duration,
    /// Seqs below the last one asked for again at each resume.
    pub overlap: u64,
    /// How long a resume may take (a restart included).
    pub resume_within: Duration,
    /// Silence after which a connection counts as gone.
    pub silent: Duration,
    /// Silence after which a client expecting a turn sends a message.
    pub kick_after: Duration,
}

pub struct Job {
    pub index: usize,
    pub url: String,
    pub user: String,
    /// The message of each turn (`/stream T MS`).
    pub text: String,
    /// How long after the start the first turn is asked for.
    pub offset: Duration,
    pub churn: Arc<Notify>,
    pub shared: Arc<Shared>,
    pub timing: Timing,
}

/// The fields of a server frame a soak client reads.
#[derive(Deserialize)]
struct Frame {
    #[serde(rename = "type")]
    ty: String,
    conversation_id: Option<String>,
    seq: Option<u64>,
    ts: Option<String>,
    kind: Option<String>,
    data: Option<Value>,
    req: Option<u64>,
    code: Option<String>,
    head_seq: Option<u64>,
    duplicate: Option<bool>,
}

/// The client's view of its conversation.
struct State {
    id: String,
    check: StreamCheck,
    /// The head at the last attach: seqs up to it are a replay.
    head: u64,
    caught_up: bool,
    /// A turn was asked for (its `user_message` seen) and has not finished.
    turn_open: bool,
    /// The `client_msg_id` of a message sent and not acked: sent again
    /// with the same id after a reconnect, so that it runs once.
    pending: Option<String>,
    sent: u64,
    resend_at: Option<Instant>,
    last_frame: Instant,
}

/// What woke the client up.
enum Wake {
    Stop,
    Churn,
    Frame(anyhow::Result<tokio_tungstenite::tungstenite::Utf8Bytes>),
    Kick,
    Resend,
}

impl Job {
    /// Sets up (connect, create), reports ready, streams from `Go` until
    /// `Stop`, checks once more and closes. Returns its error if it could
    /// not go on.
    pub async fn run(
        self,
        connecting: Arc<Semaphore>,
        ready: mpsc::UnboundedSender<Result<(), String>>,
        mut phase: watch::Receiver<Phase>,
    ) -> Result<(), String> {
        let Some((client, id, head)) =
            Client::set_up(&self.url, &self.user, &connecting, &ready).await
        else {
            return Err(format!("{}: set-up failed", self.user));
        };
        if phase.wait_for(|p| *p >= Phase::Go).await.is_err() || *phase.borrow() >= Phase::Stop {
            client.close().await;
            return Ok(());
        }
        let mut state = State {
            id,
            check: StreamCheck::starting_after(head),
            head,
            caught_up: true,
            turn_open: false,
            pending: None,
            sent: 0,
            resend_at: None,
            last_frame: Instant::now(),
        };
        self.shared.attached(self.index);
        let result = self.soak(client, &mut state, &mut phase).await;
        result.map_err(|e| {
            let e = format!("{}: {e:#}", self.user);
            self.shared.note_error(e.clone());
            e
        })
    }

    async fn soak(
        &self,
        mut client: Client,
        state: &mut State,
        phase: &mut watch::Receiver<Phase>,
    ) -> anyhow::Result<()> {
        tokio::time::sleep(self.offset).await;
        self.ask(&mut client, state).await;
        // Bounded by the stop signal, which the run sends by its deadline;
        // every wait inside is bounded too.
        loop {
            let kick = state.last_frame + self.timing.kick_after;
            let resend = state.resend_at;
            let wake = tokio::select! {
                _ = phase.wait_for(|p| *p >= Phase::Stop) => Wake::Stop,
                _ = self.churn.notified() => Wake::Churn,
                frame = client.recv(self.timing.silent) => Wake::Frame(frame),
                _ = tokio::time::sleep_until(kick) => Wake::Kick,
                _ = sleep_until_some(resend) => Wake::Resend,
            };
            match wake {
                Wake::Stop => break,
                Wake::Churn => {
                    client.drop_abruptly();
                    self.shared.counters.add(Count::Dropped, 1);
                    tokio::time::sleep(self.timing.away).await;
                    client = self.resume(state).await?;
                }
                Wake::Frame(Ok(text)) => {
                    state.last_frame = Instant::now();
                    if !self.on_frame(&mut client, state, text.as_str()).await? {
                        self.shared.counters.add(Count::Lost, 1);
                        client = self.resume(state).await?;
                    }
                }
                Wake::Frame(Err(_)) => {
                    self.shared.counters.add(Count::Lost, 1);
                    client = self.resume(state).await?;
                }
                Wake::Kick => {
                    state.last_frame = Instant::now();
                    if state.caught_up {
                        self.shared.counters.add(Count::Stalls, 1);
                        state.turn_open = false;
                        self.ask(&mut client, state).await;
                    }
                }
                Wake::Resend => {
                    state.resend_at = None;
                    if !state.turn_open {
                        self.ask(&mut client, state).await;
                    }
                }
            }
        }
        self.final_check(client, state).await
    }

    /// Asks for the next turn: the unacked message again, or a new one.
    async fn ask(&self, client: &mut Client, state: &mut State) {
        let msg_id = match &state.pending {
            Some(id) => id.clone(),
            None => {
                state.sent += 1;
                format!("{}-{}", self.user, state.sent)
            }
        };
        state.pending = Some(msg_id.clone());
        // A send that fails is a lost connection: the next read says so.
        let _ = client
            .send(json!({
                "type": "message", "conversation_id": state.id, "text": self.text,
                "client_msg_id": msg_id, "req": MESSAGE_REQ,
            }))
            .await;
    }

    /// Handles one frame; false when the conversation was detached (attach
    /// again).
    async fn on_frame(
        &self,
        client: &mut Client,
        state: &mut State,
        text: &str,
    ) -> anyhow::Result<bool> {
        let mut frame: Frame =
            serde_json::from_str(text).map_err(|e| anyhow!("not a server frame ({e}): {text}"))?;
        let counters = &self.shared.counters;
        let ty = std::mem::take(&mut frame.ty);
        match ty.as_str() {
            "event" => {
                if frame.conversation_id.as_deref() != Some(state.id.as_str()) {
                    return Ok(true);
                }
                if self.on_event(state, frame) && state.caught_up && !state.turn_open {
                    self.ask(client, state).await;
                }
            }
            "ack" if frame.req == Some(MESSAGE_REQ) => {
                state.pending = None;
                // The message had been recorded before a reconnect: if its
                // turn is over, ask for the next one.
                if frame.duplicate == Some(true) && state.caught_up && !state.turn_open {
                    self.ask(client, state).await;
                }
            }
            "error" => {
                if frame.code.as_deref() == Some("store_unavailable") {
                    counters.add(Count::StoreErrors, 1);
                } else {
                    counters.add(Count::Errors, 1);
                    self.shared.note_error(format!("{}: {text}", self.user));
                }
                // A message refused (nothing recorded): again in a second.
                if frame.req == Some(MESSAGE_REQ) {
                    state.resend_at = Some(Instant::now() + Duration::from_secs(1));
                }
            }
            "detached" => return Ok(false),
            _ => {}
        }
        Ok(true)
    }

    /// Checks and counts one event of the conversation; true when, caught
    /// up, the client may ask for a turn (one just ended, or the replay
    /// just ended with none running).
    fn on_event(&self, state: &mut State, frame: Frame) -> bool {
        let counters = &self.shared.counters;
        let Some(seq) = frame.seq else {
            return false;
        };
        let kind = frame.kind.unwrap_or_default();
        let seen = Seen {
            kind: kind.clone(),
            ts: frame.ts.unwrap_or_default(),
            data: frame.data.unwrap_or(Value::Null),
        };
        let live = seq > state.head;
        let ts = seen.ts.clone();
        match state.check.see(seq, seen) {
            Verdict::Again { same } => {
                counters.add(
                    if same {
                        Count::Rechecked
                    } else {
                        Count::Renumbered
                    },
                    1,
                );
                if !same {
                    self.shared
                        .note_error(format!("{}: seq {seq} came again changed", self.user));
                }
                return false;
            }
            Verdict::Duplicate => {
                counters.add(Count::Duplicates, 1);
                self.shared
                    .note_error(format!("{}: seq {seq} came twice", self.user));
                return false;
            }
            Verdict::New { skipped } => {
                counters.add(Count::Events, 1);
                if skipped > 0 {
                    counters.add(Count::Gaps, skipped);
                    self.shared.note_error(format!(
                        "{}: {skipped} seqs missing before {seq}",
                        self.user
                    ));
                }
            }
        }
        if live {
            if let Some(us) = latency_us(&ts) {
                self.shared.latencies.local().record(us);
            }
            self.shared
                .last_live_us
                .fetch_max(self.shared.since_start_us(), Ordering::Relaxed);
        }
        let finished = kind == "turn_finished";
        match kind.as_str() {
            "user_message" | "turn_started" => state.turn_open = true,
            "turn_finished" => {
                state.turn_open = false;
                counters.add(Count::Turns, 1);
            }
            _ => {}
        }
        if !state.caught_up && state.check.last() >= state.head {
            state.caught_up = true;
            return true;
        }
        finished
    }

    /// Connects again and attaches from a little below the last seq seen,
    /// retrying (a restarting server refuses for a while) within
    /// `resume_within`.
    async fn resume(&self, state: &mut State) -> anyhow::Result<Client> {
        let deadline = Instant::now() + self.timing.resume_within;
        let mut last_error = anyhow!("no attempt");
        // Bounded by the deadline.
        while Instant::now() < deadline {
            let mut client = match Client::connect(&self.url, &self.user).await {
                Ok(client) => client,
                Err(e) => {
                    last_error = e;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    continue;
                }
            };
            let from = state.check.resume_from(self.timing.overlap);
            match attach(&mut client, &state.id, from).await {
                Ok(head) => {
                    let behind = state.check.behind(head);
                    if behind > 0 {
                        self.shared.counters.add(Count::Behind, behind);
                        self.shared.note_error(format!(
                            "{}: head {head} below the last seq seen {}",
                            self.user,
                            state.check.last()
                        ));
                    }
                    self.shared.counters.add(Count::Resumes, 1);
                    self.shared.attached(self.index);
                    state.head = head;
                    state.caught_up = state.check.last() >= head;
                    state.last_frame = Instant::now();
                    if state.caught_up && !state.turn_open {
                        self.ask(&mut client, state).await;
                    }
                    return Ok(client);
                }
                Err(e) => {
                    last_error = e;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
        Err(last_error.context(format!(
            "could not resume within {:?}",
            self.timing.resume_within
        )))
    }

    /// Attaches once more from the oldest event kept and reads until every
    /// one of them came again and the head is reached.
    async fn final_check(&self, mut client: Client, state: &mut State) -> anyhow::Result<()> {
        let from = state.check.resume_from(KEPT as u64);
        state.head = attach(&mut client, &state.id, from).await?;
        let deadline = Instant::now() + FINAL_CHECK_WITHIN;
        // Bounded by the deadline.
        while !(state.check.rechecked_all() && state.check.last() >= state.head) {
            let left = deadline.saturating_duration_since(Instant::now());
            let text = client
                .recv(left)
                .await
                .map_err(|e| e.context("the final check did not end"))?;
            let frame: Frame = serde_json::from_str(text.as_str())
                .map_err(|e| anyhow!("not a server frame ({e})"))?;
            if frame.ty == "event" && frame.conversation_id.as_deref() == Some(state.id.as_str()) {
                self.on_event(state, frame);
            }
        }
        client.close().await;
        Ok(())
    }
}

/// How long the final check may take.
const FINAL_CHECK_WITHIN: Duration = Duration::from_secs(60);

/// Sends `attach` and returns `attached.head_seq` (a fresh connection: no
/// event comes before it).
async fn attach(client: &mut Client, id: &str, last_seq: u64) -> anyhow::Result<u64> {
    client
        .send(json!({
            "type": "attach", "conversation_id": id, "last_seq": last_seq, "req": ATTACH_REQ,
        }))
        .await?;
    let within = Duration::from_secs(15);
    // Bounded: the answer is the first frame but for a stray few.
    for _ in 0..64 {
        let text = client.recv(within).await?;
        let frame: Frame =
            serde_json::from_str(text.as_str()).map_err(|e| anyhow!("not a server frame ({e})"))?;
        match frame.ty.as_str() {
            "attached" => {
                return frame
                    .head_seq
                    .ok_or_else(|| anyhow!("attached without head_seq: {}", text.as_str()))
            }
            "error" | "detached" => bail!("attach refused: {}", text.as_str()),
            _ => {}
        }
    }
    bail!("no answer to attach among 64 frames")
}

/// Sleeps until `at`, or forever when there is none.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

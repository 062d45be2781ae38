//! One active conversation's command-agent session: the handle the
//! conversation holds ([`CommandSession`], whose methods only post to the
//! driver) and the **driver** task, the session's only state machine. The
//! driver starts the process on activation, hands it turns, tool results
//! and stops, discards it (failing its turn) when it exits, breaks the
//! protocol, stops reading or ignores a stop for [`STOP_GRACE`], starts a
//! fresh one for the next turn, and closes it when the conversation stops.
//!
//! The agent's output lines carry no turn id: they belong to the turn the
//! process was last given, until it writes `turn_finished`. That is why a
//! turn started while the previous one is still being stopped waits until
//! that stop is resolved (the agent finished it or was killed).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::line::ToAgent;
use super::process::{
    close_process, describe_exit, kill_process, Broken, Launch, LogCtx, Note, Proc,
};
use crate::agent::{AgentOutput, AgentSession, EventSink, TurnRequest};

/// How long a stopped turn may take to finish before its process is killed
/// (protocol §9).
const STOP_GRACE: Duration = Duration::from_secs(2);
/// A child that exited while something it started still holds its stdout
/// open never shows an end of file; after this long it counts as gone. Long
/// enough for the reader to finish the lines the child wrote before exiting.
const EXIT_EOF_GRACE: Duration = Duration::from_secs(5);

/// What the session asks of its driver.
enum Control {
    Turn(TurnRequest),
    ToolResult {
        call_id: String,
        output: Value,
        is_error: bool,
    },
    Stop,
    Close,
}

/// The conversation's handle. The control channel is unbounded because its
/// only sender is the conversation actor, which starts one turn at a time and
/// forwards rate-limited client frames: it cannot outrun the driver, and a
/// bounded channel would make the caller wait or drop a command.
pub(super) struct CommandSession {
    ctl: mpsc::UnboundedSender<Control>,
    events: EventSink,
    closed: bool,
}

impl CommandSession {
    /// Starts the session's driver, which starts the agent process at once.
    pub(super) fn open(launch: Launch, names: LogCtx, events: EventSink) -> Box<dyn AgentSession> {
        let (ctl, ctl_rx) = mpsc::unbounded_channel();
        let driver = Driver {
            launch,
            conversation: names.conversation,
            user: names.user,
            events: events.clone(),
            ctl: ctl_rx,
            proc: None,
            stopping: None,
            pending: None,
        };
        tokio::spawn(driver.run());
        Box::new(CommandSession {
            ctl,
            events,
            closed: false,
        })
    }
}

impl AgentSession for CommandSession {
    fn start_turn(&mut self, turn: TurnRequest) {
        let turn_id = turn.turn_id.clone();
        if self.ctl.send(Control::Turn(turn)).is_err() {
            // The driver only ends after close: say so rather than leave the
            // turn to its timeout.
            self.events.emit_now(
                &turn_id,
                AgentOutput::Finished {
                    failed: Some("the command agent session has ended".into()),
                },
            );
        }
    }

    fn tool_result(&mut self, call_id: &str, output: Value, is_error: bool) {
        let _ = self.ctl.send(Control::ToolResult {
            call_id: call_id.to_owned(),
            output,
            is_error,
        });
    }

    fn stop_turn(&mut self) {
        let _ = self.ctl.send(Control::Stop);
    }

    fn close(&mut self) {
        // The conversation may close more than once (stopping, then its
        // post_stop); the driver needs to hear it once.
        if !self.closed {
            self.closed = true;
            let _ = self.ctl.send(Control::Close);
        }
    }
}

/// Why a process is being discarded, and so what the turn it was working on
/// (if any, and not already stopped) is told.
enum Discard {
    Broken(Broken),
    /// Exited, and the end of its output did not follow (something it
    /// started holds it open), or has not yet.
    Exited,
    /// Its stdin queue is full.
    NotReading,
    /// It ignored a stop for [`STOP_GRACE`].
    StopIgnored,
}

impl Discard {
    /// The turn's error, and whether the exit status belongs in it.
    fn failure(&self) -> Option<(String, bool)> {
        match self {
            Discard::Broken(Broken::Eof) | Discard::Exited => {
                Some(("the agent process exited during the turn".into(), true))
            }
            Discard::Broken(Broken::Read(e)) => Some((
                format!("reading the agent process's output failed: {e}"),
                true,
            )),
            Discard::Broken(Broken::Invalid(e)) => {
                Some((format!("the agent wrote an invalid line: {e}"), false))
            }
            Discard::Broken(Broken::Write(e)) => Some((
                format!("the agent process stopped reading its input: {e}"),
                true,
            )),
            Discard::NotReading => {
                Some(("the agent process does not read its input".into(), false))
            }
            // The conversation has already recorded the turn as stopped.
            Discard::StopIgnored => None,
        }
    }

    fn log_reason(&self) -> String {
        match self {
            Discard::StopIgnored => format!(
                "the agent did not finish a stopped turn within {}",
                humantime::format_duration(STOP_GRACE)
            ),
            Discard::Broken(Broken::Eof) => "its output ended".into(),
            other => other
                .failure()
                .map(|(why, _)| why)
                .unwrap_or_else(|| "discarded".into()),
        }
    }
}

/// A stop sent to the agent and not yet resolved.
struct Stopping {
    turn_id: Arc<str>,
    deadline: Instant,
}

/// What wakes the driver.
enum Wake {
    Control(Control),
    Note(Note),
    Exited(io::Result<std::process::ExitStatus>),
    StopDeadline,
    ExitDeadline,
}

/// The session's state machine, run as one task; see the module doc.
struct Driver {
    launch: Launch,
    conversation: String,
    user: String,
    events: EventSink,
    ctl: mpsc::UnboundedReceiver<Control>,
    proc: Option<Proc>,
    stopping: Option<Stopping>,
    /// A turn that waits for `stopping` to resolve.
    pending: Option<TurnRequest>,
}

impl Driver {
    async fn run(mut self) {
        // Started on activation (§9), so the agent can get ready before the
        // first message; a failure here is retried, and reported, by the
        // first turn.
        if let Err(e) = self.spawn_process().await {
            warn!(conversation = %self.conversation, user = %self.user, error = %e,
                program = %self.launch.argv[0], "could not start the agent process");
        }
        loop {
            match self.next_wake().await {
                Wake::Control(Control::Close) => break,
                Wake::Control(Control::Turn(turn)) => self.begin_turn(turn).await,
                Wake::Control(Control::ToolResult {
                    call_id,
                    output,
                    is_error,
                }) => self.tool_result(call_id, output, is_error),
                Wake::Control(Control::Stop) => self.stop(),
                Wake::Note(Note::TurnEnded(turn_id)) => {
                    if self.stopping.as_ref().is_some_and(|s| s.turn_id == turn_id) {
                        debug!(conversation = %self.conversation, turn = %turn_id,
                            "the agent finished the stopped turn");
                        self.stopping = None;
                    }
                }
                Wake::Note(Note::Broken(broken)) => self.discard(Discard::Broken(broken)),
                Wake::Exited(status) => {
                    if let Some(p) = self.proc.as_mut() {
                        let status = describe_exit(&status);
                        info!(conversation = %self.conversation, user = %self.user,
                            pid = p.pid, status = %status, "agent process exited");
                        p.exited = Some(status);
                        p.exit_deadline = Some(Instant::now() + EXIT_EOF_GRACE);
                    }
                }
                Wake::StopDeadline => self.discard(Discard::StopIgnored),
                Wake::ExitDeadline => self.discard(Discard::Exited),
            }
            if self.stopping.is_none() {
                if let Some(turn) = self.pending.take() {
                    self.begin_turn(turn).await;
                }
            }
        }
        if let Some(p) = self.proc.take() {
            let log = self.log_ctx();
            tokio::spawn(close_process(p, log));
        }
    }

    async fn next_wake(&mut self) -> Wake {
        let stop_deadline = self.stopping.as_ref().map(|s| s.deadline);
        let Some(p) = self.proc.as_mut() else {
            return Wake::Control(self.ctl.recv().await.unwrap_or(Control::Close));
        };
        let running = p.exited.is_none();
        let exit_deadline = p.exit_deadline;
        tokio::select! {
            // A dropped session is a close.
            control = self.ctl.recv() => Wake::Control(control.unwrap_or(Control::Close)),
            Some(note) = p.notes.recv() => Wake::Note(note),
            status = p.child.wait(), if running => Wake::Exited(status),
            _ = sleep_until(stop_deadline) => Wake::StopDeadline,
            _ = sleep_until(exit_deadline) => Wake::ExitDeadline,
        }
    }

    fn log_ctx(&self) -> LogCtx {
        LogCtx {
            conversation: self.conversation.clone(),
            user: self.user.clone(),
        }
    }

    async fn begin_turn(&mut self, turn: TurnRequest) {
        if self.stopping.is_some() {
            self.pending = Some(turn);
            return;
        }
        if let Some(old) = self.proc.as_ref().and_then(|p| p.turn.get()) {
            // The conversation stops a turn before it starts the next one;
            // should it not, the agent's output would be ambiguous, so stop
            // the old turn first.
            warn!(conversation = %self.conversation, turn = %old,
                "a turn started while the agent still runs the previous one; stopping that");
            self.pending = Some(turn);
            self.send_stop(old);
            return;
        }
        if let Some(p) = self.proc.as_mut().filter(|p| p.exited.is_none()) {
            // Reaping here is fine (the Child keeps the status); it narrows
            // the window in which a turn goes to a process that is exiting.
            if let Ok(Some(status)) = p.child.try_wait() {
                p.exited = Some(status.to_string());
            }
        }
        if self.proc.as_ref().is_some_and(|p| p.exited.is_some()) {
            // Exited between turns and its end of file is not in yet.
            self.discard(Discard::Exited);
        }
        if self.proc.is_none() {
            if let Err(e) = self.spawn_process().await {
                warn!(conversation = %self.conversation, user = %self.user, error = %e,
                    program = %self.launch.argv[0], "could not start the agent process");
                self.events.emit_now(
                    &turn.turn_id,
                    AgentOutput::Finished {
                        failed: Some(format!(
                            "could not start the agent process ({}): {e}",
                            self.launch.argv[0]
                        )),
                    },
                );
                return;
            }
        }
        if let Some(p) = self.proc.as_ref() {
            p.turn.set(turn.turn_id.clone());
        }
        self.write(ToAgent::Turn {
            turn_id: &turn.turn_id,
            text: &turn.text,
            resumed: turn.resumed,
        });
    }

    fn tool_result(&mut self, call_id: String, output: Value, is_error: bool) {
        // Only the current turn's calls are answered; a stopped turn's
        // answers would reach a turn the agent is told to drop.
        let current = self.proc.as_ref().is_some_and(|p| p.turn.get().is_some());
        if self.stopping.is_none() && current {
            self.write(ToAgent::ToolResult {
                call_id: &call_id,
                output: &output,
                is_error,
            });
        }
    }

    fn stop(&mut self) {
        if self.pending.take().is_some() {
            // That turn waited for an earlier stop and never reached the
            // agent: dropping it is all there is to do.
            return;
        }
        if self.stopping.is_some() {
            return;
        }
        if let Some(turn) = self.proc.as_ref().and_then(|p| p.turn.get()) {
            self.send_stop(turn);
        }
    }

    fn send_stop(&mut self, turn_id: Arc<str>) {
        self.write(ToAgent::Stop { turn_id: &turn_id });
        if self.proc.is_some() {
            self.stopping = Some(Stopping {
                turn_id,
                deadline: Instant::now() + STOP_GRACE,
            });
        }
    }

    /// Queues one line for the writer, never waiting: an agent that lets
    /// its input pile up is treated as broken.
    fn write(&mut self, frame: ToAgent) {
        let Some(p) = self.proc.as_ref() else {
            return;
        };
        match p.stdin.try_send(frame.to_line()) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => self.discard(Discard::NotReading),
            // The writer ended on an error it reports as a note, which
            // discards the process.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// Gives up on the current process: fails the turn it was working on
    /// (unless that turn is the one being stopped) and kills and reaps it in
    /// a task of its own. The next turn starts a fresh process.
    fn discard(&mut self, why: Discard) {
        let Some(p) = self.proc.take() else {
            return;
        };
        let stopped = self.stopping.take().map(|s| s.turn_id);
        let turn = p.turn.take();
        info!(conversation = %self.conversation, user = %self.user, pid = p.pid,
            turn = turn.as_deref().unwrap_or(""), reason = %why.log_reason(),
            "discarding the agent process; the next turn starts a new one");
        let failure = match (turn, why.failure()) {
            (Some(turn), Some((error, with_status))) if stopped.as_ref() != Some(&turn) => {
                Some((turn, error, with_status))
            }
            _ => None,
        };
        // Its output is stale from now on.
        p.cancel.cancel();
        tokio::spawn(kill_process(
            p,
            failure,
            self.events.clone(),
            self.log_ctx(),
        ));
    }

    async fn spawn_process(&mut self) -> io::Result<()> {
        self.proc = Some(Proc::spawn(&self.launch, &self.log_ctx(), &self.events).await?);
        Ok(())
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

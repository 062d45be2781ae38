//! The command agent of protocol §9: every active conversation runs one
//! child process that speaks JSON lines on stdin and stdout.
//!
//! What this module owns, per session (one active conversation):
//! - a **driver** task, the session's only state machine: it starts the child
//!   on activation, hands it turns, tool results and stops, kills it when a
//!   stop is ignored or the child breaks the protocol, and starts a fresh one
//!   for the next turn. The session's methods only post to it, so the
//!   conversation actor never waits on a process.
//! - per child process: the child itself, in a process group of its own so
//!   that a kill reaches whatever it started; a **writer** task owning its
//!   stdin; a **stdout reader** task that parses each line
//!   ([`parse_agent_line`]) and reports it through the [`EventSink`]; a
//!   **stderr** task that logs each line (and keeps the last one, which the
//!   error of a turn whose agent died quotes).
//! - the end of every child: each is reaped (`wait`) by the task that ends
//!   it, so none is left as a zombie, and its whole group is killed, so none
//!   of its helpers outlives it; a guard kills the group even if that task
//!   is dropped. [`CommandAgent::processes_ended`] tells when all are gone.
//!
//! The agent's output lines carry no turn id: they belong to the turn the
//! process was last given, until it writes `turn_finished`. That is why a
//! turn started while the previous one is still being stopped waits until
//! that stop is resolved (the agent finished it or was killed).

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde_json::{json, Map, Value};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};
use tokio::sync::{mpsc, Notify};
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{Agent, AgentOutput, AgentSession, EventSink, SessionContext};

/// The longest line an agent may write on stdout. A longer one fails the
/// turn: the reader never holds more than this much of one line.
pub const MAX_LINE_BYTES: usize = 1024 * 1024;

/// How long a stopped turn may take to finish before its process is killed
/// (protocol §9).
const STOP_GRACE: Duration = Duration::from_secs(2);
/// Closing: how long the agent has to exit once its stdin is closed, then
/// once it was sent SIGTERM.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
const TERM_GRACE: Duration = Duration::from_secs(2);
/// A child that exited while something it started still holds its stdout
/// open never shows an end of file; after this long it counts as gone. Long
/// enough for the reader to finish the lines the child wrote before exiting.
const EXIT_EOF_GRACE: Duration = Duration::from_secs(5);
/// Lines waiting for the writer. A handful per turn is normal; a full queue
/// means the agent does not read its input, which fails the turn.
const STDIN_QUEUE: usize = 16;
/// Stderr lines longer than this are logged in pieces.
const MAX_STDERR_LINE: usize = 16 * 1024;
/// How much of an agent's text an error message quotes.
const QUOTE_CHARS: usize = 64;
/// How much of its last stderr line the error of a dead agent's turn quotes.
const STDERR_QUOTE_CHARS: usize = 300;
/// How long the end of a process waits for its stderr to be read.
const STDERR_DRAIN: Duration = Duration::from_millis(500);

/// Runs each conversation's agent as a child process (`agent.command`).
pub struct CommandAgent {
    argv: Arc<Vec<String>>,
    /// Variables of linger's environment its agents do not inherit.
    hidden_env: Arc<Vec<OsString>>,
    live: Live,
}

/// Counts the processes of all sessions that have not ended yet (running,
/// or being closed or killed), so that a shutdown can wait for them.
#[derive(Clone, Default)]
struct Live(Arc<LiveInner>);

#[derive(Default)]
struct LiveInner {
    count: AtomicUsize,
    ended: Notify,
}

/// One counted process; dropped once it has ended and been reaped.
struct LiveToken(Arc<LiveInner>);

impl Live {
    fn token(&self) -> LiveToken {
        self.0.count.fetch_add(1, Ordering::SeqCst);
        LiveToken(self.0.clone())
    }
}

impl Drop for LiveToken {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.ended.notify_waiters();
        }
    }
}

/// SIGKILLs a process group when dropped while armed: if a task that owns
/// a child is dropped before it reaped it (the runtime shutting down), the
/// child and whatever it started still go. `kill_on_drop` alone would only
/// reach the child.
struct GroupGuard {
    pgid: u32,
    armed: bool,
}

impl GroupGuard {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if self.armed {
            signal_group(self.pgid, Signal::SIGKILL);
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("agent.command must name a program")]
pub struct EmptyCommand;

impl CommandAgent {
    /// `argv` as configured. Agents run in their conversation's workspace,
    /// so a relative path in `argv` that names an existing file from
    /// linger's own working directory (`["python3", "agents/mine.py"]`) is
    /// made absolute here; other arguments are passed as they are.
    /// linger's configuration overrides (`LINGER__*`) are not passed on.
    pub fn new(argv: Vec<String>) -> Result<CommandAgent, EmptyCommand> {
        if argv.first().is_none_or(|program| program.is_empty()) {
            return Err(EmptyCommand);
        }
        let argv = match std::env::current_dir() {
            Ok(base) => resolve_paths(argv, &base),
            Err(_) => argv,
        };
        let hidden_env = std::env::vars_os()
            .map(|(name, _)| name)
            .filter(|name| name.to_string_lossy().starts_with("LINGER__"))
            .collect();
        Ok(CommandAgent {
            argv: Arc::new(argv),
            hidden_env: Arc::new(hidden_env),
            live: Live::default(),
        })
    }

    /// Resolves once every process this agent started has ended and been
    /// reaped, including those still being closed (which takes up to
    /// [`CLOSE_GRACE`] plus [`TERM_GRACE`] after their conversation stopped).
    /// For a graceful shutdown: after every conversation has stopped, wait
    /// for this (bounded) before the runtime goes away.
    pub fn processes_ended(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let live = self.live.0.clone();
        async move {
            loop {
                let ended = live.ended.notified();
                tokio::pin!(ended);
                // Registered before the check, so a last drop in between
                // still wakes this.
                ended.as_mut().enable();
                if live.count.load(Ordering::SeqCst) == 0 {
                    return;
                }
                ended.await;
            }
        }
    }

    /// Keeps one more variable from the agents, such as the one holding
    /// the JWT secret (`auth.jwt_secret_env`).
    pub fn hide_env(mut self, name: &str) -> CommandAgent {
        Arc::make_mut(&mut self.hidden_env).push(OsString::from(name));
        self
    }
}

/// Makes absolute each relative argument that contains a `/` and names an
/// existing path under `base`.
fn resolve_paths(argv: Vec<String>, base: &Path) -> Vec<String> {
    argv.into_iter()
        .map(|arg| {
            let path = Path::new(&arg);
            if !arg.contains('/') || path.is_absolute() {
                return arg;
            }
            let full = base.join(path);
            match full.to_str() {
                Some(full_str) if full.exists() => full_str.to_owned(),
                _ => arg,
            }
        })
        .collect()
}

impl Agent for CommandAgent {
    fn drained(&self) -> futures_util::future::BoxFuture<'static, ()> {
        Box::pin(self.processes_ended())
    }

    fn open(&self, ctx: SessionContext) -> Box<dyn AgentSession> {
        let (ctl, ctl_rx) = mpsc::unbounded_channel();
        let events = ctx.events.clone();
        let driver = Driver {
            argv: self.argv.clone(),
            hidden_env: self.hidden_env.clone(),
            live: self.live.clone(),
            conversation: ctx.conversation_id,
            user: ctx.user,
            workspace: ctx.workspace,
            events: ctx.events,
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

/// What the session asks of its driver.
enum Control {
    Turn {
        turn_id: Arc<str>,
        text: String,
    },
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
struct CommandSession {
    ctl: mpsc::UnboundedSender<Control>,
    events: EventSink,
    closed: bool,
}

impl AgentSession for CommandSession {
    fn start_turn(&mut self, turn_id: Arc<str>, text: String) {
        let turn = Control::Turn {
            turn_id: turn_id.clone(),
            text,
        };
        if self.ctl.send(turn).is_err() {
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

/// The turn a process is working on: set by the driver when it hands the
/// process a turn, taken by the stdout reader when the agent finishes it.
/// Shared because the reader tags and emits output without a round trip
/// through the driver.
#[derive(Clone, Default)]
struct TurnSlot(Arc<Mutex<Option<Arc<str>>>>);

impl TurnSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Arc<str>>> {
        // Nothing panics while holding this lock; a poisoned one still holds
        // a valid value.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn get(&self) -> Option<Arc<str>> {
        self.lock().clone()
    }
    fn set(&self, turn: Arc<str>) {
        *self.lock() = Some(turn);
    }
    fn take(&self) -> Option<Arc<str>> {
        self.lock().take()
    }
}

/// What the I/O tasks of a process tell the driver.
enum Note {
    /// The agent wrote `turn_finished` for this turn.
    TurnEnded(Arc<str>),
    /// The process can no longer be used.
    Broken(Broken),
}

enum Broken {
    Eof,
    Read(io::Error),
    Invalid(LineError),
    Write(io::Error),
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

/// One live child process and the ends of its I/O tasks.
struct Proc {
    child: Child,
    /// Also its process group id (`process_group(0)`).
    pid: u32,
    stdin: mpsc::Sender<Vec<u8>>,
    turn: TurnSlot,
    notes: mpsc::UnboundedReceiver<Note>,
    /// Set once the driver has seen it exit (and reaped it).
    exited: Option<String>,
    exit_deadline: Option<Instant>,
    /// Ends the stdout reader: cancelled when the process is discarded, as
    /// its output is stale from then on.
    cancel: CancellationToken,
    /// The stderr task, which ends at the end of file once the whole group
    /// is gone; cancelled after a grace in case something the agent started
    /// elsewhere still holds the pipe.
    stderr: StderrTask,
    /// Armed until the process is reaped.
    group: GroupGuard,
    /// Held until the process is reaped.
    _live: LiveToken,
}

/// The stderr logger of one process, and the last line it logged: the best
/// clue to why an agent died, so a failed turn quotes it.
struct StderrTask {
    done: tokio::task::JoinHandle<()>,
    cancel: CancellationToken,
    last_line: Arc<Mutex<String>>,
}

impl StderrTask {
    /// Waits (briefly) for the logger to read what the dead process wrote,
    /// then returns its last line.
    async fn finish(self) -> String {
        let _ = timeout(STDERR_DRAIN, self.done).await;
        self.cancel.cancel();
        let last = self.last_line.lock().unwrap_or_else(|e| e.into_inner());
        last.clone()
    }
}

/// A stop sent to the agent and not yet resolved.
struct Stopping {
    turn_id: Arc<str>,
    deadline: Instant,
}

enum Wake {
    Control(Control),
    Note(Note),
    Exited(io::Result<std::process::ExitStatus>),
    StopDeadline,
    ExitDeadline,
}

/// Names for logs, cloned into the tasks that end a process.
#[derive(Clone)]
struct LogCtx {
    conversation: String,
    user: String,
}

struct Driver {
    argv: Arc<Vec<String>>,
    hidden_env: Arc<Vec<OsString>>,
    live: Live,
    conversation: String,
    user: String,
    workspace: PathBuf,
    events: EventSink,
    ctl: mpsc::UnboundedReceiver<Control>,
    proc: Option<Proc>,
    stopping: Option<Stopping>,
    /// A turn that waits for `stopping` to resolve.
    pending: Option<(Arc<str>, String)>,
}

impl Driver {
    async fn run(mut self) {
        // Started on activation (§9), so the agent can get ready before the
        // first message; a failure here is retried, and reported, by the
        // first turn.
        if let Err(e) = self.spawn_process().await {
            warn!(conversation = %self.conversation, user = %self.user, error = %e,
                program = %self.argv[0], "could not start the agent process");
        }
        loop {
            match self.next_wake().await {
                Wake::Control(Control::Close) => break,
                Wake::Control(Control::Turn { turn_id, text }) => {
                    self.begin_turn(turn_id, text).await
                }
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
                if let Some((turn_id, text)) = self.pending.take() {
                    self.begin_turn(turn_id, text).await;
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

    async fn begin_turn(&mut self, turn_id: Arc<str>, text: String) {
        if self.stopping.is_some() {
            self.pending = Some((turn_id, text));
            return;
        }
        if let Some(old) = self.proc.as_ref().and_then(|p| p.turn.get()) {
            // The conversation stops a turn before it starts the next one;
            // should it not, the agent's output would be ambiguous, so stop
            // the old turn first.
            warn!(conversation = %self.conversation, turn = %old,
                "a turn started while the agent still runs the previous one; stopping that");
            self.pending = Some((turn_id, text));
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
                    program = %self.argv[0], "could not start the agent process");
                self.events.emit_now(
                    &turn_id,
                    AgentOutput::Finished {
                        failed: Some(format!(
                            "could not start the agent process ({}): {e}",
                            self.argv[0]
                        )),
                    },
                );
                return;
            }
        }
        if let Some(p) = self.proc.as_ref() {
            p.turn.set(turn_id.clone());
        }
        self.write(&json!({"type": "turn", "turn_id": &*turn_id, "text": text}));
    }

    fn tool_result(&mut self, call_id: String, output: Value, is_error: bool) {
        // Only the current turn's calls are answered; a stopped turn's
        // answers would reach a turn the agent is told to drop.
        let current = self.proc.as_ref().is_some_and(|p| p.turn.get().is_some());
        if self.stopping.is_none() && current {
            self.write(&json!({
                "type": "tool_result",
                "call_id": call_id,
                "output": output,
                "is_error": is_error,
            }));
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
        self.write(&json!({"type": "stop", "turn_id": &*turn_id}));
        if self.proc.is_some() {
            self.stopping = Some(Stopping {
                turn_id,
                deadline: Instant::now() + STOP_GRACE,
            });
        }
    }

    /// Queues one line for the writer, never waiting: an agent that lets
    /// its input pile up is treated as broken.
    fn write(&mut self, message: &Value) {
        let Some(p) = self.proc.as_ref() else {
            return;
        };
        let mut line = message.to_string().into_bytes();
        line.push(b'\n');
        match p.stdin.try_send(line) {
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
        tokio::fs::create_dir_all(&self.workspace).await?;
        let mut command = Command::new(&self.argv[0]);
        command
            .args(&self.argv[1..])
            .current_dir(&self.workspace)
            .env("LINGER_CONVERSATION_ID", &self.conversation)
            .env("LINGER_USER", &self.user)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own group: a kill reaches what it started, and a Ctrl-C
            // at the server's terminal does not reach it.
            .process_group(0)
            // The last resort if a task holding it is dropped.
            .kill_on_drop(true);
        for name in self.hidden_env.iter() {
            command.env_remove(name);
        }
        let mut child = command.spawn()?;
        let pid = child
            .id()
            .ok_or_else(|| io::Error::other("the process has no pid"))?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(io::Error::other("the process has no pipes"));
        };
        let turn = TurnSlot::default();
        let cancel = CancellationToken::new();
        let (notes_tx, notes) = mpsc::unbounded_channel();
        let (stdin_tx, stdin_rx) = mpsc::channel(STDIN_QUEUE);
        tokio::spawn(write_stdin(stdin, stdin_rx, notes_tx.clone()));
        tokio::spawn(read_stdout(
            stdout,
            turn.clone(),
            self.events.clone(),
            notes_tx,
            cancel.clone(),
            self.log_ctx(),
        ));
        let last_line = Arc::new(Mutex::new(String::new()));
        let stderr_cancel = CancellationToken::new();
        let stderr = StderrTask {
            done: tokio::spawn(log_stderr(
                stderr,
                self.log_ctx(),
                pid,
                last_line.clone(),
                stderr_cancel.clone(),
            )),
            cancel: stderr_cancel,
            last_line,
        };
        info!(conversation = %self.conversation, user = %self.user, pid,
            command = ?self.argv, workspace = %self.workspace.display(),
            "agent process started");
        self.proc = Some(Proc {
            child,
            pid,
            stdin: stdin_tx,
            turn,
            notes,
            exited: None,
            exit_deadline: None,
            cancel,
            stderr,
            group: GroupGuard {
                pgid: pid,
                armed: true,
            },
            _live: self.live.token(),
        });
        Ok(())
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

fn describe_exit(status: &io::Result<std::process::ExitStatus>) -> String {
    match status {
        Ok(status) => status.to_string(),
        Err(e) => format!("exit status unknown: {e}"),
    }
}

/// Signals a child's whole process group. Groups 0 and 1 are never
/// signalled: `killpg(0)` would hit linger's own group.
///
/// Called before the child is reaped, its group id cannot have been reused.
/// Called after (to kill what a child that exited left behind), the id stays
/// reserved as long as any member of the group lives; with none left the
/// call finds nothing, unless in the instant since the reap a new process
/// got the same number and made itself a group leader, which pids handed
/// out in sequence make practically impossible.
fn signal_group(pgid: u32, signal: Signal) {
    let Ok(raw) = i32::try_from(pgid) else {
        return;
    };
    if raw <= 1 {
        return;
    }
    match killpg(Pid::from_raw(raw), signal) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(e) => {
            warn!(pgid, signal = %signal, error = %e, "signalling the agent process group failed")
        }
    }
}

/// Kills a discarded process's group, reaps it, then fails the turn it was
/// working on, with its exit status when that explains the failure.
async fn kill_process(
    p: Proc,
    failure: Option<(Arc<str>, String, bool)>,
    events: EventSink,
    log: LogCtx,
) {
    let Proc {
        mut child,
        pid,
        stdin,
        stderr,
        group,
        ..
    } = p;
    signal_group(pid, Signal::SIGKILL);
    drop(stdin);
    let status = describe_exit(&child.wait().await);
    group.disarm();
    let last_words = stderr.finish().await;
    info!(conversation = %log.conversation, user = %log.user, pid, status = %status,
        "agent process ended");
    if let Some((turn, error, with_status)) = failure {
        let error = match (with_status, last_words.is_empty()) {
            (false, _) => error,
            (true, true) => format!("{error} ({status})"),
            (true, false) => format!("{error} ({status}); its last stderr line: {last_words}"),
        };
        // The final report of a turn never waits for a credit.
        events.emit_now(
            &turn,
            AgentOutput::Finished {
                failed: Some(error),
            },
        );
    }
}

/// Ends a process when its conversation stops (§9): close stdin, then
/// SIGTERM, then SIGKILL, each after a grace; always reaped.
async fn close_process(p: Proc, log: LogCtx) {
    let Proc {
        mut child,
        pid,
        stdin,
        exited,
        cancel,
        stderr,
        group,
        ..
    } = p;
    // The writer sends what is queued, then drops stdin: end of input.
    drop(stdin);
    let mut how = "exited";
    if exited.is_none() && timeout(CLOSE_GRACE, child.wait()).await.is_err() {
        how = "terminated";
        signal_group(pid, Signal::SIGTERM);
        if timeout(TERM_GRACE, child.wait()).await.is_err() {
            how = "killed";
            signal_group(pid, Signal::SIGKILL);
        }
    }
    let status = describe_exit(&child.wait().await);
    // Whatever it started in its group goes with it.
    signal_group(pid, Signal::SIGKILL);
    group.disarm();
    cancel.cancel();
    stderr.finish().await;
    info!(conversation = %log.conversation, user = %log.user, pid, status = %status, how,
        "agent process closed");
}

/// Owns the child's stdin: writes each queued line. Dropping the queue's
/// sender closes stdin once what is queued is written.
async fn write_stdin(
    mut stdin: ChildStdin,
    mut lines: mpsc::Receiver<Vec<u8>>,
    notes: mpsc::UnboundedSender<Note>,
) {
    while let Some(line) = lines.recv().await {
        let written = async {
            stdin.write_all(&line).await?;
            stdin.flush().await
        }
        .await;
        if let Err(e) = written {
            let _ = notes.send(Note::Broken(Broken::Write(e)));
            return;
        }
    }
}

/// Reads the child's stdout line by line and reports each line for the turn
/// the process is working on. Awaiting each emit's credit is the
/// backpressure: a flooding agent blocks in its pipe.
async fn read_stdout(
    stdout: ChildStdout,
    turn: TurnSlot,
    events: EventSink,
    notes: mpsc::UnboundedSender<Note>,
    cancel: CancellationToken,
    log: LogCtx,
) {
    let mut reader = BufReader::new(stdout);
    let broken = tokio::select! {
        broken = read_lines(&mut reader, &turn, &events, &notes, &log) => broken,
        _ = cancel.cancelled() => None,
    };
    if let Some(broken) = broken {
        let _ = notes.send(Note::Broken(broken));
    }
}

/// Returns why the process is no longer usable, or None when the
/// conversation is gone.
async fn read_lines(
    reader: &mut BufReader<ChildStdout>,
    turn: &TurnSlot,
    events: &EventSink,
    notes: &mpsc::UnboundedSender<Note>,
    log: &LogCtx,
) -> Option<Broken> {
    let mut buf = Vec::new();
    let mut outside_turn: u64 = 0;
    loop {
        buf.clear();
        match read_bounded_line(reader, &mut buf, MAX_LINE_BYTES).await {
            Ok(LineRead::Line) => {}
            Ok(LineRead::Eof) => return Some(Broken::Eof),
            Ok(LineRead::TooLong) => {
                return Some(Broken::Invalid(LineError::TooLong {
                    limit: MAX_LINE_BYTES,
                }))
            }
            Err(e) => return Some(Broken::Read(e)),
        }
        if buf.capacity() > 64 * 1024 {
            // One huge line should not pin its buffer for the process's life.
            buf.shrink_to(64 * 1024);
        }
        let Ok(line) = std::str::from_utf8(&buf) else {
            return Some(Broken::Invalid(LineError::NotUtf8));
        };
        // Blank lines (a stray print()) carry nothing and break nothing.
        if line.trim().is_empty() {
            continue;
        }
        let output = match parse_agent_line(line) {
            Ok(output) => output,
            Err(e) => return Some(Broken::Invalid(e)),
        };
        let finished = matches!(output, AgentOutput::Finished { .. });
        // Taken before the final emit: once the conversation has that event
        // it may start the next turn, which must find the process free.
        let current = if finished { turn.take() } else { turn.get() };
        let Some(turn_id) = current else {
            outside_turn += 1;
            if outside_turn == 1 {
                warn!(conversation = %log.conversation, user = %log.user,
                    "the agent wrote output outside a turn; ignored");
            }
            continue;
        };
        if !events.emit(&turn_id, output).await {
            return None;
        }
        if finished {
            let _ = notes.send(Note::TurnEnded(turn_id));
        }
    }
}

enum LineRead {
    Line,
    Eof,
    TooLong,
}

/// Reads one line into `buf` (newline and all), never more than `max` bytes
/// of content: past that it stops and reports `TooLong`.
async fn read_bounded_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<LineRead> {
    let limit = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
    let n = (&mut *reader).take(limit).read_until(b'\n', buf).await?;
    if n == 0 {
        Ok(LineRead::Eof)
    } else if buf.last() != Some(&b'\n') && buf.len() > max {
        Ok(LineRead::TooLong)
    } else {
        // Either a whole line, or the last one without its newline.
        Ok(LineRead::Line)
    }
}

/// Logs the child's stderr line by line (§9: stderr goes to the log), and
/// keeps the last non-blank one.
async fn log_stderr(
    stderr: ChildStderr,
    log: LogCtx,
    pid: u32,
    last_line: Arc<Mutex<String>>,
    cancel: CancellationToken,
) {
    let mut reader = BufReader::new(stderr);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let mut limited = (&mut reader).take(MAX_STDERR_LINE as u64);
        let read = tokio::select! {
            read = limited.read_until(b'\n', &mut buf) => read,
            _ = cancel.cancelled() => return,
        };
        match read {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&buf);
        let text = text.trim_end();
        info!(conversation = %log.conversation, user = %log.user, pid,
            "agent stderr: {text}");
        if !text.trim().is_empty() {
            let mut last = last_line.lock().unwrap_or_else(|e| e.into_inner());
            *last = quote_n(text.trim(), STDERR_QUOTE_CHARS);
        }
    }
}

/// Why a line from the agent is not valid (§9). Any of these fails the turn.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    #[error("the line is longer than {limit} bytes")]
    TooLong { limit: usize },
    #[error("the line is not UTF-8")]
    NotUtf8,
    #[error("not JSON ({0})")]
    NotJson(String),
    #[error("not a JSON object")]
    NotObject,
    #[error("no string field \"kind\"")]
    MissingKind,
    #[error("unknown kind \"{0}\"")]
    UnknownKind(String),
    #[error("{kind} needs a {expected} field \"{field}\"")]
    BadField {
        kind: &'static str,
        field: &'static str,
        expected: &'static str,
    },
    #[error("turn_finished has status \"{0}\", not completed or failed")]
    BadStatus(String),
}

/// Parses one line the agent wrote on stdout (without its newline) into what
/// it reports. Pure, and total: any input gives a value or an error.
pub fn parse_agent_line(line: &str) -> Result<AgentOutput, LineError> {
    if line.len() > MAX_LINE_BYTES {
        return Err(LineError::TooLong {
            limit: MAX_LINE_BYTES,
        });
    }
    let value: Value = serde_json::from_str(line).map_err(|e| LineError::NotJson(e.to_string()))?;
    let Value::Object(mut fields) = value else {
        return Err(LineError::NotObject);
    };
    let kind = match fields.remove("kind") {
        Some(Value::String(kind)) => kind,
        _ => return Err(LineError::MissingKind),
    };
    match kind.as_str() {
        "text_delta" => Ok(AgentOutput::TextDelta(string_field(
            &mut fields,
            "text_delta",
            "text",
        )?)),
        "assistant_message" => Ok(AgentOutput::AssistantMessage(string_field(
            &mut fields,
            "assistant_message",
            "text",
        )?)),
        "tool_call" => {
            let call_id = id_field(&mut fields, "tool_call", "call_id")?;
            let name = id_field(&mut fields, "tool_call", "name")?;
            // Arguments are optional: a tool may take none.
            let args = match fields.remove("args") {
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(args) => args,
            };
            Ok(AgentOutput::ToolCall {
                call_id,
                name,
                args,
            })
        }
        "turn_finished" => {
            let status = string_field(&mut fields, "turn_finished", "status")?;
            match status.as_str() {
                "completed" => Ok(AgentOutput::Finished { failed: None }),
                "failed" => {
                    let error = match fields.remove("error") {
                        None | Some(Value::Null) => "the agent reported the turn failed".to_owned(),
                        Some(Value::String(error)) => error,
                        Some(_) => {
                            return Err(LineError::BadField {
                                kind: "turn_finished",
                                field: "error",
                                expected: "string",
                            })
                        }
                    };
                    Ok(AgentOutput::Finished {
                        failed: Some(error),
                    })
                }
                _ => Err(LineError::BadStatus(quote(&status))),
            }
        }
        _ => Err(LineError::UnknownKind(quote(&kind))),
    }
}

fn string_field(
    fields: &mut Map<String, Value>,
    kind: &'static str,
    field: &'static str,
) -> Result<String, LineError> {
    match fields.remove(field) {
        Some(Value::String(s)) => Ok(s),
        _ => Err(LineError::BadField {
            kind,
            field,
            expected: "string",
        }),
    }
}

fn id_field(
    fields: &mut Map<String, Value>,
    kind: &'static str,
    field: &'static str,
) -> Result<String, LineError> {
    match fields.remove(field) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s),
        _ => Err(LineError::BadField {
            kind,
            field,
            expected: "non-empty string",
        }),
    }
}

/// The start of an agent-supplied string, for an error message.
fn quote(text: &str) -> String {
    quote_n(text, QUOTE_CHARS)
}

fn quote_n(text: &str, max_chars: usize) -> String {
    let mut chars = text.chars();
    let mut quoted: String = chars.by_ref().take(max_chars).collect();
    if chars.next().is_some() {
        quoted.push('…');
    }
    quoted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(error: &str) -> AgentOutput {
        AgentOutput::Finished {
            failed: Some(error.into()),
        }
    }

    #[test]
    fn parses_every_kind() {
        assert_eq!(
            parse_agent_line(r#"{"kind":"text_delta","text":"hel"}"#),
            Ok(AgentOutput::TextDelta("hel".into()))
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"assistant_message","text":"hello"}"#),
            Ok(AgentOutput::AssistantMessage("hello".into()))
        );
        assert_eq!(
            parse_agent_line(
                r#"{"kind":"tool_call","call_id":"c1","name":"confirm","args":{"q":1}}"#
            ),
            Ok(AgentOutput::ToolCall {
                call_id: "c1".into(),
                name: "confirm".into(),
                args: json!({"q": 1}),
            })
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"completed"}"#),
            Ok(AgentOutput::Finished { failed: None })
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"failed","error":"boom"}"#),
            Ok(failed("boom"))
        );
    }

    #[test]
    fn lenient_where_it_costs_nothing() {
        // Extra fields are for later versions; whitespace around is fine.
        assert_eq!(
            parse_agent_line(r#"  {"kind":"text_delta","text":"x","extra":[1]} "#),
            Ok(AgentOutput::TextDelta("x".into()))
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"tool_call","call_id":"c","name":"n"}"#),
            Ok(AgentOutput::ToolCall {
                call_id: "c".into(),
                name: "n".into(),
                args: json!({}),
            })
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"failed"}"#),
            Ok(failed("the agent reported the turn failed"))
        );
        // An error on a completed turn is not an error.
        assert_eq!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"completed","error":"x"}"#),
            Ok(AgentOutput::Finished { failed: None })
        );
    }

    #[test]
    fn rejects_invalid_lines() {
        assert!(matches!(
            parse_agent_line("hello"),
            Err(LineError::NotJson(_))
        ));
        assert!(matches!(parse_agent_line(""), Err(LineError::NotJson(_))));
        assert_eq!(parse_agent_line("[1,2]"), Err(LineError::NotObject));
        assert_eq!(parse_agent_line(r#""text""#), Err(LineError::NotObject));
        assert_eq!(
            parse_agent_line(r#"{"text":"x"}"#),
            Err(LineError::MissingKind)
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":7,"text":"x"}"#),
            Err(LineError::MissingKind)
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"shout","text":"x"}"#),
            Err(LineError::UnknownKind("shout".into()))
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"text_delta"}"#),
            Err(LineError::BadField {
                kind: "text_delta",
                field: "text",
                expected: "string"
            })
        );
        assert_eq!(
            parse_agent_line(r#"{"kind":"assistant_message","text":42}"#),
            Err(LineError::BadField {
                kind: "assistant_message",
                field: "text",
                expected: "string"
            })
        );
        assert!(matches!(
            parse_agent_line(r#"{"kind":"tool_call","call_id":"","name":"n"}"#),
            Err(LineError::BadField {
                field: "call_id",
                ..
            })
        ));
        assert!(matches!(
            parse_agent_line(r#"{"kind":"tool_call","call_id":"c"}"#),
            Err(LineError::BadField { field: "name", .. })
        ));
        assert_eq!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"stopped"}"#),
            Err(LineError::BadStatus("stopped".into()))
        );
        assert!(matches!(
            parse_agent_line(r#"{"kind":"turn_finished"}"#),
            Err(LineError::BadField {
                field: "status",
                ..
            })
        ));
        assert!(matches!(
            parse_agent_line(r#"{"kind":"turn_finished","status":"failed","error":{}}"#),
            Err(LineError::BadField { field: "error", .. })
        ));
        // Two objects on one line are not one line of JSON.
        assert!(matches!(
            parse_agent_line(r#"{"kind":"text_delta","text":"a"}{"kind":"text_delta","text":"b"}"#),
            Err(LineError::NotJson(_))
        ));
    }

    #[test]
    fn messages_are_short_and_clear() {
        let long_kind = "k".repeat(10_000);
        let line = format!(r#"{{"kind":"{long_kind}"}}"#);
        let error = parse_agent_line(&line).unwrap_err().to_string();
        assert!(error.len() < 120, "{error}");
        assert!(error.starts_with("unknown kind"), "{error}");
        let error = parse_agent_line(r#"{"kind":"text_delta"}"#)
            .unwrap_err()
            .to_string();
        assert_eq!(error, r#"text_delta needs a string field "text""#);
    }

    #[test]
    fn too_long_lines_are_rejected_before_parsing() {
        let line = format!(
            r#"{{"kind":"text_delta","text":"{}"}}"#,
            "a".repeat(MAX_LINE_BYTES)
        );
        assert_eq!(
            parse_agent_line(&line),
            Err(LineError::TooLong {
                limit: MAX_LINE_BYTES
            })
        );
    }

    #[test]
    fn never_panics() {
        // Deep nesting, odd escapes, truncations of valid lines, multibyte
        // text cut anywhere, and pseudo-random bytes.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(parse_agent_line(&deep).is_err());
        let deep_obj = format!(
            r#"{{"kind":"tool_call","call_id":"c","name":"n","args":{}1{}}}"#,
            "[".repeat(5_000),
            "]".repeat(5_000)
        );
        assert!(parse_agent_line(&deep_obj).is_err());
        let valid = r#"{"kind":"tool_call","call_id":"c\u00e9","name":"é😀","args":{"a":[1,2.5e300,null,true,"\ud83d\ude00"]}}"#;
        for (i, _) in valid.char_indices() {
            let _ = parse_agent_line(&valid[..i]);
            let _ = parse_agent_line(&valid[i..]);
        }
        let _ = parse_agent_line(r#"{"kind":"text_delta","text":"\ud800"}"#);
        let _ = parse_agent_line(r#"{"kind":"text_delta","text":"\u0000"}"#);
        let _ = parse_agent_line("1e999999");
        let _ = parse_agent_line("-");
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let alphabet = br#"{}[]":,\ 0123456789.eE+-truefalsnkindtext_delta"#;
        for _ in 0..20_000 {
            let len = (seed % 40) as usize;
            let mut bytes = Vec::with_capacity(len);
            for _ in 0..len {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                bytes.push(alphabet[(seed % alphabet.len() as u64) as usize]);
            }
            if let Ok(text) = std::str::from_utf8(&bytes) {
                let _ = parse_agent_line(text);
            }
        }
    }

    #[test]
    fn quotes_are_cut_on_char_boundaries() {
        assert_eq!(quote("abc"), "abc");
        let long = "é".repeat(100);
        let quoted = quote(&long);
        assert_eq!(quoted.chars().count(), QUOTE_CHARS + 1);
        assert!(quoted.ends_with('…'));
    }

    #[tokio::test]
    async fn bounded_reader_stops_at_the_limit() {
        let data: &[u8] = b"short\n0123456789\nthis one is too long\nlast";
        let mut reader = BufReader::new(data);
        let mut buf = Vec::new();
        assert!(matches!(
            read_bounded_line(&mut reader, &mut buf, 10).await,
            Ok(LineRead::Line)
        ));
        assert_eq!(buf, b"short\n");
        buf.clear();
        assert!(matches!(
            read_bounded_line(&mut reader, &mut buf, 10).await,
            Ok(LineRead::Line)
        ));
        assert_eq!(buf, b"0123456789\n");
        buf.clear();
        assert!(matches!(
            read_bounded_line(&mut reader, &mut buf, 10).await,
            Ok(LineRead::TooLong)
        ));
        assert_eq!(buf.len(), 11);
        // The rest of that line is never read by the session (it discards
        // the process); read on to check the tail.
        buf.clear();
        let _ = read_bounded_line(&mut reader, &mut buf, 100).await;
        buf.clear();
        assert!(matches!(
            read_bounded_line(&mut reader, &mut buf, 10).await,
            Ok(LineRead::Line)
        ));
        assert_eq!(buf, b"last");
        buf.clear();
        assert!(matches!(
            read_bounded_line(&mut reader, &mut buf, 10).await,
            Ok(LineRead::Eof)
        ));
    }

    #[test]
    fn relative_paths_that_exist_are_made_absolute() {
        let base = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(base.path().join("agents")).unwrap();
        std::fs::write(base.path().join("agents/mine.py"), "").unwrap();
        let full = base.path().join("agents/mine.py").display().to_string();
        let argv = vec![
            "python3".to_owned(),
            "agents/mine.py".to_owned(),
            "agents/missing.py".to_owned(),
            "--flag=a/b".to_owned(),
            "/usr/bin/env".to_owned(),
        ];
        assert_eq!(
            resolve_paths(argv, base.path()),
            [
                "python3",
                &full,
                "agents/missing.py",
                "--flag=a/b",
                "/usr/bin/env"
            ]
        );
    }

    #[tokio::test]
    async fn processes_ended_waits_for_the_last_token() {
        let agent = CommandAgent::new(vec!["true".into()]).unwrap();
        agent.processes_ended().await;
        let first = agent.live.token();
        let second = agent.live.token();
        let ended = tokio::spawn(agent.processes_ended());
        drop(first);
        tokio::task::yield_now().await;
        assert!(!ended.is_finished());
        drop(second);
        timeout(Duration::from_secs(5), ended)
            .await
            .expect("resolves once the last process ended")
            .unwrap();
    }

    #[test]
    fn empty_command_is_refused() {
        assert!(CommandAgent::new(Vec::new()).is_err());
        assert!(CommandAgent::new(vec![String::new()]).is_err());
        assert!(CommandAgent::new(vec!["python3".into()]).is_ok());
    }
}

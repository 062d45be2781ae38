//! One agent process and everything that touches it: starting it in a
//! process group of its own ([`Proc::spawn`]), the **writer** task that owns
//! its stdin, the **stdout reader** that parses each line and reports it for
//! the turn the process is working on, the **stderr** logger, and its end
//! (killed when discarded, closed gracefully when its conversation stops),
//! always reaped and with its whole group signalled. A guard kills the group
//! should the task that owns the process be dropped first.
//!
//! The driver (`session.rs`) decides *when* a process starts, gets a line or
//! ends; this module does the doing, and reports back through [`Note`]s.

use std::ffi::OsString;
use std::io;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};
use tokio::sync::mpsc;
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::line::{
    parse_agent_line, quote_n, read_bounded_line, LineError, LineRead, MAX_LINE_BYTES,
};
use super::{Live, LiveToken};
use crate::agent::{AgentOutput, EventSink};

/// Closing: how long the agent has to exit once its stdin is closed, then
/// once it was sent SIGTERM (protocol §9).
const CLOSE_GRACE: Duration = Duration::from_secs(2);
const TERM_GRACE: Duration = Duration::from_secs(2);
/// Lines waiting for the writer. A handful per turn is normal; a full queue
/// means the agent does not read its input, which fails the turn.
const STDIN_QUEUE: usize = 16;
/// Stderr lines longer than this are logged in pieces.
const MAX_STDERR_LINE: usize = 16 * 1024;
/// How much of its last stderr line the error of a dead agent's turn quotes.
const STDERR_QUOTE_CHARS: usize = 300;
/// How long the end of a process waits for its stderr to be read.
const STDERR_DRAIN: Duration = Duration::from_millis(500);

/// How a session starts its processes: the same for each one.
pub(super) struct Launch {
    pub(super) argv: Arc<Vec<String>>,
    /// Variables of linger's environment the process does not inherit.
    pub(super) hidden_env: Arc<Vec<OsString>>,
    /// The conversation's workspace: the process's working directory.
    pub(super) workspace: PathBuf,
    /// Counts the process until it is reaped.
    pub(super) live: Live,
}

/// The conversation and user a process belongs to: in its environment and
/// in every log line about it; cloned into the tasks that end a process.
#[derive(Clone)]
pub(super) struct LogCtx {
    pub(super) conversation: String,
    pub(super) user: String,
}

/// One live child process and the ends of its I/O tasks. The driver owns it
/// and reads or sets the `pub(super)` fields; the rest is this module's.
pub(super) struct Proc {
    pub(super) child: Child,
    /// Also its process group id (`process_group(0)`).
    pub(super) pid: u32,
    /// The writer's queue: one encoded line per entry.
    pub(super) stdin: mpsc::Sender<Vec<u8>>,
    pub(super) turn: TurnSlot,
    pub(super) notes: mpsc::UnboundedReceiver<Note>,
    /// Set once the driver has seen it exit (and reaped it).
    pub(super) exited: Option<String>,
    pub(super) exit_deadline: Option<Instant>,
    /// Ends the stdout reader: cancelled when the process is discarded, as
    /// its output is stale from then on.
    pub(super) cancel: CancellationToken,
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

impl Proc {
    /// Starts the agent in its workspace (created if need be) and the tasks
    /// around it. Its output is reported through `events` for the turn in
    /// [`Proc::turn`].
    pub(super) async fn spawn(
        launch: &Launch,
        log: &LogCtx,
        events: &EventSink,
    ) -> io::Result<Proc> {
        tokio::fs::create_dir_all(&launch.workspace).await?;
        let mut command = Command::new(&launch.argv[0]);
        command
            .args(&launch.argv[1..])
            .current_dir(&launch.workspace)
            .env("LINGER_CONVERSATION_ID", &log.conversation)
            .env("LINGER_USER", &log.user)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own group: a kill reaches what it started, and a Ctrl-C
            // at the server's terminal does not reach it.
            .process_group(0)
            // The last resort if a task holding it is dropped.
            .kill_on_drop(true);
        for name in launch.hidden_env.iter() {
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
            events.clone(),
            notes_tx,
            cancel.clone(),
            log.clone(),
        ));
        let last_line = Arc::new(Mutex::new(String::new()));
        let stderr_cancel = CancellationToken::new();
        let stderr = StderrTask {
            done: tokio::spawn(log_stderr(
                stderr,
                log.clone(),
                pid,
                last_line.clone(),
                stderr_cancel.clone(),
            )),
            cancel: stderr_cancel,
            last_line,
        };
        info!(conversation = %log.conversation, user = %log.user, pid,
            command = ?launch.argv, workspace = %launch.workspace.display(),
            "agent process started");
        Ok(Proc {
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
            _live: launch.live.token(),
        })
    }
}

/// The turn a process is working on: set by the driver when it hands the
/// process a turn, taken by the stdout reader when the agent finishes it.
/// Shared because the reader tags and emits output without a round trip
/// through the driver.
#[derive(Clone, Default)]
pub(super) struct TurnSlot(Arc<Mutex<Option<Arc<str>>>>);

impl TurnSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Arc<str>>> {
        // Nothing panics while holding this lock; a poisoned one still holds
        // a valid value.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(super) fn get(&self) -> Option<Arc<str>> {
        self.lock().clone()
    }
    pub(super) fn set(&self, turn: Arc<str>) {
        *self.lock() = Some(turn);
    }
    pub(super) fn take(&self) -> Option<Arc<str>> {
        self.lock().take()
    }
}

/// What the I/O tasks of a process tell the driver.
pub(super) enum Note {
    /// The agent wrote `turn_finished` for this turn.
    TurnEnded(Arc<str>),
    /// The process can no longer be used.
    Broken(Broken),
}

/// Why a process can no longer be used.
pub(super) enum Broken {
    /// Its stdout ended.
    Eof,
    Read(io::Error),
    /// It wrote a line that is not valid.
    Invalid(LineError),
    /// Writing to its stdin failed.
    Write(io::Error),
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

/// An exit status (or why there is none), for logs and errors.
pub(super) fn describe_exit(status: &io::Result<std::process::ExitStatus>) -> String {
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
pub(super) async fn kill_process(
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
pub(super) async fn close_process(p: Proc, log: LogCtx) {
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

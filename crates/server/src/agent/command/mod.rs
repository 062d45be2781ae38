//! The command agent of protocol §9: every active conversation runs one
//! child process that speaks JSON lines on stdin and stdout.
//!
//! This module owns the agent itself ([`CommandAgent`]: the configured
//! command, the environment it hides, opening a session per conversation)
//! and the accounting of every process its sessions started, so that a
//! shutdown can wait until all have ended ([`CommandAgent::processes_ended`]).
//! The rest lives in one module per concept:
//! - `session`: one conversation's session, and its **driver** task, the
//!   session's only state machine (when to start, feed, stop, discard and
//!   close a process);
//! - `process`: one child process, in a process group of its own, with its
//!   writer, stdout reader and stderr logger tasks, and its end (killed or
//!   closed, always reaped, its whole group signalled);
//! - `line`: the wire format: frames to the agent, [`parse_agent_line`] for
//!   lines from it, bounded line reads.

mod line;
mod process;
mod session;

use std::ffi::OsString;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

use super::{Agent, AgentSession, SessionContext};
pub use line::{parse_agent_line, LineError, MAX_LINE_BYTES};
use process::{Launch, LogCtx};
use session::CommandSession;

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

/// `agent.command` is empty, or its program is.
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
    /// reaped, including those still being closed (which takes up to four
    /// seconds after their conversation stopped: two after stdin is closed,
    /// two more after SIGTERM).
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
        let launch = Launch {
            argv: self.argv.clone(),
            hidden_env: self.hidden_env.clone(),
            workspace: ctx.workspace,
            live: self.live.clone(),
        };
        let names = LogCtx {
            conversation: ctx.conversation_id,
            user: ctx.user,
        };
        CommandSession::open(launch, names, ctx.events)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::timeout;

    use super::*;

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

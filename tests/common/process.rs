//! The real `linger` binary as a child process, for the tests that kill it
//! (SIGKILL, SIGTERM) and read its log.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use serde_json::Value;

use super::{Client, RECV_TIMEOUT};

pub struct ServerProcess {
    pub addr: SocketAddr,
    pub pid: u32,
    http: reqwest::Client,
    log: Arc<Mutex<Vec<String>>>,
    /// Whether the log's reader may read on (see [`ServerProcess::stop_reading_log`]).
    log_open: Arc<(Mutex<bool>, Condvar)>,
    new_line: mpsc::Receiver<String>,
    exit: mpsc::Receiver<ExitStatus>,
    exited: Option<ExitStatus>,
}

impl ServerProcess {
    /// Starts `linger serve` on a free port with its store in `store`, the
    /// given extra TOML appended to the config, and waits for
    /// `listening on ADDR`.
    pub fn spawn(store: &Path, extra_toml: &str) -> ServerProcess {
        ServerProcess::start(serve_command(store, "127.0.0.1:0", extra_toml))
    }

    /// [`ServerProcess::spawn`] with the command changed first (its
    /// environment, say).
    pub fn spawn_with(
        store: &Path,
        extra_toml: &str,
        change: impl FnOnce(&mut Command),
    ) -> ServerProcess {
        let mut command = serve_command(store, "127.0.0.1:0", extra_toml);
        change(&mut command);
        ServerProcess::start(command)
    }

    /// Starts a server from a command of one's own (which must listen on a
    /// free port) and waits for `listening on ADDR`.
    pub fn start(mut command: Command) -> ServerProcess {
        let mut child = command
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the linger binary");
        let pid = child.id();
        let stderr = child.stderr.take().expect("stderr is piped");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (line_tx, new_line) = mpsc::channel();
        let sink = log.clone();
        let log_open = Arc::new((Mutex::new(true), Condvar::new()));
        let gate = log_open.clone();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stderr).lines();
            loop {
                let (open, opened) = &*gate;
                drop(
                    opened
                        .wait_while(open.lock().unwrap(), |open| !*open)
                        .unwrap(),
                );
                let Some(Ok(line)) = lines.next() else { break };
                sink.lock().unwrap().push(line.clone());
                let _ = line_tx.send(line);
            }
        });
        let (exit_tx, exit) = mpsc::channel();
        std::thread::spawn(move || {
            if let Ok(status) = child.wait() {
                let _ = exit_tx.send(status);
            }
        });
        let mut process = ServerProcess {
            addr: "127.0.0.1:0".parse().unwrap(),
            pid,
            http: reqwest::Client::new(),
            log,
            log_open,
            new_line,
            exit,
            exited: None,
        };
        let line = process.wait_for_log(|l| l.contains("listening on "));
        let addr = line
            .split("listening on ")
            .nth(1)
            .map(|rest| {
                rest.chars()
                    .take_while(|c| c.is_ascii_hexdigit() || matches!(c, '.' | ':' | '[' | ']'))
                    .collect::<String>()
            })
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in {line:?}"));
        process.addr = addr;
        process
    }

    /// Its peak and current resident memory (`VmHWM`, `VmRSS` in
    /// `/proc/PID/status`), in KiB.
    pub fn memory_kib(&self) -> (u64, u64) {
        let pid = self.pid;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
        };
        (field("VmHWM:"), field("VmRSS:"))
    }

    pub fn ws_url(&self, user: &str) -> String {
        format!("ws://{}/v1/ws?token={user}", self.addr)
    }

    pub async fn connect(&self, user: &str) -> Client {
        Client::connect(&self.ws_url(user), user).await
    }

    pub fn http_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// GET `path` with `token` as a bearer token (none: no Authorization);
    /// returns the status and the body as JSON (a string when not JSON).
    pub async fn get(&self, path: &str, token: Option<&str>) -> (u16, Value) {
        super::http_call(&self.http, &self.http_url(""), "GET", path, token, None).await
    }

    /// Any REST call, as [`super::TestServer::call`].
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        super::http_call(&self.http, &self.http_url(""), method, path, token, body).await
    }

    /// The value `/metrics` shows for a series (its name, with its labels
    /// if it has some), 0 when it has not counted anything yet.
    pub async fn metric(&self, series: &str) -> f64 {
        let (status, metrics) = self.get("/metrics", None).await;
        assert_eq!(status, 200, "/metrics: {metrics}");
        metrics
            .as_str()
            .unwrap_or_default()
            .lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0.0)
    }

    /// The stored events of a conversation after `after`, through REST
    /// (which never activates or attaches), paged until `head_seq`.
    pub async fn stored_events(&self, id: &str, user: &str, after: u64) -> Vec<Value> {
        super::stored_events_at(&self.http, &self.http_url(""), id, user, after).await
    }

    /// Waits for a log line (already written or coming) that matches.
    pub fn wait_for_log(&mut self, pred: impl Fn(&str) -> bool) -> String {
        self.wait_for_log_within(RECV_TIMEOUT, pred)
    }

    /// [`ServerProcess::wait_for_log`] for a line that comes only after a
    /// long server-side timer (the slow-consumer patience, say).
    pub fn wait_for_log_within(&mut self, within: Duration, pred: impl Fn(&str) -> bool) -> String {
        if let Some(line) = self.log.lock().unwrap().iter().find(|l| pred(l)) {
            return line.clone();
        }
        let deadline = std::time::Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.new_line.recv_timeout(left) {
                Ok(line) if pred(&line) => return line,
                Ok(_) => continue,
                Err(_) => panic!(
                    "no matching log line in {within:?}; log:\n{}",
                    self.log.lock().unwrap().join("\n")
                ),
            }
        }
    }

    /// Waits for a line matching `pred` that comes after the `nth` line
    /// matching `after` (the first is 1), both perhaps already written.
    pub fn wait_for_log_after(
        &mut self,
        after: impl Fn(&str) -> bool,
        nth: usize,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let found = |log: &[String]| {
            let (start, _) = log
                .iter()
                .enumerate()
                .filter(|(_, l)| after(l))
                .nth(nth - 1)?;
            log[start + 1..].iter().find(|l| pred(l)).cloned()
        };
        let deadline = std::time::Instant::now() + RECV_TIMEOUT;
        loop {
            if let Some(line) = found(&self.log.lock().unwrap()) {
                return line;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if self.new_line.recv_timeout(left).is_err() {
                panic!(
                    "no matching log line in {RECV_TIMEOUT:?} after the one numbered {nth} of those it must follow; log:\n{}",
                    self.log.lock().unwrap().join("\n")
                );
            }
        }
    }

    /// Stops reading the server's stderr (after the line being read): the
    /// pipe fills up and its writes block, as with a log nobody reads.
    pub fn stop_reading_log(&self) {
        *self.log_open.0.lock().unwrap() = false;
    }

    /// Reads the server's stderr again.
    pub fn resume_reading_log(&self) {
        let (open, opened) = &*self.log_open;
        *open.lock().unwrap() = true;
        opened.notify_all();
    }

    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {} failed", self.pid);
    }

    /// SIGSTOP, and wait until the kernel shows every thread stopped
    /// (state `T` in each `/proc/PID/task/TID/stat`): a stop takes effect
    /// as each thread gets a CPU, which on a busy machine is not at once.
    pub fn pause(&self) {
        self.signal("STOP");
        let deadline = std::time::Instant::now() + RECV_TIMEOUT;
        while !self.all_threads_stopped() {
            assert!(
                std::time::Instant::now() < deadline,
                "linger {} not stopped within {RECV_TIMEOUT:?}",
                self.pid
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn all_threads_stopped(&self) -> bool {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.pid)) else {
            return false;
        };
        tasks.filter_map(Result::ok).all(|task| {
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
            // The state follows the command name, which is in parentheses.
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
        })
    }

    /// Waits for the process to exit (at most `within`).
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        if let Some(status) = self.exited {
            return status;
        }
        let status = self.exit.recv_timeout(within).unwrap_or_else(|_| {
            panic!(
                "linger did not exit within {within:?}; log:\n{}",
                self.log.lock().unwrap().join("\n")
            )
        });
        self.exited = Some(status);
        status
    }

    /// SIGKILL, and wait until it is gone.
    pub fn kill9(&mut self) {
        self.signal("KILL");
        self.wait_exit(RECV_TIMEOUT);
    }
}

/// The config file's name, in the directory it is written to.
const CONFIG_FILE: &str = "linger-test.toml";

fn config_text(store: &Path, listen: &str, extra_toml: &str) -> String {
    format!(
        "[server]\nlisten = {listen:?}\n[store]\npath = {:?}\n{extra_toml}\n",
        store.display().to_string()
    )
}

/// Rewrites the config file of a server started by [`ServerProcess::spawn`]
/// on `store` (same listen address and store, new `extra_toml`), for a
/// reload to read.
pub fn rewrite_config(store: &Path, extra_toml: &str) {
    let text = config_text(store, "127.0.0.1:0", extra_toml);
    std::fs::write(store.join(CONFIG_FILE), text).unwrap();
}

/// Writes `text` as the config file, verbatim (a broken one, say).
pub fn write_config_verbatim(store: &Path, text: &str) {
    std::fs::write(store.join(CONFIG_FILE), text).unwrap();
}

/// `linger serve` on `listen` with its store (and config file) in `store`.
fn serve_command(store: &Path, listen: &str, extra_toml: &str) -> Command {
    std::fs::create_dir_all(store).unwrap();
    serve_command_configured_in(store, store, listen, extra_toml)
}

/// `linger serve` with its config file written in `config_dir`.
fn serve_command_configured_in(
    config_dir: &Path,
    store: &Path,
    listen: &str,
    extra_toml: &str,
) -> Command {
    let config = config_dir.join(CONFIG_FILE);
    std::fs::write(&config, config_text(store, listen, extra_toml)).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_linger"));
    command
        .args(["serve", "--config"])
        .arg(&config)
        .env("LINGER_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    command
}

/// Starts `linger serve` on `listen` with its store in `store`, expecting
/// it to refuse: returns its exit status and stderr.
pub fn serve_refused(store: &Path, listen: &str) -> (ExitStatus, String) {
    serve_refused_with(store, listen, "")
}

/// [`serve_refused`] with extra TOML in the configuration.
pub fn serve_refused_with(store: &Path, listen: &str, extra_toml: &str) -> (ExitStatus, String) {
    // The config lives apart from the store, which may be unwritable.
    let config_dir = tempfile::tempdir().unwrap();
    let out = serve_command_configured_in(config_dir.path(), store, listen, extra_toml)
        .stderr(Stdio::piped())
        .output()
        .expect("run the linger binary");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        // A failed test shows what each server it ran said.
        if std::thread::panicking() {
            eprintln!(
                "--- log of the server on {} (pid {}) ---\n{}",
                self.addr,
                self.pid,
                self.log.lock().map(|l| l.join("\n")).unwrap_or_default()
            );
        }
        if self.exited.is_none() && self.exit.try_recv().is_err() {
            let _ = Command::new("kill")
                .args(["-KILL", &self.pid.to_string()])
                .status();
        }
    }
}

impl Client {
    /// Reads frames until the server closes the connection; returns the
    /// frames before the close and the close code.
    pub async fn until_closed(&mut self) -> (Vec<super::Value>, Option<u16>) {
        use futures_util::StreamExt;
        use tokio_tungstenite::tungstenite::Message;
        let mut frames: Vec<super::Value> = self.backlog.drain(..).collect();
        loop {
            let next = tokio::time::timeout(RECV_TIMEOUT, self.ws.next())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "{}: the server did not close in {RECV_TIMEOUT:?}",
                        self.user
                    )
                });
            match next {
                Some(Ok(Message::Text(text))) => frames
                    .push(serde_json::from_str(text.as_str()).expect("server frames are JSON")),
                Some(Ok(Message::Close(frame))) => {
                    return (frames, frame.map(|f| u16::from(f.code)))
                }
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return (frames, None),
            }
        }
    }
}

pub fn temp_store() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    (dir, store)
}

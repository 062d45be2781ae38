//! The server under load: a `linger serve` or `relay` the bench spawns on a
//! free loopback port (and kills after, or kills and starts again on the
//! same store and port), or one already running; and its CPU time and
//! memory, read from /proc.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

use super::Common;

/// How long a spawned server may take to say where it listens.
const START_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    Linger,
    Relay,
    /// `linger serve` as one node of a cluster (`cluster.mode = "nats"`,
    /// given by the overrides); a report's column for the whole cluster.
    Cluster,
}

impl Server {
    /// Its column in a report.
    pub fn name(self) -> &'static str {
        match self {
            Server::Linger => "linger",
            Server::Relay => "relay",
            Server::Cluster => "cluster",
        }
    }
}

pub struct Target {
    pub server: Server,
    pub url: String,
    pub pid: Option<u32>,
    external: bool,
    child: Option<Child>,
    dir: Option<PathBuf>,
    /// A spawned linger's environment, to start it again as it was.
    env: Vec<(String, String)>,
}

/// A process's CPU time and memory (Linux /proc).
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcStats {
    pub cpu_secs: f64,
    pub rss_kib: u64,
    pub hwm_kib: u64,
}

impl ProcStats {
    pub fn read(pid: u32) -> Option<ProcStats> {
        // Fields 14 and 15 of /proc/PID/stat (utime, stime), in clock
        // ticks of 1/100 s on Linux.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let rest = stat.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let kib = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        };
        Some(ProcStats {
            cpu_secs: ticks as f64 / 100.0,
            rss_kib: kib("VmRSS:"),
            hwm_kib: kib("VmHWM:"),
        })
    }

    /// Several processes, summed (none if one is gone).
    pub fn summed(pids: &[u32]) -> Option<ProcStats> {
        if pids.is_empty() {
            return None;
        }
        pids.iter().try_fold(ProcStats::default(), |sum, pid| {
            let s = ProcStats::read(*pid)?;
            Some(ProcStats {
                cpu_secs: sum.cpu_secs + s.cpu_secs,
                rss_kib: sum.rss_kib + s.rss_kib,
                hwm_kib: sum.hwm_kib + s.hwm_kib,
            })
        })
    }

    /// This process (the generator).
    pub fn me() -> Option<ProcStats> {
        ProcStats::read(std::process::id())
    }
}

impl Target {
    pub fn external(url: &str, pid: Option<u32>) -> Target {
        Target {
            server: Server::Linger,
            url: url.to_owned(),
            pid,
            external: true,
            child: None,
            dir: None,
            env: Vec::new(),
        }
    }

    pub fn label(&self) -> &'static str {
        match (self.external, self.server) {
            (true, _) => "server",
            (false, Server::Linger) => "linger",
            (false, Server::Relay) => "relay",
            (false, Server::Cluster) => "cluster node",
        }
    }

    pub fn stats(&self) -> Option<ProcStats> {
        ProcStats::read(self.pid?)
    }

    /// Spawns `linger serve` (this executable) or `relay` (its sibling) on
    /// a free loopback port; linger gets a fresh store in a temporary
    /// directory, its log goes to `server.log` there.
    pub async fn spawn(
        server: Server,
        common: &Common,
        linger_overrides: &[(&str, String)],
    ) -> anyhow::Result<Target> {
        Target::spawn_with_store(server, common, linger_overrides, None).await
    }

    /// As [`Target::spawn`], with linger's store at `store` when given
    /// (a small filesystem the caller mounted) instead of the temporary
    /// directory.
    pub async fn spawn_with_store(
        server: Server,
        common: &Common,
        linger_overrides: &[(&str, String)],
        store: Option<&Path>,
    ) -> anyhow::Result<Target> {
        let exe = std::env::current_exe().context("locating this executable")?;
        let dir = std::env::temp_dir().join(format!(
            "linger-bench-{}-{}",
            std::process::id(),
            ulid::Ulid::new()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut env = Vec::new();
        let cmd = match server {
            Server::Linger | Server::Cluster => {
                let store = store.map_or_else(|| dir.join("data"), Path::to_path_buf);
                env.push((
                    "LINGER__SERVER__LISTEN".to_owned(),
                    "127.0.0.1:0".to_owned(),
                ));
                env.push((
                    "LINGER__STORE__PATH".to_owned(),
                    store.to_string_lossy().into_owned(),
                ));
                env.push(("LINGER__LOG__FORMAT".to_owned(), "json".to_owned()));
                for (key, value) in linger_overrides {
                    env.push((env_key(key), value.clone()));
                }
                for kv in &common.overrides {
                    let (key, value) = kv
                        .split_once('=')
                        .ok_or_else(|| anyhow!("--set {kv}: expected KEY=VALUE"))?;
                    env.push((env_key(key), value.to_owned()));
                }
                let filter = log_filter(std::env::var("LINGER_LOG").ok(), &env);
                env.push(("LINGER_LOG".to_owned(), filter));
                linger_command(&exe, &dir, &env)?
            }
            Server::Relay => {
                let relay = exe.with_file_name("relay");
                if !relay.exists() {
                    bail!(
                        "{} not found: build it with `cargo build --release --bin relay`",
                        relay.display()
                    );
                }
                let mut cmd = Command::new(relay);
                cmd.arg("--listen").arg("127.0.0.1:0");
                cmd
            }
        };
        let (child, addr) = launch(cmd, &dir).await?;
        Ok(Target {
            server,
            url: format!("ws://{addr}/v1/ws"),
            pid: child.id(),
            external: false,
            child: Some(child),
            dir: Some(dir),
            env,
        })
    }

    /// Starts a spawned linger again after [`Target::kill`], on the same
    /// store and the same port (clients come back to the URL they had).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        if self.child.is_some() {
            bail!("the server is still running");
        }
        let dir = self
            .dir
            .clone()
            .ok_or_else(|| anyhow!("only a spawned server can be restarted"))?;
        if self.env.is_empty() {
            bail!("only a spawned linger can be restarted");
        }
        let addr = self
            .url
            .strip_prefix("ws://")
            .and_then(|u| u.strip_suffix("/v1/ws"))
            .ok_or_else(|| anyhow!("unexpected url {}", self.url))?
            .to_owned();
        for (key, value) in &mut self.env {
            if key == "LINGER__SERVER__LISTEN" {
                value.clone_from(&addr);
            }
        }
        let exe = std::env::current_exe().context("locating this executable")?;
        let cmd = linger_command(&exe, &dir, &self.env)?;
        let (child, now_at) = launch(cmd, &dir).await?;
        if now_at != addr {
            bail!("restarted on {now_at}, not on {addr}");
        }
        self.pid = child.id();
        self.child = Some(child);
        Ok(())
    }

    /// The HTTP base of its REST API (`http://127.0.0.1:PORT`).
    pub fn http_base(&self) -> String {
        let base = self.url.strip_suffix("/v1/ws").unwrap_or(&self.url);
        base.replacen("ws://", "http://", 1)
    }

    /// SIGKILLs a spawned server and reaps it (within 10 s); its directory
    /// stays until [`Target::stop`].
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        let child = self
            .child
            .as_mut()
            .ok_or_else(|| anyhow!("only a spawned server can be killed"))?;
        child.start_kill().context("killing the server")?;
        tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .map_err(|_| anyhow!("the killed server was not gone within 10 s"))??;
        self.child = None;
        self.pid = None;
        Ok(())
    }

    /// Kills a spawned server and removes its directory (set
    /// `LINGER_BENCH_KEEP=1` to keep it, with its log).
    pub async fn stop(mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
        }
        if let Some(dir) = self.dir.take() {
            if std::env::var_os("LINGER_BENCH_KEEP").is_some() {
                eprintln!("kept {}", dir.display());
            } else {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}

/// The spawned server's log filter: the level asked for (inherited
/// `LINGER_LOG`, else `--set log.level=…`, else `info`), with the line that
/// says where it listens kept whatever that level, as the bench reads it.
fn log_filter(inherited: Option<String>, env: &[(String, String)]) -> String {
    let asked = inherited.or_else(|| {
        env.iter()
            .rev()
            .find(|(key, _)| key == "LINGER__LOG__LEVEL")
            .map(|(_, level)| level.clone())
    });
    format!("{},linger::server=info", asked.as_deref().unwrap_or("info"))
}

/// `linger serve` with an empty config file in `dir` and `env`.
fn linger_command(exe: &Path, dir: &Path, env: &[(String, String)]) -> anyhow::Result<Command> {
    let config = dir.join("bench.toml");
    std::fs::write(&config, "").with_context(|| format!("writing {}", config.display()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve").arg("--config").arg(&config);
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    Ok(cmd)
}

/// Starts `cmd` in `dir` and waits until it says where it listens; its
/// log is appended to `server.log` there (a restart adds to it).
async fn launch(mut cmd: Command, dir: &Path) -> anyhow::Result<(Child, String)> {
    cmd.current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().context("spawning the server")?;
    let stderr = child.stderr.take().context("the server's stderr")?;
    let mut lines = BufReader::new(stderr).lines();
    let log_path = dir.join("server.log");
    let mut log = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .await
        .with_context(|| format!("opening {}", log_path.display()))?;
    let find = async {
        // Bounded: start-up logs a handful of lines.
        for _ in 0..1000 {
            let Some(line) = lines.next_line().await? else {
                break;
            };
            log.write_all(line.as_bytes()).await?;
            log.write_all(b"\n").await?;
            if let Some(addr) = listening_on(&line) {
                return Ok(addr);
            }
        }
        Err(anyhow!("the server exited without saying where it listens"))
    };
    let addr = match tokio::time::timeout(START_TIMEOUT, find).await {
        Ok(Ok(addr)) => addr,
        Ok(Err(e)) => return Err(e.context(format!("see {}", log_path.display()))),
        Err(_) => bail!("the server did not start within {START_TIMEOUT:?}"),
    };
    // Keep draining its log so that it never blocks on stderr: in chunks
    // of what has come, not line by line. Each write to a tokio file is a
    // hop to a blocking thread; two per line took enough of the generator's
    // time, when 10,000 turns start at once and each logs, to show as
    // latency (p99 160 to 200 ms read through this log against 18 to 21 ms
    // with the server's log sent straight to a file).
    let mut rest = lines.into_inner();
    tokio::spawn(async move {
        let _ = tokio::io::copy_buf(&mut rest, &mut log).await;
    });
    Ok((child, addr))
}

/// `conversations.replay_buffer_events` → `LINGER__CONVERSATIONS__REPLAY_BUFFER_EVENTS`.
fn env_key(key: &str) -> String {
    format!("LINGER__{}", key.replace('.', "__").to_uppercase())
}

/// The address in a `listening on ADDR` line (plain or JSON).
fn listening_on(line: &str) -> Option<String> {
    let rest = line.split_once("listening on ")?.1;
    let addr: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
        .collect();
    addr.parse::<std::net::SocketAddr>()
        .ok()
        .filter(|a| a.ip().is_loopback())
        .map(|a| a.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_address() {
        assert_eq!(
            listening_on(
                r#"{"level":"INFO","message":"listening on 127.0.0.1:4321","target":"x"}"#
            ),
            Some("127.0.0.1:4321".into())
        );
        assert_eq!(
            listening_on("listening on 127.0.0.1:80"),
            Some("127.0.0.1:80".into())
        );
        assert_eq!(listening_on("nothing"), None);
        assert_eq!(
            env_key("conversations.replay_buffer_events"),
            "LINGER__CONVERSATIONS__REPLAY_BUFFER_EVENTS"
        );
    }

    #[test]
    fn the_listening_line_is_logged_whatever_the_level_asked() {
        let level = |v: &str| vec![("LINGER__LOG__LEVEL".to_owned(), v.to_owned())];
        assert_eq!(log_filter(None, &[]), "info,linger::server=info");
        assert_eq!(log_filter(None, &level("warn")), "warn,linger::server=info");
        // The environment's LINGER_LOG wins, as it does for the server.
        assert_eq!(
            log_filter(Some("error".into()), &level("warn")),
            "error,linger::server=info"
        );
    }
}

//! Configuration (protocol §7): one TOML file, humantime durations, and
//! `LINGER__SECTION__KEY` environment overrides. Unknown keys and bad values
//! stop start-up with a message naming the key.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

pub mod keys;
pub mod live;

pub use live::{ConfigOwner, LiveConfig};

/// Where `linger serve` looks for its config when `--config` is not given.
pub const DEFAULT_CONFIG_PATH: &str = "config/linger.toml";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub auth: AuthConfig,
    pub conversations: ConversationsConfig,
    pub store: StoreConfig,
    pub agent: AgentConfig,
    pub limits: LimitsConfig,
    pub log: LogConfig,
    pub cluster: ClusterConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub allowed_origins: Vec<String>,
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7420)),
            allowed_origins: Vec::new(),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AuthMode {
    #[default]
    Dev,
    Tokens,
    Jwt,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    pub token: String,
    pub user: String,
    #[serde(default)]
    pub admin: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    pub mode: AuthMode,
    pub tokens: Vec<TokenEntry>,
    pub jwt_secret_env: String,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            mode: AuthMode::Dev,
            tokens: Vec::new(),
            jwt_secret_env: "LINGER_JWT_SECRET".into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnLimit {
    #[default]
    Evict,
    Reject,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConversationsConfig {
    #[serde(with = "humantime_serde")]
    pub close_delay: Duration,
    #[serde(with = "humantime_serde")]
    pub detach_grace: Duration,
    pub max_per_user: usize,
    pub on_limit: OnLimit,
    #[serde(with = "humantime_serde")]
    pub max_close_delay: Duration,
    pub replay_buffer_events: usize,
    pub max_queued_messages: usize,
    pub client_msg_id_window: usize,
}

impl Default for ConversationsConfig {
    fn default() -> Self {
        ConversationsConfig {
            close_delay: Duration::from_secs(15 * 60),
            detach_grace: Duration::from_secs(10 * 60),
            max_per_user: 3,
            on_limit: OnLimit::Evict,
            max_close_delay: Duration::from_secs(24 * 3600),
            replay_buffer_events: 2000,
            max_queued_messages: 16,
            client_msg_id_window: 1000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    pub path: PathBuf,
    #[serde(with = "humantime_serde")]
    pub retain: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            path: PathBuf::from("./data"),
            retain: Duration::from_secs(30 * 24 * 3600),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AgentKind {
    #[default]
    Demo,
    Command,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    pub kind: AgentKind,
    pub command: Vec<String>,
    #[serde(with = "humantime_serde")]
    pub turn_timeout: Duration,
    /// Protocol §11: run a turn that ended `interrupted` again, once, when
    /// its conversation is next active.
    pub resume_interrupted: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            kind: AgentKind::Demo,
            command: Vec::new(),
            turn_timeout: Duration::from_secs(30 * 60),
            resume_interrupted: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    pub max_frame_bytes: usize,
    pub max_outbound_frames: usize,
    pub max_connections_per_user: usize,
    pub messages_per_second: u32,
    pub messages_burst: u32,
    /// A client that reads nothing for this long while frames wait for it
    /// is closed with 4008 (slow consumer).
    #[serde(with = "humantime_serde")]
    pub slow_consumer_patience: Duration,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_frame_bytes: 1_048_576,
            max_outbound_frames: 10_000,
            max_connections_per_user: 32,
            messages_per_second: 20,
            messages_burst: 40,
            slow_consumer_patience: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Pretty,
    Json,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// A tracing filter (`info`, `warn,linger=debug`); the `LINGER_LOG`
    /// environment variable, when set, wins over it.
    pub level: String,
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: "info".into(),
            format: LogFormat::Pretty,
        }
    }
}

/// Where history and ownership live (protocol §10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ClusterMode {
    /// One process, the embedded SQLite store.
    #[default]
    Single,
    /// Several nodes sharing NATS JetStream (server 2.11 or later).
    Nats,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    pub mode: ClusterMode,
    pub nats_urls: Vec<String>,
    /// Empty: a new one is generated at start.
    pub node_id: String,
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    pub replicas: usize,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            mode: ClusterMode::Single,
            nats_urls: vec!["nats://127.0.0.1:4222".into()],
            node_id: String::new(),
            lease_ttl: Duration::from_secs(5),
            replicas: 1,
        }
    }
}

/// A configuration that cannot be used; the message names the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {0}: not found")]
    Missing(PathBuf),
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    /// Loads the config: built-in defaults, then the TOML file (the given one,
    /// else `config/linger.toml` when present), then `LINGER__*` variables.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let file = match path {
            Some(p) if !p.exists() => return Err(ConfigError::Missing(p.to_owned())),
            Some(p) => Some(p.to_owned()),
            None => Some(PathBuf::from(DEFAULT_CONFIG_PATH)).filter(|p| p.exists()),
        };
        Config::from_figment(file.as_deref(), Env::prefixed("LINGER__").split("__"))
    }

    /// Loads from a file and an explicit env provider (tests pass their own).
    pub fn from_figment(file: Option<&Path>, env: Env) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(file) = file {
            figment = figment.merge(Toml::file_exact(file));
        }
        let config: Config = figment
            .merge(env)
            .extract()
            .map_err(|e| ConfigError::Invalid(describe(e)))?;
        config.validate()?;
        Ok(config)
    }

    /// Loads from TOML text alone (tests and examples).
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let config: Config = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string(text))
            .extract()
            .map_err(|e| ConfigError::Invalid(describe(e)))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what serde cannot: ranges and keys that depend on each other.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, why: &str| Err(ConfigError::Invalid(format!("{key}: {why}")));
        if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(&self.log.level) {
            return bad("log.level", &format!("not a tracing filter: {e}"));
        }
        if self.conversations.replay_buffer_events == 0 {
            return bad("conversations.replay_buffer_events", "must be at least 1");
        }
        if self.conversations.client_msg_id_window == 0 {
            return bad("conversations.client_msg_id_window", "must be at least 1");
        }
        if self.limits.max_outbound_frames < 16 {
            return bad("limits.max_outbound_frames", "must be at least 16");
        }
        if self.limits.max_frame_bytes < 1024 {
            return bad("limits.max_frame_bytes", "must be at least 1024");
        }
        if self.limits.messages_per_second == 0 {
            return bad("limits.messages_per_second", "must be at least 1");
        }
        if self.limits.slow_consumer_patience.is_zero() {
            return bad("limits.slow_consumer_patience", "must be more than 0s");
        }
        if self.limits.messages_burst == 0 {
            return bad("limits.messages_burst", "must be at least 1");
        }
        if self.agent.kind == AgentKind::Command && self.agent.command.is_empty() {
            return bad(
                "agent.command",
                "must name a program when agent.kind = \"command\"",
            );
        }
        if self.cluster.mode == ClusterMode::Nats && self.cluster.nats_urls.is_empty() {
            return bad(
                "cluster.nats_urls",
                "must list at least one URL when cluster.mode = \"nats\"",
            );
        }
        if self.cluster.lease_ttl < Duration::from_secs(1) {
            // NATS keeps KV ages in whole seconds for markers and renewal
            // needs a few round trips within one TTL.
            return bad("cluster.lease_ttl", "must be at least 1s");
        }
        if !(1..=5).contains(&self.cluster.replicas) {
            return bad(
                "cluster.replicas",
                "must be between 1 and 5 (JetStream's limit)",
            );
        }
        if !self
            .cluster
            .node_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return bad(
                "cluster.node_id",
                "may only hold ASCII letters, digits, '-' and '_'",
            );
        }
        if self.auth.mode == AuthMode::Tokens && self.auth.tokens.is_empty() {
            return bad(
                "auth.tokens",
                "must list at least one token when auth.mode = \"tokens\"",
            );
        }
        if self.auth.mode == AuthMode::Dev && !self.server.listen.ip().is_loopback() {
            return bad(
                "auth.mode",
                "\"dev\" trusts any token as a user name and is refused on a non-loopback \
                 server.listen; use \"tokens\" or \"jwt\"",
            );
        }
        Ok(())
    }
}

/// Renders figment's errors as `key: what is wrong`, one per line.
fn describe(error: figment::Error) -> String {
    error
        .into_iter()
        .map(|e| {
            let mut key = e.path.join(".");
            let kind = match &e.kind {
                // figment's own wording nests backticks inside backticks.
                figment::error::Kind::UnknownField(found, expected) => {
                    // The path already ends with the unknown key.
                    let parent = &e.path[..e.path.len().saturating_sub(1)];
                    let known = if parent.is_empty() {
                        "known sections".to_owned()
                    } else {
                        format!("known keys of [{}]", parent.join("."))
                    };
                    if key.is_empty() {
                        key = found.clone();
                    }
                    format!("unknown key; {known}: {}", expected.join(", "))
                }
                kind => kind.to_string(),
            };
            let source = e
                .metadata
                .as_ref()
                .map(|m| match &m.source {
                    Some(src) => format!(" (from {} {src})", m.name),
                    None => format!(" (from {})", m.name),
                })
                .unwrap_or_default();
            if key.is_empty() {
                format!("{kind}{source}")
            } else {
                format!("{key}: {kind}{source}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

//! Live configuration: `SIGHUP` and `POST /v1/admin/reload` re-read the
//! config file and the environment, and the keys that may change while
//! the server runs ([`crate::config::keys::reloadability`]) take their new
//! values from the next decision on, without dropping a connection or a
//! conversation. A key that cannot change live is refused, by name, and
//! the others still apply. A file with an error changes nothing.
//!
//! Each reload is one decision in the supervision log (rule
//! `config_reload`) and one log line, with what changed.

use std::path::PathBuf;
use std::sync::Arc;

use ractor::ActorRef;
use serde::Serialize;
use serde_json::{json, Map, Value};
use tracing::{error, info, warn};
use utoipa::ToSchema;

use crate::actors::supervision_log::{NewDecision, SupervisionLog};
use crate::actors::supervisor::SupervisorMsg;
use crate::config::keys::{self, KeyChange, Reloadability};
use crate::config::{Config, ConfigError, ConfigOwner};
use crate::logging::LogControl;

/// Where a reload reads the configuration from.
#[derive(Debug, Clone, Default)]
pub enum ConfigSource {
    /// Started from a value (embedded use): there is nothing to re-read.
    #[default]
    Given,
    /// As `linger serve` loads it: this file (or `config/linger.toml` when
    /// present, for `None`), then the `LINGER__*` environment variables.
    File(Option<PathBuf>),
}

/// Who asked for a reload.
#[derive(Debug, Clone)]
pub enum Trigger {
    Signal,
    Admin(String),
}

impl Trigger {
    fn describe(&self) -> String {
        match self {
            Trigger::Signal => "SIGHUP".into(),
            Trigger::Admin(user) => format!("POST /v1/admin/reload by {user}"),
        }
    }
}

/// A key that took its new value.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AppliedKey {
    #[schema(example = "conversations.max_per_user")]
    pub key: String,
    /// As the config file spells it (durations as text).
    #[schema(value_type = Object, example = 3)]
    pub from: Value,
    #[schema(value_type = Object, example = 1)]
    pub to: Value,
}

/// A key whose new value was not taken, and why.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RefusedKey {
    #[schema(example = "server.listen")]
    pub key: String,
    pub message: String,
}

/// What a reload did.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ReloadOutcome {
    pub applied: Vec<AppliedKey>,
    /// Keys that cannot change while the server runs: their running values
    /// stay until a restart.
    pub refused: Vec<RefusedKey>,
    /// The reload's number in the supervision log (`GET /v1/admin/supervision`).
    pub decision: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file or the environment has an error (the message names the
    /// key); nothing changed.
    #[error("{0}")]
    Invalid(#[from] ConfigError),
    #[error("this server was started from a configuration value, with no file to re-read")]
    NoSource,
}

/// The one owner of the running configuration.
pub struct Reloader {
    source: ConfigSource,
    owner: ConfigOwner,
    supervisor: ActorRef<SupervisorMsg>,
    decisions: Arc<SupervisionLog>,
    logging: Option<Arc<dyn LogControl>>,
    /// One reload at a time: each is decided against the one before.
    serial: tokio::sync::Mutex<()>,
}

impl Reloader {
    pub fn new(
        source: ConfigSource,
        owner: ConfigOwner,
        supervisor: ActorRef<SupervisorMsg>,
        decisions: Arc<SupervisionLog>,
        logging: Option<Arc<dyn LogControl>>,
    ) -> Reloader {
        Reloader {
            source,
            owner,
            supervisor,
            decisions,
            logging,
            serial: tokio::sync::Mutex::new(()),
        }
    }

    /// The running configuration.
    pub fn current(&self) -> Arc<Config> {
        self.owner.current()
    }

    /// Re-reads the source and applies what may change live.
    pub async fn reload(&self, trigger: Trigger) -> Result<ReloadOutcome, ReloadError> {
        let _one = self.serial.lock().await;
        let loaded = match &self.source {
            ConfigSource::Given => Err(ReloadError::NoSource),
            ConfigSource::File(path) => {
                let path = path.clone();
                // Reading a file: off the runtime's threads.
                tokio::task::spawn_blocking(move || Config::load(path.as_deref()))
                    .await
                    .unwrap_or_else(|e| Err(ConfigError::Invalid(format!("reading: {e}"))))
                    .map_err(ReloadError::from)
            }
        };
        match loaded {
            Ok(config) => self.apply_locked(config, &trigger),
            Err(e) => Err(self.not_reloaded(e, &trigger)),
        }
    }

    /// Applies `new` as if it had been re-read (tests, embedded use).
    pub async fn apply(&self, new: Config, trigger: Trigger) -> Result<ReloadOutcome, ReloadError> {
        let _one = self.serial.lock().await;
        self.apply_locked(new, &trigger)
    }

    fn not_reloaded(&self, e: ReloadError, trigger: &Trigger) -> ReloadError {
        let trigger = trigger.describe();
        error!(rule = "config_reload", trigger = %trigger, error = %e,
            "configuration not reloaded: the running configuration stays");
        crate::metrics::config_reloaded("invalid");
        self.decisions.record(NewDecision {
            rule: "config_reload",
            conversation: None,
            user: None,
            inputs: json!({ "trigger": trigger, "error": e.to_string() }),
            outcome: "invalid",
        });
        e
    }

    /// Why `change` cannot be applied now, if so.
    fn refusal(&self, change: &KeyChange) -> Option<String> {
        let key = &change.key;
        if let Reloadability::Restart(why) = keys::reloadability(key) {
            return Some(format!(
                "{key} cannot change while linger runs ({why}); the running value stays until \
                 a restart"
            ));
        }
        if !key.starts_with("log.") {
            return None;
        }
        match &self.logging {
            None => Some(format!(
                "{key}: logging is set up by the program that embeds linger"
            )),
            Some(log) if key == "log.level" => log.level_locked(),
            Some(_) => None,
        }
    }

    fn apply_locked(&self, new: Config, trigger: &Trigger) -> Result<ReloadOutcome, ReloadError> {
        let current = self.owner.current();
        let changes = keys::changes(&current, &new);
        let mut live = Vec::new();
        let mut refused = Vec::new();
        for change in &changes {
            match self.refusal(change) {
                None => live.push(change),
                Some(message) => refused.push(RefusedKey {
                    key: change.key.clone(),
                    message,
                }),
            }
        }
        let merged = keys::apply(&current, &live)
            .map_err(|e| self.not_reloaded(ReloadError::Invalid(e), trigger))?;
        if let Some(log) = &self.logging {
            if merged.log.level != current.log.level {
                if let Err(e) = log.set_level(&merged.log.level) {
                    warn!(error = %e, "the new log.level could not be applied");
                }
            }
            if merged.log.format != current.log.format {
                log.set_format(merged.log.format);
            }
        }
        self.owner.replace(merged);
        // Active conversations re-arm their timers with the new values.
        let _ = self.supervisor.cast(SupervisorMsg::ConfigChanged);
        let applied: Vec<AppliedKey> = live
            .iter()
            .map(|c| AppliedKey {
                key: c.key.clone(),
                from: c.from.clone(),
                to: c.to.clone(),
            })
            .collect();
        let decision = self.record(trigger, &applied, &refused);
        Ok(ReloadOutcome {
            applied,
            refused,
            decision,
        })
    }

    fn record(&self, trigger: &Trigger, applied: &[AppliedKey], refused: &[RefusedKey]) -> u64 {
        let trigger_text = trigger.describe();
        let changed: Map<String, Value> = applied
            .iter()
            .map(|a| (a.key.clone(), json!({ "from": a.from, "to": a.to })))
            .collect();
        let refused_keys: Map<String, Value> = refused
            .iter()
            .map(|r| (r.key.clone(), Value::from(r.message.clone())))
            .collect();
        let outcome = match (applied.is_empty(), refused.is_empty()) {
            (true, true) => "nothing changed",
            (false, true) => "applied",
            (false, false) => "partly applied",
            (true, false) => "refused",
        };
        let listed = applied
            .iter()
            .map(|a| format!("{} {} -> {}", a.key, a.from, a.to))
            .collect::<Vec<_>>()
            .join(", ");
        let refused_list = refused
            .iter()
            .map(|r| r.key.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        info!(rule = "config_reload", trigger = %trigger_text, outcome, changed = %listed,
            refused = %refused_list, "configuration reloaded");
        crate::metrics::config_reloaded(outcome);
        for r in refused {
            warn!(rule = "config_reload", key = %r.key, "{}", r.message);
        }
        let user = match trigger {
            Trigger::Admin(user) => Some(user.as_str()),
            Trigger::Signal => None,
        };
        self.decisions.record(NewDecision {
            rule: "config_reload",
            conversation: None,
            user,
            inputs: json!({
                "trigger": trigger_text,
                "changed": changed,
                "refused": refused_keys,
            }),
            outcome,
        })
    }
}

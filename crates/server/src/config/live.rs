//! The running configuration: one owner ([`ConfigOwner`], held by the
//! reloader) and any number of readers ([`LiveConfig`]), over a
//! `tokio::sync::watch` channel.
//!
//! Readers take the current value at each decision (`live.get()`), never
//! keep a copy across decisions, so a reload reaches every rule from its
//! next decision on. Keys that cannot change while the server runs
//! (`server.listen`, `store.*`, …) are never changed in the live value: the
//! reloader keeps their running values (see [`super::keys`]).

use std::sync::Arc;

use tokio::sync::watch;

use super::Config;

/// A reader of the running configuration; cheap to clone.
#[derive(Clone)]
pub struct LiveConfig {
    rx: watch::Receiver<Arc<Config>>,
}

impl LiveConfig {
    /// A configuration that never changes (tests, embedded use).
    pub fn fixed(config: Config) -> LiveConfig {
        ConfigOwner::new(config).subscribe()
    }

    /// The configuration as it is now. Read it again at the next decision
    /// rather than keeping it.
    pub fn get(&self) -> Arc<Config> {
        self.rx.borrow().clone()
    }
}

impl std::fmt::Debug for LiveConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("LiveConfig").field(&self.get()).finish()
    }
}

/// The one writer of the running configuration.
pub struct ConfigOwner {
    tx: watch::Sender<Arc<Config>>,
}

impl ConfigOwner {
    pub fn new(config: Config) -> ConfigOwner {
        ConfigOwner {
            tx: watch::Sender::new(Arc::new(config)),
        }
    }

    pub fn subscribe(&self) -> LiveConfig {
        LiveConfig {
            rx: self.tx.subscribe(),
        }
    }

    pub fn current(&self) -> Arc<Config> {
        self.tx.borrow().clone()
    }

    /// Makes `config` the running configuration for every reader.
    pub fn replace(&self, config: Config) {
        // `send_replace` stores the value even while nobody reads it.
        self.tx.send_replace(Arc::new(config));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_see_the_replaced_value_at_their_next_read() {
        let owner = ConfigOwner::new(Config::default());
        let live = owner.subscribe();
        let copy = live.clone();
        assert_eq!(live.get().conversations.max_per_user, 3);
        let mut next = Config::default();
        next.conversations.max_per_user = 1;
        owner.replace(next);
        assert_eq!(live.get().conversations.max_per_user, 1);
        assert_eq!(copy.get().conversations.max_per_user, 1);
        assert_eq!(owner.current().conversations.max_per_user, 1);
    }

    #[test]
    fn a_fixed_config_stays() {
        let live = LiveConfig::fixed(Config::default());
        assert_eq!(*live.get(), Config::default());
    }
}

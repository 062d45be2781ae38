//! How many websockets each user has open, for
//! `limits.max_connections_per_user`. A slot is held by a guard that gives
//! it back when the socket's task ends, however it ends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Clone, Default)]
pub struct ConnectionCounter {
    per_user: Arc<Mutex<HashMap<String, usize>>>,
}

/// One open connection of one user.
pub struct Slot {
    counter: ConnectionCounter,
    user: String,
}

impl ConnectionCounter {
    /// Takes a slot unless the user already has `max` connections.
    pub fn acquire(&self, user: &str, max: usize) -> Option<Slot> {
        let mut map = self.per_user.lock().expect("connection counter poisoned");
        let count = map.entry(user.to_owned()).or_default();
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(Slot {
            counter: self.clone(),
            user: user.to_owned(),
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut map = self
            .counter
            .per_user
            .lock()
            .expect("connection counter poisoned");
        if let Some(count) = map.get_mut(&self.user) {
            *count -= 1;
            if *count == 0 {
                map.remove(&self.user);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_and_returned() {
        let counter = ConnectionCounter::default();
        let a = counter.acquire("alice", 2).unwrap();
        let _b = counter.acquire("alice", 2).unwrap();
        assert!(counter.acquire("alice", 2).is_none());
        assert!(counter.acquire("bob", 2).is_some());
        drop(a);
        assert!(counter.acquire("alice", 2).is_some());
    }
}

//! The store's own OS threads (the writer, the checkpointer): started by
//! name, joined when the store is dropped.

use super::*;

pub(super) fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<Joined, StoreError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(|h| Joined(Some(h)))
        .map_err(|e| StoreError::Backend(format!("spawn {name}: {e}")))
}

/// Joins a store thread when the store is dropped, so that a reopened store
/// sees everything the old one had queued.
pub(super) struct Joined(Option<JoinHandle<()>>);

impl Drop for Joined {
    fn drop(&mut self) {
        let Some(handle) = self.0.take() else {
            return;
        };
        // The last handle may be dropped by a callback, on the writer
        // itself: joining there would deadlock, and the writer ends anyway.
        if handle.thread().id() == std::thread::current().id() {
            return;
        }
        if handle.join().is_err() {
            tracing::error!("store: a store thread panicked");
        }
    }
}

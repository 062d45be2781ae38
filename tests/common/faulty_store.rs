//! A [`Store`] wrapper whose writes can be made to fail on demand, as a full
//! disk or an I/O error would: the in-process way to test store failures
//! (tests/store_faults.rs also fills a real tmpfs where the machine allows a
//! mount). Reads go through unless they are made to fail too, as with a
//! store that cannot be reached at all (NATS without quorum): a full disk
//! still reads.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use linger::event::EventRecord;
use linger::store::{AppendBatch, CommitCallback, ConversationMeta, Snapshot, Store, StoreError};

pub const INJECTED: &str = "database or disk is full (injected)";

pub struct FaultyStore {
    inner: Arc<dyn Store>,
    fault: Fault,
}

/// The switches a test flips.
#[derive(Clone, Default)]
pub struct Fault {
    writes: Arc<AtomicBool>,
    reads: Arc<AtomicBool>,
}

impl Fault {
    pub fn fail_writes(&self, fail: bool) {
        self.writes.store(fail, Ordering::SeqCst);
    }

    pub fn fail_reads(&self, fail: bool) {
        self.reads.store(fail, Ordering::SeqCst);
    }

    /// Wraps a store so that these switches control it.
    pub fn wrap(&self, inner: Arc<dyn Store>) -> Arc<dyn Store> {
        Arc::new(FaultyStore {
            inner,
            fault: self.clone(),
        })
    }
}

impl FaultyStore {
    fn failing(&self) -> bool {
        self.fault.writes.load(Ordering::SeqCst)
    }

    /// Err while reads fail.
    fn read(&self) -> Result<(), StoreError> {
        if self.fault.reads.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable(INJECTED.into()));
        }
        Ok(())
    }
}

#[async_trait]
impl Store for FaultyStore {
    fn append(&self, batch: AppendBatch, done: CommitCallback) {
        if !self.failing() {
            return self.inner.append(batch, done);
        }
        // A real store answers in queue order: fail this one only after
        // everything queued before it has been answered.
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let _ = inner.flush().await;
            done(Err(StoreError::Unavailable(INJECTED.into())), &batch.events);
        });
    }

    async fn flush(&self) -> Result<(), StoreError> {
        self.inner.flush().await
    }

    async fn get(&self, id: &str) -> Result<Option<ConversationMeta>, StoreError> {
        self.read()?;
        self.inner.get(id).await
    }

    async fn list(&self, user: Option<&str>) -> Result<Vec<ConversationMeta>, StoreError> {
        self.read()?;
        self.inner.list(user).await
    }

    async fn events(
        &self,
        id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Arc<EventRecord>>, StoreError> {
        self.read()?;
        self.inner.events(id, after, limit).await
    }

    async fn snapshot(
        &self,
        id: &str,
        tail: usize,
        client_msg_ids: usize,
    ) -> Result<Option<Snapshot>, StoreError> {
        self.read()?;
        self.inner.snapshot(id, tail, client_msg_ids).await
    }

    async fn unfinished(&self) -> Result<Vec<ConversationMeta>, StoreError> {
        self.read()?;
        self.inner.unfinished().await
    }

    async fn delete(&self, id: &str) -> Result<bool, StoreError> {
        if self.failing() {
            return Err(StoreError::Unavailable(INJECTED.into()));
        }
        self.inner.delete(id).await
    }

    async fn add_observer(&self, id: &str, user: &str) -> Result<(), StoreError> {
        if self.failing() {
            return Err(StoreError::Unavailable(INJECTED.into()));
        }
        self.inner.add_observer(id, user).await
    }

    async fn prune(&self, before: SystemTime) -> Result<u64, StoreError> {
        self.inner.prune(before).await
    }

    fn health(&self) -> Result<(), String> {
        if self.failing() || self.read().is_err() {
            return Err(INJECTED.into());
        }
        self.inner.health()
    }

    async fn probe(&self) -> Result<(), StoreError> {
        if self.failing() {
            return Err(StoreError::Unavailable(INJECTED.into()));
        }
        self.inner.probe().await
    }
}

//! The checkpointer thread: copies the WAL into the database file so that
//! the copy and its fsyncs do not hold appends back.

use super::*;

/// The checkpointer's own connection. No busy timeout: it must never wait
/// on the writer or a reader, only skip a round.
pub(super) fn open_checkpointer(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open(path)?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.busy_timeout(Duration::ZERO)?;
    Ok(conn)
}

/// Runs a passive checkpoint (never blocks the writer); returns the WAL's
/// size in frames.
pub(super) fn checkpoint(conn: &Connection) -> Result<i64, StoreError> {
    let log_frames = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| row.get(1))?;
    Ok(log_frames)
}

/// Copies the WAL into the database file off the writer's thread: done by
/// the writer (SQLite's auto-checkpoint), the copy and its two fsyncs held
/// back every append queued meanwhile by tens of milliseconds.
pub(super) struct Checkpointer {
    pub(super) conn: Connection,
    pub(super) stop: Receiver<()>,
    pub(super) restart_wanted: Arc<AtomicBool>,
    pub(super) commits: Arc<AtomicU64>,
}

impl Checkpointer {
    pub(super) fn run(self) {
        let mut seen_commits = self.commits.load(Ordering::Relaxed);
        let mut idle_rounds = 0u32;
        // Nothing is ever sent: the channel closing is the stop signal.
        while let Err(RecvTimeoutError::Timeout) = self.stop.recv_timeout(CHECKPOINT_EVERY) {
            let commits = self.commits.load(Ordering::Relaxed);
            if commits != seen_commits {
                seen_commits = commits;
                idle_rounds = 0;
            } else {
                idle_rounds = idle_rounds.saturating_add(1);
                if idle_rounds != TRUNCATE_WHEN_IDLE_FOR {
                    continue;
                }
            }
            let result = if idle_rounds == TRUNCATE_WHEN_IDLE_FOR {
                self.truncate().map(|done| {
                    if !done {
                        // A reader was in the way: try again next round.
                        idle_rounds -= 1;
                    }
                })
            } else {
                self.pass()
            };
            if let Err(e) = result {
                tracing::warn!(error = %e, "store: checkpoint failed");
            }
        }
    }

    /// Copies everything and truncates the WAL file. This mode holds new
    /// appends back while it runs, hence only when idle, and without
    /// waiting for readers (no busy timeout on this connection): if one is
    /// reading, it returns false and nothing waited.
    pub(super) fn truncate(&self) -> Result<bool, StoreError> {
        let busy: i64 = self
            .conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |row| row.get(0))?;
        if busy == 0 {
            self.restart_wanted.store(false, Ordering::Relaxed);
        }
        Ok(busy == 0)
    }

    pub(super) fn pass(&self) -> Result<(), StoreError> {
        let mut frames = checkpoint(&self.conn)?;
        if frames < RESTART_WAL_FRAMES {
            return Ok(());
        }
        // Whatever was appended while that pass ran is left for the writer's
        // restart, on its thread: catch up first so that only a few frames
        // remain.
        for _ in 0..CATCH_UP_PASSES {
            let now = checkpoint(&self.conn)?;
            let appended = now.saturating_sub(frames);
            frames = now;
            if appended <= FEW_FRAMES {
                break;
            }
        }
        self.restart_wanted.store(true, Ordering::Relaxed);
        Ok(())
    }
}

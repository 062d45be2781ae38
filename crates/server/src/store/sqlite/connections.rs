//! Opening the database: the write connection (WAL, the pragmas, the
//! tables created or migrated), and the pool of read-only connections
//! reads run on, at most [`MAX_READS_AT_ONCE`] at a time; and freeing the
//! page cache they share when the writer is quiet.

use super::*;

pub(super) fn open_writer(path: &Path) -> Result<Connection, StoreError> {
    let mut conn = Connection::open(path)?;
    let mode: String =
        conn.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Backend(format!(
            "{}: journal_mode is {mode}, WAL is required",
            path.display()
        )));
    }
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    // Checkpoints are the checkpointer's job (see `Checkpointer`).
    conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    // No journal_size_limit: cutting a WAL that grew under load back when
    // it starts over took the writer tens of milliseconds; the checkpointer
    // truncates it once the store is idle instead.
    conn.pragma_update(None, "cache_size", -16 * 1024)?;
    conn.pragma_update(None, "foreign_keys", false)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.set_prepared_statement_cache_capacity(64);
    migrate::migrate(&mut conn)?;
    Ok(conn)
}

/// Frees the pages SQLite's cache holds that no statement is using. The
/// bundled SQLite is built with `SQLITE_ENABLE_MEMORY_MANAGEMENT`, so its
/// connections share one page cache (each adds its `cache_size` to it) and
/// this frees the read connections' pages as well as `conn`'s. The writer
/// calls it when it has gone quiet, before the heaps give their free pages
/// back: an idle server otherwise kept the pages its last writes touched,
/// about 0.7 KiB per conversation after 10,000 were created
/// (BENCHMARKS.md, item 34). The next statement reads what it needs again
/// from the operating system's cache of the file.
pub(super) fn release_page_cache(conn: &Connection) {
    if let Err(e) = conn.release_memory() {
        tracing::warn!(error = %e, "store: freeing the page cache failed");
    }
}

pub(super) fn open_reader(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.set_prepared_statement_cache_capacity(32);
    Ok(conn)
}

pub(super) struct Readers {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
    /// One per read under way (see [`MAX_READS_AT_ONCE`]).
    permits: Arc<tokio::sync::Semaphore>,
}

impl Readers {
    pub(super) fn new(path: PathBuf) -> Readers {
        Readers {
            path,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(tokio::sync::Semaphore::new(MAX_READS_AT_ONCE)),
        }
    }

    /// Runs `f` on a read connection on the runtime's blocking threads,
    /// once fewer than [`MAX_READS_AT_ONCE`] reads are under way. The
    /// permit goes with the read, so a caller that stops waiting does not
    /// let another read start before this one ends.
    pub(super) async fn read<T, F>(self: &Arc<Self>, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| StoreError::Closed)?;
        let readers = self.clone();
        tokio::task::spawn_blocking(move || {
            let result = readers.with(f);
            drop(permit);
            result
        })
        .await
        .map_err(|e| StoreError::Backend(format!("read task: {e}")))?
    }

    /// The pool holds whole connections only: a panic elsewhere while it
    /// was locked leaves it usable.
    fn lock_idle(&self) -> std::sync::MutexGuard<'_, Vec<Connection>> {
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let idle = self.lock_idle().pop();
        let mut conn = match idle {
            Some(conn) => conn,
            None => open_reader(&self.path)?,
        };
        let result = f(&mut conn);
        let mut idle = self.lock_idle();
        if idle.len() < MAX_IDLE_READERS {
            idle.push(conn);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes `conn`'s page cache holds (`SQLITE_DBSTATUS_CACHE_USED`).
    fn cache_used(conn: &Connection) -> i32 {
        let (mut current, mut highest) = (0, 0);
        // SAFETY: the handle is `conn`'s own, open for the whole call, and
        // the two outputs are plain integers this frame owns.
        let rc = unsafe {
            rusqlite::ffi::sqlite3_db_status(
                conn.handle(),
                rusqlite::ffi::SQLITE_DBSTATUS_CACHE_USED,
                &mut current,
                &mut highest,
                0,
            )
        };
        assert_eq!(rc, rusqlite::ffi::SQLITE_OK);
        current
    }

    /// A store whose `filler` table holds about 2 MB.
    fn filled_store(path: &Path) -> Connection {
        let conn = open_writer(path).unwrap();
        conn.execute_batch("CREATE TABLE filler (body BLOB)")
            .unwrap();
        let mut insert = conn.prepare("INSERT INTO filler VALUES (?1)").unwrap();
        for _ in 0..2_000 {
            insert.execute([vec![7u8; 1_000]]).unwrap();
        }
        drop(insert);
        conn
    }

    /// Reads every row of `filler` whole.
    fn count_filler(conn: &Connection) -> i64 {
        let sql = "SELECT count(*) FROM filler WHERE length(body) > 0";
        conn.query_row(sql, [], |row| row.get(0)).unwrap()
    }

    /// Reads `filler` on `conn` until its cache holds the table: the cache
    /// is shared by the process, and the other tests' stores free it when
    /// they go quiet, which may come between a read and its count.
    fn cached_after_reading(conn: &Connection) -> i32 {
        for _ in 0..20 {
            assert_eq!(count_filler(conn), 2_000);
            let cached = cache_used(conn);
            if cached > 1_000_000 {
                return cached;
            }
        }
        panic!("2 MB read, {} bytes cached", cache_used(conn));
    }

    #[test]
    fn freeing_the_writers_page_cache_frees_the_readers_too() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("linger.db");
        let writer = filled_store(&path);
        let reader = open_reader(&path).unwrap();
        let (writer_filled, reader_filled) = (0..20)
            .find_map(|_| {
                let writer_filled = cached_after_reading(&writer);
                let reader_filled = cached_after_reading(&reader);
                // Read last, the writer's may have been freed meanwhile.
                (cache_used(&writer) > 1_000_000).then_some((writer_filled, reader_filled))
            })
            .expect("the writer's and the reader's caches filled at once");

        release_page_cache(&writer);
        let (writer_left, reader_left) = (cache_used(&writer), cache_used(&reader));
        assert!(
            writer_left < writer_filled / 20 && reader_left < reader_filled / 20,
            "still cached after the release: the writer {writer_left} of {writer_filled} \
             bytes, the reader {reader_left} of {reader_filled}"
        );
        // Both still read: what they need is read back.
        assert_eq!(count_filler(&writer), 2_000);
        assert_eq!(count_filler(&reader), 2_000);
    }

    #[tokio::test]
    async fn no_more_reads_run_at_once_than_the_bound() {
        use std::sync::atomic::{AtomicUsize, Ordering};

        const READS: usize = 5 * MAX_READS_AT_ONCE;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("linger.db");
        let _writer = open_writer(&path).unwrap();
        let readers = Arc::new(Readers::new(path));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let (entered_tx, mut entered) = tokio::sync::mpsc::unbounded_channel();
        // Each read holds its connection until the test lets one go.
        let (go_tx, go) = std::sync::mpsc::channel::<()>();
        let go = Arc::new(Mutex::new(go));
        let mut reads = Vec::new();
        for _ in 0..READS {
            let (readers, in_flight, most) = (readers.clone(), in_flight.clone(), most.clone());
            let (entered_tx, go) = (entered_tx.clone(), go.clone());
            reads.push(tokio::spawn(async move {
                readers
                    .read(move |conn| {
                        let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        let one: i64 = conn.query_row("SELECT 1", [], |row| row.get(0))?;
                        entered_tx.send(()).unwrap();
                        go.lock().unwrap().recv().unwrap();
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        Ok(one)
                    })
                    .await
            }));
        }
        // The first reads fill the bound; then each read let go lets the
        // next one in, until every read has run.
        for _ in 0..MAX_READS_AT_ONCE {
            entered.recv().await.unwrap();
        }
        for _ in MAX_READS_AT_ONCE..READS {
            go_tx.send(()).unwrap();
            entered.recv().await.unwrap();
        }
        for _ in 0..MAX_READS_AT_ONCE {
            go_tx.send(()).unwrap();
        }
        for read in reads {
            assert_eq!(read.await.unwrap().unwrap(), 1);
        }
        assert_eq!(most.load(Ordering::SeqCst), MAX_READS_AT_ONCE);
        assert!(
            readers.lock_idle().len() <= MAX_IDLE_READERS,
            "the pool keeps at most {MAX_IDLE_READERS} connections"
        );
    }
}

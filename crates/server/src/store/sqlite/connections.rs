//! Opening the database: the write connection (WAL, the pragmas, the
//! tables created or migrated), and the pool of read-only connections
//! reads run on; and freeing their page caches when the writer is quiet.

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

/// Frees the pages SQLite's cache holds for `conn` (up to its
/// `cache_size`). The writer calls it when it has gone quiet, before the
/// heaps give their free pages back: an idle server otherwise kept the
/// pages its last writes touched, about 0.7 KiB per conversation after
/// 10,000 were created (BENCHMARKS.md, item 34). The next statement reads
/// what it needs again from the operating system's cache of the file.
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
    pub(super) path: PathBuf,
    pub(super) idle: Mutex<Vec<Connection>>,
}

impl Readers {
    /// Frees the page caches of the read connections waiting in the pool
    /// (up to [`MAX_IDLE_READERS`] of them, up to SQLite's default 2 MB
    /// each): called with the writer's, when the store has gone quiet.
    /// Reads under way keep theirs until they are back.
    pub(super) fn release_idle_page_caches(&self) {
        for conn in self.lock_idle().iter() {
            release_page_cache(conn);
        }
    }

    /// The pool holds whole connections only: a panic elsewhere while it
    /// was locked leaves it usable.
    fn lock_idle(&self) -> std::sync::MutexGuard<'_, Vec<Connection>> {
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn with<T>(
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

    #[test]
    fn the_writer_frees_its_page_cache_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let conn = filled_store(&dir.path().join("linger.db"));
        let filled = cache_used(&conn);
        assert!(filled > 1_000_000, "2 MB written, {filled} bytes cached");

        release_page_cache(&conn);
        let left = cache_used(&conn);
        assert!(
            left < filled / 20,
            "{left} of {filled} bytes still cached after the release"
        );
        // Still usable: what it needs is read back.
        assert_eq!(count_filler(&conn), 2_000);
    }

    #[test]
    fn the_idle_readers_free_their_page_caches_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("linger.db");
        let _writer = filled_store(&path);
        let readers = Readers {
            path,
            idle: Mutex::new(Vec::new()),
        };
        let rows = readers.with(|conn| Ok(count_filler(conn))).unwrap();
        assert_eq!(rows, 2_000);
        let filled = cache_used(&readers.lock_idle()[0]);
        assert!(filled > 1_000_000, "2 MB read, {filled} bytes cached");

        readers.release_idle_page_caches();
        let left = cache_used(&readers.lock_idle()[0]);
        assert!(
            left < filled / 20,
            "{left} of {filled} bytes still cached after the release"
        );
        let rows = readers.with(|conn| Ok(count_filler(conn))).unwrap();
        assert_eq!(rows, 2_000, "and the reader reads again");
    }
}

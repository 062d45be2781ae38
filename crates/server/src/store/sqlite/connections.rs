//! Opening the database: the write connection (WAL, the pragmas, the
//! tables created or migrated), and the pool of read-only connections reads run on.

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
    pub(super) fn with<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let idle = self.idle.lock().expect("reader pool poisoned").pop();
        let mut conn = match idle {
            Some(conn) => conn,
            None => open_reader(&self.path)?,
        };
        let result = f(&mut conn);
        let mut idle = self.idle.lock().expect("reader pool poisoned");
        if idle.len() < MAX_IDLE_READERS {
            idle.push(conn);
        }
        result
    }
}

//! One process per store: an exclusive lock on `store.path/linger.lock`,
//! taken before anything in the store is read or written and held for the
//! life of the process.
//!
//! Two servers on one store would each recover, assign seq and write the
//! same conversations, so the second must not even read it. The lock is an
//! OS file lock (`flock`), so the kernel releases it when the holder exits,
//! however it exits (a SIGKILL leaves no stale lock to clean up). The file
//! also names its holder (pid, address, start time), so that a refused start
//! can say who holds the store.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The lock file's name inside `store.path`.
pub const LOCK_FILE: &str = "linger.lock";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "the store {path} is in use by another linger ({holder}); stop it, or give this \
         server its own store.path (LINGER__STORE__PATH=...)"
    )]
    Held { path: PathBuf, holder: String },
    #[error("cannot lock the store {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The held lock; dropping it (or exiting) releases the store.
#[derive(Debug)]
pub struct StoreLock {
    file: File,
    path: PathBuf,
}

impl StoreLock {
    /// Takes the store's lock, making `dir` if it does not exist yet.
    pub fn acquire(dir: &Path) -> Result<StoreLock, LockError> {
        let io = |source| LockError::Io {
            path: dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                return Err(LockError::Held {
                    path: dir.to_owned(),
                    holder: if holder.is_empty() {
                        "a process that has not said who it is yet".into()
                    } else {
                        holder.to_owned()
                    },
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        let mut lock = StoreLock { file, path };
        lock.describe_holder(None).map_err(io)?;
        Ok(lock)
    }

    /// Writes who holds the lock (this process, and its address once
    /// known) for the message a second start prints.
    pub fn describe_holder(
        &mut self,
        listening: Option<std::net::SocketAddr>,
    ) -> std::io::Result<()> {
        let since = humantime::format_rfc3339_seconds(std::time::SystemTime::now());
        let mut text = format!("pid {}", std::process::id());
        if let Some(addr) = listening {
            text.push_str(&format!(", listening on {addr}"));
        }
        text.push_str(&format!(", since {since}\n"));
        self.file.set_len(0)?;
        self.file.rewind()?;
        self.file.write_all(text.as_bytes())?;
        self.file.flush()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_one_store_is_refused_and_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = StoreLock::acquire(dir.path()).unwrap();
        first
            .describe_holder(Some("127.0.0.1:7420".parse().unwrap()))
            .unwrap();
        let err = StoreLock::acquire(dir.path()).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, LockError::Held { .. }), "{text}");
        assert!(
            text.contains(&format!("pid {}", std::process::id())),
            "{text}"
        );
        assert!(text.contains("listening on 127.0.0.1:7420"), "{text}");
        drop(first);
        StoreLock::acquire(dir.path()).expect("released on drop");
    }
}

//! The small filesystem the fault soak puts the server's store on: a tmpfs
//! the bench mounts (it runs as root), shrinks to what is used plus a little
//! and fills with a ballast file to make the disk full, then frees; always
//! unmounted when dropped.
//!
//! A tmpfs's size is a limit, not memory taken: it is mounted large enough
//! for the whole run, and only the disk-full episode shrinks it (filling a
//! large one would take that much memory).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("cannot create {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`{command}` failed: {reason}")]
    Command { command: String, reason: String },
    #[error("cannot read the usage of {path}: {source}")]
    Usage { path: PathBuf, source: nix::Error },
    #[error("ballast {path}: {source}")]
    Ballast {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub struct SmallDisk {
    dir: PathBuf,
    /// Its size while not full, bytes.
    size: u64,
}

/// A ballast file filling the disk.
pub struct Ballast {
    path: PathBuf,
    pub bytes: u64,
}

impl SmallDisk {
    /// Mounts a tmpfs of `size` bytes on a new temporary directory.
    pub fn mount(size: u64) -> Result<SmallDisk, DiskError> {
        let dir = std::env::temp_dir().join(format!(
            "linger-soak-disk-{}-{}",
            std::process::id(),
            ulid::Ulid::new()
        ));
        std::fs::create_dir_all(&dir).map_err(|source| DiskError::Dir {
            path: dir.clone(),
            source,
        })?;
        let options = format!("size={size}");
        if let Err(e) = run("mount", &["-t", "tmpfs", "-o", &options, "tmpfs"], &dir) {
            let _ = std::fs::remove_dir(&dir);
            return Err(e);
        }
        Ok(SmallDisk { dir, size })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Bytes in use.
    pub fn used(&self) -> Result<u64, DiskError> {
        let stat = nix::sys::statvfs::statvfs(&self.dir).map_err(|source| DiskError::Usage {
            path: self.dir.clone(),
            source,
        })?;
        let blocks = stat.blocks().saturating_sub(stat.blocks_free());
        // Their C types are not u64 on every target.
        #[allow(clippy::unnecessary_cast)]
        Ok(blocks as u64 * stat.fragment_size() as u64)
    }

    /// Shrinks the disk to what is used plus `headroom` bytes and fills
    /// the headroom with a ballast file: writes fail from here.
    pub fn fill(&self, headroom: u64) -> Result<Ballast, DiskError> {
        let page = 4096;
        let size = (self.used()? + headroom).div_ceil(page) * page;
        self.resize(size)?;
        let path = self.dir.join("ballast");
        match write_until_full(&path, size) {
            Ok(bytes) => Ok(Ballast { path, bytes }),
            Err(source) => {
                // Not full after all: give the disk its size back.
                let _ = std::fs::remove_file(&path);
                let _ = self.resize(self.size);
                Err(DiskError::Ballast { path, source })
            }
        }
    }

    /// Removes the ballast and gives the disk its size back.
    pub fn free(&self, ballast: Ballast) -> Result<(), DiskError> {
        std::fs::remove_file(&ballast.path).map_err(|source| DiskError::Ballast {
            path: ballast.path.clone(),
            source,
        })?;
        self.resize(self.size)
    }

    fn resize(&self, size: u64) -> Result<(), DiskError> {
        run("mount", &["-o", &format!("remount,size={size}")], &self.dir)
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        // Lazily if something still holds it open: the mount goes either
        // way.
        if run("umount", &[], &self.dir).is_err() {
            if let Err(e) = run("umount", &["-l"], &self.dir) {
                eprintln!("soak: could not unmount {}: {e}", self.dir.display());
                return;
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Writes `path` until the disk is full (at most `size` bytes); the bytes
/// written.
fn write_until_full(path: &Path, size: u64) -> std::io::Result<u64> {
    let mut file = std::fs::File::create(path)?;
    let mut bytes = 0u64;
    // Bounded: the disk holds at most `size` bytes.
    for chunk in [64 * 1024, 512] {
        let block = vec![0u8; chunk];
        for _ in 0..=size / chunk as u64 {
            if file.write_all(&block).is_err() {
                break;
            }
            bytes += chunk as u64;
        }
    }
    let _ = file.sync_all();
    Ok(bytes)
}

/// Runs `program args dir`, its stderr the reason when it fails.
fn run(program: &str, args: &[&str], dir: &Path) -> Result<(), DiskError> {
    let command = format!("{program} {} {}", args.join(" "), dir.display());
    let out = Command::new(program)
        .args(args)
        .arg(dir)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| DiskError::Command {
            command: command.clone(),
            reason: e.to_string(),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(DiskError::Command {
            command,
            reason: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }
}

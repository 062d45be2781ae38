//! The C allocator's settings for this process: two of glibc's malloc
//! parameters, set once at start, so that what linger keeps in memory is
//! bounded by its configuration rather than by the largest or the busiest
//! thing that ever passed through it. Elsewhere than glibc, nothing.

/// Allocations at least this large get a mapping of their own, returned to
/// the system when freed. Above what the hot paths allocate (a batch of
/// frames, a socket's write buffer under load), which mapping and
/// unmapping each time would slow down; below a long message.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: usize = 1024 * 1024;

/// Sets the parameters, unless the environment sets them already
/// (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_ARENA_MAX` or `GLIBC_TUNABLES`): an
/// operator's choice wins. Call it first thing, before any thread starts.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    glibc::tune(std::thread::available_parallelism().map_or(2, |n| n.get()));
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    use super::MMAP_THRESHOLD;

    pub(super) fn tune(cores: usize) {
        let set = |name: &str| std::env::var_os(name).is_some();
        if set("GLIBC_TUNABLES") {
            return;
        }
        // glibc raises its mapping threshold to the size of each large
        // block freed (up to 32 MiB). After one long assistant message
        // (its frame, its record, a socket's write buffer grown for it),
        // blocks of that size come from the heaps, which keep them once
        // freed: a server's memory then grew with the longest turn it
        // served. Setting it also keeps glibc from raising its trim
        // threshold, so what is freed at a heap's top goes back as well.
        if !set("MALLOC_MMAP_THRESHOLD_") {
            set_parameter(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        }
        // glibc makes up to 8 heaps (arenas) per core, one more each time
        // a thread finds the others busy, and each keeps what was freed in
        // it. Four per core (at least eight): one heap per core made the
        // runtime's workers, the store's writer and its checkpointer wait
        // on each other's heap locks (saturated, 10 % fewer events per
        // second at 10 % more CPU per event), while four per core hold
        // what one per core held within a few MiB (BENCHMARKS.md, items
        // 17 and 20).
        if !set("MALLOC_ARENA_MAX") {
            set_parameter(libc::M_ARENA_MAX, (4 * cores).max(8));
        }
    }

    fn set_parameter(parameter: libc::c_int, value: usize) {
        let value = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt only reads its two integers; glibc takes its
        // own lock, so a call while other threads allocate is sound.
        let _ = unsafe { libc::mallopt(parameter, value) };
    }
}

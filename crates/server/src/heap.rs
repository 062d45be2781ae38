//! Giving the C allocator's freed memory back to the system, at moments
//! its owner chooses. glibc keeps what a thread freed in its heap (arena)
//! for the next allocation; only a heap's top goes back on its own. A
//! large transient working set whose blocks sat among long-lived ones
//! (the store's fold, between the rows it keeps in its caches) thus stays
//! resident after it is gone. Elsewhere than glibc, nothing.

/// Returns the free pages of every heap to the system; whether any went
/// back. It walks each heap under its lock, which waits for the kernel to
/// take the pages (under a millisecond at 10,000 idle conversations here,
/// 59 ms for 370 MiB), and costs a page fault per page reused later, so
/// call it when the process has gone quiet, not on a hot path.
pub fn release_freed() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes each heap's own lock; it only releases
    // pages no allocation holds.
    unsafe {
        libc::malloc_trim(0) == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// The resident KiB of the mappings that hold any of `addresses`
    /// (`/proc/self/smaps`), each counted once.
    fn resident_kib_around(addresses: &[usize]) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut total = 0;
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((from, to)) = first.split_once('-') {
                if let (Ok(from), Ok(to)) = (
                    usize::from_str_radix(from, 16),
                    usize::from_str_radix(to, 16),
                ) {
                    inside = addresses.iter().any(|a| (from..to).contains(a));
                    continue;
                }
            }
            if inside {
                if let Some(kib) = line.strip_prefix("Rss:") {
                    let kib = kib.trim().trim_end_matches("kB").trim();
                    total += kib.parse::<u64>().expect("an Rss line");
                    inside = false;
                }
            }
        }
        total
    }

    #[test]
    fn pages_freed_among_kept_blocks_go_back() {
        // On a thread of its own, so that its heap holds mostly this:
        // 32 MiB in blocks below glibc's mapping threshold, every 16th
        // followed by a small block that stays, then every large one
        // freed (in runs of 64 KiB between the kept ones). None of the
        // freed pages is at the heap's top, so only a release returns
        // them.
        std::thread::spawn(|| {
            let mut kept = Vec::with_capacity(512);
            let mut freed = Vec::with_capacity(8192);
            for i in 0..8192 {
                freed.push(vec![1u8; 4096]);
                if i % 16 == 15 {
                    kept.push(vec![2u8; 32]);
                }
            }
            // The blocks may span more than one of the heap's mappings.
            let heap: Vec<usize> = kept.iter().map(|k| k.as_ptr() as usize).collect();
            // Read while everything is held: a store writer of another
            // test may release the heaps at any moment once it is freed.
            let held = resident_kib_around(&heap);
            drop(freed);
            release_freed();
            let after = resident_kib_around(&heap);
            assert!(
                after + 16 * 1024 < held,
                "resident {held} KiB with the blocks held, {after} after they were freed \
                 and the heaps released"
            );
            assert!(kept.iter().all(|k| k.iter().all(|&b| b == 2)));
        })
        .join()
        .expect("the allocating thread");
    }
}

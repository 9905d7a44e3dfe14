//! The process's memory, as the OS reports it.

/// A snapshot of this process's memory use, in bytes.
///
/// On Linux all fields come from `/proc/self/status`. Elsewhere only
/// `peak_rss` is known (from `getrusage`, whose unit differs by platform:
/// KiB on Linux, bytes on macOS; converted here).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessMemory {
    /// Resident set size now (`VmRSS`).
    pub rss: Option<u64>,
    /// Peak resident set size (`VmHWM` / `ru_maxrss`).
    pub peak_rss: Option<u64>,
    /// Private anonymous memory now (`RssAnon`): heap, MLX buffers, copies.
    pub rss_anon: Option<u64>,
    /// File-backed resident memory now (`RssFile`): mapped weights.
    pub rss_file: Option<u64>,
}

impl ProcessMemory {
    /// Reads the current figures.
    pub fn read() -> ProcessMemory {
        let mut memory = ProcessMemory::default();
        if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
            for line in status.lines() {
                let mut parts = line.split_whitespace();
                let (Some(key), Some(value)) = (parts.next(), parts.next()) else {
                    continue;
                };
                let bytes = value.parse::<u64>().ok().map(|kib| kib * 1024);
                match key {
                    "VmRSS:" => memory.rss = bytes,
                    "VmHWM:" => memory.peak_rss = bytes,
                    "RssAnon:" => memory.rss_anon = bytes,
                    "RssFile:" => memory.rss_file = bytes,
                    _ => {}
                }
            }
        }
        if memory.peak_rss.is_none() {
            memory.peak_rss = peak_rss_from_rusage();
        }
        memory
    }
}

/// The memory this process may use, in bytes: the machine's physical
/// memory, or on Linux the limit of the process's cgroup (v2
/// `memory.max`, as containers and `systemd-run -p MemoryMax=` set it)
/// when that is lower. `None` when the OS does not say.
pub fn memory_limit() -> Option<u64> {
    let physical = physical_memory();
    match (physical, cgroup_memory_max()) {
        (Some(p), Some(c)) => Some(p.min(c)),
        (p, c) => p.or(c),
    }
}

fn physical_memory() -> Option<u64> {
    #[cfg(unix)]
    {
        // SAFETY: sysconf only reads system configuration values.
        let (pages, page_size) = unsafe {
            (
                libc::sysconf(libc::_SC_PHYS_PAGES),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        let (pages, page_size) = (u64::try_from(pages).ok()?, u64::try_from(page_size).ok()?);
        pages.checked_mul(page_size)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// The lowest memory limit of this process's cgroup and its ancestors:
/// v2 `memory.max`, or v1 `memory.limit_in_bytes` (whose "no limit" is a
/// number near 2⁶³, which physical memory then undercuts).
fn cgroup_memory_max() -> Option<u64> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let root = std::path::Path::new("/sys/fs/cgroup");
    let mut limits = Vec::new();
    for line in cgroups.lines() {
        // `hierarchy:controllers:/path`; v2's is `0::/path`.
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next(), fields.next()?, fields.next()?);
        let (base, file) = match controllers {
            "" => (root.to_path_buf(), "memory.max"),
            c if c.split(',').any(|c| c == "memory") => {
                (root.join("memory"), "memory.limit_in_bytes")
            }
            _ => continue,
        };
        let mut dir = base.join(path.trim_start_matches('/'));
        loop {
            // "max" (no limit) does not parse.
            if let Some(limit) = std::fs::read_to_string(dir.join(file))
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
            {
                limits.push(limit);
            }
            if dir == base || !dir.pop() {
                break;
            }
        }
    }
    limits.into_iter().min()
}

/// Drops `path` from the OS page cache so that the next read of it comes
/// from the disk: what a "cold" measurement needs. Linux only
/// (`posix_fadvise(DONTNEED)`, which skips pages some process has mapped
/// or dirtied); false where it cannot.
pub fn evict_from_page_cache(path: &std::path::Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let Ok(file) = std::fs::File::open(path) else {
            return false;
        };
        // SAFETY: a valid open descriptor; the call only advises the kernel.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        false
    }
}

/// `getrusage(who)`: the process's or (Linux) the calling thread's usage.
fn rusage(who: libc::c_int) -> Option<libc::rusage> {
    // SAFETY: getrusage fills the zero-initialised struct we own.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        (libc::getrusage(who, &mut usage) == 0).then_some(usage)
    }
}

fn peak_rss_from_rusage() -> Option<u64> {
    let max = u64::try_from(rusage(libc::RUSAGE_SELF)?.ru_maxrss).ok()?;
    // ru_maxrss is in bytes on macOS and in KiB elsewhere.
    Some(if cfg!(target_os = "macos") {
        max
    } else {
        max * 1024
    })
}

/// Asks the C allocator to keep freed memory for reuse instead of handing
/// it back to the OS at once, in one heap, and MLX to leave the caching of
/// freed buffers to it; returns whether it applied.
///
/// Why: MLX's CPU backend allocates and frees a buffer for every
/// operation, on the thread that runs its stream. With glibc's defaults
/// that thread's heap shrinks whenever the free space at its top passes
/// the trim threshold, and the next operations fault the same pages back
/// in, each one zeroed by the kernel: about a million page faults (four
/// gigabytes) for 32 conversations of the engine benchmark, which ran
/// about a fifth faster without them. This fixes the size from which
/// blocks are mapped on their own at 32 MiB (glibc's ceiling for its
/// adaptive threshold) and keeps 64 MiB free at the top of the heap when
/// it shrinks.
///
/// One heap for every thread (glibc's `M_ARENA_MAX` 1): each MLX stream
/// runs on its own thread, and with a heap per thread each kept its own
/// free memory (the engine's two lanes peaked 40 MB higher). And MLX's own
/// cache of freed buffers is turned off (`set_cache_limit(0)`): with the
/// heap keeping freed memory, the two caches held the same memory twice
/// (another 50 MB with two lanes). Together, SmolLM2 classification at
/// batch 8 on two lanes peaked at 776 MB instead of 875 MB, in the same
/// time (docs/mlx-engine.md, "Chunks in lanes").
///
/// Process-wide, so it is the application's choice: no library here calls
/// it; the engine benchmark, the examples and the demo do, first thing.
/// glibc only: elsewhere it does nothing and returns `false`.
pub fn retain_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes the allocator's tuning parameters;
        // glibc takes its own locks to do so.
        let tuned = unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                && libc::mallopt(libc::M_TOP_PAD, 64 << 20) == 1
                && libc::mallopt(libc::M_ARENA_MAX, 1) == 1
        };
        tuned && mlx_rs::memory::set_cache_limit(0).is_ok()
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Hands the memory that is allocated but free back to the OS: MLX's cache
/// of freed buffers, then the C heap's free pages; returns whether the heap
/// gave any back.
///
/// Why: loading a model leaves memory behind that nothing uses any more
/// (a tokenizer's parsed file, the weights' transient copies, the first
/// forward's arrays), and the allocator keeps it resident. After the
/// streamed load of an E2B-shaped model that was about half of the
/// process's RSS. Called once after a load, it lowers what the process
/// holds between requests; it does not lower the peak, since the next
/// forward takes the same amount again. Not to be called per request: the
/// pages it returns are faulted in again, each one zeroed by the kernel,
/// which is what [`retain_freed_memory`] exists to avoid.
///
/// glibc's `malloc_trim`, which also returns the free pages in the middle
/// of the heap; other allocators (macOS's) return free pages themselves,
/// and there only MLX's cache is cleared and the result is `false`.
pub fn release_free_memory() -> bool {
    // An error here leaves the cache as it was: nothing to report.
    let _ = mlx_rs::memory::clear_cache();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only returns free memory to the OS, under
        // the allocator's own locks.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_is_at_least_current_and_grows_with_touched_memory() {
        let before = ProcessMemory::read();
        let peak_before = before
            .peak_rss
            .expect("peak RSS is known on every platform");
        if cfg!(target_os = "linux") {
            assert!(before.rss.unwrap() <= peak_before);
            assert!(before.rss_anon.is_some() && before.rss_file.is_some());
        }
        // Touch 64 MiB so it becomes resident.
        let block = vec![1u8; 64 << 20];
        assert_eq!(block.iter().map(|&b| u64::from(b)).sum::<u64>(), 64 << 20);
        let after = ProcessMemory::read();
        assert!(after.peak_rss.unwrap() >= peak_before.max(60 << 20));
        drop(block);
    }

    #[test]
    fn the_memory_limit_is_known_and_at_most_physical_memory() {
        let limit = memory_limit().expect("known on Linux and macOS");
        assert!(limit <= physical_memory().unwrap());
        // No machine that runs MLX has less than 256 MiB.
        assert!(limit >= 256 << 20, "{limit}");
    }

    /// Minor page faults of the calling thread so far.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn thread_faults() -> i64 {
        rusage(libc::RUSAGE_THREAD).unwrap().ru_minflt
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn retained_memory_is_reused_without_faulting_it_in_again() {
        assert!(retain_freed_memory());
        // A dozen buffers of 4 MiB alive at once, then freed, round after
        // round, on a thread of its own (its own heap), as MLX's operations
        // use memory: the first round faults the pages in; with glibc's
        // defaults, the heap would shrink after each round and the next
        // round fault them in again.
        let faults = std::thread::spawn(|| {
            let start = thread_faults();
            let mut first_round = 0;
            for round in 0..10u8 {
                let buffers: Vec<Vec<u8>> = (0..12).map(|_| vec![round + 1; 4 << 20]).collect();
                assert!(buffers.iter().all(|b| b[b.len() - 1] == round + 1));
                drop(buffers);
                if round == 0 {
                    first_round = thread_faults() - start;
                }
            }
            (first_round, thread_faults() - start)
        })
        .join()
        .unwrap();
        let (first_round, all) = faults;
        assert!(first_round > 5_000, "{faults:?}");
        assert!(all < first_round * 2, "{faults:?}");
    }
}

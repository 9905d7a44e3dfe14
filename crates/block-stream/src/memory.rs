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

fn peak_rss_from_rusage() -> Option<u64> {
    // SAFETY: getrusage fills the zero-initialised struct we own.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return None;
        }
        usage
    };
    let max = u64::try_from(usage.ru_maxrss).ok()?;
    // ru_maxrss is in bytes on macOS and in KiB elsewhere.
    Some(if cfg!(target_os = "macos") {
        max
    } else {
        max * 1024
    })
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
}

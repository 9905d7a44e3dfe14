//! Free heap memory handed back to the OS. Its own test binary: the
//! figures are the process's resident memory, which other tests running
//! at the same time would move.

/// Resident anonymous memory now, in bytes (Linux).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn rss_anon() -> u64 {
    mlx_support::ProcessMemory::read()
        .rss_anon
        .expect("Linux reports RssAnon")
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn freed_heap_memory_leaves_the_process_when_released() {
    const BLOCK: usize = 64 << 10;
    const BLOCKS: usize = 1024;
    // 64 MiB in blocks small enough for the heap (glibc maps larger ones
    // on their own and unmaps them when freed), every page written.
    let blocks: Vec<Vec<u8>> = (0..BLOCKS).map(|i| vec![i as u8 | 1; BLOCK]).collect();
    // Allocated after them, so the heap cannot shrink from its top past
    // them: what is freed below it stays resident until released.
    let pin = vec![7u8; BLOCK];
    let filled = rss_anon();
    drop(blocks);
    let freed = rss_anon();
    assert!(
        filled.saturating_sub(freed) < 16 << 20,
        "freeing alone gave back {} MiB",
        filled.saturating_sub(freed) >> 20
    );
    assert!(mlx_support::release_free_memory());
    let released = rss_anon();
    assert!(
        freed.saturating_sub(released) >= 56 << 20,
        "released {} MiB of the 64 MiB freed",
        freed.saturating_sub(released) >> 20
    );
    assert_eq!(
        pin.iter().map(|&b| u64::from(b)).sum::<u64>(),
        7 * BLOCK as u64
    );
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
#[test]
fn elsewhere_the_heap_is_left_to_its_allocator() {
    assert!(!mlx_support::release_free_memory());
}

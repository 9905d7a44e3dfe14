//! Checks that MLX's memory statistics follow an allocation, alone in its
//! process: the counters are process-wide, so tests running beside it in
//! one process (plain `cargo test`) would move them. `tests/mlx_runtime.rs`
//! runs it; it exits non-zero, saying why, when a check fails.

use anyhow::{ensure, Result};
use mlx_rs::{memory, Array};
use mlx_support::{best_device, use_device};

fn main() -> Result<()> {
    use_device(best_device())?;
    memory::clear_cache()?;
    memory::reset_peak_memory()?;
    let before = memory::active_memory()?;
    let bytes = 64 << 20;
    let big = Array::zeros::<f32>(&[(bytes / 4) as i32])?;
    big.eval()?;
    let during = memory::active_memory()?;
    ensure!(
        during >= before + bytes,
        "active {before} -> {during} after a {bytes}-byte array"
    );
    ensure!(memory::peak_memory()? >= during, "peak below active memory");
    drop(big);
    let after = memory::active_memory()?;
    ensure!(
        after + bytes <= during,
        "active memory did not drop: {during} -> {after}"
    );
    // Freed buffers go to MLX's cache until it is cleared.
    memory::clear_cache()?;
    ensure!(memory::cache_memory()? == 0, "the cache was not cleared");
    ensure!(
        memory::peak_memory()? >= before + bytes,
        "peak forgets the freed array"
    );
    println!("memory statistics: active {before} -> {during} -> {after} bytes");
    Ok(())
}

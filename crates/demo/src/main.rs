//! `cargo xtask demo`: shows the toolkit working on this machine.
//!
//! At this stage it reports what MLX runs on here: version, device, BLAS and
//! a measured matmul throughput.

use anyhow::Result;
use block_stream::{best_device, use_device};
use mlx_rs::Dtype;

fn main() -> Result<()> {
    let device = use_device(best_device())?;
    println!(
        "MLX {} (mlx-rs 0.33.0, mlx-c 0.7.0)",
        block_stream::mlx_version()
    );
    println!("device: {device}");
    println!("BLAS: {} (libmlx from {})", mlx_sys::BLAS, mlx_sys::LIB_DIR);
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        let report = demo::matmul_gflops(1024, dtype, 2, 5)?;
        println!(
            "matmul 1024³ {:?}: {:.1} GFLOP/s median of {} (spread {:.1})",
            dtype,
            report.median(),
            report.runs_gflops.len(),
            report.spread()
        );
    }
    Ok(())
}

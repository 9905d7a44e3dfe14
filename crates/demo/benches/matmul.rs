//! Matmul throughput of MLX on this machine (`cargo xtask bench`).
//!
//! A bench binary rather than criterion: each run is a whole MLX evaluation,
//! and the figure users want is GFLOP/s with its spread.

use mlx_rs::Dtype;

fn main() -> anyhow::Result<()> {
    mlx_support::use_device(mlx_support::best_device())?;
    println!(
        "BLAS: {}, kernels {} (OPENBLAS_CORETYPE {})",
        mlx_sys::BLAS,
        mlx_support::kernels_in_use().unwrap_or_else(|| "none (no OpenBLAS)".into()),
        std::env::var("OPENBLAS_CORETYPE").unwrap_or_else(|_| "unset".into())
    );
    for n in [256, 1024] {
        for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
            let report = demo::matmul_gflops(n, dtype, 2, 9)?;
            println!(
                "matmul {n}³ {dtype:?}: median {:.1} GFLOP/s, min {:.1}, max {:.1} ({} runs)",
                report.median(),
                report.runs_gflops[0],
                report.runs_gflops[report.runs_gflops.len() - 1],
                report.runs_gflops.len()
            );
        }
    }
    Ok(())
}

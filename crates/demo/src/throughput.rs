//! Matmul throughput, measured with MLX evaluation inside the timed region.

use anyhow::Result;
use mlx_rs::Dtype;

/// Timings of one square matmul size and dtype.
#[derive(Debug, Clone)]
pub struct MatmulReport {
    /// Side of the square matrices.
    pub n: i32,
    /// Element type.
    pub dtype: Dtype,
    /// GFLOP/s of each timed run (2·n³ flops per run), sorted ascending.
    pub runs_gflops: Vec<f64>,
}

impl MatmulReport {
    /// The median run.
    pub fn median(&self) -> f64 {
        self.runs_gflops[self.runs_gflops.len() / 2]
    }

    /// Fastest minus slowest run.
    pub fn spread(&self) -> f64 {
        self.runs_gflops.last().unwrap_or(&0.0) - self.runs_gflops.first().unwrap_or(&0.0)
    }
}

/// Multiplies two random `n × n` matrices of `dtype`, `warmup` untimed then
/// `runs` timed times; each timed run evaluates its result before the clock stops.
pub fn matmul_gflops(n: i32, dtype: Dtype, warmup: usize, runs: usize) -> Result<MatmulReport> {
    let runs_gflops = mlx_support::gemm_gflops((n, n, n), dtype, warmup, runs)?;
    Ok(MatmulReport {
        n,
        dtype,
        runs_gflops,
    })
}

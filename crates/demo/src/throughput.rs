//! Matmul throughput, measured with MLX evaluation inside the timed region.

use std::time::Instant;

use anyhow::Result;
use mlx_rs::{random, transforms::eval, Array, Dtype};

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
    let key = random::key(7)?;
    let a = random::normal::<f32>(&[n, n], None, None, &key)?.as_dtype(dtype)?;
    let b = random::normal::<f32>(&[n, n], None, None, &key)?.as_dtype(dtype)?;
    eval([&a, &b])?;
    let once = |a: &Array, b: &Array| -> Result<f64> {
        let start = Instant::now();
        let c = a.matmul(b)?;
        c.eval()?;
        Ok(start.elapsed().as_secs_f64())
    };
    for _ in 0..warmup {
        once(&a, &b)?;
    }
    let flops = 2.0 * f64::from(n).powi(3);
    let mut runs_gflops = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        runs_gflops.push(flops / once(&a, &b)? / 1e9);
    }
    runs_gflops.sort_by(f64::total_cmp);
    Ok(MatmulReport {
        n,
        dtype,
        runs_gflops,
    })
}

//! Shared pieces of the demo binary and the benchmarks.

mod throughput;

pub use throughput::{matmul_gflops, MatmulReport};

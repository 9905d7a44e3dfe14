//! Shared pieces of the demo binary and the benchmarks: matmul throughput,
//! a synthetic many-block transformer, and measured streaming passes.

pub mod e2e;
pub mod streaming;
pub mod synthetic;
mod throughput;

pub use throughput::{matmul_gflops, MatmulReport};

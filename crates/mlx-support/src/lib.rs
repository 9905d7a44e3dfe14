//! The MLX pieces every MLX-using crate of this workspace shares, each
//! written once: arrays from safetensors bytes and back, the device policy,
//! the process's memory as the OS reports it, mlx_lm's quantization config
//! (per-module overrides included), the LoRA arithmetic that fuses an
//! adapter into a dense or quantized weight, and which BLAS kernels run
//! ([`kernels_in_use`], [`reexec_with_best_kernels`]).
//!
//! Why a crate of its own: block-stream (streaming), adapter-fuse (fusing)
//! and mlx-engine (serving) each need these, and none of them should depend
//! on another only to borrow them. A fuser that writes a fused model and a
//! fuser that applies an adapter while streaming must be the same
//! arithmetic; here they are the same function.
//!
//! ```
//! use mlx_rs::Array;
//! use mlx_support::{fuse_lora, LinearWeights, Lora, LoraLayout};
//!
//! # fn main() -> Result<(), mlx_support::Error> {
//! mlx_support::use_device(mlx_support::best_device())?;
//! // A 2×2 identity, and a rank-1 mlx_lm adapter: a (in, rank), b (rank, out).
//! let w = LinearWeights::dense(Array::from_slice(&[1.0f32, 0.0, 0.0, 1.0], &[2, 2]));
//! let a = Array::from_slice(&[1.0f32, 0.0], &[2, 1]);
//! let b = Array::from_slice(&[0.0f32, 1.0], &[1, 2]);
//! let fused = fuse_lora(&w, None, Lora { a: &a, b: &b, scale: 2.0, layout: LoraLayout::MlxLm })?;
//! fused.weight.eval()?;
//! // W + 2 · (Bᵀ @ Aᵀ): row 1, column 0 gains 2.
//! assert_eq!(fused.weight.as_slice::<f32>(), &[1.0, 0.0, 2.0, 1.0]);
//! # Ok(())
//! # }
//! ```
//!
//! # Errors
//!
//! [`Error`] names the tensor or setting: dtypes MLX cannot hold, shapes
//! past its 32-bit dimensions, byte lengths that disagree with a shape,
//! unusable quantization entries, LoRA pairs that do not fit their weight.
//! Device choices have their own [`DeviceError`].

mod blas;
mod bytes;
mod checkpoint;
mod device;
pub mod distributed;
mod error;
mod lora;
mod memory;
mod quant;
pub mod quantized;

pub use blas::{
    best_coretype, blas_threads, gemm_gflops, kernels_in_use, reexec_with_best_kernels,
    runs_generic_kernels, set_blas_threads, CpuFeatures,
};
pub use bytes::{
    array_from_bytes, array_to_bytes, array_written, checked_dtype, checked_shape, mlx_dtype_of,
};
pub use checkpoint::unused_by_mlx_lm;
pub use device::{
    best_device, current_device, is_available, mlx_version, use_device, ComputeDevice, DeviceError,
};
pub use error::{Error, Result};
pub use lora::{fuse_lora, fused_dense, LinearWeights, Lora, LoraLayout};
pub use memory::{
    evict_from_page_cache, memory_limit, release_free_memory, retain_freed_memory, ProcessMemory,
};
pub use quant::{QuantMode, Quantization, QuantizationConfig};

/// Compiles the README's example with the doc-tests, so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

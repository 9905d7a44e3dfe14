//! Run a transformer whose weights do not fit in memory by binding one
//! block's weights at a time into a single shared block module, so resident
//! memory stays near one block instead of all of them.
//!
//! [`BlockStreamer`] maps each block's bytes from the safetensors files
//! (copy-on-write, paged in lazily), turns them into MLX arrays without
//! copying, and swaps them into the module; the previous block's arrays are
//! freed and unmapped as they are replaced. [`BlockLoraSource`] indexes
//! per-block LoRA pairs, and a [`LoraFuser`] ([`DenseLoraFuser`],
//! [`QuantizedLoraFuser`] or any closure) applies them while binding.
//!
//! This is the lowest crate that uses MLX, so it also holds the workspace's
//! device policy: [`best_device`] picks the Metal GPU where MLX has one and the
//! CPU otherwise, and [`use_device`] refuses an unavailable device with a typed
//! error instead of letting MLX abort.
//!
//! ```
//! use block_stream::{best_device, use_device, ComputeDevice};
//!
//! let device = best_device();
//! let chosen = use_device(device).expect("the best device is available");
//! assert_eq!(chosen, device);
//! if !cfg!(target_os = "macos") {
//!     // MLX's Linux CPU backend has no GPU: asking for one is an error.
//!     assert!(use_device(ComputeDevice::Gpu).is_err());
//! }
//! ```
//!
//! # Errors
//!
//! [`Error`] names the file, block and parameter: unknown blocks list the
//! known ones; a missing, extra, mis-shaped or mis-typed parameter fails the
//! bind and leaves the module unchanged; LoRA sources without a fuser are an
//! error, not silently ignored.

mod bytes;
mod device;
mod error;
mod lora;
mod mapped;
mod memory;
mod streamer;

pub use bytes::{array_from_bytes, array_to_bytes};
pub use device::{
    best_device, current_device, is_available, mlx_version, use_device, ComputeDevice, DeviceError,
};
pub use error::{Error, Result};
pub use lora::{BlockLoraSource, DenseLoraFuser, LoraFuser, LoraPair, QuantizedLoraFuser};
pub use memory::{retain_freed_memory, ProcessMemory};
pub use streamer::BlockStreamer;

/// Compiles the README's example with the doc-tests, so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

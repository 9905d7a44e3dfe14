//! Run a transformer whose weights do not fit in memory by binding one
//! block's weights at a time into a single shared block module, so resident
//! memory stays near one block instead of all of them.
//!
//! [`BlockStreamer`] swaps each block's tensors into the module as MLX's
//! own lazy loads from the safetensors files (headers validated by
//! `st-mmap`): each tensor is read once, when first evaluated, straight
//! into the buffer MLX keeps for it, and the previous block's arrays are
//! freed as they are replaced. [`BlockLoraSource`] indexes
//! per-block LoRA pairs, and a [`LoraFuser`] ([`DenseLoraFuser`],
//! [`QuantizedLoraFuser`] or any closure) applies them while binding.
//!
//! ```
//! use block_stream::BlockStreamer;
//! use mlx_rs::{macros::ModuleParameters, module::Module, nn::Linear, Array};
//!
//! #[derive(Debug, ModuleParameters)]
//! struct Block {
//!     #[param]
//!     proj: Linear,
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("model.safetensors");
//! # let weights: Vec<(String, Array)> = (0..3)
//! #     .flat_map(|i| [
//! #         (format!("blocks.{i}.proj.weight"), Array::full::<f32>(&[4, 4], Array::from_f32(i as f32)).unwrap()),
//! #         (format!("blocks.{i}.proj.bias"), Array::zeros::<f32>(&[4]).unwrap()),
//! #     ])
//! #     .collect();
//! # Array::save_safetensors(weights.iter().map(|(k, v)| (k.as_str(), v)), None, &path)?;
//! // One module; each block's weights are bound into it in turn.
//! let mut block = Block { proj: Linear::new(4, 4)? };
//! let mut streamer = BlockStreamer::new([&path], "blocks.")?;
//! let mut x = Array::ones::<f32>(&[1, 4])?;
//! for i in streamer.blocks() {
//!     streamer.bind(&mut block, i, &[])?; // block i in, block i-1 out
//!     x = block.proj.forward(&x)?;
//!     x.eval()?;
//! }
//! // Block 0 zeroes x; blocks 1 and 2 keep it at zero.
//! assert_eq!(x.as_slice::<f32>(), &[0.0; 4]);
//! # Ok(())
//! # }
//! ```
//!
//! The device policy, the bytes ↔ arrays conversions and the LoRA
//! arithmetic the fusers use live in `mlx-support`.
//!
//! # The Python original's API, here
//!
//! | mlx-arsenal | block-stream |
//! | --- | --- |
//! | `BlockStreamer(paths, prefix, lora_fuser)` | `BlockStreamer::new(paths, prefix)?.with_fuser(f)` |
//! | `block_keys(i)`, `bind(block, i, evict_previous, lora_sources)` | `block_keys(i)`, `bind(block, i, lora_sources)` (the previous block is always evicted; `with_cache_clearing`) |
//! | `close()` | drop the streamer |
//! | `BlockLoraSource(path, prefix, strength, key_mapper)` | `BlockLoraSource::open` / `open_with_mapper` |
//! | `has_block(i)`, `get_block_lora_dict(i)`, `close()` | `has_block(i)`, `block_lora(i)` (or `pairs(i)`), drop |
//!
//! # Errors
//!
//! [`Error`] names the file, block and parameter: unknown blocks list the
//! known ones; a missing, extra, mis-shaped or mis-typed parameter fails the
//! bind and leaves the module unchanged; LoRA sources without a fuser are an
//! error, not silently ignored.

mod adapter;
mod error;
mod loader;
mod lora;
mod streamer;

pub use adapter::MlxLmAdapter;
pub use error::{Error, Result};
pub use lora::{
    BlockLoraSource, CheckpointLoraFuser, DenseLoraFuser, LoraFuser, LoraPair, QuantizedLoraFuser,
};
pub use mlx_support::LoraLayout;
pub use streamer::BlockStreamer;

/// Compiles the README's example with the doc-tests, so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

//! Batched MLX inference on a dedicated worker thread that owns the model,
//! computes the prompt cache of the shared prefix messages once, and runs
//! greedy generation (one token by default: classification) over many
//! conversations.
//!
//! Why: MLX is not thread-safe across threads sharing arrays, and most of a
//! classification prompt is a shared prefix worth computing once.
//!
//! Status: the decoder ([`Model`]: llama, mistral, qwen2, qwen3 from an
//! mlx_lm-format folder, with a key/value cache and padded batches) is here;
//! the worker-thread engine, tokenizer and chat templates are not yet.
//!
//! ```no_run
//! use mlx_engine::{KvCache, Model, QuantizedWeights};
//! use mlx_rs::Array;
//!
//! # fn main() -> mlx_engine::Result<()> {
//! let model = Model::load("models/SmolLM2-135M-Instruct".as_ref(), QuantizedWeights::DequantizeF32)?;
//! let mut cache = KvCache::new();
//! let logits = model.forward(&Array::from_slice(&[1i32, 2, 3], &[1, 3]), &mut cache, None)?;
//! assert_eq!(logits.shape()[2] as usize, model.config().vocab_size);
//! # Ok(())
//! # }
//! ```

mod config;
mod error;
mod model;

pub use config::{ModelConfig, Quantization, SUPPORTED};
pub use error::{Error, Result};
pub use model::{padded_causal_mask, KvCache, Model, QuantizedWeights};

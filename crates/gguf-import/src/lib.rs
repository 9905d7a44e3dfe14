//! Imports a GGUF file (llama.cpp's format) into an mlx_lm-format model
//! folder that `mlx-engine` and mlx_lm load: weights as safetensors (4-bit
//! affine or f32), `config.json`, `tokenizer.json` built from the GGUF's
//! vocabulary, the chat template and special tokens.
//!
//! A converter, not a runtime: the engine never needs it. Two
//! architectures:
//!
//! - `llama` (SmolLM2, Llama, Mistral-shaped files): tensors through MLX's
//!   GGUF loader (F32, F16, Q4_0, Q4_1, Q8_0), q/k rows un-permuted.
//! - `gemma3`: K-quants and Q5_0 decoded here (MLX's loader rejects Q5_0
//!   and misreads Q4_K), llama.cpp's `1 + w` norms undone, the SentencePiece
//!   BPE vocabulary built as transformers builds it.
//!
//! ```no_run
//! use gguf_import::{import_gguf, ImportWeights};
//! use std::path::Path;
//!
//! import_gguf(
//!     Path::new("SmolLM2-135M-Instruct.Q4_1.gguf"),
//!     Path::new("models/smollm2"),
//!     ImportWeights::Quantized,
//! )?;
//! # Ok::<(), gguf_import::Error>(())
//! ```
//!
//! # Errors
//!
//! The file's structure is checked before anything reads it (counts,
//! lengths, tensor extents against the file's size, known tensor types)
//! and the model's numbers before they size anything: a corrupt or lying
//! file is an [`Error`] naming it, never a crash. The folder is built beside
//! the destination and renamed into place, so an error leaves the
//! destination as it was.

mod check;
mod error;
mod gemma;
mod import;
mod output;
mod quants;

pub use error::{Error, Result};
pub use import::import_gguf;
pub use output::ImportWeights;

/// Compiles the README's example with the doc-tests, so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

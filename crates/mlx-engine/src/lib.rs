//! Batched MLX inference on a dedicated worker thread that owns the model,
//! computes the prompt cache of the shared prefix messages once, and runs
//! greedy generation (one token by default: classification) over many
//! conversations.
//!
//! Why: MLX is not thread-safe across threads sharing arrays, and most of a
//! classification prompt is a shared prefix worth computing once.
//!
//! [`MlxEngine`] starts a named worker thread that loads a model folder
//! ([`Model`]: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, gpt_oss, Gemma 3
//! and Gemma 4 text in mlx_lm format), its
//! [`Tokenizer`] and chat template, and runs the shared prefix messages once.
//! [`MlxEngine::generate`] then checks that each conversation starts with
//! that prefix, sorts conversations by the length of their last message,
//! prefills each chunk of `batch_size` suffixes after the prefix cache,
//! which the rows share rather than copy (the padding between prefix and
//! suffix hidden by the mask and skipped by the rotary positions), decodes
//! greedily through the logits processor, and returns the texts in the
//! given order.
//!
//! ```
//! use mlx_engine::{EngineConfig, GenerateOptions, Message, MlxEngine};
//!
//! # fn main() -> Result<(), mlx_engine::EngineError> {
//! # // Runs on the real model where `cargo xtask test` provides it.
//! # let Some(fixture) = std::env::var_os("MLX_LOWMEM_SMOLLM2") else {
//! #     eprintln!("SKIP: MLX_LOWMEM_SMOLLM2 is not set (cargo xtask fixtures)");
//! #     return Ok(());
//! # };
//! # let model_dir = std::path::Path::new(&fixture).join("f32");
//! let system = Message::new("system", "Answer in one short sentence.");
//! // `model_dir`: e.g. the folder adapter_fuse::ensure_fused returns.
//! let config = EngineConfig::new(model_dir)
//!     .prefix_messages(vec![system.clone()])
//!     .batch_size(8);
//! let engine = MlxEngine::new(config)?;
//! engine.ensure_loaded()?;
//! let question = vec![system, Message::new("user", "What is the capital of France?")];
//! let answers = engine
//!     .generate(vec![question], GenerateOptions::new().max_tokens(12))?
//!     .texts;
//! assert!(answers[0].contains("Paris"), "{answers:?}");
//! # Ok(())
//! # }
//! ```
//!
//! # The Python original's API, here
//!
//! | spawnllm `MlxEngine` | mlx-engine |
//! | --- | --- |
//! | `MlxEngine(model_dir, logits_processor_factory, prefix_messages, batch_size, worker_name)` | `MlxEngine::new(EngineConfig::new(model_dir).logits_processor(..).prefix_messages(..).batch_size(..).worker_name(..))` |
//! | `ensure_loaded()` | `ensure_loaded()` / `ensure_loaded_async()` |
//! | `generate(conversations, on_progress, max_tokens=1)` | `generate(conversations, GenerateOptions::new().on_progress(..).max_tokens(..))` → `Generation { texts, stats }` |
//! | `submit(fn, *args)` | `submit(|worker| ..)`: the job gets the [`Worker`] (model, tokenizer) |
//! | `peak_memory_gb()` | `peak_memory_bytes()` (the OS's figure, right on every platform) |
//! | `close()` | `close()`, or drop the engine |
//!
//! A job given to `submit` may run the [`Model`] itself (`forward` with a
//! [`KvCache`]): that is why both are public.
//!
//! # Failure policy
//!
//! A failed load reaches `ensure_loaded` and every later call; an error in a
//! request fails that request only; a panic in a job becomes that job's
//! [`EngineError::Panicked`] and the worker goes on; after `close` every call
//! gets [`EngineError::Closed`] at once. Every call has a blocking form and
//! a [`Reply`] that is also a runtime-agnostic `Future`.
//!
//! Models in GGUF (llama architecture, e.g. SmolLM2; Gemma 3, e.g. Gemma 3
//! 270M in Q4_K_M with its Q5_0, Q4_K, Q6_K and Q8_0 tensors) become mlx_lm
//! folders with the `gguf-import` crate, a converter beside the engine.
//!
//! # Little memory
//!
//! [`MemoryMode`] (`EngineConfig::memory`) says where the weights live:
//! all resident; the embedding tables left in their files
//! (`MappedTables`); or, for a model larger than the memory, each decoder
//! layer read from the files only while it runs (`Streamed`, which can
//! also apply an unfused LoRA adapter as the layers are read:
//! `EngineConfig::lora`). All give the same logits bit for bit; the
//! default follows the model's size, its tables' size and
//! [`mlx_support::memory_limit`] ([`MemoryMode::for_model`]).
//!
//! # Performance
//!
//! On Linux with glibc, calling [`mlx_support::retain_freed_memory`] once
//! at start-up spares MLX's CPU work re-faulting memory it frees (about a
//! fifth faster classification in the project's benchmark, same peak RSS).
//! It changes the whole process's allocator, so the engine leaves that
//! choice to the application. What the engine does by itself, once its
//! load is done, is hand the memory the load freed back to the OS
//! ([`mlx_support::release_free_memory`]), so that an idle engine holds
//! its weights and caches, not the load's leftovers.
//!
//! On the CPU, an engine runs two chunks of a call side by side by default
//! ([`EngineConfig::lanes`], [`default_lanes`]), each on its own thread
//! and MLX stream: MLX runs a stream's element-wise work on one core. The
//! lanes are threads the engine starts once, with the model. With
//! OpenBLAS, let the engine give each lane its share of the cores for
//! the products ([`BlasThreads::SharedByLanes`]; OpenBLAS's count is the
//! process's, so the first engine that asks sets it, before its lanes
//! start):
//!
//! ```no_run
//! use mlx_engine::{BlasThreads, EngineConfig, MlxEngine};
//!
//! mlx_support::retain_freed_memory();
//! let config = EngineConfig::new("models/fused").blas_threads(BlasThreads::SharedByLanes);
//! let engine = MlxEngine::new(config).unwrap();
//! ```

mod distributed;
mod error;
mod evaluation;
mod models;
mod nn;
mod ops;
mod runtime;
#[cfg(test)]
mod test_support;
mod tokenizer;
mod weights;

pub use block_stream::BlockLoraSource;
pub use distributed::Placement;
pub use error::{EngineError, Error, Result};
pub use mlx_support::distributed::{Group, GroupConfig};
pub use mlx_support::{Quantization, QuantizationConfig};
pub use models::checkpoint::Checkpoint;
pub use models::config::{ModelConfig, SUPPORTED};
pub use models::loader::ModelLoader;
pub use models::{MemoryMode, Model, QuantizedWeights};
pub use nn::cache::KvCache;
pub use runtime::engine::{MlxEngine, Reply, Worker};
pub use runtime::generate::{Generation, GenerationStats};
pub use runtime::lanes::{default_lanes, BlasThreads};
pub use runtime::options::{
    EngineConfig, GenerateOptions, LogitsProcessor, LogitsProcessorFactory, PrefixCache,
    DEFAULT_ADMISSION_WINDOW, DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_QUEUE, DEFAULT_PEER_TIMEOUT,
    DEFAULT_PREFIX_STORE_BYTES,
};
pub use runtime::serving::{
    Completion, CompletionStream, CompletionText, Constraint, Finish, FinishReason, Sampling,
    ServingMetrics, StreamEvent, TokenLogprob,
};
pub use tokenizer::{Message, SpecialTokens, Tokenizer};
pub use weights::kernels::Kernels;
pub use weights::routing_counts::{
    expert_bytes_read, routing_counts, DecodeStep, RoutingCounts, DECODE_STEPS_KEPT,
};

/// Compiles the README's example with the doc-tests, so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

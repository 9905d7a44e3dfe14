//! What the workspace's tests and benches share, as a dev-dependency (not
//! published): checkpoint writers whose shapes more than one crate tests
//! against, and the probe for the interop Python that the Python
//! references run in.
//!
//! - [`gemma4_e2b`]: a Gemma 4 checkpoint with E2B's real module shapes and
//!   random weights, quantized as the published "UD" MLX checkpoints are.
//! - [`gemma_words`]: a word-level tokenizer in Gemma's chat shape for
//!   random Gemma checkpoints.
//! - [`tiny_llama`]: tiny random llama, mistral, qwen2 and qwen3
//!   checkpoints, the models most engine tests run.
//! - [`smollm2_adapter`]: random mlx_lm adapters with SmolLM2-135M's
//!   shapes (the fixture model's), served per row and fused in tests.
//! - [`tensors`]: every tensor of a model folder, to compare two folders.
//! - [`python`]: the interop Python (`MLX_LOWMEM_PYTHON`, which `cargo
//!   xtask test` sets) if it has the modules a test needs; otherwise the
//!   test says that it skips.
//!
//! ```no_run
//! let Some(python) = test_support::python::mlx_lm_python("my_test") else {
//!     return; // said on stderr: "SKIP my_test: … lacks mlx_lm"
//! };
//! ```

pub mod gemma4_e2b;
pub mod gemma_words;
pub mod python;
pub mod smollm2_adapter;
pub mod tensors;
pub mod tiny_llama;

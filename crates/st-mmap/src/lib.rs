//! Memory-mapped `.safetensors` files, one or many shards, with validated
//! headers and keys indexed by transformer block.
//!
//! Why: a model's weights should be read straight from the page cache, not
//! copied into private memory, so that a process can run a model larger than
//! its RAM budget. This crate has no MLX dependency and builds anywhere.

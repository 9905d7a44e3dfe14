//! The compact shipping format for LoRA adapters: each tensor byte-shuffled
//! (bytes grouped by position within the dtype), the whole file one zstd
//! frame, and a digest of the compressed bytes that names fused models.
//!
//! Why: adapters ship inside applications; shuffled floats compress far
//! better than raw ones. This crate has no MLX dependency.

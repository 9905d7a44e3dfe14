//! mlx_lm adapter folders for SmolLM2's shapes (test-support's writer).

#![allow(unused_imports)]

pub use test_support::smollm2_adapter::{write_smollm2_adapter, PREFIX, RANK};

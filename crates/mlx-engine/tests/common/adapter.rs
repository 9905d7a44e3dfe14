//! mlx_lm adapter folders for SmolLM2's shapes (test-support's writer).

#![allow(unused_imports)]

pub use test_support::smollm2_adapter::{write_smollm2_adapter, PREFIX, RANK};

use std::path::Path;

use mlx_rs::Array;

/// A copy of the adapter in `from` at `to` with one more pair: `module`'s
/// `lora_a` `(576, 4)` and `lora_b` `(4, outputs)` (SmolLM2's width in).
pub fn with_extra_pair(from: &Path, to: &Path, module: &str, outputs: i32) {
    std::fs::create_dir_all(to).unwrap();
    std::fs::copy(
        from.join("adapter_config.json"),
        to.join("adapter_config.json"),
    )
    .unwrap();
    let mut tensors: Vec<(String, Array)> =
        Array::load_safetensors(from.join("adapters.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    tensors.push((format!("{module}.lora_a"), super::normal(&[576, 4], 1, 0.1)));
    tensors.push((
        format!("{module}.lora_b"),
        super::normal(&[4, outputs], 2, 0.1),
    ));
    Array::save_safetensors(
        tensors.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        to.join("adapters.safetensors"),
    )
    .unwrap();
}

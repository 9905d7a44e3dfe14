//! mlx_lm adapter folders with SmolLM2-135M's shapes, random, which the
//! engine's and the server's tests serve per row and fuse.

use std::path::{Path, PathBuf};

use mlx_rs::Array;

use crate::tiny_llama::normal;

/// SmolLM2's decoder layers' key prefix.
pub const PREFIX: &str = "model.layers.";
pub const RANK: usize = 4;

/// An mlx_lm adapter on SmolLM2's q and v projections of every other
/// layer, its matrices drawn from `seed` on, at `scale`:
/// `adapters.safetensors` + `adapter_config.json` in `dir`; returns the
/// weights file.
pub fn write_smollm2_adapter(dir: &Path, seed: u64, scale: f32) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let (hidden, kv) = (576usize, 192usize);
    let mut tensors = Vec::new();
    for layer in (0..30).step_by(2) {
        for (module, out) in [("q_proj", hidden), ("v_proj", kv)] {
            let key = format!("{PREFIX}{layer}.self_attn.{module}");
            let s = seed + (layer * 2 + usize::from(module == "v_proj")) as u64;
            let a = normal(&[hidden as i32, RANK as i32], s, 0.03);
            let b = normal(&[RANK as i32, out as i32], s + 100, 0.03);
            tensors.push((format!("{key}.lora_a"), a));
            tensors.push((format!("{key}.lora_b"), b));
        }
    }
    let file = dir.join("adapters.safetensors");
    Array::save_safetensors(tensors.iter().map(|(k, v)| (k.as_str(), v)), None, &file).unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        format!(
            r#"{{"fine_tune_type": "lora", "num_layers": 30, "lora_parameters": {{"rank": {RANK}, "scale": {scale}, "dropout": 0.0}}}}"#
        ),
    )
    .unwrap();
    file
}

/// An adapter shaped as mlx_lm's `lora` trains one by default (and as
/// cc-sentiment's is): rank 8, scale 20, every linear layer of the last 16
/// decoder layers (attention's four projections and the MLP's three), its
/// matrices drawn from `seed` on (`lora_b` small, as training leaves it).
/// About 5 MB of f32 for SmolLM2.
pub fn write_smollm2_default_adapter(dir: &Path, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    let (hidden, kv, inter, rank) = (576, 192, 1536, 8);
    let modules = [
        ("self_attn.q_proj", hidden, hidden),
        ("self_attn.k_proj", hidden, kv),
        ("self_attn.v_proj", hidden, kv),
        ("self_attn.o_proj", hidden, hidden),
        ("mlp.gate_proj", hidden, inter),
        ("mlp.up_proj", hidden, inter),
        ("mlp.down_proj", inter, hidden),
    ];
    let mut tensors = Vec::new();
    for layer in 14..30u64 {
        for (m, (module, inputs, outputs)) in modules.iter().enumerate() {
            let key = format!("{PREFIX}{layer}.{module}");
            let s = seed + layer * 16 + m as u64;
            tensors.push((format!("{key}.lora_a"), normal(&[*inputs, rank], s, 0.05)));
            tensors.push((
                format!("{key}.lora_b"),
                normal(&[rank, *outputs], s + 7, 0.002),
            ));
        }
    }
    Array::save_safetensors(
        tensors.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        dir.join("adapters.safetensors"),
    )
    .unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        r#"{"fine_tune_type": "lora", "num_layers": 16, "lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0}}"#,
    )
    .unwrap();
}

//! A random tiny qwen3_moe checkpoint for the engine's MoE tests.

use std::path::Path;

use mlx_rs::Array;
use serde_json::json;

use super::{attention_weights, normal, write_tokenizer, VOCAB};

pub const LAYERS: usize = 3;
pub const EXPERTS: i32 = 8;

/// A random qwen3_moe: layers 0 and 2 route to experts, layer 1 is dense
/// (`mlp_only_layers`), an untied head.
pub fn write_qwen3_moe(dir: &Path) {
    write(dir, false, false);
}

/// A random mixtral of the same sizes: every layer routes to its experts
/// (under `block_sparse_moe`), no per-head norms, and no `rope_theta`
/// (mlx_lm's default for mixtral is 1e6).
pub fn write_mixtral(dir: &Path) {
    write(dir, false, true);
}

/// [`write_qwen3_moe`] quantized as mlx_lm quantizes: every projection,
/// the experts' stacks and both tables at 4 bits in groups of 32, with
/// per-module entries of mixed precision (layer 0's experts' gate
/// projection and layer 2's attention output at 8 bits in groups of 64);
/// the routers stay dense, as mlx_lm keeps them when they have no scales.
pub fn write_qwen3_moe_quantized(dir: &Path) {
    write(dir, true, false);
}

/// Modules of mixed precision in [`write_qwen3_moe_quantized`]: 8 bits,
/// groups of 64.
const EIGHT_BIT: [&str; 2] = [
    "model.layers.0.mlp.switch_mlp.gate_proj",
    "model.layers.2.self_attn.o_proj",
];

fn write(dir: &Path, quantized: bool, mixtral: bool) {
    let (hidden, heads, kv, hd, inter, moe_inter) = (64, 4, 2, 16, 96, 32);
    let config = if mixtral {
        json!({
            "model_type": "mixtral", "hidden_size": hidden, "num_hidden_layers": LAYERS,
            "intermediate_size": moe_inter, "num_attention_heads": heads,
            "num_key_value_heads": kv, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
            "tie_word_embeddings": false, "max_position_embeddings": 512, "eos_token_id": 44,
            "num_local_experts": EXPERTS, "num_experts_per_tok": 2
        })
    } else {
        json!({
        "model_type": "qwen3_moe", "hidden_size": hidden, "num_hidden_layers": LAYERS,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": hd, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "max_position_embeddings": 512, "eos_token_id": 44,
        "num_experts": EXPERTS, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [1], "moe_intermediate_size": moe_inter, "norm_topk_prob": true
        })
    };
    let block = if mixtral { "block_sparse_moe" } else { "mlp" };
    let mut seed = 500;
    let mut w = |shape: &[i32], std: f32| {
        seed += 1;
        normal(shape, seed, std)
    };
    let ones = |n: i32| Array::ones::<f32>(&[n]).unwrap();
    let mut weights = vec![
        (
            "model.embed_tokens.weight".to_owned(),
            w(&[VOCAB, hidden], 1.0),
        ),
        ("model.norm.weight".to_owned(), ones(hidden)),
        ("lm_head.weight".to_owned(), w(&[VOCAB, hidden], 0.2)),
    ];
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}.");
        weights.extend(attention_weights(
            &p,
            (hidden, heads, kv, hd),
            (0.2, false),
            &mut w,
        ));
        if !mixtral {
            weights.push((format!("{p}self_attn.q_norm.weight"), ones(hd)));
            weights.push((format!("{p}self_attn.k_norm.weight"), ones(hd)));
        }
        if i == 1 && !mixtral {
            for (name, out, inp) in [
                ("mlp.gate_proj", inter, hidden),
                ("mlp.up_proj", inter, hidden),
                ("mlp.down_proj", hidden, inter),
            ] {
                weights.push((format!("{p}{name}.weight"), w(&[out, inp], 0.2)));
            }
        } else {
            weights.push((
                format!("{p}{block}.gate.weight"),
                w(&[EXPERTS, hidden], 0.5),
            ));
            for (name, out, inp) in [
                ("gate_proj", moe_inter, hidden),
                ("up_proj", moe_inter, hidden),
                ("down_proj", hidden, moe_inter),
            ] {
                weights.push((
                    format!("{p}{block}.switch_mlp.{name}.weight"),
                    w(&[EXPERTS, out, inp], 0.2),
                ));
            }
        }
        weights.push((format!("{p}input_layernorm.weight"), ones(hidden)));
        weights.push((format!("{p}post_attention_layernorm.weight"), ones(hidden)));
    }
    let mut config = config;
    if quantized {
        weights = quantize(weights);
        let mut q = json!({"group_size": 32, "bits": 4});
        for module in EIGHT_BIT {
            q[module] = json!({"group_size": 64, "bits": 8});
        }
        config["quantization"] = q;
    }
    std::fs::write(
        dir.join("config.json"),
        st_mmap::json::sorted(&config).to_string(),
    )
    .unwrap();
    Array::save_safetensors(
        weights.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        dir.join("model.safetensors"),
    )
    .unwrap();
    write_tokenizer(dir, false);
}

/// Each matrix but the norms and the routers replaced by its packed
/// weight, scales and biases (MLX's `quantize`, as mlx_lm calls it).
fn quantize(weights: Vec<(String, Array)>) -> Vec<(String, Array)> {
    let mut out = Vec::new();
    for (key, value) in weights {
        let module = key.strip_suffix(".weight").unwrap_or(&key).to_owned();
        let router = module.ends_with("mlp.gate") || module.ends_with("block_sparse_moe.gate");
        let dense = value.ndim() == 1 || router || !key.ends_with(".weight");
        if dense {
            out.push((key, value));
            continue;
        }
        let (group_size, bits) = if EIGHT_BIT.contains(&module.as_str()) {
            (64, 8)
        } else {
            (32, 4)
        };
        let (w, scales, biases) = mlx_rs::ops::quantize(&value, group_size, bits).unwrap();
        out.push((key, w));
        out.push((format!("{module}.scales"), scales));
        out.push((format!("{module}.biases"), biases));
    }
    out
}

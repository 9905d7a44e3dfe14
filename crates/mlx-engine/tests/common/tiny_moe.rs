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
    let (hidden, heads, kv, hd, inter, moe_inter) = (64, 4, 2, 16, 96, 32);
    let config = json!({
        "model_type": "qwen3_moe", "hidden_size": hidden, "num_hidden_layers": LAYERS,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": hd, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "max_position_embeddings": 512, "eos_token_id": 44,
        "num_experts": EXPERTS, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [1], "moe_intermediate_size": moe_inter, "norm_topk_prob": true
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
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
        weights.push((format!("{p}self_attn.q_norm.weight"), ones(hd)));
        weights.push((format!("{p}self_attn.k_norm.weight"), ones(hd)));
        if i == 1 {
            for (name, out, inp) in [
                ("mlp.gate_proj", inter, hidden),
                ("mlp.up_proj", inter, hidden),
                ("mlp.down_proj", hidden, inter),
            ] {
                weights.push((format!("{p}{name}.weight"), w(&[out, inp], 0.2)));
            }
        } else {
            weights.push((format!("{p}mlp.gate.weight"), w(&[EXPERTS, hidden], 0.5)));
            for (name, out, inp) in [
                ("gate_proj", moe_inter, hidden),
                ("up_proj", moe_inter, hidden),
                ("down_proj", hidden, moe_inter),
            ] {
                weights.push((
                    format!("{p}mlp.switch_mlp.{name}.weight"),
                    w(&[EXPERTS, out, inp], 0.2),
                ));
            }
        }
        weights.push((format!("{p}input_layernorm.weight"), ones(hidden)));
        weights.push((format!("{p}post_attention_layernorm.weight"), ones(hidden)));
    }
    Array::save_safetensors(
        weights.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        dir.join("model.safetensors"),
    )
    .unwrap();
    write_tokenizer(dir, false);
}

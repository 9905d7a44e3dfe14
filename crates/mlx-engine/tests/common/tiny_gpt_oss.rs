//! A random tiny gpt_oss checkpoint in mlx_lm's layout (what
//! `mlx_lm.convert` writes): every feature of the family at small sizes.

use std::path::Path;

use mlx_rs::{Array, Dtype};
use serde_json::json;

use super::{attention_weights, normal, write_tokenizer, VOCAB};

pub const LAYERS: usize = 4;
pub const EXPERTS: i32 = 8;
/// Keys a sliding layer's query sees: shorter than the tests' prompts.
pub const WINDOW: i32 = 8;

/// Sliding and full layers, not in mlx_lm's default alternation, so that
/// each layer's own type is what counts.
const LAYER_TYPES: [&str; LAYERS] = [
    "sliding_attention",
    "full_attention",
    "full_attention",
    "sliding_attention",
];

/// A random gpt_oss in f32: 8 experts, top 2, biases on every projection,
/// the router and the experts, a sink per head, YaRN positions (factor 32
/// over an original context of 4096, as gpt-oss-20b's), sliding windows of
/// 8. The experts' gate and up weights are large enough that the SwiGLU's
/// clamps at ±7 are reached.
pub fn write_gpt_oss(dir: &Path) {
    write_gpt_oss_in(dir, false, Dtype::Float32);
}

/// [`write_gpt_oss`] quantized as mlx_lm 0.32.2 quantizes gpt_oss: every
/// projection, the experts' stacks and both tables at 4 bits in groups of
/// 32, the routers at 8 bits in groups of 64 (its `quant_predicate`).
pub fn write_gpt_oss_quantized(dir: &Path) {
    write_gpt_oss_in(dir, true, Dtype::Float32);
}

/// How a test's gpt_oss is quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    Dense,
    /// Affine 4-bit in groups of 32, routers 8-bit in groups of 64.
    Affine,
    /// As the published gpt-oss MLX checkpoints: the experts MXFP4 (per-module
    /// entries with their mode), the rest as [`Packing::Affine`].
    Mxfp4Experts,
}

/// [`write_gpt_oss`] with MXFP4 experts (see [`Packing::Mxfp4Experts`]).
pub fn write_gpt_oss_mxfp4(dir: &Path) {
    write_gpt_oss_packed(dir, Packing::Mxfp4Experts, Dtype::Float32);
}

/// [`write_gpt_oss`], quantized or not, with every floating-point tensor
/// in `dtype` (scales included).
pub fn write_gpt_oss_in(dir: &Path, quantized: bool, dtype: Dtype) {
    let packing = if quantized {
        Packing::Affine
    } else {
        Packing::Dense
    };
    write_gpt_oss_packed(dir, packing, dtype);
}

/// [`write_gpt_oss`] packed as `packing` says, every floating-point
/// tensor in `dtype`.
pub fn write_gpt_oss_packed(dir: &Path, packing: Packing, dtype: Dtype) {
    let (hidden, heads, kv, hd, inter) = (64, 4, 2, 16, 32);
    let mut config = json!({
        "model_type": "gpt_oss", "hidden_size": hidden, "num_hidden_layers": LAYERS,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": hd, "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "rope_theta": 150000,
        "tie_word_embeddings": false, "max_position_embeddings": 512, "eos_token_id": 44,
        "num_local_experts": EXPERTS, "num_experts_per_tok": 2,
        "sliding_window": WINDOW, "layer_types": LAYER_TYPES,
        "rope_scaling": {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": false, "original_max_position_embeddings": 4096
        }
    });
    let mut seed = 900;
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
            (0.2, true),
            &mut w,
        ));
        weights.push((format!("{p}self_attn.o_proj.bias"), w(&[hidden], 0.1)));
        weights.push((format!("{p}self_attn.sinks"), w(&[heads], 1.0)));
        weights.push((format!("{p}mlp.router.weight"), w(&[EXPERTS, hidden], 0.5)));
        weights.push((format!("{p}mlp.router.bias"), w(&[EXPERTS], 0.2)));
        for (name, out, inp, std) in [
            ("gate_proj", inter, hidden, 0.6),
            ("up_proj", inter, hidden, 0.6),
            ("down_proj", hidden, inter, 0.2),
        ] {
            let module = format!("{p}mlp.experts.{name}");
            weights.push((format!("{module}.weight"), w(&[EXPERTS, out, inp], std)));
            weights.push((format!("{module}.bias"), w(&[EXPERTS, out], 0.5)));
        }
        weights.push((format!("{p}input_layernorm.weight"), ones(hidden)));
        weights.push((format!("{p}post_attention_layernorm.weight"), ones(hidden)));
    }
    let weights: Vec<(String, Array)> = weights
        .into_iter()
        .map(|(k, v)| (k, v.as_dtype(dtype).unwrap()))
        .collect();
    let weights = if packing == Packing::Dense {
        weights
    } else {
        let mxfp4 = packing == Packing::Mxfp4Experts;
        let (weights, modules) = quantize(weights, mxfp4);
        let mut q = json!({"group_size": 32, "bits": 4});
        for module in &modules {
            if module.ends_with("router") {
                q[module] = json!({"group_size": 64, "bits": 8});
            } else if mxfp4 && module.contains(".experts.") {
                q[module] = json!({"group_size": 32, "bits": 4, "mode": "mxfp4"});
            }
        }
        config["quantization"] = q;
        weights
    };
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

/// Every matrix replaced by its packed weight, scales and biases (MLX's
/// `quantize`, as mlx_lm calls it): routers at 8 bits in groups of 64, the
/// rest at 4 bits in groups of 32 — the experts MXFP4 with `mxfp4_experts`
/// (weight and scales, no biases); vectors (norms, sinks, biases) kept.
/// Returns the weights and the quantized modules.
fn quantize(
    weights: Vec<(String, Array)>,
    mxfp4_experts: bool,
) -> (Vec<(String, Array)>, Vec<String>) {
    let (mut out, mut modules) = (Vec::new(), Vec::new());
    for (key, value) in weights {
        let Some(module) = key.strip_suffix(".weight").filter(|_| value.ndim() >= 2) else {
            out.push((key, value));
            continue;
        };
        let module = module.to_owned();
        if mxfp4_experts && module.contains(".experts.") {
            let q = mlx_support::Quantization {
                group_size: 32,
                bits: 4,
                mode: mlx_support::QuantMode::Mxfp4,
            };
            let (w, scales, _) = mlx_support::quantized::quantize(&value, q).unwrap();
            out.push((key, w));
            out.push((format!("{module}.scales"), scales));
            modules.push(module);
            continue;
        }
        let (group_size, bits) = if module.ends_with("router") {
            (64, 8)
        } else {
            (32, 4)
        };
        let (w, scales, biases) = mlx_rs::ops::quantize(&value, group_size, bits).unwrap();
        out.push((key, w));
        out.push((format!("{module}.scales"), scales));
        out.push((format!("{module}.biases"), biases));
        modules.push(module);
    }
    (out, modules)
}

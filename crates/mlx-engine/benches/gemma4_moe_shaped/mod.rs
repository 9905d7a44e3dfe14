//! A Gemma 4 with the widths of Gemma 4 26B-A4B, fewer layers and random
//! 4-bit weights, made by the benchmark (never committed): hidden size
//! 2816; sliding layers of 16 query and 8 key/value heads of 256 with a
//! 1024-token window, every sixth layer full attention with 2 key/value
//! heads of 512 whose values are the keys' projection (`attention_k_eq_v`);
//! in every layer a dense GeGLU MLP of 2112 and, beside it, 128 experts of
//! 704 with the top 8 chosen; a tied 262,144-token table; the logit
//! softcap — 6 layers instead of 30 (five sliding, one full: the real
//! pattern's period), so that it is made in a few minutes. Its experts are
//! ~0.43 GB a layer, as in the real model (the 26B-A4B's widths, as its
//! `config.json` gives them, are in docs/benchmarks.md).
//!
//! Every matrix, the experts' stacks and the table are affine 4-bit in
//! groups of 64 (as mlx-community's 4-bit conversion has them, there with
//! bfloat16 scales), scales and norms f32; the routers are dense f32 with
//! random rows (the published conversion has them in 8 bits), router
//! scales and per-expert scales one. The tokenizer is Gemma 3's (the same
//! 262,144 entries), from the Gemma 3 270M fixture.

use std::path::{Path, PathBuf};

use mlx_rs::{random, Array};
use serde_json::json;

use crate::gemma4_e2b::{BITS, GROUP};
use crate::qwen3_moe_shaped::File;

const HIDDEN: i32 = 2816;
const LAYERS: i32 = 6;
const HEADS: i32 = 16;
const KV_HEADS: i32 = 8;
const GLOBAL_KV_HEADS: i32 = 2;
const HEAD_DIM: i32 = 256;
const GLOBAL_HEAD_DIM: i32 = 512;
const INTERMEDIATE: i32 = 2112;
const EXPERTS: i32 = 128;
const TOP_K: i32 = 8;
const EXPERT_INTERMEDIATE: i32 = 704;
const WINDOW: i32 = 1024;
const VOCAB: i32 = 262_144;
/// Bumped whenever what is written changes, so an old copy is remade.
const VERSION: &str = "1";

/// The 26B-A4B's pattern: five sliding layers, then a full one.
fn is_full(i: i32) -> bool {
    (i + 1) % 6 == 0
}

fn config() -> serde_json::Value {
    let layer_types: Vec<&str> = (0..LAYERS)
        .map(|i| {
            if is_full(i) {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    json!({
        "model_type": "gemma4_text", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_global_key_value_heads": GLOBAL_KV_HEADS,
        "head_dim": HEAD_DIM, "global_head_dim": GLOBAL_HEAD_DIM, "attention_k_eq_v": true,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
        "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
        "sliding_window": WINDOW, "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}
        },
        "enable_moe_block": true, "num_experts": EXPERTS, "top_k_experts": TOP_K,
        "moe_intermediate_size": EXPERT_INTERMEDIATE,
        "final_logit_softcapping": 30.0, "use_double_wide_mlp": false,
        "tie_word_embeddings": true, "max_position_embeddings": 262_144,
        "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
        "quantization": {"group_size": GROUP, "bits": BITS, "mode": "affine"}
    })
}

fn layer_file(i: i32) -> anyhow::Result<File> {
    let mut f = File {
        arrays: Vec::new(),
        seed: 3000 * (i as u64 + 1),
    };
    let p = format!("model.layers.{i}");
    let full = is_full(i);
    let (hd, kv_heads) = match full {
        true => (GLOBAL_HEAD_DIM, GLOBAL_KV_HEADS),
        false => (HEAD_DIM, KV_HEADS),
    };
    let (q, kv) = (HEADS * hd, kv_heads * hd);
    f.matrix(&format!("{p}.self_attn.q_proj"), None, q, HIDDEN)?;
    f.matrix(&format!("{p}.self_attn.k_proj"), None, kv, HIDDEN)?;
    if !full {
        f.matrix(&format!("{p}.self_attn.v_proj"), None, kv, HIDDEN)?;
    }
    f.matrix(&format!("{p}.self_attn.o_proj"), None, HIDDEN, q)?;
    f.filled(&format!("{p}.self_attn.q_norm.weight"), hd);
    f.filled(&format!("{p}.self_attn.k_norm.weight"), hd);
    for (name, rows, cols) in [
        ("gate_proj", INTERMEDIATE, HIDDEN),
        ("up_proj", INTERMEDIATE, HIDDEN),
        ("down_proj", HIDDEN, INTERMEDIATE),
    ] {
        f.matrix(&format!("{p}.mlp.{name}"), None, rows, cols)?;
    }
    let router = random::normal::<f32>(&[EXPERTS, HIDDEN], None, None, &random::key(f.seed)?)?
        .multiply(Array::from_f32(1.0 / (HIDDEN as f32).sqrt()))?;
    f.arrays.push((format!("{p}.router.proj.weight"), router));
    f.filled(&format!("{p}.router.scale"), HIDDEN);
    f.filled(&format!("{p}.router.per_expert_scale"), EXPERTS);
    for (name, rows, cols) in [
        ("gate_proj", EXPERT_INTERMEDIATE, HIDDEN),
        ("up_proj", EXPERT_INTERMEDIATE, HIDDEN),
        ("down_proj", HIDDEN, EXPERT_INTERMEDIATE),
    ] {
        f.matrix(
            &format!("{p}.experts.switch_glu.{name}"),
            Some(EXPERTS),
            rows,
            cols,
        )?;
    }
    for norm in [
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "post_feedforward_layernorm_1",
        "pre_feedforward_layernorm_2",
        "post_feedforward_layernorm_2",
    ] {
        f.filled(&format!("{p}.{norm}.weight"), HIDDEN);
    }
    f.filled_with(&format!("{p}.layer_scalar"), 1, 0.8);
    Ok(f)
}

/// Makes (once) the model under `target/bench-fixtures` and returns the
/// folder holding `q4/`; the tokenizer comes from `tokenizer_dir` and the
/// chat template is `chat_template`.
pub fn ensure(tokenizer_dir: &Path, chat_template: &str) -> anyhow::Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/bench-fixtures/gemma4-26b-a4b-shaped");
    let done = root.join(format!("complete-v{VERSION}"));
    if done.exists() {
        return Ok(root);
    }
    let _ = std::fs::remove_dir_all(&root);
    let q4 = root.join("q4");
    std::fs::create_dir_all(&q4)?;
    eprintln!(
        "making a Gemma 4 26B-A4B-shaped model ({LAYERS} layers) with random 4-bit weights in {}",
        root.display()
    );
    let mut tables = File {
        arrays: Vec::new(),
        seed: 11,
    };
    tables.matrix("model.embed_tokens", None, VOCAB, HIDDEN)?;
    tables.filled("model.norm.weight", HIDDEN);
    // Named `model*`, as mlx_lm loads only such files.
    tables.save(&q4.join("model-tables.safetensors"))?;
    for i in 0..LAYERS {
        let name = format!("model-layer-{i:02}.safetensors");
        layer_file(i)?.save(&q4.join(&name))?;
        eprintln!("  {name}");
    }
    std::fs::write(q4.join("config.json"), config().to_string())?;
    let mut tokenizer_config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tokenizer_dir.join("tokenizer_config.json"))?)?;
    tokenizer_config["chat_template"] = chat_template.into();
    std::fs::copy(
        tokenizer_dir.join("tokenizer.json"),
        q4.join("tokenizer.json"),
    )?;
    std::fs::write(
        q4.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )?;
    std::fs::write(&done, "")?;
    Ok(root)
}

//! A qwen3_moe with Qwen3-30B-A3B's widths, fewer layers and random 4-bit
//! weights, made by the benchmark (never committed): hidden size 2048,
//! 32 query heads and 4 key/value heads of 128, 128 experts of
//! intermediate size 768 with the top 8 chosen (weights renormalised),
//! every layer sparse, an untied head — 6 layers instead of 48, so that
//! it is made in about a minute; its experts are ~0.38 GB a layer.
//!
//! Every matrix, the experts' stacks and both tables are affine 4-bit in
//! groups of 64 (as `mlx_lm.convert` makes them, f32 scales); the routers
//! are dense f32 with random rows, so that positions spread over the
//! experts as a real router's do not need to (random routers share experts
//! between rows only by chance). The tokenizer and chat template are
//! SmolLM2's (49,152 entries), from its fixture.

use std::path::{Path, PathBuf};

use mlx_rs::{random, Array};
use serde_json::json;

use crate::gemma4_e2b::{random_packed, BITS, GROUP};

const HIDDEN: i32 = 2048;
const LAYERS: i32 = 6;
const HEADS: i32 = 32;
const KV_HEADS: i32 = 4;
const HEAD_DIM: i32 = 128;
const EXPERTS: i32 = 128;
const TOP_K: i32 = 8;
const EXPERT_INTERMEDIATE: i32 = 768;
/// SmolLM2's tokenizer.
const VOCAB: i32 = 49_152;
/// Bumped whenever what is written changes, so an old copy is remade.
const VERSION: &str = "1";

fn config() -> serde_json::Value {
    json!({
        "model_type": "qwen3_moe", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "intermediate_size": 6144, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "rope_theta": 1e6, "tie_word_embeddings": false,
        "max_position_embeddings": 40_960, "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "moe_intermediate_size": EXPERT_INTERMEDIATE, "norm_topk_prob": true,
        "bos_token_id": 1, "eos_token_id": 2,
        "quantization": {"group_size": GROUP, "bits": BITS}
    })
}

/// Arrays of one weights file (the Gemma 4 26B-A4B-shaped model's too).
pub(crate) struct File {
    pub(crate) arrays: Vec<(String, Array)>,
    pub(crate) seed: u64,
}

impl File {
    /// A packed `(rows, cols)` matrix, or `experts` of them stacked.
    pub(crate) fn matrix(
        &mut self,
        module: &str,
        experts: Option<i32>,
        rows: i32,
        cols: i32,
    ) -> anyhow::Result<()> {
        self.seed += 1;
        let n = experts.unwrap_or(1);
        let [w, s, b] = random_packed(n * rows, cols, self.seed)?;
        for (suffix, a) in [("weight", w), ("scales", s), ("biases", b)] {
            let a = match experts {
                Some(e) => a.reshape(&[e, rows, -1])?,
                None => a,
            };
            self.arrays.push((format!("{module}.{suffix}"), a));
        }
        Ok(())
    }

    pub(crate) fn filled(&mut self, key: &str, len: i32) {
        self.filled_with(key, len, 1.0);
    }

    pub(crate) fn filled_with(&mut self, key: &str, len: i32, value: f32) {
        let a = Array::from_slice(&vec![value; len as usize], &[len]);
        self.arrays.push((key.to_owned(), a));
    }

    pub(crate) fn save(self, path: &Path) -> anyhow::Result<()> {
        Array::save_safetensors(self.arrays.iter().map(|(k, v)| (k.as_str(), v)), None, path)?;
        Ok(())
    }
}

fn layer_file(i: i32) -> anyhow::Result<File> {
    let mut f = File {
        arrays: Vec::new(),
        seed: 1000 * (i as u64 + 1),
    };
    let p = format!("model.layers.{i}");
    let q = HEADS * HEAD_DIM;
    let kv = KV_HEADS * HEAD_DIM;
    for (name, rows, cols) in [
        ("q_proj", q, HIDDEN),
        ("k_proj", kv, HIDDEN),
        ("v_proj", kv, HIDDEN),
        ("o_proj", HIDDEN, q),
    ] {
        f.matrix(&format!("{p}.self_attn.{name}"), None, rows, cols)?;
    }
    f.filled(&format!("{p}.self_attn.q_norm.weight"), HEAD_DIM);
    f.filled(&format!("{p}.self_attn.k_norm.weight"), HEAD_DIM);
    f.filled(&format!("{p}.input_layernorm.weight"), HIDDEN);
    f.filled(&format!("{p}.post_attention_layernorm.weight"), HIDDEN);
    let router = random::normal::<f32>(&[EXPERTS, HIDDEN], None, None, &random::key(f.seed)?)?
        .multiply(Array::from_f32(1.0 / (HIDDEN as f32).sqrt()))?;
    f.arrays.push((format!("{p}.mlp.gate.weight"), router));
    for (name, rows, cols) in [
        ("gate_proj", EXPERT_INTERMEDIATE, HIDDEN),
        ("up_proj", EXPERT_INTERMEDIATE, HIDDEN),
        ("down_proj", HIDDEN, EXPERT_INTERMEDIATE),
    ] {
        f.matrix(
            &format!("{p}.mlp.switch_mlp.{name}"),
            Some(EXPERTS),
            rows,
            cols,
        )?;
    }
    Ok(f)
}

/// Makes (once) the model under `target/bench-fixtures` and returns the
/// folder holding `q4/`; the tokenizer and its chat template come from
/// `tokenizer_dir`.
pub fn ensure(tokenizer_dir: &Path) -> anyhow::Result<PathBuf> {
    let root =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-fixtures/qwen3-moe-shaped");
    let done = root.join(format!("complete-v{VERSION}"));
    if done.exists() {
        return Ok(root);
    }
    let _ = std::fs::remove_dir_all(&root);
    let q4 = root.join("q4");
    std::fs::create_dir_all(&q4)?;
    eprintln!(
        "making a Qwen3-30B-A3B-shaped qwen3_moe ({LAYERS} layers) with random 4-bit weights in {}",
        root.display()
    );
    let mut tables = File {
        arrays: Vec::new(),
        seed: 7,
    };
    tables.matrix("model.embed_tokens", None, VOCAB, HIDDEN)?;
    tables.matrix("lm_head", None, VOCAB, HIDDEN)?;
    tables.filled("model.norm.weight", HIDDEN);
    // Named `model*`, as mlx_lm loads only such files.
    tables.save(&q4.join("model-tables.safetensors"))?;
    for i in 0..LAYERS {
        let name = format!("model-layer-{i:02}.safetensors");
        layer_file(i)?.save(&q4.join(&name))?;
        eprintln!("  {name}");
    }
    std::fs::write(q4.join("config.json"), config().to_string())?;
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer_dir.join(name), q4.join(name))?;
    }
    std::fs::write(&done, "")?;
    Ok(root)
}

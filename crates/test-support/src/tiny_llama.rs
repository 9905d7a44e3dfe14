//! Tiny random llama-family checkpoints (llama, mistral, qwen2, qwen3) in
//! mlx_lm's format: 64 wide, 4 heads over 2 key/value heads, an MLP of
//! 128, random weights drawn from MLX's generator in a fixed order, so a
//! given [`TinyLlama`] always writes the same bytes.
//!
//! ```no_run
//! let dir = std::path::Path::new("target/tiny");
//! test_support::tiny_llama::TinyLlama::new("qwen2").write(dir);
//! ```

use std::path::Path;

use mlx_rs::Array;

/// How the norms' weights are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Norms {
    /// All ones, drawing nothing.
    Ones,
    /// `1 + N(0, std)`, each from the next seed.
    Random { std: f32 },
}

/// What to write; [`TinyLlama::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct TinyLlama {
    /// `llama`, `mistral` (an untied `lm_head`), `qwen2` (query, key and
    /// value biases) or `qwen3` (query and key norms).
    pub model_type: &'static str,
    pub layers: i32,
    pub vocab: i32,
    /// The first weight is drawn from `seed + 1`, each next one from the
    /// seed after.
    pub seed: u64,
    pub embed_std: f32,
    pub weight_std: f32,
    pub norms: Norms,
    /// Keys merged over `config.json`'s (e.g. `eos_token_id`).
    pub config: serde_json::Value,
}

/// `N(0, std)` of `shape` from `seed`.
pub fn normal(shape: &[i32], seed: u64, std: f32) -> Array {
    let key = mlx_rs::random::key(seed).expect("a random key");
    mlx_rs::random::normal::<f32>(shape, None, std, &key).expect("random normal weights")
}

impl TinyLlama {
    /// Two layers, a vocabulary of 48, seeds from 8, embeddings `N(0, 1)`,
    /// weights `N(0, 0.2)`, norms of ones, no extra config keys.
    pub fn new(model_type: &'static str) -> TinyLlama {
        TinyLlama {
            model_type,
            layers: 2,
            vocab: 48,
            seed: 7,
            embed_std: 1.0,
            weight_std: 0.2,
            norms: Norms::Ones,
            config: serde_json::json!({}),
        }
    }

    /// Writes `config.json` and `model.safetensors` into `dir` (created if
    /// needed); returns the weights' keys in the order written.
    pub fn write(&self, dir: &Path) -> Vec<String> {
        let (hidden, heads, kv, inter) = (64, 4, 2, 128);
        let hd = hidden / heads;
        std::fs::create_dir_all(dir).expect("creating the model folder");
        let mut config = serde_json::json!({
            "model_type": self.model_type, "hidden_size": hidden,
            "num_hidden_layers": self.layers, "intermediate_size": inter,
            "num_attention_heads": heads, "num_key_value_heads": kv, "rms_norm_eps": 1e-5,
            "vocab_size": self.vocab, "rope_theta": 10000.0,
            "tie_word_embeddings": self.model_type != "mistral"
        });
        if let (Some(config), Some(extra)) = (config.as_object_mut(), self.config.as_object()) {
            config.extend(extra.clone());
        }
        std::fs::write(
            dir.join("config.json"),
            st_mmap::json::sorted(&config).to_string(),
        )
        .expect("writing config.json");
        let mut seed = self.seed;
        let mut w = |shape: &[i32], std: f32| {
            seed += 1;
            normal(shape, seed, std)
        };
        let norms = self.norms;
        let norm = |len: i32, w: &mut dyn FnMut(&[i32], f32) -> Array| match norms {
            Norms::Ones => Array::ones::<f32>(&[len]).expect("ones"),
            Norms::Random { std } => w(&[len], std)
                .add(Array::from_f32(1.0))
                .expect("a norm's weights"),
        };
        let mut weights = vec![(
            "model.embed_tokens.weight".to_owned(),
            w(&[self.vocab, hidden], self.embed_std),
        )];
        weights.push(("model.norm.weight".into(), norm(hidden, &mut w)));
        if self.model_type == "mistral" {
            weights.push(("lm_head.weight".into(), w(&[self.vocab, hidden], 0.1)));
        }
        for i in 0..self.layers {
            let p = format!("model.layers.{i}.");
            let qwen2 = self.model_type == "qwen2";
            weights.extend(attention_weights(
                &p,
                (hidden, heads, kv, hd),
                (self.weight_std, qwen2),
                &mut w,
            ));
            for (name, out, inp) in [
                ("mlp.gate_proj", inter, hidden),
                ("mlp.up_proj", inter, hidden),
                ("mlp.down_proj", hidden, inter),
            ] {
                weights.push((format!("{p}{name}.weight"), w(&[out, inp], self.weight_std)));
            }
            if self.model_type == "qwen3" {
                for name in ["q_norm", "k_norm"] {
                    let weight = w(&[hd], 0.1).add(Array::from_f32(1.0)).expect("a norm");
                    weights.push((format!("{p}self_attn.{name}.weight"), weight));
                }
            }
            for name in ["input_layernorm", "post_attention_layernorm"] {
                weights.push((format!("{p}{name}.weight"), norm(hidden, &mut w)));
            }
        }
        Array::save_safetensors(
            weights.iter().map(|(k, v)| (k.as_str(), v)),
            None,
            dir.join("model.safetensors"),
        )
        .expect("writing model.safetensors");
        weights.into_iter().map(|(k, _)| k).collect()
    }
}

/// Layer `p`'s (`model.layers.{i}.`) attention projections, random from
/// `w(shape, std)`: `(hidden, heads, kv_heads, head_dim)`; weights of
/// `std`, and query, key and value biases of 0.1 with `biases` (qwen2),
/// each bias drawn after its weight.
pub fn attention_weights(
    p: &str,
    (hidden, heads, kv, hd): (i32, i32, i32, i32),
    (std, biases): (f32, bool),
    w: &mut impl FnMut(&[i32], f32) -> Array,
) -> Vec<(String, Array)> {
    let mut out = Vec::new();
    for (name, rows, cols) in [
        ("self_attn.q_proj", heads * hd, hidden),
        ("self_attn.k_proj", kv * hd, hidden),
        ("self_attn.v_proj", kv * hd, hidden),
        ("self_attn.o_proj", hidden, heads * hd),
    ] {
        out.push((format!("{p}{name}.weight"), w(&[rows, cols], std)));
        if biases && name != "self_attn.o_proj" {
            out.push((format!("{p}{name}.bias"), w(&[rows], 0.1)));
        }
    }
    out
}

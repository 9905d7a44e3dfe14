//! A Gemma 4 text model with the shapes of Gemma 4 E2B and random 4-bit
//! weights, made by the benchmark (never committed): hidden size 1536,
//! 35 layers (every fifth full attention), 8 heads and 1 key/value head,
//! head sizes 256 and 512, per-layer embeddings 256 wide, a 262,144-token
//! vocabulary, the last 20 layers sharing keys and values (with the
//! double-wide MLP), a 512-token window, the logit softcap.
//!
//! Every matrix and both embedding tables are affine 4-bit, groups of 64,
//! as `mlx_lm.convert` makes them; scales, biases and norms are f32 (the
//! published E2B checkpoint has bfloat16 there; on the CPU backend both
//! sides compute in f32 either way). The packed nibbles are uniform random
//! and each row's scale is chosen so that a layer keeps its input's size:
//! the model is not a language model, but every product, gather and
//! cache has E2B's size.
//!
//! Beside it, `f32/` holds the same weights with every decoder matrix
//! dequantized to f32 (the tables stay 4-bit, since they are only
//! gathered from and the head reads one position per row): the copy that
//! mlx_lm runs with its f32 BLAS products instead of MLX's slow CPU
//! quantized ones. The tokenizer is Gemma 3's (the same 262,144 entries),
//! from the Gemma 3 270M fixture.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mlx_rs::ops::dequantize;
use mlx_rs::{random, Array};
use serde_json::json;

// E2B's shapes have one home, shared with the tests' UD-style checkpoint.
use test_support::gemma4_e2b::{
    is_full as full_attention, layer_tensors, LayerTensor, E2B_VOCAB as VOCAB, GLOBAL_HEAD_DIM,
    HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, PER_LAYER, SHARED_LAYERS, WINDOW,
};
pub(crate) const GROUP: i32 = 64;
pub(crate) const BITS: i32 = 4;
/// Layers per weights file, so that making one holds a few layers at most.
const LAYERS_PER_FILE: i32 = 5;
/// Bumped whenever what is written changes, so an old copy is remade.
const VERSION: &str = "4";

fn config() -> serde_json::Value {
    let layer_types: Vec<&str> = (0..LAYERS)
        .map(|i| {
            if full_attention(i) {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    json!({
        "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"],
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "global_head_dim": GLOBAL_HEAD_DIM, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
        "num_kv_shared_layers": SHARED_LAYERS, "hidden_size_per_layer_input": PER_LAYER,
        "sliding_window": WINDOW, "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}
        },
        "final_logit_softcapping": 30.0, "use_double_wide_mlp": true, "tie_word_embeddings": true,
        "max_position_embeddings": 131_072, "bos_token_id": 2, "eos_token_id": [1, 106],
        "pad_token_id": 0
    })
}

/// Random packed 4-bit weights for a `(rows, cols)` matrix: `(weight,
/// scales, biases)`, each nibble uniform in 0..16 and the values centred
/// on zero with a standard deviation of about `1/√cols`.
pub(crate) fn random_packed(rows: i32, cols: i32, seed: u64) -> anyhow::Result<[Array; 3]> {
    let key = random::key(seed)?;
    let (k1, k2) = random::split(&key, 2)?;
    let shape = [rows, cols * BITS / 32];
    // Two 16-bit halves: a float draw holds 24 bits exactly, not 32.
    let high = random::randint::<_, u32>(0, 1 << 16, &shape[..], &k1)?;
    let low = random::randint::<_, u32>(0, 1 << 16, &shape[..], &k2)?;
    let weight = high
        .multiply(Array::from_slice(&[1u32 << 16], &[]))?
        .add(&low)?;
    // Nibbles uniform in 0..16 have a standard deviation of √(255/12).
    let scale = 1.0 / ((cols as f32).sqrt() * (255.0f32 / 12.0).sqrt());
    let groups = [rows, cols / GROUP];
    let scales = random::uniform::<_, f32>(0.75 * scale, 1.25 * scale, &groups[..], &key)?;
    let biases = scales.multiply(Array::from_f32(-7.5))?;
    Ok([weight, scales, biases])
}

/// One weights file being written.
struct File {
    arrays: Vec<(String, Array)>,
    seed: u64,
}

impl File {
    fn matrix(&mut self, module: &str, rows: i32, cols: i32) -> anyhow::Result<()> {
        self.seed += 1;
        let [w, s, b] = random_packed(rows, cols, self.seed)?;
        for (suffix, a) in [("weight", w), ("scales", s), ("biases", b)] {
            self.arrays.push((format!("model.{module}.{suffix}"), a));
        }
        Ok(())
    }

    fn filled(&mut self, key: &str, len: i32, value: f32) {
        let a = Array::from_slice(&vec![value; len as usize], &[len]);
        self.arrays.push((format!("model.{key}"), a));
    }

    fn save(self, path: &Path) -> anyhow::Result<()> {
        Array::save_safetensors(self.arrays.iter().map(|(k, v)| (k.as_str(), v)), None, path)?;
        Ok(())
    }
}

/// Layers `range` of the model into one file.
fn layers_file(range: std::ops::Range<i32>) -> anyhow::Result<File> {
    let mut f = File {
        arrays: Vec::new(),
        seed: 1000 * range.start as u64,
    };
    let first_shared = LAYERS - SHARED_LAYERS;
    for i in range {
        for tensor in layer_tensors(i, i < first_shared) {
            match tensor {
                LayerTensor::Matrix { module, rows, cols } => f.matrix(&module, rows, cols)?,
                // Unit norms (q and k included), and E2B's layer scalar.
                LayerTensor::Vector { key, len, kind } => f.filled(
                    &key,
                    len,
                    if kind == test_support::gemma4_e2b::VectorKind::Scalar {
                        0.8
                    } else {
                        1.0
                    },
                ),
            }
        }
    }
    Ok(f)
}

/// The embedding tables and the other weights outside the layers.
fn tables_file() -> anyhow::Result<File> {
    let mut f = File {
        arrays: Vec::new(),
        seed: 7,
    };
    f.matrix("embed_tokens", VOCAB, HIDDEN)?;
    f.matrix("embed_tokens_per_layer", VOCAB, LAYERS * PER_LAYER)?;
    f.matrix("per_layer_model_projection", LAYERS * PER_LAYER, HIDDEN)?;
    f.filled("per_layer_projection_norm.weight", PER_LAYER, 1.0);
    f.filled("norm.weight", HIDDEN, 1.0);
    Ok(f)
}

/// `file`'s weights with every quantized matrix but the embedding tables
/// dequantized to f32.
fn dequantized(file: &Path) -> anyhow::Result<File> {
    let mut arrays: HashMap<String, Array> = Array::load_safetensors(file)?;
    let modules: Vec<String> = arrays
        .keys()
        .filter_map(|k| k.strip_suffix(".scales").map(str::to_owned))
        .filter(|m| !m.ends_with("embed_tokens") && !m.ends_with("embed_tokens_per_layer"))
        .collect();
    for m in modules {
        let w = arrays.remove(&format!("{m}.weight")).unwrap();
        let s = arrays.remove(&format!("{m}.scales")).unwrap();
        let b = arrays.remove(&format!("{m}.biases")).unwrap();
        arrays.insert(format!("{m}.weight"), dequantize(&w, &s, &b, GROUP, BITS)?);
    }
    let mut arrays: Vec<_> = arrays.into_iter().collect();
    arrays.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(File { arrays, seed: 0 })
}

/// Makes (once) the model under `target/bench-fixtures` and returns the
/// folder holding `q4/` and `f32/`; the tokenizer comes from `tokenizer_dir`
/// and the chat template is `chat_template`.
pub fn ensure(tokenizer_dir: &Path, chat_template: &str) -> anyhow::Result<PathBuf> {
    let root =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-fixtures/gemma4-e2b-shaped");
    let done = root.join(format!("complete-v{VERSION}"));
    if done.exists() {
        return Ok(root);
    }
    let _ = std::fs::remove_dir_all(&root);
    let (q4, f32) = (root.join("q4"), root.join("f32"));
    std::fs::create_dir_all(&q4)?;
    std::fs::create_dir_all(&f32)?;
    eprintln!(
        "making an E2B-shaped Gemma 4 with random 4-bit weights in {}",
        root.display()
    );
    let mut parts = vec![None];
    parts.extend((0..LAYERS).step_by(LAYERS_PER_FILE as usize).map(Some));
    // Made and written a file at a time; named `model*` because mlx_lm
    // loads only files matching `model*.safetensors`.
    for part in parts {
        let (name, file) = match part {
            None => ("model-tables.safetensors".to_owned(), tables_file()?),
            Some(start) => {
                let end = (start + LAYERS_PER_FILE).min(LAYERS);
                (
                    format!("model-layers-{start:02}-{end:02}.safetensors"),
                    layers_file(start..end)?,
                )
            }
        };
        file.save(&q4.join(&name))?;
        dequantized(&q4.join(&name))?.save(&f32.join(&name))?;
        eprintln!("  {name}");
    }
    let mut q4_config = config();
    q4_config["quantization"] = json!({"group_size": GROUP, "bits": BITS, "mode": "affine"});
    std::fs::write(q4.join("config.json"), q4_config.to_string())?;
    // Still a quantized model (the tables), so the same entry.
    std::fs::write(f32.join("config.json"), q4_config.to_string())?;
    // Gemma 3's tokenizer config with a chat template, as E2B's own has
    // one: so that the folder serves as it is (`classify`, `cargo xtask
    // memory-limit --model-dir …/q4`), not only through the benchmark.
    let mut tokenizer_config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tokenizer_dir.join("tokenizer_config.json"))?)?;
    tokenizer_config["chat_template"] = chat_template.into();
    for dir in [&q4, &f32] {
        std::fs::copy(
            tokenizer_dir.join("tokenizer.json"),
            dir.join("tokenizer.json"),
        )?;
        std::fs::write(
            dir.join("tokenizer_config.json"),
            tokenizer_config.to_string(),
        )?;
    }
    std::fs::write(&done, "")?;
    Ok(root)
}

//! A Gemma 4 checkpoint with E2B's real module shapes and random weights,
//! quantized the way the "UD" MLX checkpoints are (4-bit by default, some
//! modules in 8 bits or another group size, some left unquantized), in
//! mlx_lm's multimodal layout (`language_model.model.*`), with vision and
//! audio tower tensors beside the text weights and, optionally, the unused
//! k/v weights of KV-shared layers that checkpoints made with mlx_lm 0.31.3
//! still carry.
//!
//! Why it is made rather than downloaded:
//! `unsloth/gemma-4-E2B-it-UD-MLX-4bit` (3.5–4.5 GB) cannot be downloaded
//! where the tests run, and the shipped cc-sentiment adapter needs E2B's
//! shapes in layers 19–34.

use std::path::Path;

use mlx_rs::{Array, Dtype};
use serde_json::json;

pub const HIDDEN: i32 = 1536;
pub const LAYERS: i32 = 35;
pub const HEADS: i32 = 8;
pub const KV_HEADS: i32 = 1;
pub const HEAD_DIM: i32 = 256;
pub const GLOBAL_HEAD_DIM: i32 = 512;
pub const INTERMEDIATE: i32 = 6144;
pub const PER_LAYER: i32 = 256;
pub const SHARED_LAYERS: i32 = 20;
pub const WINDOW: i32 = 512;
/// E2B's vocabulary (the engine benchmark's); tests use a small one.
pub const E2B_VOCAB: i32 = 262_144;

/// How many layers, which of them share keys and values, which attend
/// to everything. E2B's is [`Depth::E2B`]; a test may take fewer layers
/// as long as every kind stays: sliding and full layers that own their
/// keys and values, and KV-shared ones of both kinds (the double-wide MLP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Depth {
    pub layers: i32,
    /// The last `shared` layers reuse an earlier layer's keys and values.
    pub shared: i32,
    /// Every `full_every`-th layer attends to the whole context.
    pub full_every: i32,
}

impl Depth {
    /// Gemma 4 E2B: 35 layers, every fifth full, the last 20 KV-shared.
    pub const E2B: Depth = Depth {
        layers: LAYERS,
        shared: SHARED_LAYERS,
        full_every: 5,
    };
    /// Four layers with every kind E2B has: sliding, full, then a
    /// KV-shared sliding and a KV-shared full layer.
    pub const EVERY_KIND: Depth = Depth {
        layers: 4,
        shared: 2,
        full_every: 2,
    };

    /// Whether layer `i` is a full-attention layer.
    pub fn is_full(&self, i: i32) -> bool {
        (i + 1) % self.full_every == 0
    }

    /// The first KV-shared layer.
    pub fn first_shared(&self) -> i32 {
        self.layers - self.shared
    }
}

/// What to write.
#[derive(Debug, Clone)]
pub struct E2bBase {
    pub vocab: i32,
    pub depth: Depth,
    /// The unused k/v/k_norm weights of KV-shared layers (0.31.3-era).
    pub legacy_kv: bool,
    /// Layers per weights shard (the embeddings get a shard of their own).
    pub layers_per_shard: i32,
    pub seed: u64,
    /// Of the scales, biases, norms and dense weights: bfloat16 as
    /// published, or float32 (MLX's CPU products in bfloat16 are slow).
    pub dtype: Dtype,
}

impl Default for E2bBase {
    fn default() -> Self {
        E2bBase {
            vocab: 512,
            depth: Depth::E2B,
            legacy_kv: true,
            layers_per_shard: 12,
            seed: 2026,
            dtype: Dtype::Bfloat16,
        }
    }
}

/// Whether layer `i` of E2B is a full-attention layer (every fifth).
pub fn is_full(i: i32) -> bool {
    Depth::E2B.is_full(i)
}

const PREFIX: &str = "language_model.model.";

/// One tensor of a decoder layer, as E2B has it (names under `model.`).
#[derive(Debug)]
pub enum LayerTensor {
    /// A `(rows, cols)` weight matrix (the checkpoint's `(out, in)`).
    Matrix {
        module: String,
        rows: i32,
        cols: i32,
    },
    /// A vector of `len` entries.
    Vector {
        key: String,
        len: i32,
        kind: VectorKind,
    },
}

/// What a layer's vector is, for the writer to choose its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VectorKind {
    /// The q or k norm's weight.
    QkNorm,
    /// Another norm's weight.
    Norm,
    /// `layer_scalar`.
    Scalar,
}

/// Layer `i`'s tensors in the order the writers make them. `kv`: with
/// the k/v projections and k norm (KV-shared layers have none, except in
/// 0.31.3-era checkpoints). KV-shared layers have the double-wide MLP.
pub fn layer_tensors(i: i32, kv: bool) -> Vec<LayerTensor> {
    layer_tensors_of(Depth::E2B, i, kv)
}

/// [`layer_tensors`] for a model of `depth`.
pub fn layer_tensors_of(depth: Depth, i: i32, kv: bool) -> Vec<LayerTensor> {
    let p = format!("layers.{i}");
    let hd = if depth.is_full(i) {
        GLOBAL_HEAD_DIM
    } else {
        HEAD_DIM
    };
    let inter = if i >= depth.first_shared() {
        2 * INTERMEDIATE
    } else {
        INTERMEDIATE
    };
    let matrix = |name: &str, rows, cols| LayerTensor::Matrix {
        module: format!("{p}.{name}"),
        rows,
        cols,
    };
    let vector = |name: &str, len, kind| LayerTensor::Vector {
        key: format!("{p}.{name}"),
        len,
        kind,
    };
    let mut t = vec![matrix("self_attn.q_proj", HEADS * hd, HIDDEN)];
    if kv {
        t.push(matrix("self_attn.k_proj", KV_HEADS * hd, HIDDEN));
        t.push(matrix("self_attn.v_proj", KV_HEADS * hd, HIDDEN));
        t.push(vector("self_attn.k_norm.weight", hd, VectorKind::QkNorm));
    }
    t.push(matrix("self_attn.o_proj", HIDDEN, HEADS * hd));
    t.push(vector("self_attn.q_norm.weight", hd, VectorKind::QkNorm));
    t.push(matrix("mlp.gate_proj", inter, HIDDEN));
    t.push(matrix("mlp.up_proj", inter, HIDDEN));
    t.push(matrix("mlp.down_proj", HIDDEN, inter));
    t.push(matrix("per_layer_input_gate", PER_LAYER, HIDDEN));
    t.push(matrix("per_layer_projection", HIDDEN, PER_LAYER));
    for norm in [
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "post_per_layer_input_norm",
    ] {
        t.push(vector(&format!("{norm}.weight"), HIDDEN, VectorKind::Norm));
    }
    t.push(vector("layer_scalar", 1, VectorKind::Scalar));
    t
}

/// The q/k norms' weights. Gemma 4 scales attention by 1: with unit norms,
/// random 256-wide heads would score keys ~16 apart, a softmax so sharp
/// that rounding differences between implementations pick other keys and
/// the logits stop being comparable. A quarter keeps scores near 1.
const QK_NORM: f32 = 0.25;

/// The UD-like plan: module (under the text prefix) → `(group, bits)`, or
/// `None` for a module left unquantized. Others: group 64, 4 bits.
fn plan(module: &str) -> Option<Option<(i32, i32)>> {
    let layer: Option<i32> = module
        .strip_prefix("layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse().ok());
    if module == "per_layer_model_projection" {
        return Some(Some((64, 8)));
    }
    let layer = layer?;
    if module.ends_with("mlp.down_proj") && layer >= 19 && layer % 2 == 1 {
        return Some(Some((64, 8)));
    }
    if module.ends_with("self_attn.o_proj") && layer % 5 == 0 {
        return Some(Some((32, 4)));
    }
    if module.ends_with("per_layer_projection") && layer % 3 == 0 {
        return Some(None);
    }
    if module.ends_with("self_attn.q_proj") && layer == 21 {
        return Some(None);
    }
    None
}

fn quantization(depth: Depth) -> serde_json::Value {
    let mut q = json!({"group_size": 64, "bits": 4, "mode": "affine"});
    let mut modules = vec!["per_layer_model_projection".to_owned()];
    for i in 0..depth.layers {
        for m in [
            "mlp.down_proj",
            "self_attn.o_proj",
            "per_layer_projection",
            "self_attn.q_proj",
        ] {
            modules.push(format!("layers.{i}.{m}"));
        }
    }
    for m in modules {
        if let Some(own) = plan(&m) {
            q[format!("{PREFIX}{m}")] = match own {
                Some((g, b)) => json!({"group_size": g, "bits": b}),
                None => json!(false),
            };
        }
    }
    q
}

/// The checkpoint's `config.json` (mlx_lm's `gemma4` with `text_config`).
pub fn config(base: &E2bBase) -> serde_json::Value {
    let depth = base.depth;
    let types: Vec<&str> = (0..depth.layers)
        .map(|i| {
            if depth.is_full(i) {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    json!({
        "model_type": "gemma4",
        "vocab_size": base.vocab,
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": HIDDEN, "num_hidden_layers": depth.layers,
            "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "global_head_dim": GLOBAL_HEAD_DIM,
            "rms_norm_eps": 1e-6, "vocab_size": base.vocab, "vocab_size_per_layer_input": base.vocab,
            "num_kv_shared_layers": depth.shared, "hidden_size_per_layer_input": PER_LAYER,
            "sliding_window": WINDOW, "layer_types": types,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"}
            },
            "final_logit_softcapping": 30.0, "use_double_wide_mlp": true,
            "tie_word_embeddings": true, "max_position_embeddings": 131072,
            "attention_k_eq_v": false, "enable_moe_block": false
        },
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 16},
        "audio_config": {"model_type": "gemma4_audio", "hidden_size": 16},
        "quantization": quantization(depth),
        "eos_token_id": [1, 106],
        "tie_word_embeddings": true
    })
}

struct Shard {
    tensors: Vec<(String, Array)>,
    seed: u64,
    dtype: Dtype,
}

impl Shard {
    fn normal(&mut self, shape: &[i32], std: f32) -> Array {
        self.seed += 1;
        let key = mlx_rs::random::key(self.seed).unwrap();
        mlx_rs::random::normal::<f32>(shape, None, std, &key)
            .unwrap()
            .as_dtype(self.dtype)
            .unwrap()
    }

    /// A vector of bfloat16 near `mean`.
    fn vector(&mut self, key: &str, len: i32, mean: f32) {
        let v = self
            .normal(&[len], 0.05)
            .add(Array::from_f32(mean).as_dtype(self.dtype).unwrap())
            .unwrap();
        self.tensors.push((format!("{PREFIX}{key}"), v));
    }

    /// The next value of a splitmix64 sequence: random bits far faster than
    /// MLX's normal distribution on the CPU (gigabytes of weights).
    fn bits(&mut self) -> u64 {
        self.seed = self.seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A matrix quantized by the plan (random packed values, scales and
    /// biases that centre them, weights of standard deviation ~`std`), or a
    /// dense bfloat16 one for modules left unquantized.
    fn matrix(&mut self, module: &str, rows: i32, cols: i32, std: f32) {
        let q = match plan(module) {
            Some(own) => own,
            None => Some((64, 4)),
        };
        let key = |suffix: &str| format!("{PREFIX}{module}.{suffix}");
        let Some((group, bits)) = q else {
            let w = self.normal(&[rows, cols], std);
            self.tensors.push((key("weight"), w));
            return;
        };
        let words = (rows as usize) * (cols * bits / 32) as usize;
        let packed: Vec<u32> = (0..words).map(|_| self.bits() as u32).collect();
        let packed = Array::from_slice(&packed, &[rows, cols * bits / 32]);
        // Uniform levels 0..2^bits have standard deviation ~2^bits/√12.
        let levels = (1u32 << bits) as f32;
        let step = std * 12f32.sqrt() / levels;
        let groups = (rows as usize) * (cols / group) as usize;
        let mut scales = Vec::with_capacity(groups);
        let mut biases = Vec::with_capacity(groups);
        for _ in 0..groups {
            let jitter = (self.bits() % 1000) as f32 / 1000.0 - 0.5;
            let scale = step * (1.0 + 0.5 * jitter);
            scales.push(scale);
            biases.push(-scale * (levels - 1.0) / 2.0);
        }
        let dtype = self.dtype;
        let scaled = |v: Vec<f32>| {
            Array::from_slice(&v, &[rows, cols / group])
                .as_dtype(dtype)
                .unwrap()
        };
        self.tensors.push((key("weight"), packed));
        self.tensors.push((key("scales"), scaled(scales)));
        self.tensors.push((key("biases"), scaled(biases)));
    }

    fn save(self, path: &Path) -> Vec<String> {
        Array::save_safetensors(
            self.tensors.iter().map(|(k, v)| (k.as_str(), v)),
            None,
            path,
        )
        .unwrap();
        self.tensors.into_iter().map(|(k, _)| k).collect()
    }
}

/// Writes the checkpoint (config, shards, index) into `dir`.
pub fn write(dir: &Path, base: &E2bBase) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        st_mmap::json::sorted(&config(base)).to_string(),
    )
    .unwrap();
    let depth = base.depth;
    let shards = 1 + (depth.layers + base.layers_per_shard - 1) / base.layers_per_shard;
    let name = |k: i32| format!("model-{:05}-of-{:05}.safetensors", k + 1, shards);
    let mut weight_map = serde_json::Map::new();
    let mut record = |keys: Vec<String>, file: String| {
        for key in keys {
            weight_map.insert(key, json!(file.clone()));
        }
    };

    let mut s = Shard {
        tensors: Vec::new(),
        seed: base.seed,
        dtype: base.dtype,
    };
    s.matrix("embed_tokens", base.vocab, HIDDEN, 0.03);
    s.matrix(
        "embed_tokens_per_layer",
        base.vocab,
        depth.layers * PER_LAYER,
        0.03,
    );
    s.matrix(
        "per_layer_model_projection",
        depth.layers * PER_LAYER,
        HIDDEN,
        0.02,
    );
    s.vector("per_layer_projection_norm.weight", PER_LAYER, 1.0);
    s.vector("norm.weight", HIDDEN, 1.0);
    // Towers mlx_lm drops on load (the text decoder never reads them).
    for tower in [
        "vision_tower.encoder.patch.weight",
        "audio_tower.conv.weight",
        "embed_vision.embedding_projection.weight",
    ] {
        let t = s.normal(&[16, 16], 0.02);
        s.tensors.push((tower.to_owned(), t));
    }
    let seed = s.seed;
    record(s.save(&dir.join(name(0))), name(0));

    let first_shared = depth.first_shared();
    for shard in 0..shards - 1 {
        let mut s = Shard {
            tensors: Vec::new(),
            seed: seed + 1_000 * (shard as u64 + 1),
            dtype: base.dtype,
        };
        let layers =
            shard * base.layers_per_shard..((shard + 1) * base.layers_per_shard).min(depth.layers);
        for i in layers {
            for tensor in layer_tensors_of(depth, i, i < first_shared || base.legacy_kv) {
                match tensor {
                    LayerTensor::Matrix { module, rows, cols } => {
                        s.matrix(&module, rows, cols, 0.02)
                    }
                    LayerTensor::Vector { key, len, kind } => s.vector(
                        &key,
                        len,
                        match kind {
                            VectorKind::QkNorm => QK_NORM,
                            VectorKind::Norm => 1.0,
                            VectorKind::Scalar => 0.8,
                        },
                    ),
                }
            }
        }
        record(s.save(&dir.join(name(shard + 1))), name(shard + 1));
    }
    let index = json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&st_mmap::json::sorted(&index)).unwrap(),
    )
    .unwrap();
}

//! Tiny random Gemma 3 and Gemma 4 checkpoints (every feature the engine
//! implements), their conversations and prompts: what the Gemma tests run.

use std::path::Path;

use mlx_engine::{Message, SpecialTokens, Tokenizer};
use mlx_rs::Array;
use serde_json::json;

use super::{normal, write_tokenizer, VOCAB};

/// Keys a query of a sliding layer may see, itself included.
pub const WINDOW: i32 = 5;
pub const HIDDEN: i32 = 64;
pub const LAYERS: usize = 6;
pub const HEADS: i32 = 4;
pub const KV_HEADS: i32 = 2;
pub const HEAD_DIM: i32 = 16;
pub const GLOBAL_HEAD_DIM: i32 = 32;
pub const INTER: i32 = 96;
pub const PER_LAYER: i32 = 16;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layout {
    /// `gemma*_text`, weights under `model.`.
    Text,
    /// `gemma*` with `text_config`, weights under `language_model.model.`
    /// (mlx_lm's layout), towers beside them.
    Mlx,
    /// Hugging Face's layout, `model.language_model.` (Gemma 4).
    HuggingFace,
}

impl Layout {
    fn text_prefix(self) -> &'static str {
        match self {
            Layout::Text => "model.",
            Layout::Mlx => "language_model.model.",
            Layout::HuggingFace => "model.language_model.",
        }
    }
}

/// A random checkpoint being written: weights by key, each quantized as
/// the plan says when written.
pub struct Writer {
    prefix: &'static str,
    /// Of every floating-point tensor (the packed weights stay uint32).
    dtype: mlx_rs::Dtype,
    seed: u64,
    weights: Vec<(String, Array)>,
    /// Module path (relative to the text prefix) → `(group, bits)`, or
    /// `None` to leave it unquantized; modules not listed follow `default`.
    plan: Vec<(String, Option<(i32, i32)>)>,
    default: Option<(i32, i32)>,
}

impl Writer {
    fn random(&mut self, key: &str, shape: &[i32], std: f32, mean: f32) {
        self.seed += 1;
        let a = normal(shape, self.seed, std)
            .add(Array::from_f32(mean))
            .unwrap();
        self.put(key, a);
    }

    fn put(&mut self, key: &str, a: Array) {
        let a = if a.dtype() == mlx_rs::Dtype::Float32 {
            a.as_dtype(self.dtype).unwrap()
        } else {
            a
        };
        self.weights.push((format!("{}{key}", self.prefix), a));
    }

    /// A linear layer or embedding table, quantized by the plan.
    fn matrix(&mut self, module: &str, shape: &[i32], std: f32) {
        self.seed += 1;
        let a = normal(shape, self.seed, std);
        let own = self.plan.iter().find(|(m, _)| m == module).map(|(_, q)| *q);
        match own.unwrap_or(self.default) {
            Some((group, bits)) => {
                let (w, s, b) = mlx_rs::ops::quantize(&a, group, bits).unwrap();
                self.put(&format!("{module}.weight"), w);
                self.put(&format!("{module}.scales"), s);
                self.put(&format!("{module}.biases"), b);
            }
            None => self.put(&format!("{module}.weight"), a),
        }
    }

    /// config.json's `quantization` entry, with module paths as mlx_lm
    /// names them.
    fn quantization(&self) -> serde_json::Value {
        let Some((group, bits)) = self.default else {
            return serde_json::Value::Null;
        };
        let mut q = json!({"group_size": group, "bits": bits, "mode": "affine"});
        for (module, own) in &self.plan {
            let path = format!("{}{module}", self.prefix);
            q[path] = match own {
                Some((g, b)) => json!({"group_size": g, "bits": b}),
                None => json!(false),
            };
        }
        q
    }

    fn save(self, dir: &Path, extra: Vec<(String, Array)>) {
        let all: Vec<_> = self.weights.into_iter().chain(extra).collect();
        Array::save_safetensors(
            all.iter().map(|(k, v)| (k.as_str(), v)),
            None,
            dir.join("model.safetensors"),
        )
        .unwrap();
    }
}

pub fn layer_types() -> Vec<&'static str> {
    // Layers 4 (full) and 5 (sliding) share the keys and values of layers
    // 2 and 3.
    let (s, f) = ("sliding_attention", "full_attention");
    vec![s, s, f, s, f, s]
}

pub const SHARED_LAYERS: usize = 2;

/// A Gemma 4 checkpoint in `layout`; `quantized`: mixed 4/8-bit with
/// modules left in f32.
pub fn write_gemma4(dir: &Path, layout: Layout, quantized: bool) {
    write_gemma4_in(dir, layout, quantized, mlx_rs::Dtype::Float32);
}

/// [`write_gemma4`] with every floating-point tensor in `dtype` (bfloat16:
/// scales, biases, norms and unquantized modules as published Gemma 4
/// checkpoints have them).
pub fn write_gemma4_in(dir: &Path, layout: Layout, quantized: bool, dtype: mlx_rs::Dtype) {
    write_gemma4_with(dir, layout, quantized, dtype, VOCAB);
}

/// [`write_gemma4_in`] with a vocabulary of `vocab` entries (the test's
/// word-level tokenizer is written all the same: one of another size
/// replaces it).
pub fn write_gemma4_with(
    dir: &Path,
    layout: Layout,
    quantized: bool,
    dtype: mlx_rs::Dtype,
    vocab: i32,
) {
    write_gemma4_model(dir, layout, quantized, dtype, vocab, false);
}

/// Experts of the MoE variant.
pub const EXPERTS: i32 = 8;
pub const MOE_INTER: i32 = 32;

/// The 26B-A4B's variant of [`write_gemma4`]: in every layer a router and
/// 8 routed experts (top 2) beside the MLP, and full layers whose values
/// are their keys' projection (`attention_k_eq_v`, one key/value head).
/// `quantized`: 4-bit with the routers in 8 bits, as mlx_lm quantizes it.
#[allow(dead_code)]
pub fn write_gemma4_moe(dir: &Path, quantized: bool) {
    write_gemma4_moe_in(dir, quantized, mlx_rs::Dtype::Float32);
}

/// [`write_gemma4_moe`] with every floating-point tensor in `dtype`.
#[allow(dead_code)]
pub fn write_gemma4_moe_in(dir: &Path, quantized: bool, dtype: mlx_rs::Dtype) {
    write_gemma4_model(dir, Layout::Text, quantized, dtype, VOCAB, true);
}

fn write_gemma4_model(
    dir: &Path,
    layout: Layout,
    quantized: bool,
    dtype: mlx_rs::Dtype,
    vocab: i32,
    moe: bool,
) {
    std::fs::create_dir_all(dir).unwrap();
    let mut text = json!({
        "model_type": "gemma4_text", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "global_head_dim": GLOBAL_HEAD_DIM, "rms_norm_eps": 1e-6,
        "vocab_size": vocab, "vocab_size_per_layer_input": vocab,
        "num_kv_shared_layers": SHARED_LAYERS, "hidden_size_per_layer_input": PER_LAYER,
        "sliding_window": WINDOW, "layer_types": layer_types(),
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}
        },
        "final_logit_softcapping": 4.0, "use_double_wide_mlp": true, "tie_word_embeddings": true,
        "max_position_embeddings": 2048, "eos_token_id": 44
    });
    if moe {
        for (key, value) in [
            ("enable_moe_block", json!(true)),
            ("num_experts", json!(EXPERTS)),
            ("top_k_experts", json!(2)),
            ("moe_intermediate_size", json!(MOE_INTER)),
            ("attention_k_eq_v", json!(true)),
            ("num_global_key_value_heads", json!(1)),
        ] {
            text[key] = value;
        }
    }
    let mut w = Writer {
        prefix: layout.text_prefix(),
        dtype,
        seed: 400,
        weights: Vec::new(),
        plan: Vec::new(),
        default: None,
    };
    if quantized {
        w.default = Some((32, 4));
        w.plan = vec![
            ("embed_tokens_per_layer".into(), Some((32, 8))),
            ("layers.1.mlp.gate_proj".into(), Some((64, 8))),
            ("layers.2.self_attn.o_proj".into(), None),
            ("layers.4.mlp.up_proj".into(), Some((64, 8))),
        ];
        // A 16-wide input has no 32-element group: left in f32, as
        // mlx_lm's quantization would.
        for i in 0..LAYERS {
            w.plan
                .push((format!("layers.{i}.per_layer_projection"), None));
        }
    }
    let n = LAYERS as i32;
    w.matrix("embed_tokens", &[vocab, HIDDEN], 0.5);
    w.matrix("embed_tokens_per_layer", &[vocab, n * PER_LAYER], 0.5);
    w.matrix("per_layer_model_projection", &[n * PER_LAYER, HIDDEN], 0.2);
    w.random("per_layer_projection_norm.weight", &[PER_LAYER], 0.1, 1.0);
    w.random("norm.weight", &[HIDDEN], 0.1, 1.0);
    let first_shared = LAYERS - SHARED_LAYERS;
    let mut legacy = Vec::new();
    for (i, kind) in layer_types().into_iter().enumerate() {
        let p = format!("layers.{i}");
        let hd = if kind == "full_attention" {
            GLOBAL_HEAD_DIM
        } else {
            HEAD_DIM
        };
        let inter = if i >= first_shared { 2 * INTER } else { INTER };
        w.matrix(&format!("{p}.self_attn.q_proj"), &[HEADS * hd, HIDDEN], 0.2);
        w.matrix(&format!("{p}.self_attn.o_proj"), &[HIDDEN, HEADS * hd], 0.2);
        w.random(&format!("{p}.self_attn.q_norm.weight"), &[hd], 0.1, 1.0);
        let values_are_keys = moe && kind == "full_attention";
        let kv_heads = if values_are_keys { 1 } else { KV_HEADS };
        if i < first_shared {
            w.matrix(
                &format!("{p}.self_attn.k_proj"),
                &[kv_heads * hd, HIDDEN],
                0.2,
            );
            if !values_are_keys {
                w.matrix(
                    &format!("{p}.self_attn.v_proj"),
                    &[kv_heads * hd, HIDDEN],
                    0.2,
                );
            }
            w.random(&format!("{p}.self_attn.k_norm.weight"), &[hd], 0.1, 1.0);
        } else if layout != Layout::Text {
            // What mlx_lm 0.31.3 still wrote for shared layers: never read.
            for (name, shape) in [
                ("k_proj.weight", vec![KV_HEADS * hd, HIDDEN]),
                ("v_proj.weight", vec![KV_HEADS * hd, HIDDEN]),
                ("k_norm.weight", vec![hd]),
            ] {
                legacy.push((
                    format!("{}{p}.self_attn.{name}", w.prefix),
                    normal(&shape, 900 + i as u64, 1.0),
                ));
            }
        }
        w.matrix(&format!("{p}.mlp.gate_proj"), &[inter, HIDDEN], 0.2);
        w.matrix(&format!("{p}.mlp.up_proj"), &[inter, HIDDEN], 0.2);
        w.matrix(&format!("{p}.mlp.down_proj"), &[HIDDEN, inter], 0.2);
        if moe {
            write_experts(&mut w, &p, quantized);
        }
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_per_layer_input_norm",
        ] {
            w.random(&format!("{p}.{norm}.weight"), &[HIDDEN], 0.1, 1.0);
        }
        w.matrix(
            &format!("{p}.per_layer_input_gate"),
            &[PER_LAYER, HIDDEN],
            0.2,
        );
        w.matrix(
            &format!("{p}.per_layer_projection"),
            &[HIDDEN, PER_LAYER],
            0.2,
        );
        w.put(
            &format!("{p}.layer_scalar"),
            Array::from_slice(&[0.6 + 0.15 * i as f32], &[1]),
        );
    }
    let quantization = w.quantization();
    let config = match layout {
        Layout::Text => {
            let mut c = text;
            c["quantization"] = quantization;
            c
        }
        Layout::Mlx | Layout::HuggingFace => json!({
            "model_type": "gemma4", "text_config": text, "vocab_size": vocab,
            "vision_config": {"hidden_size": 8}, "quantization": quantization, "eos_token_id": 44
        }),
    };
    std::fs::write(
        dir.join("config.json"),
        st_mmap::json::sorted(&config).to_string(),
    )
    .unwrap();
    if layout != Layout::Text {
        let tower = if layout == Layout::Mlx { "" } else { "model." };
        legacy.push((
            format!("{tower}vision_tower.patch.weight"),
            normal(&[4, 8], 1, 1.0),
        ));
        legacy.push((
            format!("{tower}audio_tower.conv.weight"),
            normal(&[4, 8], 2, 1.0),
        ));
        legacy.push((
            format!("{tower}embed_vision.weight"),
            normal(&[4, 8], 3, 1.0),
        ));
    }
    w.save(dir, legacy);
    write_tokenizer(dir, false);
}

/// Layer `p`'s router, experts and their norms (mlx_lm's names).
fn write_experts(w: &mut Writer, p: &str, quantized: bool) {
    let router = format!("{p}.router.proj");
    if quantized {
        // mlx_lm's `quant_predicate` for Gemma 4: routers in 8 bits.
        w.plan.push((router.clone(), Some((64, 8))));
    }
    w.matrix(&router, &[EXPERTS, HIDDEN], 0.5);
    w.random(&format!("{p}.router.scale"), &[HIDDEN], 0.1, 1.0);
    w.random(
        &format!("{p}.router.per_expert_scale"),
        &[EXPERTS],
        0.2,
        1.0,
    );
    let switch = format!("{p}.experts.switch_glu");
    w.matrix(
        &format!("{switch}.gate_proj"),
        &[EXPERTS, MOE_INTER, HIDDEN],
        0.2,
    );
    w.matrix(
        &format!("{switch}.up_proj"),
        &[EXPERTS, MOE_INTER, HIDDEN],
        0.2,
    );
    w.matrix(
        &format!("{switch}.down_proj"),
        &[EXPERTS, HIDDEN, MOE_INTER],
        0.2,
    );
    for norm in [
        "post_feedforward_layernorm_1",
        "pre_feedforward_layernorm_2",
        "post_feedforward_layernorm_2",
    ] {
        w.random(&format!("{p}.{norm}.weight"), &[HIDDEN], 0.1, 1.0);
    }
}

/// A Gemma 3 checkpoint (sliding pattern 3: layers 2 and 5 are global).
pub fn write_gemma3(dir: &Path, layout: Layout) {
    std::fs::create_dir_all(dir).unwrap();
    let text = json!({
        "model_type": "gemma3_text", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 12, "sliding_window": WINDOW,
        "sliding_window_pattern": 3, "max_position_embeddings": 2048, "eos_token_id": 44
    });
    let mut w = Writer {
        prefix: layout.text_prefix(),
        dtype: mlx_rs::Dtype::Float32,
        seed: 700,
        weights: Vec::new(),
        plan: Vec::new(),
        default: None,
    };
    w.matrix("embed_tokens", &[VOCAB, HIDDEN], 0.5);
    // Gemma 3 scales by (1 + w): weights near 0.
    w.random("norm.weight", &[HIDDEN], 0.1, 0.0);
    for i in 0..LAYERS {
        let p = format!("layers.{i}");
        for (name, shape) in [
            ("self_attn.q_proj", [HEADS * HEAD_DIM, HIDDEN]),
            ("self_attn.k_proj", [KV_HEADS * HEAD_DIM, HIDDEN]),
            ("self_attn.v_proj", [KV_HEADS * HEAD_DIM, HIDDEN]),
            ("self_attn.o_proj", [HIDDEN, HEADS * HEAD_DIM]),
            ("mlp.gate_proj", [INTER, HIDDEN]),
            ("mlp.up_proj", [INTER, HIDDEN]),
            ("mlp.down_proj", [HIDDEN, INTER]),
        ] {
            w.matrix(&format!("{p}.{name}"), &shape, 0.2);
        }
        for norm in ["self_attn.q_norm", "self_attn.k_norm"] {
            w.random(&format!("{p}.{norm}.weight"), &[HEAD_DIM], 0.1, 0.0);
        }
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            w.random(&format!("{p}.{norm}.weight"), &[HIDDEN], 0.1, 0.0);
        }
    }
    let config = match layout {
        Layout::Text => text,
        _ => {
            json!({"model_type": "gemma3", "text_config": text, "vocab_size": VOCAB, "eos_token_id": 44})
        }
    };
    std::fs::write(
        dir.join("config.json"),
        st_mmap::json::sorted(&config).to_string(),
    )
    .unwrap();
    let towers = if layout == Layout::Text {
        Vec::new()
    } else {
        vec![
            (
                "vision_tower.patch.weight".to_owned(),
                normal(&[4, 8], 1, 1.0),
            ),
            (
                "multi_modal_projector.proj.weight".to_owned(),
                normal(&[4, 8], 2, 1.0),
            ),
        ]
    };
    w.save(dir, towers);
    write_tokenizer(dir, false);
}

/// A system prompt longer than the engine's 256-position prefill pieces
/// (so the prefix is prefilled in two, the sliding layers dropping
/// positions between them), and users' messages from one word to past a
/// piece as well.
pub fn system() -> Message {
    let words: Vec<String> = (0..270)
        .map(|i| format!("w{}", (i * 11 + 1) % 40))
        .collect();
    Message::new("system", words.join(" "))
}

pub fn conversations() -> Vec<Vec<Message>> {
    let long: Vec<String> = (0..300).map(|i| format!("w{}", (i * 7) % 40)).collect();
    [
        "w7".to_owned(),
        "w8 w9 w10 w11 w12 w13".into(),
        "w20 w21 w22".into(),
        long.join(" "),
        "w30 w31 w32 w33 w34 w35 w36 w37".into(),
        "w5 w6".into(),
    ]
    .into_iter()
    .map(|u| vec![system(), Message::new("user", u)])
    .collect()
}

/// The prompt's tokens: the prefix's, and each conversation's after it.
pub fn prompt_tokens(dir: &Path) -> (Vec<u32>, Vec<Vec<u32>>) {
    let tokenizer = Tokenizer::load(dir).unwrap();
    let prefix = tokenizer
        .chat_tokens(&[system()], false, SpecialTokens::AsText)
        .unwrap();
    let suffixes = conversations()
        .iter()
        .map(|c| {
            let all = tokenizer
                .chat_tokens(c, true, SpecialTokens::AsText)
                .unwrap();
            all.strip_prefix(prefix.as_slice()).unwrap().to_vec()
        })
        .collect();
    (prefix, suffixes)
}

pub const MAX_TOKENS: usize = 6;

pub fn ids(tokens: &[u32]) -> Vec<i32> {
    tokens.iter().map(|&t| t as i32).collect()
}

/// The suffixes as one left-padded batch: `(tokens (rows × width), each
/// row's padding, width)`.
pub fn left_padded(suffixes: &[Vec<u32>]) -> (Vec<i32>, Vec<i32>, usize) {
    let width = suffixes.iter().map(Vec::len).max().unwrap_or(0);
    let block = suffixes
        .iter()
        .flat_map(|s| std::iter::repeat_n(0, width - s.len()).chain(ids(s)))
        .collect();
    let pads = suffixes.iter().map(|s| (width - s.len()) as i32).collect();
    (block, pads, width)
}

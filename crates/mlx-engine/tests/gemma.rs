//! Gemma 3 and Gemma 4 against mlx_lm 0.32.2 (`tests/parity/mlx_lm_gemma.py`)
//! on tiny random checkpoints that exercise every feature: sliding and full
//! layers with a window far shorter than the prompts and the shared prefix,
//! different head sizes per layer type, KV-shared layers of both types,
//! per-layer input embeddings, layer scalars ≠ 1, the logit softcap,
//! multimodal layouts (mlx_lm's and Hugging Face's, with towers and the
//! unused k/v weights of 0.31.3-era checkpoints), f32 and mixed 4/8-bit;
//! a prefix and a prompt longer than the engine's prefill pieces.

mod common;

use std::path::Path;
use std::process::Command;

use common::{mlx_lm_python, normal, write_tokenizer, VOCAB};
use mlx_engine::{
    EngineConfig, Error, GenerateOptions, KvCache, MemoryMode, Message, MlxEngine, Model,
    QuantizedWeights, SpecialTokens, Tokenizer,
};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use serde_json::json;

/// Keys a query of a sliding layer may see, itself included.
const WINDOW: i32 = 5;
const HIDDEN: i32 = 64;
const LAYERS: usize = 6;
const HEADS: i32 = 4;
const KV_HEADS: i32 = 2;
const HEAD_DIM: i32 = 16;
const GLOBAL_HEAD_DIM: i32 = 32;
const INTER: i32 = 96;
const PER_LAYER: i32 = 16;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
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
struct Writer {
    prefix: &'static str,
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

fn layer_types() -> Vec<&'static str> {
    // Layers 4 (full) and 5 (sliding) share the keys and values of layers
    // 2 and 3.
    let (s, f) = ("sliding_attention", "full_attention");
    vec![s, s, f, s, f, s]
}

const SHARED_LAYERS: usize = 2;

/// A Gemma 4 checkpoint in `layout`; `quantized`: mixed 4/8-bit with
/// modules left in f32.
fn write_gemma4(dir: &Path, layout: Layout, quantized: bool) {
    std::fs::create_dir_all(dir).unwrap();
    let text = json!({
        "model_type": "gemma4_text", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "global_head_dim": GLOBAL_HEAD_DIM, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
        "num_kv_shared_layers": SHARED_LAYERS, "hidden_size_per_layer_input": PER_LAYER,
        "sliding_window": WINDOW, "layer_types": layer_types(),
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}
        },
        "final_logit_softcapping": 4.0, "use_double_wide_mlp": true, "tie_word_embeddings": true,
        "max_position_embeddings": 2048, "eos_token_id": 44
    });
    let mut w = Writer {
        prefix: layout.text_prefix(),
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
    w.matrix("embed_tokens", &[VOCAB, HIDDEN], 0.5);
    w.matrix("embed_tokens_per_layer", &[VOCAB, n * PER_LAYER], 0.5);
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
        if i < first_shared {
            w.matrix(
                &format!("{p}.self_attn.k_proj"),
                &[KV_HEADS * hd, HIDDEN],
                0.2,
            );
            w.matrix(
                &format!("{p}.self_attn.v_proj"),
                &[KV_HEADS * hd, HIDDEN],
                0.2,
            );
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
            "model_type": "gemma4", "text_config": text, "vocab_size": VOCAB,
            "vision_config": {"hidden_size": 8}, "quantization": quantization, "eos_token_id": 44
        }),
    };
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
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

/// A Gemma 3 checkpoint (sliding pattern 3: layers 2 and 5 are global).
fn write_gemma3(dir: &Path, layout: Layout) {
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
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
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
fn system() -> Message {
    let words: Vec<String> = (0..270)
        .map(|i| format!("w{}", (i * 11 + 1) % 40))
        .collect();
    Message::new("system", words.join(" "))
}

fn conversations() -> Vec<Vec<Message>> {
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

#[derive(serde::Deserialize)]
struct Reference {
    version: String,
    alone_logits: Vec<Vec<f32>>,
    alone_greedy: Vec<Vec<u32>>,
    batch_greedy: Vec<Vec<u32>>,
}

/// The prompt's tokens: the prefix's, and each conversation's after it.
fn prompt_tokens(dir: &Path) -> (Vec<u32>, Vec<Vec<u32>>) {
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

const MAX_TOKENS: usize = 6;

fn mlx_lm_reference(python: &str, dir: &Path) -> Reference {
    let (prefix, suffixes) = prompt_tokens(dir);
    let request = dir.join("request.json");
    let body =
        json!({"prefix": prefix, "suffixes": suffixes, "max_tokens": MAX_TOKENS, "eos": [44]});
    std::fs::write(&request, body.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/mlx_lm_gemma.py");
    let out = Command::new(python)
        .arg(&script)
        .arg(dir)
        .arg(&request)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let reference: Reference = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        reference.version, "0.32.2",
        "the reference must be mlx_lm 0.32.2 (cargo xtask test installs it beside the venv)"
    );
    reference
}

fn row_logits(logits: &Array, row: i32) -> Vec<f32> {
    let v = logits.index(row).as_dtype(Dtype::Float32).unwrap();
    v.eval().unwrap();
    v.as_slice::<f32>().to_vec()
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn ids(tokens: &[u32]) -> Vec<i32> {
    tokens.iter().map(|&t| t as i32).collect()
}

/// Our logits and greedy texts against mlx_lm's: each row alone (the whole
/// prompt in one forward), the rows as one left-padded batch after the
/// shared prefix's cache, and the engine's batched generation.
fn check_against_mlx_lm(python: &str, dir: &Path, mode: QuantizedWeights, tolerance: f32) {
    let what = dir.display().to_string();
    let reference = mlx_lm_reference(python, dir);
    let model = Model::load(dir, mode).unwrap();
    let (prefix, suffixes) = prompt_tokens(dir);
    for (row, suffix) in suffixes.iter().enumerate() {
        let full = ids(&[prefix.clone(), suffix.clone()].concat());
        let logits = model
            .forward_last(
                &Array::from_slice(&full, &[1, full.len() as i32]),
                &mut KvCache::new(),
            )
            .unwrap();
        let d = max_difference(&row_logits(&logits, 0), &reference.alone_logits[row]);
        assert!(d <= tolerance, "{what}: row {row} alone differs by {d}");
    }
    let mut shared = KvCache::new();
    let p = ids(&prefix);
    model
        .forward_last(&Array::from_slice(&p, &[1, p.len() as i32]), &mut shared)
        .unwrap();
    let width = suffixes.iter().map(Vec::len).max().unwrap();
    let pads: Vec<i32> = suffixes.iter().map(|s| (width - s.len()) as i32).collect();
    let block: Vec<i32> = suffixes
        .iter()
        .flat_map(|s| std::iter::repeat_n(0, width - s.len()).chain(ids(s)))
        .collect();
    let mut cache = shared.fork(suffixes.len() as i32).unwrap();
    cache.set_pads(pads).unwrap();
    let rows = suffixes.len() as i32;
    let logits = model
        .forward_last(
            &Array::from_slice(&block, &[rows, width as i32]),
            &mut cache,
        )
        .unwrap();
    for row in 0..suffixes.len() {
        let d = max_difference(
            &row_logits(&logits, row as i32),
            &reference.alone_logits[row],
        );
        assert!(
            d <= tolerance,
            "{what}: row {row} in the batch differs by {d}"
        );
    }
    // The engine: sorted, chunked, grouped prefill, stacked decode.
    let engine = MlxEngine::new(
        EngineConfig::new(dir)
            .prefix_messages(vec![system()])
            .batch_size(4)
            .quantized(mode),
    )
    .unwrap();
    let texts = engine
        .generate(
            conversations(),
            GenerateOptions::new().max_tokens(MAX_TOKENS),
        )
        .unwrap()
        .texts;
    let tokenizer = Tokenizer::load(dir).unwrap();
    for (row, text) in texts.iter().enumerate() {
        let alone = tokenizer.decode(&reference.alone_greedy[row]).unwrap();
        let batched = tokenizer.decode(&reference.batch_greedy[row]).unwrap();
        assert_eq!(alone, batched, "{what}: mlx_lm alone vs batched, row {row}");
        assert_eq!(text, &alone, "{what}: engine vs mlx_lm, row {row}");
    }
}

#[test]
fn gemma4_matches_mlx_lm_in_every_layout() {
    let Some(python) = mlx_lm_python("gemma4_matches_mlx_lm_in_every_layout") else {
        return;
    };
    for layout in [Layout::Text, Layout::Mlx, Layout::HuggingFace] {
        let dir = tempfile::tempdir().unwrap();
        write_gemma4(dir.path(), layout, false);
        check_against_mlx_lm(&python, dir.path(), QuantizedWeights::Keep, 1e-4);
    }
}

#[test]
fn gemma4_mixed_4_and_8_bit_matches_mlx_lm() {
    let Some(python) = mlx_lm_python("gemma4_mixed_4_and_8_bit_matches_mlx_lm") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    write_gemma4(dir.path(), Layout::Text, true);
    // The same products as mlx_lm (MLX's quantized matmul and gathers).
    check_against_mlx_lm(&python, dir.path(), QuantizedWeights::Keep, 1e-4);
}

#[test]
fn gemma3_matches_mlx_lm() {
    let Some(python) = mlx_lm_python("gemma3_matches_mlx_lm") else {
        return;
    };
    for layout in [Layout::Text, Layout::Mlx] {
        let dir = tempfile::tempdir().unwrap();
        write_gemma3(dir.path(), layout);
        check_against_mlx_lm(&python, dir.path(), QuantizedWeights::Keep, 1e-4);
    }
}

/// The CPU modes (dequantized before each product, or at load) give the
/// logits of MLX's quantized products, up to their rounding.
#[test]
fn quantized_gemma4_modes_agree() {
    let dir = tempfile::tempdir().unwrap();
    write_gemma4(dir.path(), Layout::Text, true);
    let (prefix, suffixes) = prompt_tokens(dir.path());
    let full = ids(&[prefix, suffixes[3].clone()].concat());
    let logits = |mode| {
        let model = Model::load(dir.path(), mode).unwrap();
        let out = model
            .forward_last(
                &Array::from_slice(&full, &[1, full.len() as i32]),
                &mut KvCache::new(),
            )
            .unwrap();
        row_logits(&out, 0)
    };
    let kept = logits(QuantizedWeights::Keep);
    let on_use = logits(QuantizedWeights::DequantizeOnUse);
    let at_load = logits(QuantizedWeights::DequantizeF32);
    assert!(max_difference(&kept, &on_use) < 1e-3);
    assert!(max_difference(&on_use, &at_load) < 1e-5);
}

/// Embedding tables left in the files (the token table, tied head, and
/// the per-layer table), and decoder layers streamed from the files too
/// (KV-shared layers included), give the resident model's logits bit for
/// bit, in every quantized-weights mode, f32 and 4-bit, for a whole prompt
/// and for a padded batch after a shared prefix; the engine's greedy texts
/// are the same; a token outside the vocabulary is a typed error. The
/// 4-bit model is in mlx_lm's multimodal layout (layers under
/// `language_model.model.layers.`).
#[test]
fn gemma4_in_low_memory_modes_equals_resident() {
    for (quantized, layout) in [(false, Layout::Text), (true, Layout::Mlx)] {
        let dir = tempfile::tempdir().unwrap();
        write_gemma4(dir.path(), layout, quantized);
        let (prefix, suffixes) = prompt_tokens(dir.path());
        let full = ids(&[prefix.clone(), suffixes[3].clone()].concat());
        let width = suffixes.iter().map(Vec::len).max().unwrap();
        let block: Vec<i32> = suffixes
            .iter()
            .flat_map(|s| std::iter::repeat_n(0, width - s.len()).chain(ids(s)))
            .collect();
        let pads: Vec<i32> = suffixes.iter().map(|s| (width - s.len()) as i32).collect();
        let rows = suffixes.len() as i32;
        let logits = |mode, memory| {
            let model = Model::load_with(dir.path(), mode, memory).unwrap();
            let alone = model
                .forward(
                    &Array::from_slice(&full, &[1, full.len() as i32]),
                    &mut KvCache::new(),
                )
                .unwrap();
            let mut shared = KvCache::new();
            let p = ids(&prefix);
            model
                .forward_last(&Array::from_slice(&p, &[1, p.len() as i32]), &mut shared)
                .unwrap();
            let mut cache = shared.fork(rows).unwrap();
            cache.set_pads(pads.clone()).unwrap();
            let batch = model
                .forward_last(
                    &Array::from_slice(&block, &[rows, width as i32]),
                    &mut cache,
                )
                .unwrap();
            let bits = |a: &Array| -> Vec<u32> {
                let a = a.as_dtype(Dtype::Float32).unwrap();
                a.eval().unwrap();
                a.as_slice::<f32>().iter().map(|v| v.to_bits()).collect()
            };
            (bits(&alone), bits(&batch))
        };
        for mode in [
            QuantizedWeights::Keep,
            QuantizedWeights::DequantizeOnUse,
            QuantizedWeights::DequantizeF32,
        ] {
            let resident = logits(mode, MemoryMode::Resident);
            for memory in [MemoryMode::MappedTables, MemoryMode::Streamed] {
                assert!(
                    resident == logits(mode, memory),
                    "quantized {quantized}, {mode:?}: {memory:?} changes the logits"
                );
            }
        }
        let texts = |memory| {
            let engine = MlxEngine::new(
                EngineConfig::new(dir.path())
                    .prefix_messages(vec![system()])
                    .batch_size(4)
                    .memory(memory),
            )
            .unwrap();
            engine
                .generate(
                    conversations(),
                    GenerateOptions::new().max_tokens(MAX_TOKENS),
                )
                .unwrap()
                .texts
        };
        let resident = texts(MemoryMode::Resident);
        assert_eq!(
            resident,
            texts(MemoryMode::MappedTables),
            "quantized {quantized}"
        );
        assert_eq!(
            resident,
            texts(MemoryMode::Streamed),
            "quantized {quantized}"
        );

        for memory in [MemoryMode::MappedTables, MemoryMode::Streamed] {
            let model = Model::load_with(dir.path(), QuantizedWeights::Keep, memory).unwrap();
            let outside = Array::from_slice(&[3, VOCAB], &[1, 2]);
            match model.forward(&outside, &mut KvCache::new()) {
                Err(Error::TokenOutOfRange { id, vocab }) => {
                    assert_eq!((id, vocab), (VOCAB as u32, VOCAB as usize));
                }
                other => panic!("{memory:?}: {other:?}"),
            }
        }
    }
}

/// A streamed model whose weight file is gone when a forward needs the
/// next layer fails with an error naming the folder, not a panic.
#[test]
fn a_streamed_layer_whose_file_is_gone_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    write_gemma4(dir.path(), Layout::Text, true);
    let model = Model::load_with(dir.path(), QuantizedWeights::Keep, MemoryMode::Streamed).unwrap();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    match model.forward(&Array::from_slice(&[3, 4], &[1, 2]), &mut KvCache::new()) {
        Err(e @ Error::Stream { .. }) => {
            let message = e.to_string();
            assert!(message.contains("model.safetensors"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
}

#[test]
fn bad_gemma_checkpoints_are_typed_errors_naming_file_and_key() {
    // Text weights missing: only towers in the files.
    let dir = tempfile::tempdir().unwrap();
    write_gemma4(dir.path(), Layout::Mlx, false);
    let towers_only: Vec<(String, Array)> =
        vec![("vision_tower.patch.weight".into(), normal(&[4, 8], 1, 1.0))];
    Array::save_safetensors(
        towers_only.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let err = Model::load(dir.path(), QuantizedWeights::Keep).unwrap_err();
    assert!(
        matches!(&err, Error::MissingWeight { key, .. } if key.contains("language_model.model.embed_tokens")),
        "{err}"
    );

    // A shape the config does not imply.
    let dir = tempfile::tempdir().unwrap();
    write_gemma4(dir.path(), Layout::Text, false);
    edit_config(dir.path(), |c| c["global_head_dim"] = json!(24));
    let err = Model::load(dir.path(), QuantizedWeights::Keep).unwrap_err();
    match &err {
        Error::WeightShape {
            path,
            key,
            expected,
            actual,
        } => {
            assert_eq!(path, &dir.path().join("model.safetensors"));
            assert_eq!(key, "model.layers.2.self_attn.k_proj.weight");
            assert_eq!(expected, &[(KV_HEADS * 24) as usize, HIDDEN as usize]);
            assert_eq!(
                actual,
                &[(KV_HEADS * GLOBAL_HEAD_DIM) as usize, HIDDEN as usize]
            );
        }
        other => panic!("{other}"),
    }

    // No text_config, a text_config that is not an object, an incomplete
    // one, an unknown layer type, a shared layer with nothing to share.
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "no text_config",
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("text_config");
            }),
            "text_config",
        ),
        (
            "text_config a list",
            Box::new(|c| c["text_config"] = json!([1])),
            "text_config",
        ),
        (
            "incomplete",
            Box::new(|c| {
                c["text_config"]
                    .as_object_mut()
                    .unwrap()
                    .remove("hidden_size");
            }),
            "hidden_size",
        ),
        (
            "layer type",
            Box::new(|c| c["text_config"]["layer_types"][1] = json!("local")),
            "layer type",
        ),
        (
            "all shared",
            Box::new(|c| c["text_config"]["num_kv_shared_layers"] = json!(6)),
            "num_kv_shared_layers",
        ),
        (
            "moe",
            Box::new(|c| c["text_config"]["enable_moe_block"] = json!(true)),
            "enable_moe_block",
        ),
    ];
    for (what, edit, needle) in cases {
        let dir = tempfile::tempdir().unwrap();
        write_gemma4(dir.path(), Layout::Mlx, false);
        edit_config(dir.path(), edit);
        let err = Model::load(dir.path(), QuantizedWeights::Keep).unwrap_err();
        match &err {
            Error::Config { path, message } => {
                assert_eq!(path, &dir.path().join("config.json"), "{what}");
                assert!(message.contains(needle), "{what}: {message}");
            }
            other => panic!("{what}: {other}"),
        }
    }
}

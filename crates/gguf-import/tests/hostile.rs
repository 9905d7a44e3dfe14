//! Importing GGUF files: a small valid one built here, and corrupt ones
//! (truncated, lying counts, zero heads, huge dimensions, unknown tensor
//! types, a broken merges list). Each corrupt file is a typed error naming
//! the file, never a crash, and leaves no output folder (an existing one is
//! kept as it was).

use gguf_import::{import_gguf, Error, ImportWeights};
use mlx_engine::{Model, QuantizedWeights, Tokenizer};

/// A GGUF metadata value.
#[derive(Clone)]
enum Value {
    U32(u32),
    F32(f32),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

/// A GGUF file's contents, written by [`Gguf::bytes`].
#[derive(Clone)]
struct Gguf {
    kvs: Vec<(String, Value)>,
    /// Name, dims (innermost first), ggml type, data.
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

const HIDDEN: u64 = 16;
const VOCAB: u64 = 8;

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Gguf {
    /// A one-layer llama: 4 heads, 2 key/value heads, hidden 16, a
    /// byte-level BPE vocabulary of 8 tokens.
    fn tiny() -> Gguf {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "abc", "Ġ", "<s>", "</s>"]
            .iter()
            .map(|t| t.to_string())
            .collect();
        let kvs = vec![
            ("general.architecture".into(), Value::Str("llama".into())),
            ("llama.attention.head_count".into(), Value::U32(4)),
            ("llama.attention.head_count_kv".into(), Value::U32(2)),
            ("llama.block_count".into(), Value::U32(1)),
            ("llama.embedding_length".into(), Value::U32(HIDDEN as u32)),
            ("llama.feed_forward_length".into(), Value::U32(32)),
            ("llama.context_length".into(), Value::U32(128)),
            (
                "llama.attention.layer_norm_rms_epsilon".into(),
                Value::F32(1e-5),
            ),
            ("llama.rope.freq_base".into(), Value::F32(10000.0)),
            ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
            ("tokenizer.ggml.tokens".into(), Value::Strs(tokens)),
            (
                "tokenizer.ggml.token_type".into(),
                Value::I32s(vec![1, 1, 1, 1, 1, 1, 3, 3]),
            ),
            (
                "tokenizer.ggml.merges".into(),
                Value::Strs(vec!["a b".into(), "ab c".into()]),
            ),
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(6)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(7)),
        ];
        let f32s = |n: u64, seed: u64| -> Vec<u8> {
            (0..n)
                .flat_map(|i| ((((i * 31 + seed * 17) % 23) as f32 - 11.0) / 50.0).to_le_bytes())
                .collect()
        };
        let head_dim = HIDDEN / 4;
        let mut tensors = vec![
            (
                "token_embd.weight".to_string(),
                vec![HIDDEN, VOCAB],
                0,
                f32s(HIDDEN * VOCAB, 1),
            ),
            (
                "output_norm.weight".into(),
                vec![HIDDEN],
                0,
                f32s(HIDDEN, 2),
            ),
        ];
        for (i, (name, rows, cols)) in [
            ("attn_q", HIDDEN, HIDDEN),
            ("attn_k", 2 * head_dim, HIDDEN),
            ("attn_v", 2 * head_dim, HIDDEN),
            ("attn_output", HIDDEN, HIDDEN),
            ("ffn_gate", 32, HIDDEN),
            ("ffn_up", 32, HIDDEN),
            ("ffn_down", HIDDEN, 32),
        ]
        .into_iter()
        .enumerate()
        {
            tensors.push((
                format!("blk.0.{name}.weight"),
                vec![cols, rows],
                0,
                f32s(rows * cols, 3 + i as u64),
            ));
        }
        for name in ["attn_norm", "ffn_norm"] {
            tensors.push((
                format!("blk.0.{name}.weight"),
                vec![HIDDEN],
                0,
                f32s(HIDDEN, 20),
            ));
        }
        Gguf { kvs, tensors }
    }

    fn set(&mut self, key: &str, value: Value) {
        let slot = self
            .kvs
            .iter_mut()
            .find(|(k, _)| k == key)
            .expect("a key of tiny()");
        slot.1 = value;
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (key, value) in &self.kvs {
            string(&mut out, key);
            match value {
                Value::U32(v) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Value::F32(v) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Value::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    string(&mut out, s);
                }
                Value::Strs(list) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((list.len() as u64).to_le_bytes());
                    for s in list {
                        string(&mut out, s);
                    }
                }
                Value::I32s(list) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(5u32.to_le_bytes());
                    out.extend((list.len() as u64).to_le_bytes());
                    for v in list {
                        out.extend(v.to_le_bytes());
                    }
                }
            }
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        out.resize(out.len().div_ceil(32) * 32, 0);
        let start = out.len();
        for ((_, _, _, data), at) in self.tensors.iter().zip(offsets) {
            out.resize(start + at as usize, 0);
            out.extend(data);
        }
        out
    }
}

/// Imports `bytes` into `out` inside a temp dir; returns the error.
fn import_err(bytes: &[u8]) -> Error {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("model.gguf");
    std::fs::write(&src, bytes).unwrap();
    // An earlier, good import in `out`: a failed one must leave it be.
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("config.json"), "earlier").unwrap();
    let err = import_gguf(&src, &out, ImportWeights::F32).unwrap_err();
    let listing: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut listing = listing;
    listing.sort();
    assert_eq!(listing, ["model.gguf", "out"], "leftovers after {err}");
    assert_eq!(
        std::fs::read_to_string(out.join("config.json")).unwrap(),
        "earlier"
    );
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1, "{err}");
    assert!(
        err.to_string().contains("model.gguf"),
        "the error names the file: {err}"
    );
    err
}

fn gguf_message(err: &Error) -> &str {
    match err {
        Error::Gguf { message, .. } => message,
        other => panic!("expected a GGUF error, got {other:?}"),
    }
}

#[test]
fn a_valid_file_imports_and_loads() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("model.gguf");
    std::fs::write(&src, Gguf::tiny().bytes()).unwrap();
    let out = dir.path().join("out");
    import_gguf(&src, &out, ImportWeights::F32).unwrap();
    let model = Model::loader(&out)
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    assert_eq!(model.config().num_hidden_layers, 1);
    assert_eq!(model.config().vocab_size, VOCAB as usize);
    let tokenizer = Tokenizer::load(&out).unwrap();
    assert_eq!(tokenizer.encode("abc").unwrap(), [4]);
    // Importing again replaces the folder.
    import_gguf(&src, &out, ImportWeights::F32).unwrap();
    assert!(out.join("tokenizer.json").is_file());
}

#[test]
fn truncated_files_are_errors() {
    let bytes = Gguf::tiny().bytes();
    for cut in [3, 20, 200, bytes.len() / 2, bytes.len() - 1] {
        let err = import_err(&bytes[..cut]);
        assert!(matches!(err, Error::Gguf { .. }), "cut at {cut}: {err:?}");
    }
}

#[test]
fn counts_the_file_cannot_hold_are_errors() {
    let good = Gguf::tiny().bytes();
    for (at, what) in [(8, "tensors"), (16, "metadata")] {
        let mut bytes = good.clone();
        bytes[at..at + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
        let err = import_err(&bytes);
        assert!(gguf_message(&err).contains("more than"), "{what}: {err}");
    }
}

#[test]
fn zero_heads_are_errors_not_divisions_by_zero() {
    for key in [
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.block_count",
    ] {
        let mut g = Gguf::tiny();
        g.set(key, Value::U32(0));
        let err = import_err(&g.bytes());
        assert!(gguf_message(&err).contains(key), "{key}: {err}");
    }
    let mut g = Gguf::tiny();
    g.set("llama.attention.head_count_kv", Value::U32(3));
    let err = import_err(&g.bytes());
    assert!(gguf_message(&err).contains("divide"), "{err}");
}

#[test]
fn huge_dimensions_and_unknown_types_are_errors() {
    let mut g = Gguf::tiny();
    g.tensors[1].1 = vec![1 << 60];
    let err = import_err(&g.bytes());
    assert!(gguf_message(&err).contains("output_norm.weight"), "{err}");

    let mut g = Gguf::tiny();
    g.tensors[1].2 = 99;
    let err = import_err(&g.bytes());
    assert!(gguf_message(&err).contains("ggml type 99"), "{err}");

    // A type that Gemma's import decodes but the llama import, which reads
    // through MLX's loader, does not convert (Q5_0, on ffn_down's 32-wide
    // rows: one block each).
    let mut g = Gguf::tiny();
    let down = g
        .tensors
        .iter()
        .position(|t| t.0 == "blk.0.ffn_down.weight")
        .unwrap();
    g.tensors[down].2 = 6;
    g.tensors[down].3 = vec![0; 16 * 22];
    let err = import_err(&g.bytes());
    assert!(gguf_message(&err).contains("ggml type 6 (Q5_0)"), "{err}");
}

/// A one-layer Gemma 3 as llama.cpp writes it: hidden 64, 2 heads of 32
/// over one key/value head, norms stored as 1 + w, a SentencePiece BPE
/// vocabulary without merges; attn_q in Q8_0 and attn_k in Q5_0.
fn tiny_gemma3() -> Gguf {
    const H: u64 = 64;
    let tokens: Vec<String> = [
        "<pad>", "<eos>", "<bos>", "<unk>", "\n\n", "▁", "a", "b", "▁a", "ab", "▁ab", "  ",
    ]
    .iter()
    .map(|t| t.to_string())
    .collect();
    let types = vec![3, 3, 3, 3, 4, 1, 1, 1, 1, 1, 1, 1];
    let vocab = tokens.len() as u64;
    let kvs = vec![
        ("general.architecture".into(), Value::Str("gemma3".into())),
        ("gemma3.context_length".into(), Value::U32(256)),
        ("gemma3.embedding_length".into(), Value::U32(H as u32)),
        ("gemma3.block_count".into(), Value::U32(1)),
        ("gemma3.feed_forward_length".into(), Value::U32(128)),
        ("gemma3.attention.head_count".into(), Value::U32(2)),
        ("gemma3.attention.head_count_kv".into(), Value::U32(1)),
        ("gemma3.attention.key_length".into(), Value::U32(32)),
        ("gemma3.attention.value_length".into(), Value::U32(32)),
        (
            "gemma3.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-6),
        ),
        ("gemma3.rope.freq_base".into(), Value::F32(1e6)),
        ("gemma3.attention.sliding_window".into(), Value::U32(4)),
        ("tokenizer.ggml.model".into(), Value::Str("llama".into())),
        ("tokenizer.ggml.tokens".into(), Value::Strs(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::I32s(types)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.unknown_token_id".into(), Value::U32(3)),
        ("tokenizer.ggml.padding_token_id".into(), Value::U32(0)),
    ];
    let f32s = |n: u64, seed: u64, base: f32| -> Vec<u8> {
        (0..n)
            .flat_map(|i| (base + (((i * 31 + seed * 17) % 23) as f32 - 11.0) / 60.0).to_le_bytes())
            .collect()
    };
    // Blocks of 32 with a scale of 1/64 and varied quants.
    let q8_0 = |blocks: u64| -> Vec<u8> {
        (0..blocks)
            .flat_map(|b| {
                let mut block = half::f16::from_f32(1.0 / 64.0).to_le_bytes().to_vec();
                block.extend((0..32).map(|i| ((i * 7 + b * 3) % 41) as u8 ^ 0x80));
                block
            })
            .collect()
    };
    let q5_0 = |blocks: u64| -> Vec<u8> {
        (0..blocks)
            .flat_map(|b| {
                let mut block = half::f16::from_f32(1.0 / 64.0).to_le_bytes().to_vec();
                block.extend(((b as u32).wrapping_mul(0x9e37_79b9)).to_le_bytes());
                block.extend((0..16).map(|i| (i * 11 + b * 5) as u8));
                block
            })
            .collect()
    };
    let mut tensors = vec![
        (
            "token_embd.weight".to_string(),
            vec![H, vocab],
            0,
            f32s(H * vocab, 1, 0.0),
        ),
        ("output_norm.weight".into(), vec![H], 0, f32s(H, 2, 1.0)),
        (
            "blk.0.attn_q.weight".into(),
            vec![H, 64],
            8,
            q8_0(H * 64 / 32),
        ),
        (
            "blk.0.attn_k.weight".into(),
            vec![H, 32],
            6,
            q5_0(H * 32 / 32),
        ),
        (
            "blk.0.attn_v.weight".into(),
            vec![H, 32],
            0,
            f32s(H * 32, 3, 0.0),
        ),
        (
            "blk.0.attn_output.weight".into(),
            vec![64, H],
            0,
            f32s(64 * H, 4, 0.0),
        ),
        (
            "blk.0.ffn_gate.weight".into(),
            vec![H, 128],
            0,
            f32s(H * 128, 5, 0.0),
        ),
        (
            "blk.0.ffn_up.weight".into(),
            vec![H, 128],
            0,
            f32s(H * 128, 6, 0.0),
        ),
        (
            "blk.0.ffn_down.weight".into(),
            vec![128, H],
            0,
            f32s(128 * H, 7, 0.0),
        ),
        (
            "blk.0.attn_q_norm.weight".into(),
            vec![32],
            0,
            f32s(32, 8, 1.0),
        ),
        (
            "blk.0.attn_k_norm.weight".into(),
            vec![32],
            0,
            f32s(32, 9, 1.0),
        ),
    ];
    for (i, name) in [
        "attn_norm",
        "post_attention_norm",
        "ffn_norm",
        "post_ffw_norm",
    ]
    .into_iter()
    .enumerate()
    {
        tensors.push((
            format!("blk.0.{name}.weight"),
            vec![H],
            0,
            f32s(H, 10 + i as u64, 1.0),
        ));
    }
    Gguf { kvs, tensors }
}

#[test]
fn a_gemma3_file_imports_and_loads_in_both_forms() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("model.gguf");
    let g = tiny_gemma3();
    std::fs::write(&src, g.bytes()).unwrap();
    for weights in [ImportWeights::F32, ImportWeights::Quantized] {
        let out = dir.path().join(format!("{weights:?}"));
        import_gguf(&src, &out, weights).unwrap();
        let model = Model::loader(&out)
            .quantized(QuantizedWeights::DequantizeF32)
            .load()
            .unwrap();
        assert_eq!(model.config().model_type, "gemma3_text");
        assert_eq!(model.config().num_hidden_layers, 1);
        let logits = model
            .forward(
                &mlx_rs::Array::from_slice(&[2i32, 8, 10, 6], &[1, 4]),
                &mut mlx_engine::KvCache::new(),
            )
            .unwrap();
        logits.eval().unwrap();
        assert_eq!(logits.shape(), [1, 4, 12]);
        let values = logits.as_slice::<f32>();
        assert!(
            values.iter().all(|v| v.is_finite()),
            "{weights:?}: logits not finite"
        );
        let tokenizer = Tokenizer::load(&out).unwrap();
        // " ab a" → ▁ab ▁a; the user-defined "\n\n" stays whole.
        assert_eq!(tokenizer.encode(" ab a").unwrap(), [10, 8]);
        assert_eq!(tokenizer.encode("\n\n").unwrap(), [4]);
    }
    // The norms lose llama.cpp's + 1; the rest is the file's values.
    let weights =
        mlx_rs::Array::load_safetensors(dir.path().join("F32/model.safetensors")).unwrap();
    let norm = &weights["model.norm.weight"];
    norm.eval().unwrap();
    let want: Vec<f32> = g.tensors[1]
        .3
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) - 1.0)
        .collect();
    assert_eq!(norm.as_slice::<f32>(), want.as_slice());
    let q = &weights["model.layers.0.self_attn.q_proj.weight"];
    q.eval().unwrap();
    assert_eq!(q.shape(), [64, 64]);
    // Q8_0: first block's first value is (0 ^ 0x80) as i8 · 1/64 = −2.
    assert_eq!(q.as_slice::<f32>()[0], -2.0);
}

#[test]
fn a_gemma3_file_missing_or_misshaping_a_tensor_is_an_error_naming_it() {
    let mut g = tiny_gemma3();
    g.tensors.retain(|t| t.0 != "blk.0.attn_q.weight");
    let err = import_err(&g.bytes());
    assert!(gguf_message(&err).contains("blk.0.attn_q.weight"), "{err}");

    let mut g = tiny_gemma3();
    let k = g
        .tensors
        .iter()
        .position(|t| t.0 == "blk.0.attn_k.weight")
        .unwrap();
    g.tensors[k].1 = vec![64, 64];
    g.tensors[k].3 = vec![0; 64 * 2 * 22];
    let err = import_err(&g.bytes());
    let message = gguf_message(&err);
    assert!(
        message.contains("blk.0.attn_k.weight") && message.contains("dimensions"),
        "{err}"
    );

    let mut g = tiny_gemma3();
    g.kvs.retain(|(k, _)| k != "gemma3.attention.key_length");
    let err = import_err(&g.bytes());
    assert!(
        gguf_message(&err).contains("gemma3.attention.key_length"),
        "{err}"
    );

    let mut g = tiny_gemma3();
    g.tensors
        .push(("blk.0.extra.weight".into(), vec![64], 0, vec![0; 256]));
    let err = import_err(&g.bytes());
    assert!(gguf_message(&err).contains("blk.0.extra.weight"), "{err}");
}

#[test]
fn a_broken_vocabulary_leaves_no_half_import() {
    let mut g = Gguf::tiny();
    g.set(
        "tokenizer.ggml.merges",
        Value::Strs(vec!["a b".into(), "zz qq".into()]),
    );
    let err = import_err(&g.bytes());
    assert!(gguf_message(&err).contains("tokenizer"), "{err}");

    let mut g = Gguf::tiny();
    g.set("tokenizer.ggml.eos_token_id", Value::U32(1000));
    let err = import_err(&g.bytes());
    assert!(gguf_message(&err).contains("eos_token_id"), "{err}");
}

#[test]
fn missing_files_and_non_gguf_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let err = import_gguf(
        &dir.path().join("absent.gguf"),
        &dir.path().join("out"),
        ImportWeights::F32,
    )
    .unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    let err = import_err(b"PK\x03\x04 this is a zip file, not a model");
    assert!(gguf_message(&err).contains("magic"), "{err}");
}

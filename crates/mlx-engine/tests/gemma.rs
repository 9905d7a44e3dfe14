//! Gemma 3 and Gemma 4 against mlx_lm 0.32.2 (`tests/parity/mlx_lm_gemma.py`)
//! on tiny random checkpoints that exercise every feature: sliding and full
//! layers with a window far shorter than the prompts and the shared prefix,
//! different head sizes per layer type, KV-shared layers of both types,
//! per-layer input embeddings, layer scalars ≠ 1, the logit softcap,
//! multimodal layouts (mlx_lm's and Hugging Face's, with towers and the
//! unused k/v weights of 0.31.3-era checkpoints), f32 and mixed 4/8-bit;
//! a prefix and a prompt longer than the engine's prefill pieces.

mod common;
use test_support::gemma4_e2b;

use std::path::Path;
use std::process::Command;

use common::tiny_gemma::*;
use common::{normal, VOCAB};
use mlx_engine::{
    EngineConfig, Error, GenerateOptions, KvCache, MemoryMode, MlxEngine, Model, QuantizedWeights,
    Tokenizer,
};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use serde_json::json;
use test_support::python::mlx_lm_python;

#[derive(serde::Deserialize)]
struct Reference {
    version: String,
    alone_logits: Vec<Vec<f32>>,
    alone_greedy: Vec<Vec<u32>>,
    batch_greedy: Vec<Vec<u32>>,
}

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

/// Our logits and greedy texts against mlx_lm's: each row alone (the whole
/// prompt in one forward), the rows as one left-padded batch after the
/// shared prefix's cache, and the engine's batched generation.
fn check_against_mlx_lm(python: &str, dir: &Path, mode: QuantizedWeights, tolerance: f32) {
    let what = dir.display().to_string();
    let reference = mlx_lm_reference(python, dir);
    let model = Model::loader(dir).quantized(mode).load().unwrap();
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
    let (block, pads, width) = left_padded(&suffixes);
    let mut cache = shared.fork_padded(pads).unwrap();
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
/// Lanes read the model from their own threads and cannot compute any of
/// its arrays: all must be evaluated at load. Gemma 3's `1 + w` norm
/// weights were left lazy, and only a prefix's prefill happened to compute
/// them on the worker; without a prefix, two lanes failed ("no stream in
/// current thread"). Every Gemma layout is checked, none with a prefix.
#[test]
fn every_gemma_on_two_lanes_without_a_prefix_equals_one_lane() {
    type Writer = fn(&Path);
    let writers: [(&str, Writer); 3] = [
        ("Gemma 3", |dir| write_gemma3(dir, Layout::Text)),
        ("Gemma 4 f32", |dir| write_gemma4(dir, Layout::Text, false)),
        ("Gemma 4 4/8-bit", |dir| {
            write_gemma4(dir, Layout::Mlx, true)
        }),
    ];
    for (what, write) in writers {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path());
        let user_only: Vec<_> = conversations()
            .into_iter()
            .map(|c| c[1..].to_vec())
            .collect();
        let texts = |lanes| {
            let engine =
                MlxEngine::new(EngineConfig::new(dir.path()).batch_size(2).lanes(lanes)).unwrap();
            engine
                .generate(
                    user_only.clone(),
                    GenerateOptions::new().max_tokens(MAX_TOKENS),
                )
                .unwrap_or_else(|e| panic!("{what}, {lanes} lanes: {e}"))
                .texts
        };
        let one_lane = texts(1);
        assert_eq!(one_lane.len(), user_only.len(), "{what}");
        assert_eq!(texts(2), one_lane, "{what}");
    }
}

#[test]
fn quantized_gemma4_modes_agree() {
    let dir = tempfile::tempdir().unwrap();
    write_gemma4(dir.path(), Layout::Text, true);
    let (prefix, suffixes) = prompt_tokens(dir.path());
    let full = ids(&[prefix, suffixes[3].clone()].concat());
    let logits = |mode| {
        let model = Model::loader(dir.path()).quantized(mode).load().unwrap();
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

/// A prefill that wants only the last position's logits runs everything
/// after the last key/value-writing layer's keys and values on that
/// position alone (Gemma 4: the KV-shared layers; Gemma 3: the rest of the
/// last layer): the logits equal a full forward's last row, and the cache
/// is the same (the next token's logits agree too); as a padded batch
/// after a shared prefix.
#[test]
fn last_position_prefill_equals_the_full_forward() {
    for version in [3, 4] {
        let dir = tempfile::tempdir().unwrap();
        if version == 3 {
            write_gemma3(dir.path(), Layout::Text);
        } else {
            write_gemma4(dir.path(), Layout::Text, false);
        }
        last_position_prefill_check(dir.path(), version);
    }
}

fn last_position_prefill_check(dir: &Path, version: u32) {
    let model = Model::loader(dir)
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    let (prefix, suffixes) = prompt_tokens(dir);
    let p = ids(&prefix);
    let mut shared = KvCache::new();
    model
        .forward(&Array::from_slice(&p, &[1, p.len() as i32]), &mut shared)
        .unwrap();
    let (block, pads, width) = left_padded(&suffixes);
    let rows = suffixes.len() as i32;
    let run = |last_only: bool| {
        let mut cache = shared.fork_padded(pads.clone()).unwrap();
        let input = Array::from_slice(&block, &[rows, width as i32]);
        let logits = if last_only {
            model.forward_last(&input, &mut cache).unwrap()
        } else {
            model
                .forward(&input, &mut cache)
                .unwrap()
                .index((.., -1, ..))
        };
        let next = Array::from_slice(&vec![7; rows as usize], &[rows, 1]);
        let next = model.forward(&next, &mut cache).unwrap().index((.., 0, ..));
        (logits, next)
    };
    let (last, last_next) = run(true);
    let (full, full_next) = run(false);
    for row in 0..rows {
        let d = max_difference(&row_logits(&last, row), &row_logits(&full, row));
        assert!(
            d <= 1e-5,
            "Gemma {version}, row {row}: prefill logits differ by {d}"
        );
        let d = max_difference(&row_logits(&last_next, row), &row_logits(&full_next, row));
        assert!(
            d <= 1e-5,
            "Gemma {version}, row {row}: the next token's logits differ by {d}"
        );
    }
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
        let (block, pads, width) = left_padded(&suffixes);
        let rows = suffixes.len() as i32;
        let logits = |mode, memory| {
            let model = Model::loader(dir.path())
                .quantized(mode)
                .memory(memory)
                .load()
                .unwrap();
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
            let mut cache = shared.fork_padded(pads.clone()).unwrap();
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
        // Two chunks of four or fewer: with two lanes they run side by side.
        let texts = |memory, lanes| {
            let engine = MlxEngine::new(
                EngineConfig::new(dir.path())
                    .prefix_messages(vec![system()])
                    .batch_size(4)
                    .lanes(lanes)
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
        let resident = texts(MemoryMode::Resident, 1);
        assert!(conversations().len() > 4, "more than one chunk");
        for (memory, lanes) in [
            (MemoryMode::Resident, 2),
            (MemoryMode::MappedTables, 1),
            (MemoryMode::MappedTables, 2),
            // Streamed layers run one chunk at a time whatever is asked.
            (MemoryMode::Streamed, 2),
        ] {
            assert_eq!(
                resident,
                texts(memory, lanes),
                "quantized {quantized}, {memory:?}, {lanes} lanes"
            );
        }

        for memory in [MemoryMode::MappedTables, MemoryMode::Streamed] {
            let model = Model::loader(dir.path())
                .quantized(QuantizedWeights::Keep)
                .memory(memory)
                .load()
                .unwrap();
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

/// A classification (one token) keeps none of its rows' keys and values,
/// since nothing reads them after the prefill; its logits are still the
/// first step's of a generation that keeps them, bit for bit, in every
/// memory mode, f32 and 4-bit: KV-shared layers read their source's keys
/// within the forward, and a prompt longer than a prefill piece (kept
/// until its last piece) sits in a chunk of its own kind.
#[test]
fn a_classification_gives_a_generations_first_logits() {
    for (quantized, layout) in [(false, Layout::Text), (true, Layout::Mlx)] {
        let dir = tempfile::tempdir().unwrap();
        write_gemma4(dir.path(), layout, quantized);
        for memory in [
            MemoryMode::Resident,
            MemoryMode::MappedTables,
            MemoryMode::Streamed,
        ] {
            // Every step's logits as bits, the choice forced to one token
            // that is not EOS, so that each chunk decodes every step.
            let recorded = |max_tokens: usize| -> Vec<Vec<u32>> {
                let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
                let record = seen.clone();
                let engine = MlxEngine::new(
                    EngineConfig::new(dir.path())
                        .prefix_messages(vec![system()])
                        .batch_size(2)
                        .lanes(1)
                        .memory(memory)
                        .logits_processor(move |_: &Tokenizer| {
                            Box::new(move |logits: &Array| {
                                let bits = logits.as_dtype(Dtype::Float32)?;
                                bits.eval()?;
                                let bits = bits.as_slice::<f32>().iter().map(|v| v.to_bits());
                                record.lock().unwrap().push(bits.collect());
                                let ids = mlx_rs::ops::arange::<_, i32>(None, VOCAB, None)?;
                                let forced = ids.eq(Array::from_int(7))?;
                                let one_hot = mlx_rs::ops::select(
                                    &forced,
                                    Array::from_f32(1.0),
                                    Array::from_f32(0.0),
                                )?;
                                mlx_rs::ops::broadcast_to(&one_hot, logits.shape())
                            })
                        }),
                )
                .unwrap();
                let generated = engine
                    .generate(
                        conversations(),
                        GenerateOptions::new().max_tokens(max_tokens),
                    )
                    .unwrap();
                assert_eq!(generated.texts.len(), conversations().len());
                let seen = seen.lock().unwrap().clone();
                seen
            };
            let classified = recorded(1);
            let generated = recorded(2);
            assert_eq!(classified.len(), 3, "three chunks of two");
            assert_eq!(generated.len(), 6, "two steps per chunk");
            for (chunk, logits) in classified.iter().enumerate() {
                assert!(
                    *logits == generated[2 * chunk],
                    "quantized {quantized}, {memory:?}: chunk {chunk}'s logits differ"
                );
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
    let model = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .memory(MemoryMode::Streamed)
        .load()
        .unwrap();
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
    let err = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap_err();
    assert!(
        matches!(&err, Error::MissingWeight { key, .. } if key.contains("language_model.model.embed_tokens")),
        "{err}"
    );

    // A shape the config does not imply.
    let dir = tempfile::tempdir().unwrap();
    write_gemma4(dir.path(), Layout::Text, false);
    edit_config(dir.path(), |c| c["global_head_dim"] = json!(24));
    let err = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap_err();
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
            "moe without its sizes",
            Box::new(|c| c["text_config"]["enable_moe_block"] = json!(true)),
            "`enable_moe_block` needs `num_experts`",
        ),
        (
            "global kv heads",
            Box::new(|c| {
                c["text_config"]["attention_k_eq_v"] = json!(true);
                c["text_config"]["num_global_key_value_heads"] = json!(3);
            }),
            "num_global_key_value_heads 3",
        ),
    ];
    for (what, edit, needle) in cases {
        let dir = tempfile::tempdir().unwrap();
        write_gemma4(dir.path(), Layout::Mlx, false);
        edit_config(dir.path(), edit);
        let err = Model::loader(dir.path())
            .quantized(QuantizedWeights::Keep)
            .load()
            .unwrap_err();
        match &err {
            Error::Config { path, message } => {
                assert_eq!(path, &dir.path().join("config.json"), "{what}");
                assert!(message.contains(needle), "{what}: {message}");
            }
            other => panic!("{what}: {other}"),
        }
    }
}

/// A prefill whose queries are larger than the engine's budget per group
/// of rows (8 MiB of f32) runs each layer's attention, from the query
/// projection to the output projection, a group of rows at a time. With
/// E2B's shapes a global layer's queries are 8 heads of 512 features:
/// 5 rows of 120 positions are a group of 4 rows and one of 1 there (the
/// sliding layers' are half as wide, one group). A row of each group has
/// the logits of the row alone (one group). Streamed layers run the same
/// layer code (and equal resident ones: `gemma4_in_low_memory_modes_…`).
#[test]
fn rows_attended_a_group_at_a_time_equal_each_row_alone() {
    let dir = tempfile::tempdir().unwrap();
    let base = gemma4_e2b::E2bBase {
        vocab: 256,
        dtype: Dtype::Float32,
        ..gemma4_e2b::E2bBase::default()
    };
    gemma4_e2b::write(dir.path(), &base);
    let (rows, width) = (5, 120);
    let ids: Vec<i32> = (0..rows * width).map(|i| (i * 37 + i / 7) % 256).collect();
    let model = Model::loader(dir.path())
        .quantized(QuantizedWeights::DequantizeOnUse)
        .load()
        .unwrap();
    let batch = model
        .forward_last(
            &Array::from_slice(&ids, &[rows, width]),
            &mut KvCache::new(),
        )
        .unwrap();
    for row in [0, rows - 1] {
        let own = &ids[(row * width) as usize..((row + 1) * width) as usize];
        let alone = model
            .forward_last(&Array::from_slice(own, &[1, width]), &mut KvCache::new())
            .unwrap();
        let d = max_difference(&row_logits(&batch, row), &row_logits(&alone, 0));
        assert!(d <= 1e-4, "row {row}: logits differ by {d}");
    }
}

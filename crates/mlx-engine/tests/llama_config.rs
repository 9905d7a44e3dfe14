//! The llama family's `config.json` fields read as mlx_lm 0.32.2 reads
//! them, against its logits on random tiny models (every position, whole,
//! after a shared prefix and in a left-padded batch, within 1e-4, f32):
//! rotary scaling (`rope_scaling`, which mlx_lm reads for llama, mistral,
//! qwen2, qwen3 and gpt_oss) — linear positions, Llama 3's periods (what
//! Llama 3.1, 3.2 and 3.3 checkpoints carry) and YaRN's; qwen3's
//! `rope_theta` nested in `rope_parameters` (transformers 5); llama's
//! sliding layers named by `layer_types`. A scaling type the engine does
//! not compute is a typed error naming it.

mod common;

use std::path::Path;

use common::logits::{
    assert_every_position, largest_difference, moe_prompts, positions, run_parity_script,
    write_request,
};
use mlx_engine::{KvCache, Model};
use mlx_rs::Array;
use serde_json::{json, Value};
use test_support::python::mlx_lm_python;
use test_support::tiny_llama::TinyLlama;

/// f32 on both sides, summed in other orders.
const TOLERANCE: f32 = 1e-4;

/// A tiny `model_type` with `extra` fields in its `config.json`.
fn write(dir: &Path, model_type: &'static str, extra: Value) {
    TinyLlama {
        layers: 2,
        vocab: common::VOCAB,
        config: extra,
        ..TinyLlama::new(model_type)
    }
    .write(dir);
    common::write_tokenizer(dir, false);
}

/// Our logits at every position of the prompts equal mlx_lm's on `dir`.
fn positions_match(python: &str, dir: &Path, what: &str) {
    let (prefix, suffixes) = moe_prompts();
    let request = write_request(dir, &json!({"prefix": prefix, "suffixes": suffixes}));
    let expected = run_parity_script(python, "mlx_lm_positions.py", dir, &request);
    let model = Model::loader(dir).load().unwrap();
    let ids: Vec<i32> = prefix.iter().map(|&t| t as i32).collect();
    let logits = model
        .forward(
            &Array::from_slice(&ids, &[1, ids.len() as i32]),
            &mut KvCache::new(),
        )
        .unwrap();
    let d = largest_difference(&positions(&logits, 0, 0), &expected["prefix"]);
    assert!(d <= TOLERANCE, "{what}: the prefix differs by {d}");
    assert_every_position(&model, &expected, &prefix, &suffixes, TOLERANCE, what);
}

#[test]
fn rope_scaling_of_every_computed_type_matches_mlx_lm() {
    let test = "rope_scaling_of_every_computed_type_matches_mlx_lm";
    let Some(python) = mlx_lm_python(test) else {
        return;
    };
    let scalings = [
        ("linear", json!({"type": "linear", "factor": 2.0})),
        // Llama 3.1's entry; with head_dim 16 over base 10000 the pairs'
        // wavelengths fall on each side of 2048 and 8192 and between.
        (
            "llama3",
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        ),
        (
            "yarn",
            json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                   "beta_fast": 32.0, "beta_slow": 1.0}),
        ),
    ];
    for model_type in ["llama", "qwen2"] {
        for (name, scaling) in &scalings {
            let dir = tempfile::tempdir().unwrap();
            write(
                dir.path(),
                model_type,
                json!({"rope_scaling": scaling, "max_position_embeddings": 512}),
            );
            positions_match(&python, dir.path(), &format!("{model_type}, {name}"));
        }
    }
}

/// Each scaling moves the logits: without it the same model differs from
/// mlx_lm (the test above checks something).
#[test]
fn the_scaling_moves_the_logits() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let prompt: Vec<i32> = (0..30).map(|i| (i * 7 + 3) % 40).collect();
    let logits_with = |extra: Value| {
        write(dir, "llama", extra);
        let model = Model::loader(dir).load().unwrap();
        let logits = model
            .forward(
                &Array::from_slice(&prompt, &[1, prompt.len() as i32]),
                &mut KvCache::new(),
            )
            .unwrap();
        logits.as_slice::<f32>().to_vec()
    };
    let plain = logits_with(json!({}));
    for scaling in [
        json!({"type": "linear", "factor": 2.0}),
        json!({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}),
    ] {
        let scaled = logits_with(json!({ "rope_scaling": scaling }));
        let d = plain
            .iter()
            .zip(&scaled)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(d > 1e-3, "{scaling}: {d}");
    }
}

/// transformers 5 writes qwen3's `rope_theta` inside `rope_parameters`,
/// and mlx_lm reads it there.
#[test]
fn qwen3_with_its_rope_theta_in_rope_parameters_matches_mlx_lm() {
    let test = "qwen3_with_its_rope_theta_in_rope_parameters_matches_mlx_lm";
    let Some(python) = mlx_lm_python(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write(
        dir,
        "qwen3",
        json!({"head_dim": 16, "max_position_embeddings": 512}),
    );
    let path = dir.join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let object = config.as_object_mut().unwrap();
    object.remove("rope_theta");
    object.insert(
        "rope_parameters".into(),
        json!({"rope_theta": 1000000.0, "rope_type": "default"}),
    );
    std::fs::write(&path, config.to_string()).unwrap();
    positions_match(&python, dir, "qwen3, rope_parameters");
}

/// mlx_lm's `dynamic` (and types it lacks) are refused at load with the
/// type named, not computed as unscaled positions.
#[test]
fn a_scaling_the_engine_does_not_compute_is_a_typed_error() {
    for kind in ["dynamic", "longrope"] {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "llama",
            json!({"rope_scaling": {"rope_type": kind, "factor": 2.0}}),
        );
        let Err(err) = Model::loader(dir.path()).load() else {
            panic!("{kind} is refused")
        };
        let message = err.to_string();
        assert!(
            message.contains(kind) && message.contains("rope_scaling"),
            "{message}"
        );
    }
}

/// llama layers that `layer_types` names sliding attend within
/// `sliding_window` (8 here, under prompts of 40–70 tokens).
#[test]
fn llama_sliding_layers_match_mlx_lm() {
    let test = "llama_sliding_layers_match_mlx_lm";
    let Some(python) = mlx_lm_python(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "llama",
        json!({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
               "max_position_embeddings": 512}),
    );
    positions_match(&python, dir.path(), "llama, sliding layers");
}

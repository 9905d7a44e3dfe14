//! qwen3_moe against mlx_lm 0.32.2: a random tiny mixture-of-experts model
//! (8 experts, top 2 with renormalised weights, one dense layer among the
//! sparse ones), logits at every position of each prompt — whole, after a
//! shared prefix, and in a left-padded batch after it — within 1e-4 of
//! mlx_lm's, and the engine's greedy answers equal to mlx_lm's; so too a
//! random tiny mixtral (top 2 of the logits, then a softmax). The same
//! model quantized (4 bits with 8-bit modules among them, routers dense)
//! within 1e-3 of mlx_lm 0.32.2 on MLX 0.32.4 (the MLX its quantized
//! experts need), multiplied packed or unpacked to f32. Gemma 4's MoE (the
//! 26B-A4B's block: a router with its own norm and per-expert scales, GeGLU
//! experts beside the dense MLP, values equal to keys on full layers) the
//! same way, f32 and 4-bit with 8-bit routers; and gpt_oss (sliding and
//! full layers, attention sinks, YaRN positions, biased router and
//! experts behind a clamped SwiGLU), f32 and 4-bit with 8-bit routers, and
//! with MXFP4 experts as its published MLX checkpoints hold them.

mod common;

use std::path::Path;

use common::logits::{
    assert_every_position, largest_difference, moe_prompts, newer_mlx, positions,
    run_parity_script, run_parity_script_newer_mlx, write_request,
};
use common::tiny_gemma::write_gemma4_moe;
use common::tiny_gpt_oss::{
    write_gpt_oss, write_gpt_oss_mxfp4, write_gpt_oss_packed, write_gpt_oss_quantized, Packing,
};
use common::tiny_moe::{write_mixtral, write_qwen3_moe, write_qwen3_moe_quantized};
use mlx_engine::{
    EngineConfig, GenerateOptions, KvCache, MemoryMode, Message, MlxEngine, Model,
    QuantizedWeights, SpecialTokens, Tokenizer,
};
use mlx_rs::Array;
use serde_json::json;
use test_support::python::mlx_lm_python;

/// f32 on both sides, summed in other orders (our BLAS products, MLX's
/// `gather_mm` on both).
const TOLERANCE: f32 = 1e-4;

/// 4-bit experts: MLX's packed product against ours unpacked to f32, or
/// MLX 0.32.2's packed product against 0.32.4's.
const QUANTIZED_TOLERANCE: f32 = 1e-3;

/// The reference for `test`: mlx_lm 0.32.2, on MLX 0.32.4 for quantized
/// experts; `None` (said) where Python or that MLX is missing.
struct Reference {
    python: String,
    newer_mlx: bool,
}

impl Reference {
    fn find(test: &str, quantized: bool) -> Option<Reference> {
        let python = mlx_lm_python(test)?;
        if quantized {
            newer_mlx(&python, test)?;
        }
        Some(Reference {
            python,
            newer_mlx: quantized,
        })
    }

    fn run(&self, script: &str, dir: &Path, request: &Path) -> serde_json::Value {
        if self.newer_mlx {
            run_parity_script_newer_mlx(&self.python, script, dir, request)
        } else {
            run_parity_script(&self.python, script, dir, request)
        }
    }
}

fn ids(tokens: &[u32]) -> Vec<i32> {
    tokens.iter().map(|&t| t as i32).collect()
}

#[test]
fn qwen3_moe_matches_mlx_lm_at_every_position() {
    let test = "qwen3_moe_matches_mlx_lm_at_every_position";
    let Some(reference) = Reference::find(test, false) else {
        return;
    };
    positions_match(
        &reference,
        write_qwen3_moe,
        &[QuantizedWeights::Keep],
        TOLERANCE,
    );
}

#[test]
fn mixtral_matches_mlx_lm_at_every_position() {
    let test = "mixtral_matches_mlx_lm_at_every_position";
    let Some(reference) = Reference::find(test, false) else {
        return;
    };
    positions_match(
        &reference,
        write_mixtral,
        &[QuantizedWeights::Keep],
        TOLERANCE,
    );
}

#[test]
fn quantized_qwen3_moe_matches_mlx_lm_at_every_position() {
    let test = "quantized_qwen3_moe_matches_mlx_lm_at_every_position";
    let Some(reference) = Reference::find(test, true) else {
        return;
    };
    positions_match(
        &reference,
        write_qwen3_moe_quantized,
        &[QuantizedWeights::Keep, QuantizedWeights::DequantizeOnUse],
        QUANTIZED_TOLERANCE,
    );
}

#[test]
fn gemma4_moe_matches_mlx_lm_at_every_position() {
    let test = "gemma4_moe_matches_mlx_lm_at_every_position";
    let Some(reference) = Reference::find(test, false) else {
        return;
    };
    positions_match(
        &reference,
        |dir| write_gemma4_moe(dir, false),
        &[QuantizedWeights::Keep],
        TOLERANCE,
    );
}

#[test]
fn quantized_gemma4_moe_matches_mlx_lm_at_every_position() {
    let test = "quantized_gemma4_moe_matches_mlx_lm_at_every_position";
    let Some(reference) = Reference::find(test, true) else {
        return;
    };
    positions_match(
        &reference,
        |dir| write_gemma4_moe(dir, true),
        &[QuantizedWeights::Keep, QuantizedWeights::DequantizeOnUse],
        QUANTIZED_TOLERANCE,
    );
}

#[test]
fn gpt_oss_matches_mlx_lm_at_every_position() {
    let test = "gpt_oss_matches_mlx_lm_at_every_position";
    let Some(reference) = Reference::find(test, false) else {
        return;
    };
    positions_match(
        &reference,
        write_gpt_oss,
        &[QuantizedWeights::Keep],
        TOLERANCE,
    );
}

#[test]
fn quantized_gpt_oss_matches_mlx_lm_at_every_position() {
    let test = "quantized_gpt_oss_matches_mlx_lm_at_every_position";
    let Some(reference) = Reference::find(test, true) else {
        return;
    };
    positions_match(
        &reference,
        write_gpt_oss_quantized,
        &[QuantizedWeights::Keep, QuantizedWeights::DequantizeOnUse],
        QUANTIZED_TOLERANCE,
    );
}

/// gpt_oss as its published MLX checkpoints hold it: MXFP4 experts (their
/// own mode in per-module entries) beside affine layers, multiplied packed
/// by MLX's `gather_qmm` in that mode or unpacked to f32.
#[test]
fn mxfp4_gpt_oss_matches_mlx_lm_at_every_position() {
    let test = "mxfp4_gpt_oss_matches_mlx_lm_at_every_position";
    let Some(reference) = Reference::find(test, true) else {
        return;
    };
    positions_match(
        &reference,
        write_gpt_oss_mxfp4,
        &[
            QuantizedWeights::Keep,
            QuantizedWeights::DequantizeOnUse,
            QuantizedWeights::DequantizeF32,
        ],
        QUANTIZED_TOLERANCE,
    );
}

/// The published checkpoints' dtype: bfloat16 layers and affine scales
/// beside MXFP4 experts, computed in bfloat16 under `Keep` as mlx_lm
/// computes it — every logit the same bfloat16 number.
#[test]
fn mxfp4_gpt_oss_in_bfloat16_equals_mlx_lm_under_keep() {
    let test = "mxfp4_gpt_oss_in_bfloat16_equals_mlx_lm_under_keep";
    let Some(reference) = Reference::find(test, true) else {
        return;
    };
    positions_match(
        &reference,
        |dir| write_gpt_oss_packed(dir, Packing::Mxfp4Experts, mlx_rs::Dtype::Bfloat16),
        &[QuantizedWeights::Keep],
        0.0,
    );
}

/// MXFP4 is read for a mixture of experts' experts alone: a layer of
/// another kind quantized so is a typed error naming the module and the
/// mode, not bits read as affine.
#[test]
fn an_mxfp4_layer_outside_the_experts_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write_gpt_oss_mxfp4(dir);
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["quantization"]["model.layers.1.self_attn.o_proj"] =
        json!({"group_size": 32, "bits": 4, "mode": "mxfp4"});
    std::fs::write(&path, config.to_string()).unwrap();
    let Err(err) = Model::loader(dir).load() else {
        panic!("an MXFP4 attention projection is refused")
    };
    let message = err.to_string();
    assert!(
        message.contains("model.layers.1.self_attn.o_proj") && message.contains("mxfp4"),
        "{message}"
    );
}

/// MXFP4 experts whose scales are floats (an affine checkpoint under an
/// MXFP4 entry) are a typed error naming the file and the tensor.
#[test]
fn mxfp4_experts_with_float_scales_are_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write_gpt_oss_mxfp4(dir);
    let path = dir.join("model.safetensors");
    let mut weights = Array::load_safetensors(&path).unwrap();
    let key = "model.layers.2.mlp.experts.down_proj.scales";
    let scales = weights[key].as_dtype(mlx_rs::Dtype::Float32).unwrap();
    weights.insert(key.to_owned(), scales);
    mlx_rs::transforms::eval(weights.values()).unwrap();
    Array::save_safetensors(weights.iter().map(|(k, v)| (k.as_str(), v)), None, &path).unwrap();
    let Err(err) = Model::loader(dir).load() else {
        panic!("float scales under an MXFP4 entry are refused")
    };
    let message = err.to_string();
    assert!(
        message.contains(key) && message.contains("model.safetensors"),
        "{message}"
    );
}

/// The model `write` makes, loaded with each of `handlings`, gives
/// mlx_lm's logits within `tolerance` at every position.
fn positions_match(
    reference: &Reference,
    write: fn(&Path),
    handlings: &[QuantizedWeights],
    tolerance: f32,
) {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write(dir);
    let (prefix, suffixes) = moe_prompts();
    let request = write_request(dir, &json!({"prefix": prefix, "suffixes": suffixes}));
    let expected = reference.run("mlx_lm_positions.py", dir, &request);
    for &handling in handlings {
        let model = Model::loader(dir).quantized(handling).load().unwrap();
        let p = prefix.len() as i32;
        let mut shared = KvCache::new();
        let logits = model
            .forward(&Array::from_slice(&ids(&prefix), &[1, p]), &mut shared)
            .unwrap();
        let d = largest_difference(&positions(&logits, 0, 0), &expected["prefix"]);
        assert!(d <= tolerance, "{handling:?}: the prefix differs by {d}");
        assert_every_position(
            &model,
            &expected,
            &prefix,
            &suffixes,
            tolerance,
            &format!("{handling:?}"),
        );
    }
}

/// The engine (shared prefix, batches of padded rows, greedy decoding)
/// answers as mlx_lm does: each row alone on a copy of the prefix's cache,
/// and `batch_generate` (mlx_lm_gemma.py, which runs any mlx_lm model).
#[test]
fn the_engine_answers_qwen3_moe_as_mlx_lm() {
    let test = "the_engine_answers_qwen3_moe_as_mlx_lm";
    let Some(reference) = Reference::find(test, false) else {
        return;
    };
    answers_match(&reference, write_qwen3_moe);
}

#[test]
fn the_engine_answers_mixtral_as_mlx_lm() {
    let test = "the_engine_answers_mixtral_as_mlx_lm";
    let Some(reference) = Reference::find(test, false) else {
        return;
    };
    answers_match(&reference, write_mixtral);
}

/// Gemma 4's MoE in every memory mode: its experts stay in the files but
/// for resident weights.
#[test]
fn the_engine_answers_gemma4_moe_as_mlx_lm() {
    let test = "the_engine_answers_gemma4_moe_as_mlx_lm";
    let Some(reference) = Reference::find(test, false) else {
        return;
    };
    answers_match(&reference, |dir| write_gemma4_moe(dir, false));
}

/// gpt_oss in every memory mode: sliding layers' windows, sinks and
/// biased experts through the shared prefix and padded batches.
#[test]
fn the_engine_answers_gpt_oss_as_mlx_lm() {
    let test = "the_engine_answers_gpt_oss_as_mlx_lm";
    let Some(reference) = Reference::find(test, false) else {
        return;
    };
    answers_match(&reference, write_gpt_oss);
}

/// MXFP4 experts in every memory mode: read from the files as routed,
/// their scales bytes.
#[test]
fn the_engine_answers_mxfp4_gpt_oss_as_mlx_lm() {
    let test = "the_engine_answers_mxfp4_gpt_oss_as_mlx_lm";
    let Some(reference) = Reference::find(test, true) else {
        return;
    };
    answers_match(&reference, write_gpt_oss_mxfp4);
}

/// The quantized model, as the engine holds it by default on this
/// machine's device, in every memory mode.
#[test]
fn the_engine_answers_quantized_qwen3_moe_as_mlx_lm() {
    let test = "the_engine_answers_quantized_qwen3_moe_as_mlx_lm";
    let Some(reference) = Reference::find(test, true) else {
        return;
    };
    answers_match(&reference, write_qwen3_moe_quantized);
}

fn answers_match(reference: &Reference, write: fn(&Path)) {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write(dir);
    let system = Message::new("system", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12");
    let users = ["w20 w21", "w5", "w30 w31 w32 w33 w34 w35 w36", "w9 w9 w9"];
    let conversations: Vec<Vec<Message>> = users
        .iter()
        .map(|u| vec![system.clone(), Message::new("user", *u)])
        .collect();
    let tokenizer = Tokenizer::load(dir).unwrap();
    let prefix = tokenizer
        .chat_tokens(std::slice::from_ref(&system), false, SpecialTokens::AsText)
        .unwrap();
    let suffixes: Vec<Vec<u32>> = conversations
        .iter()
        .map(|c| {
            tokenizer
                .chat_tokens(c, true, SpecialTokens::AsText)
                .unwrap()[prefix.len()..]
                .to_vec()
        })
        .collect();
    let request = write_request(
        dir,
        &json!({"prefix": prefix, "suffixes": suffixes, "max_tokens": 6, "eos": [44]}),
    );
    let expected = reference.run("mlx_lm_gemma.py", dir, &request);
    // Every memory mode: the experts are weights like any other.
    for memory in [
        MemoryMode::Resident,
        MemoryMode::ExpertsInFiles,
        MemoryMode::MappedTables,
        MemoryMode::Streamed,
    ] {
        let engine = MlxEngine::new(
            EngineConfig::new(dir)
                .prefix_messages(vec![system.clone()])
                .batch_size(3)
                .memory(memory),
        )
        .unwrap();
        let ours = engine
            .generate(conversations.clone(), GenerateOptions::new().max_tokens(6))
            .unwrap();
        for (row, text) in ours.texts.iter().enumerate() {
            for kind in ["alone_greedy", "batch_greedy"] {
                let ids: Vec<u32> = serde_json::from_value(expected[kind][row].clone()).unwrap();
                let theirs = tokenizer.decode(&ids).unwrap();
                assert_eq!(
                    text, &theirs,
                    "{memory:?}: row {row} against mlx_lm's {kind}"
                );
            }
        }
    }
}

/// Hugging Face's Gemma 4 MoE checkpoints fuse each layer's gate and up
/// experts into one `experts.gate_up_proj` (mlx_lm's `sanitize` splits it
/// when converting): loading one is a typed error naming the key and the
/// way out, not a missing weight without a reason.
#[test]
fn gemma4_moe_in_hugging_faces_fused_layout_names_the_key_and_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write_gemma4_moe(dir, false);
    let path = dir.join("model.safetensors");
    let weights = Array::load_safetensors(&path).unwrap();
    mlx_rs::transforms::eval(weights.values()).unwrap();
    let mut fused = std::collections::HashMap::new();
    for (key, value) in &weights {
        let Some(layer) = key.strip_suffix(".switch_glu.gate_proj.weight") else {
            if !key.contains(".switch_glu.up_proj.") {
                let key = key.replace(".switch_glu.down_proj.weight", ".down_proj");
                fused.insert(key, value.clone());
            }
            continue;
        };
        let up = &weights[&format!("{layer}.switch_glu.up_proj.weight")];
        let both = mlx_rs::ops::concatenate(&[value, up], -2).unwrap();
        fused.insert(format!("{layer}.gate_up_proj"), both);
    }
    Array::save_safetensors(fused.iter().map(|(k, v)| (k.as_str(), v)), None, &path).unwrap();
    let err = Model::loader(dir).load().expect_err("a fused layout loads");
    let said = err.to_string();
    assert!(
        matches!(&err, mlx_engine::Error::MissingWeight { .. })
            && said.contains("model.layers.0.experts.switch_glu.gate_proj.weight")
            && said.contains("model.layers.0.experts.gate_up_proj")
            && said.contains("mlx_lm.convert"),
        "{said}"
    );
}

/// The original gpt-oss checkpoints interleave each layer's gate and up
/// experts in one `gate_up_proj` (MXFP4 `_blocks` in the released ones;
/// mlx_lm's `sanitize` splits them when converting): a typed error naming
/// the key and the way out.
#[test]
fn gpt_oss_in_the_original_layout_names_the_key_and_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write_gpt_oss(dir);
    let path = dir.join("model.safetensors");
    let weights = Array::load_safetensors(&path).unwrap();
    mlx_rs::transforms::eval(weights.values()).unwrap();
    let mut original = std::collections::HashMap::new();
    for (key, value) in &weights {
        let key = key
            .replace("experts.gate_proj.weight", "experts.gate_up_proj")
            .replace("experts.up_proj.weight", "experts.gate_up_proj_blocks");
        original.insert(key, value.clone());
    }
    Array::save_safetensors(original.iter().map(|(k, v)| (k.as_str(), v)), None, &path).unwrap();
    let Err(err) = Model::loader(dir).load() else {
        panic!("the original layout is refused")
    };
    let message = err.to_string();
    assert!(
        message.contains("model.layers.0.mlp.experts.gate_up_proj")
            && message.contains("mlx_lm.convert"),
        "{message}"
    );
}

//! Gemma 4 in the checkpoint's own bfloat16 against mlx_lm 0.32.2: what
//! the published Gemma 4 checkpoints are (bfloat16 scales, biases and
//! norms), computed with `QuantizedWeights::Keep` (packed weights, MLX's
//! quantized product), so that the arithmetic is mlx_lm's operation for
//! operation. Logits at every position of each prompt (whole, after the
//! shared prefix alone, and in a left-padded batch after it), then the
//! engine's greedy answers with the clean prefix and with spawnllm's
//! (`PrefixCache::WithGeneratedToken`), on the tiny Gemma 4 that has every
//! feature (window 5 against a 270-token prefix, KV-shared layers of both
//! kinds, per-layer inputs, mixed 4/8-bit). Gemma 4's MoE variant (routed
//! experts beside the MLP, values equal to keys), 4-bit, the same way.

mod common;

use common::logits::{
    assert_every_position, moe_prompts, newer_mlx, run_parity_script, run_parity_script_newer_mlx,
    write_request, Only,
};
use common::tiny_gemma::*;
use common::VOCAB;
use mlx_engine::{
    EngineConfig, GenerateOptions, LogitsProcessor, MlxEngine, Model, PrefixCache,
    QuantizedWeights, Tokenizer,
};
use mlx_rs::Dtype;
use serde_json::json;
use test_support::python::{mlx_lm_python, python_with};

/// What the kept bits allow: none. MLX's products, attention and
/// element-wise steps are the ones mlx_lm calls, in the same dtype, so
/// every logit is the same bfloat16 number.
const TOLERANCE: f32 = 0.0;

#[test]
fn gemma4_in_bfloat16_equals_mlx_lm_at_every_position() {
    let test = "gemma4_in_bfloat16_equals_mlx_lm_at_every_position";
    let Some(python) = mlx_lm_python(test) else {
        return;
    };
    for quantized in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path();
        write_gemma4_in(dir, Layout::Mlx, quantized, Dtype::Bfloat16);
        let what = if quantized { "4/8-bit" } else { "dense" };
        let (prefix, suffixes) = prompt_tokens(dir);
        let request = write_request(dir, &json!({"prefix": prefix, "suffixes": suffixes}));
        let reference = run_parity_script(&python, "mlx_lm_positions.py", dir, &request);
        assert_eq!(reference["dtype"], "mlx.core.bfloat16", "{what}");
        let model = Model::loader(dir)
            .quantized(QuantizedWeights::Keep)
            .load()
            .unwrap();
        assert_every_position(&model, &reference, &prefix, &suffixes, TOLERANCE, what);
    }
}

/// Gemma 4's MoE (the 26B-A4B's block and k-eq-v attention) in bfloat16,
/// 4-bit with 8-bit routers as mlx_lm quantizes it (its quantized experts
/// need MLX 0.32.4 on the reference's side; dense bfloat16 experts it
/// cannot run on the CPU: MLX's `GatherMM` there takes float32 only).
#[test]
fn quantized_gemma4_moe_in_bfloat16_equals_mlx_lm_at_every_position() {
    let test = "quantized_gemma4_moe_in_bfloat16_equals_mlx_lm_at_every_position";
    let Some(python) = mlx_lm_python(test) else {
        return;
    };
    if newer_mlx(&python, test).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write_gemma4_moe_in(dir, true, Dtype::Bfloat16);
    // Shorter than `prompt_tokens`: mlx_lm's quantized experts are slow on
    // the CPU.
    let (prefix, suffixes) = moe_prompts();
    let request = write_request(dir, &json!({"prefix": prefix, "suffixes": suffixes}));
    let reference = run_parity_script_newer_mlx(&python, "mlx_lm_positions.py", dir, &request);
    assert_eq!(reference["dtype"], "mlx.core.bfloat16");
    let model = Model::loader(dir)
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    assert_every_position(
        &model,
        &reference,
        &prefix,
        &suffixes,
        TOLERANCE,
        "MoE 4/8-bit",
    );
}

/// The engine's answers, one label token each under a processor that
/// allows five tokens, against mlx_lm's `batch_generate` on copies of the
/// prefix's cache: made as spawnllm makes it with
/// `PrefixCache::WithGeneratedToken`, of the prefix alone by default.
#[test]
fn the_engine_answers_as_mlx_lm_with_either_prefix_cache() {
    let test = "the_engine_answers_as_mlx_lm_with_either_prefix_cache";
    let Some(python) = python_with(test, "mlx_lm") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write_gemma4_in(dir, Layout::Mlx, true, Dtype::Bfloat16);
    let tokenizer = Tokenizer::load(dir).unwrap();
    let allowed_ids: Vec<u32> = (1..=5)
        .map(|n| *tokenizer.encode(&format!("w{n}")).unwrap().last().unwrap())
        .collect();
    let (prefix, suffixes) = prompt_tokens(dir);
    let mut answers = Vec::new();
    for (setting, spawnllm) in [
        (PrefixCache::Clean, false),
        (PrefixCache::WithGeneratedToken, true),
    ] {
        let request = write_request(
            dir,
            &json!({"prefix": prefix, "suffixes": suffixes, "max_tokens": 1, "eos": [44],
                   "allowed": allowed_ids, "batch_only": true, "spawnllm_prefix": spawnllm}),
        );
        let reference = run_parity_script(&python, "mlx_lm_gemma.py", dir, &request);
        let theirs: Vec<String> = reference["batch_greedy"]
            .as_array()
            .unwrap()
            .iter()
            .map(|ids| {
                let ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
                tokenizer.decode(&ids).unwrap()
            })
            .collect();
        let engine = MlxEngine::new(
            EngineConfig::new(dir)
                .prefix_messages(vec![system()])
                .batch_size(2)
                .quantized(QuantizedWeights::Keep)
                .prefix_cache(setting)
                .logits_processor({
                    let allowed = allowed_ids.clone();
                    move |_: &Tokenizer| {
                        Box::new(Only::ids(&allowed, VOCAB)) as Box<dyn LogitsProcessor>
                    }
                }),
        )
        .unwrap();
        let ours = engine
            .generate(conversations(), GenerateOptions::new().max_tokens(1))
            .unwrap()
            .texts;
        assert_eq!(ours, theirs, "{setting:?}: ours vs mlx_lm");
        answers.push(ours);
    }
    let moved = answers[0]
        .iter()
        .zip(&answers[1])
        .filter(|(a, b)| a != b)
        .count();
    eprintln!(
        "{moved} of {} answers change with the generated token in the prefix's cache",
        answers[0].len()
    );
}

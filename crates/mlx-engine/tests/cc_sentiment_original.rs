//! cc-sentiment's own prompt and sixteen developer messages, labelled by the
//! engine and by the Python original on the same checkpoint: the tiny
//! Gemma 4 with every feature (window 5 against the 700-token prompt,
//! KV-shared layers, per-layer inputs, mixed 4/8-bit) in bfloat16, with a
//! word-level tokenizer over the prompt's and the messages' words.
//!
//! - With `PrefixCache::WithGeneratedToken` and `QuantizedWeights::Keep`
//!   (the original's prefix cache and mlx_lm's arithmetic) the labels equal
//!   those of cc-sentiment 0.2.135's `SentimentClassifier` on spawnllm
//!   0.17.1 + mlx-lm 0.31.3, kept in `tests/data/cc_sentiment_original.json`
//!   (that stack needs Python 3.13 and takes minutes: set
//!   `MLX_LOWMEM_SPAWNLLM_PYTHON` to its interpreter to compute them again,
//!   with `tests/parity/spawnllm_labels.py`, into that file). To make that
//!   interpreter:
//!
//!   ```sh
//!   python3.13 -m venv target/spawnllm-venv
//!   target/spawnllm-venv/bin/pip install 'spawnllm[mlx]==0.17.1' 'mlx[cpu]==0.32.2' \
//!       mlx-lm==0.31.3 pydantic anyio 'cc-transcript>=14,<15'
//!   target/spawnllm-venv/bin/pip install --no-deps cc-sentiment==0.2.135
//!   MLX_LOWMEM_SPAWNLLM_PYTHON=$PWD/target/spawnllm-venv/bin/python3 \
//!       MLX_LOWMEM_CC_SENTIMENT=~/.cache/mlx-lowmem/cc-sentiment \
//!       cargo test -p mlx-engine --test cc_sentiment_original
//!   ```
//!
//!   spawnllm 0.17.1 does not run on mlx-lm 0.32.2. Both spawnllm and
//!   cc-sentiment refuse to run off Apple Silicon; the script answers their
//!   two platform checks as a Mac would while the classifier is imported
//!   and built, and changes nothing else.
//! - With the clean prefix they equal mlx_lm 0.32.2's `batch_generate` on
//!   copies of the prefix's own cache (run live).
//!
//! - cc-sentiment's own code on our Python face: the same script, with
//!   `spawnllm.mlx` resolving to `mlx_lowmem` (the wheel of
//!   `crates/mlx-lowmem-py`, in the Python 3.13 environment `cargo xtask
//!   test` makes and names in `MLX_LOWMEM_FACE_PYTHON`), gives the kept
//!   labels, prefix and cache length with its defaults.
//!
//! Skips, saying so, without the system prompt (`cargo xtask fixtures`) or
//! the interop Python (or, for the last, the face's Python).

mod common;

use std::path::{Path, PathBuf};

use common::gemma_words::{label_ids, mlx_lm_labels, user_content, words_of, write_tokenizer};
use common::logits::{run_script, run_script_with, write_request, Only};
use common::tiny_gemma::{write_gemma4_with, Layout};
use mlx_engine::{
    EngineConfig, GenerateOptions, LogitsProcessor, Message, MlxEngine, PrefixCache,
    QuantizedWeights, Tokenizer,
};
use mlx_rs::Dtype;
use serde_json::json;
use sha2::{Digest, Sha256};
use test_support::python::python_with;

/// Short messages of the kind cc-sentiment scores: terse commands, thanks,
/// complaints, a pasted exchange (its `DEVELOPER:`/`AI:` form).
const TEXTS: [&str; 16] = [
    "fix the failing test in parser.rs",
    "thanks, that works perfectly!",
    "no. that is wrong again. read the error",
    "why does the build keep breaking after every change you make",
    "ok",
    "great job, this is exactly what I wanted",
    "run cargo test",
    "AI: I updated the config.\nDEVELOPER: it still fails, same error",
    "can you explain what this function does",
    "stop changing unrelated files",
    "nice, much faster now",
    "undo that",
    "this is the third time I asked, please just do what I said",
    "looks good, commit it",
    "hmm, not sure about this approach",
    "perfect! you saved me hours",
];

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What the kept labels were computed on: the checkpoint's files and the
/// system prompt, by digest.
fn inputs(dir: &Path, system: &str) -> serde_json::Value {
    let mut files = serde_json::Map::new();
    for name in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        files.insert(name.into(), sha256_hex(&bytes).into());
    }
    json!({"files": files, "system_prompt": sha256_hex(system.as_bytes()), "texts": TEXTS})
}

fn kept_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/cc_sentiment_original.json")
}

/// The original's labels: computed again when `MLX_LOWMEM_SPAWNLLM_PYTHON`
/// names its interpreter (and kept), else read from the kept file, which
/// must have been made from these very inputs.
fn original_labels(dir: &Path, inputs: &serde_json::Value) -> Vec<String> {
    let regenerate = "set MLX_LOWMEM_SPAWNLLM_PYTHON to a Python 3.13 with spawnllm[mlx]==0.17.1, \
        mlx-lm==0.31.3, cc-sentiment==0.2.135 (docs/mlx-engine.md) and run this test again";
    if let Ok(python) = std::env::var("MLX_LOWMEM_SPAWNLLM_PYTHON") {
        let request = write_request(dir, &json!({"texts": TEXTS}));
        let mut made = run_script(&python, "spawnllm_labels.py", dir, &request);
        made["inputs"] = inputs.clone();
        let path = kept_path();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, serde_json::to_string_pretty(&made).unwrap() + "\n").unwrap();
        eprintln!("wrote {}: commit it", path.display());
    }
    let kept = std::fs::read_to_string(kept_path())
        .unwrap_or_else(|e| panic!("{}: {e}; {regenerate}", kept_path().display()));
    let kept: serde_json::Value = serde_json::from_str(&kept).unwrap();
    assert_eq!(
        &kept["inputs"], inputs,
        "the kept labels were computed on other inputs; {regenerate}"
    );
    assert_eq!(kept["versions"]["spawnllm"], "0.17.1");
    assert_eq!(kept["versions"]["mlx-lm"], "0.31.3");
    serde_json::from_value(kept["labels"].clone()).unwrap()
}

/// The engine as the cc_sentiment example runs it (batch 2, one token).
fn engine_labels(
    dir: &Path,
    system: &str,
    vocab: i32,
    allowed: &[u32],
    prefix: PrefixCache,
) -> Vec<String> {
    let allowed = allowed.to_vec();
    let system = Message::new("system", system);
    let engine = MlxEngine::new(
        EngineConfig::new(dir)
            .prefix_messages(vec![system.clone()])
            .batch_size(2)
            .quantized(QuantizedWeights::Keep)
            .prefix_cache(prefix)
            .logits_processor(move |_: &Tokenizer| {
                Box::new(Only::ids(&allowed, vocab)) as Box<dyn LogitsProcessor>
            }),
    )
    .unwrap();
    let conversations = TEXTS
        .iter()
        .map(|t| vec![system.clone(), Message::new("user", user_content(t))])
        .collect();
    let texts = engine
        .generate(conversations, GenerateOptions::new().max_tokens(1))
        .unwrap()
        .texts;
    texts.iter().map(|t| t.trim().to_owned()).collect()
}

/// The checkpoint the kept labels were computed on, written into `dir`;
/// returns its vocabulary size.
fn write_checkpoint(dir: &Path, system: &str) -> i32 {
    let mut texts: Vec<&str> = vec![system, "CONVERSATION: DEVELOPER: AI:"];
    texts.extend(TEXTS);
    let words = words_of(&texts);
    let vocab = write_tokenizer(dir, words.clone());
    write_gemma4_with(dir, Layout::Text, true, Dtype::Bfloat16, vocab);
    // The writer puts its own tokenizer beside the weights: ours again.
    write_tokenizer(dir, words);
    vocab
}

fn system_prompt(test: &str) -> Option<String> {
    let Some(fixture) = std::env::var_os("MLX_LOWMEM_CC_SENTIMENT").map(PathBuf::from) else {
        eprintln!("SKIP {test}: MLX_LOWMEM_CC_SENTIMENT is not set (cargo xtask fixtures fetches cc-sentiment's system prompt)");
        return None;
    };
    Some(std::fs::read_to_string(fixture.join("system_prompt.txt")).unwrap())
}

#[test]
fn labels_equal_the_originals_with_its_prefix_cache_and_mlx_lms_without() {
    let test = "labels_equal_the_originals_with_its_prefix_cache_and_mlx_lms_without";
    let Some(system) = system_prompt(test) else {
        return;
    };
    let Some(python) = python_with(test, "mlx_lm") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let vocab = write_checkpoint(dir, &system);
    let allowed = label_ids();

    let original = original_labels(dir, &inputs(dir, &system));
    let ours = engine_labels(
        dir,
        &system,
        vocab,
        &allowed,
        PrefixCache::WithGeneratedToken,
    );
    assert_eq!(
        ours, original,
        "with the original's prefix cache: ours vs spawnllm"
    );

    let clean = mlx_lm_labels(&python, dir, &system, &TEXTS, &allowed);
    let ours = engine_labels(dir, &system, vocab, &allowed, PrefixCache::Clean);
    assert_eq!(ours, clean, "with the clean prefix: ours vs mlx_lm");
    let moved = original.iter().zip(&clean).filter(|(a, b)| a != b).count();
    eprintln!(
        "{moved} of {} labels differ between the two prefix caches",
        TEXTS.len()
    );
}

#[test]
fn cc_sentiments_own_code_on_the_python_face_gives_the_originals_labels() {
    let test = "cc_sentiments_own_code_on_the_python_face_gives_the_originals_labels";
    let Some(system) = system_prompt(test) else {
        return;
    };
    let Ok(python) = std::env::var("MLX_LOWMEM_FACE_PYTHON") else {
        eprintln!("SKIP {test}: MLX_LOWMEM_FACE_PYTHON is not set (cargo xtask test makes that Python 3.13 environment)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    write_checkpoint(dir, &system);
    let original = original_labels(dir, &inputs(dir, &system));
    let kept: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(kept_path()).unwrap()).unwrap();

    let request = write_request(dir, &json!({"texts": TEXTS}));
    let ours = run_script_with(
        &python,
        "spawnllm_labels.py",
        dir,
        &request,
        &["--through-mlx-lowmem"],
    );
    assert_eq!(
        ours["engine"], "mlx_lowmem._engine",
        "the alias took effect"
    );
    let labels: Vec<String> = serde_json::from_value(ours["labels"].clone()).unwrap();
    assert_eq!(
        labels, original,
        "cc-sentiment on mlx_lowmem vs on spawnllm"
    );
    assert_eq!(ours["prefix_tokens"], kept["prefix_tokens"]);
    // `base_cache` is mlx_lm's, built as the original builds it.
    assert_eq!(ours["cache_offset"], kept["cache_offset"]);
}

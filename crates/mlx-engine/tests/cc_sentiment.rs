//! The `cc_sentiment` example end to end on a base that can be made here: a
//! Gemma 4 checkpoint with E2B's real shapes and random 4-bit weights (the
//! real base cannot be downloaded where tests run), the adapter
//! cc-sentiment ships (`cargo xtask fixtures`), a word-level tokenizer. The
//! labels are meaningless on random weights; they must equal mlx_lm 0.32.2's
//! `batch_generate` on the same fused folder, same prompts (each from a copy
//! of the prefix's prompt cache) and same label-only logits processor.
//! Skips, saying so, without the adapter or the Python.

mod common;
use test_support::gemma4_e2b;

use std::path::PathBuf;
use std::process::Command;

use mlx_engine::Tokenizer;
use serde_json::json;

const WORDS: usize = 200;

/// The example, built by `cargo test` beside this test.
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = profile
        .join("examples")
        .join(format!("cc_sentiment{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "{} is missing: `cargo test` builds it",
        path.display()
    );
    path
}

#[test]
fn the_example_labels_as_mlx_lm_does_on_the_same_fused_model() {
    let test = "the_example_labels_as_mlx_lm_does_on_the_same_fused_model";
    let Some(shipped) = std::env::var_os("MLX_LOWMEM_CC_SENTIMENT").map(PathBuf::from) else {
        eprintln!("SKIP {test}: MLX_LOWMEM_CC_SENTIMENT is not set (cargo xtask fixtures fetches the adapter)");
        return;
    };
    let Some(python) = test_support::python::mlx_lm_python(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    // float32 scales and norms: MLX's CPU products in bfloat16 would make
    // mlx_lm's side take a quarter of an hour.
    let config = gemma4_e2b::E2bBase {
        vocab: 256,
        dtype: mlx_rs::Dtype::Float32,
        ..gemma4_e2b::E2bBase::default()
    };
    gemma4_e2b::write(&base, &config);
    common::gemma_words::write_tokenizer(&base, (0..WORDS).map(|i| format!("w{i}")));

    // A short system prompt of words the tokenizer knows and does not: the
    // random model's cost stays small on the CPU.
    let system: String = (0..12).map(|i| format!("w{} ", (i * 13) % 250)).collect();
    let system_path = dir.path().join("system.txt");
    std::fs::write(&system_path, &system).unwrap();
    let texts = ["w3 w4 w5", "continue", "AI: w1 w2", "w100 w120 w140 w160"];
    let input = dir.path().join("texts.jsonl");
    let lines: Vec<String> = texts
        .iter()
        .map(|t| json!({"text": t}).to_string())
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();

    let run = Command::new(example())
        .arg("--adapter-dir")
        .arg(&shipped)
        .arg("--system-prompt")
        .arg(&system_path)
        .arg("--base")
        .arg(&base)
        .arg("--input")
        .arg(&input)
        .arg("--cache")
        .arg(dir.path().join("hub"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "the example failed: {stderr}");
    eprintln!("{stderr}");
    let labels: Vec<String> = String::from_utf8_lossy(&run.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["label"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(labels.len(), texts.len());
    assert!(
        labels
            .iter()
            .all(|l| ["1", "2", "3", "4", "5"].contains(&l.as_str())),
        "{labels:?}"
    );
    let fused = stderr
        .lines()
        .find_map(|l| l.strip_prefix("fused model: "))
        .map(PathBuf::from)
        .expect("the example names the fused folder");

    // The same prompts for mlx_lm, the prefix's cache copied per
    // conversation, the same label tokens allowed.
    let tokenizer = Tokenizer::load(&fused).unwrap();
    let allowed: Vec<u32> = (1..=5)
        .map(|n| *tokenizer.encode(&n.to_string()).unwrap().last().unwrap())
        .collect();
    let theirs = common::gemma_words::mlx_lm_labels(&python, &fused, &system, &texts, &allowed);
    assert_eq!(labels, theirs, "ours vs mlx_lm batch_generate");
}

//! cc-sentiment 0.2.135's own code, unchanged, on the Python face
//! (`mlx_lowmem`, see `crates/mlx-lowmem-py`) with E2B's shapes: a random
//! Gemma 4 base with E2B's real module shapes (float32 scales; random 4-bit
//! weights) in a local hub cache under the application's default repo name
//! (`unsloth/gemma-4-E2B-it-UD-MLX-4bit`), the adapter it ships, its own
//! `AdapterFuser.ensure_fused`, `SentimentClassifier`, prompt (693 tokens
//! through a word-level tokenizer over its words), `score_messages` and
//! `extract_score` (`tests/parity/cc_sentiment_app.py`).
//!
//! What is checked: the fused entry is where the application looks for it
//! and its tensors equal, byte for byte, those of adapter-fuse called from
//! Rust on the same base and codec (whose equality with the Python
//! original's fuse `adapter-fuse/tests/shipped_adapter.rs` holds); the
//! labels equal those the Python original (cc-sentiment on spawnllm 0.17.1
//! and mlx-lm 0.31.3, `tests/parity/spawnllm_labels.py`) gave on the same
//! fused folder, kept in `tests/data/cc_sentiment_app_e2b.json`: its pass
//! over this model took 338 s on a 2-core CPU, so it is computed again only
//! when `MLX_LOWMEM_SPAWNLLM_PYTHON` names its interpreter (the face venv
//! has everything it needs). The engine runs with
//! `MLX_LOWMEM_QUANTIZED=dequantize_on_use`, the CPU-fast arithmetic.
//!
//! Skips, saying so, without the adapter (`cargo xtask fixtures`) or the
//! face's Python (`MLX_LOWMEM_FACE_PYTHON`, made by `cargo xtask test`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use adapter_codec::AdapterCodec;
use common::gemma_words::{words_of, write_tokenizer};
use sha2::{Digest, Sha256};
use test_support::gemma4_e2b;

/// cc-sentiment's `DEFAULT_MODEL`.
const APP_REPO: &str = "unsloth/gemma-4-E2B-it-UD-MLX-4bit";

const TEXTS: [&str; 4] = [
    "fix the failing test in parser.rs",
    "thanks, that works perfectly!",
    "no. that is wrong again. read the error",
    "AI: I updated the config.\nDEVELOPER: it still fails, same error",
];

/// Each file of `dir` by SHA-256.
fn digests(dir: &Path) -> serde_json::Value {
    let mut files = serde_json::Map::new();
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    names.sort();
    for path in names {
        let digest: String = Sha256::digest(std::fs::read(&path).unwrap())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        files.insert(
            path.file_name().unwrap().to_string_lossy().into_owned(),
            digest.into(),
        );
    }
    files.into()
}

fn kept_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/cc_sentiment_app_e2b.json")
}

/// The original's labels on `fused`: computed again when
/// `MLX_LOWMEM_SPAWNLLM_PYTHON` names its interpreter (and kept), else read
/// from the kept file, which must have been made from the same base and
/// texts. Returns them with the kept record.
fn original_labels(base: &Path, fused: &Path, work: &Path) -> (Vec<String>, serde_json::Value) {
    let inputs = serde_json::json!({"base": digests(base), "texts": TEXTS});
    if let Ok(python) = std::env::var("MLX_LOWMEM_SPAWNLLM_PYTHON") {
        let request = work.join("original-request.json");
        std::fs::write(&request, serde_json::json!({ "texts": TEXTS }).to_string()).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/spawnllm_labels.py");
        let clock = std::time::Instant::now();
        let run = Command::new(python)
            .arg(&script)
            .arg(fused)
            .arg(&request)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "the original: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let mut made: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
        made["inputs"] = inputs.clone();
        made["fused"] = digests(fused);
        made["seconds"] = clock.elapsed().as_secs_f64().round().into();
        std::fs::write(
            kept_path(),
            serde_json::to_string_pretty(&made).unwrap() + "\n",
        )
        .unwrap();
        eprintln!("wrote {}: commit it", kept_path().display());
    }
    let kept: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(kept_path()).unwrap()).unwrap();
    assert_eq!(
        kept["inputs"], inputs,
        "the kept labels were computed on another base or texts; set MLX_LOWMEM_SPAWNLLM_PYTHON \
         to target/face-venv/bin/python3 and run this test again"
    );
    assert_eq!(kept["versions"]["spawnllm"], "0.17.1");
    assert_eq!(kept["versions"]["mlx-lm"], "0.31.3");
    (
        serde_json::from_value(kept["labels"].clone()).unwrap(),
        kept,
    )
}

#[test]
fn cc_sentiment_fuses_and_classifies_through_the_python_face_with_e2b_shapes() {
    let test = "cc_sentiment_fuses_and_classifies_through_the_python_face_with_e2b_shapes";
    let Some(shipped) = std::env::var_os("MLX_LOWMEM_CC_SENTIMENT").map(PathBuf::from) else {
        eprintln!("SKIP {test}: MLX_LOWMEM_CC_SENTIMENT is not set (cargo xtask fixtures fetches the adapter)");
        return;
    };
    let Ok(python) = std::env::var("MLX_LOWMEM_FACE_PYTHON") else {
        eprintln!("SKIP {test}: MLX_LOWMEM_FACE_PYTHON is not set (cargo xtask test makes that Python 3.13 environment)");
        return;
    };
    let system = std::fs::read_to_string(shipped.join("system_prompt.txt")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let hub = dir.path().join("hub");
    let entry = hub.join(format!("models--{}", APP_REPO.replace('/', "--")));
    let revision = "0".repeat(40);
    let base = entry.join("snapshots").join(&revision);
    let clock = std::time::Instant::now();
    gemma4_e2b::write(
        &base,
        &gemma4_e2b::E2bBase {
            vocab: 1024,
            dtype: mlx_rs::Dtype::Float32,
            ..gemma4_e2b::E2bBase::default()
        },
    );
    let mut words: Vec<&str> = vec![system.as_str(), "CONVERSATION: DEVELOPER: AI:"];
    words.extend(TEXTS);
    let vocab = write_tokenizer(&base, words_of(&words));
    assert!(vocab <= 1024, "{vocab} words");
    std::fs::create_dir_all(entry.join("refs")).unwrap();
    std::fs::write(entry.join("refs/main"), &revision).unwrap();
    eprintln!("E2B-shaped base written in {:.1?}", clock.elapsed());

    let request = dir.path().join("request.json");
    std::fs::write(&request, serde_json::json!({ "texts": TEXTS }).to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/cc_sentiment_app.py");
    // The child's environment only: its hub cache, offline, the CPU-fast
    // arithmetic.
    let run = Command::new(&python)
        .arg(&script)
        .arg(&request)
        .env("HF_HUB_CACHE", &hub)
        .env("HF_HUB_OFFLINE", "1")
        .env("MLX_LOWMEM_QUANTIZED", "dequantize_on_use")
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "cc-sentiment on mlx_lowmem: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    eprintln!("cc-sentiment through mlx_lowmem: {report}");

    let codec = AdapterCodec::new(
        shipped.join("adapters.safetensors.zst"),
        shipped.join("adapter_config.json"),
    );
    let digest = codec.digest().unwrap();
    let fused = PathBuf::from(report["fused"].as_str().unwrap());
    assert_eq!(
        fused,
        hub.join(format!(
            "models--cc-sentiment--fused-{digest}/snapshots/{digest}"
        )),
        "the entry the application looks for"
    );
    let labels: Vec<String> = serde_json::from_value(report["labels"].clone()).unwrap();
    assert_eq!(labels.len(), TEXTS.len());
    assert!(
        labels
            .iter()
            .all(|l| ["1", "2", "3", "4", "5"].contains(&l.as_str())),
        "{labels:?}"
    );
    assert_eq!(report["prefix_tokens"], 693, "the application's prompt");

    let options =
        adapter_fuse::FuseOptions::from_env().with_cache_root(dir.path().join("rust-hub"));
    let from_rust = adapter_fuse::Fuse::new(base.to_str().unwrap(), &codec, "cc-sentiment--fused")
        .options(&options)
        .run()
        .unwrap();
    let (ours, rust) = (
        test_support::tensors::in_folder(&fused),
        test_support::tensors::in_folder(&from_rust),
    );
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        rust.keys().collect::<Vec<_>>()
    );
    let differing: Vec<&String> = ours.keys().filter(|k| ours[*k] != rust[*k]).collect();
    assert!(differing.is_empty(), "tensors that differ: {differing:?}");

    let (original, kept) = original_labels(&base, &fused, dir.path());
    // The fuse's bytes depend on the BLAS kernels (docs/adapter-fuse.md):
    // on other kernels than the kept run's the folder may differ in a few
    // packed words, and the labels are then compared on a folder the
    // original did not see.
    let same_folder = kept["fused"] == digests(&fused);
    assert_eq!(
        labels, original,
        "cc-sentiment on mlx_lowmem vs on spawnllm (fused folder byte-equal to the kept run's: {same_folder})"
    );
}

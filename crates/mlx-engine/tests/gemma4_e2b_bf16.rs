//! Gemma 4 E2B's shapes in bfloat16 against mlx_lm 0.32.2, bit for bit:
//! hidden 1536, heads of 256 (sliding) and 512 (full, proportional RoPE),
//! one key/value head, per-layer inputs 256 wide, the 512-token window,
//! the softcap, 4-bit groups of 64 and 32 and 8-bit modules with bfloat16
//! scales and unquantized ones, in four layers that keep every kind E2B
//! has: a sliding and a full layer with their own keys and values, then a
//! KV-shared sliding and a KV-shared full layer with the double-wide MLP.
//! `QuantizedWeights::Keep` (mlx_lm's arithmetic): logits at every
//! position of the prefix, of each row after it alone, and of the rows in
//! a left-padded batch after it.
//!
//! mlx_lm's quantized products in bfloat16 are slow on the CPU (a second
//! and a half per token on this shape, ours too), so its logits are kept in
//! `tests/data/gemma4_e2b_bf16.json` with the digests of the checkpoint
//! and prompts they were computed on; `MLX_LOWMEM_REGENERATE=1` computes
//! them again with `tests/parity/mlx_lm_positions.py` into that file. The
//! window is exercised at these shapes by a one-off run of 600 tokens
//! (docs/benchmarks.md); the tiny Gemma tests cross it in every run.

mod common;
use test_support::gemma4_e2b;
use test_support::python::mlx_lm_python;

use std::path::{Path, PathBuf};

use common::logits::{
    largest_difference, padded_forward, positions, run_parity_script, write_request,
};
use mlx_engine::{KvCache, Model, QuantizedWeights};
use mlx_rs::Array;
use serde_json::json;
use sha2::{Digest, Sha256};

const VOCAB: i32 = 256;

/// A prefix of 24 tokens and rows of 12 and 5 after it, drawn from a
/// fixed sequence (ids past the tokenizer-free specials).
fn prompts() -> (Vec<u32>, Vec<Vec<u32>>) {
    let mut state = 2026u64;
    let mut next = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                6 + ((state >> 33) % (VOCAB as u64 - 6)) as u32
            })
            .collect()
    };
    let prefix = [vec![2], next(23)].concat();
    (prefix, vec![next(12), next(5)])
}

fn kept_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gemma4_e2b_bf16.json")
}

/// The checkpoint's files and the prompts, by digest.
fn inputs(dir: &Path, prefix: &[u32], suffixes: &[Vec<u32>]) -> serde_json::Value {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json") || n.ends_with(".safetensors"))
        .collect();
    names.sort();
    let files: serde_json::Map<String, serde_json::Value> = names
        .into_iter()
        .map(|name| {
            let digest = Sha256::digest(std::fs::read(dir.join(&name)).unwrap());
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            (name, hex.into())
        })
        .collect();
    json!({"files": files, "prefix": prefix, "suffixes": suffixes})
}

/// mlx_lm's logits, computed again (and kept) with `MLX_LOWMEM_REGENERATE`
/// set, else the kept ones, which must be of these very inputs.
fn reference(dir: &Path, inputs: &serde_json::Value) -> Option<serde_json::Value> {
    if std::env::var_os("MLX_LOWMEM_REGENERATE").is_some() {
        let python = mlx_lm_python("gemma4_e2b_bf16 (regenerating)")?;
        let body =
            json!({"prefix": inputs["prefix"], "suffixes": inputs["suffixes"], "whole": false});
        let request = write_request(dir, &body);
        let mut made = run_parity_script(&python, "mlx_lm_positions.py", dir, &request);
        made["inputs"] = inputs.clone();
        std::fs::create_dir_all(kept_path().parent().unwrap()).unwrap();
        std::fs::write(kept_path(), made.to_string() + "\n").unwrap();
        eprintln!("wrote {}: commit it", kept_path().display());
    }
    let kept = std::fs::read_to_string(kept_path()).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; MLX_LOWMEM_REGENERATE=1 computes it",
            kept_path().display()
        )
    });
    let kept: serde_json::Value = serde_json::from_str(&kept).unwrap();
    assert_eq!(
        &kept["inputs"], inputs,
        "the kept logits were computed on another checkpoint or prompt; MLX_LOWMEM_REGENERATE=1 computes them again"
    );
    assert_eq!(kept["dtype"], "mlx.core.bfloat16");
    Some(kept)
}

#[test]
fn e2b_shapes_in_bfloat16_equal_mlx_lm_at_every_position() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let base = gemma4_e2b::E2bBase {
        vocab: VOCAB,
        depth: gemma4_e2b::Depth::EVERY_KIND,
        legacy_kv: false,
        ..gemma4_e2b::E2bBase::default()
    };
    gemma4_e2b::write(dir, &base);
    let (prefix, suffixes) = prompts();
    let Some(kept) = reference(dir, &inputs(dir, &prefix, &suffixes)) else {
        return;
    };
    let model = Model::loader(dir)
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    let ids = |t: &[u32]| -> Vec<i32> { t.iter().map(|&x| x as i32).collect() };

    let mut shared = KvCache::new();
    let p = ids(&prefix);
    let logits = model
        .forward(&Array::from_slice(&p, &[1, p.len() as i32]), &mut shared)
        .unwrap();
    let d = largest_difference(&positions(&logits, 0, 0), &kept["prefix"]);
    assert!(d == 0.0, "the prefix's logits differ by {d}");

    for (row, suffix) in suffixes.iter().enumerate() {
        let s = ids(suffix);
        let logits = model
            .forward(
                &Array::from_slice(&s, &[1, s.len() as i32]),
                &mut shared.fork(1).unwrap(),
            )
            .unwrap();
        let d = largest_difference(&positions(&logits, 0, 0), &kept["after_prefix"][row]);
        assert!(d == 0.0, "row {row} after the prefix differs by {d}");
    }

    let (logits, pads) = padded_forward(&model, &shared, &suffixes);
    for (row, pad) in pads.iter().enumerate() {
        let d = largest_difference(
            &positions(&logits, row as i32, *pad),
            &kept["after_prefix"][row],
        );
        assert!(d == 0.0, "row {row} of the padded batch differs by {d}");
    }
}

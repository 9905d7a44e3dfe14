//! Logits at every position, ours against mlx_lm's: running a parity
//! script, reading positions out of a forward, the largest difference.

use std::path::{Path, PathBuf};
use std::process::Command;

use mlx_engine::{KvCache, LogitsProcessor, Model};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::select;
use mlx_rs::{Array, Dtype};

/// Runs `tests/parity/<script> DIR REQUEST` with `python` and returns its
/// JSON, which must come from mlx_lm 0.32.2.
pub fn run_parity_script(
    python: &str,
    script: &str,
    dir: &Path,
    request: &Path,
) -> serde_json::Value {
    let reference = run_script(python, script, dir, request);
    assert_eq!(
        reference["version"], "0.32.2",
        "the reference must be mlx_lm 0.32.2 (cargo xtask test installs it beside the venv)"
    );
    reference
}

/// Runs `tests/parity/<script> DIR REQUEST` with `python` and returns the
/// JSON it prints.
pub fn run_script(python: &str, script: &str, dir: &Path, request: &Path) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/parity")
        .join(script);
    let out = Command::new(python)
        .arg(&script)
        .arg(dir)
        .arg(request)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Writes `body` as `DIR/request.json` for a parity script.
pub fn write_request(dir: &Path, body: &serde_json::Value) -> PathBuf {
    let request = dir.join("request.json");
    std::fs::write(&request, body.to_string()).unwrap();
    request
}

/// The logits of `suffixes` run as one left-padded batch on forks of the
/// one-row cache `shared`, and each row's padding.
pub fn padded_forward(model: &Model, shared: &KvCache, suffixes: &[Vec<u32>]) -> (Array, Vec<i32>) {
    let width = suffixes.iter().map(Vec::len).max().unwrap_or(0);
    let pads: Vec<i32> = suffixes.iter().map(|s| (width - s.len()) as i32).collect();
    let block: Vec<i32> = suffixes
        .iter()
        .flat_map(|s| std::iter::repeat_n(0, width - s.len()).chain(s.iter().map(|&t| t as i32)))
        .collect();
    let rows = suffixes.len() as i32;
    let mut cache = shared.fork(rows).unwrap();
    cache.set_pads(pads.clone()).unwrap();
    let logits = model
        .forward(
            &Array::from_slice(&block, &[rows, width as i32]),
            &mut cache,
        )
        .unwrap();
    (logits, pads)
}

/// A logits processor that leaves only the tokens where its `(vocab,)`
/// mask is true (as cc-sentiment's label processor does).
pub struct Only(pub Array);

impl Only {
    /// Only `ids`, of a vocabulary of `vocab`.
    pub fn ids(ids: &[u32], vocab: i32) -> Only {
        let mut mask = vec![false; vocab as usize];
        for &id in ids {
            mask[id as usize] = true;
        }
        Only(Array::from_slice(&mask, &[vocab]))
    }
}

impl LogitsProcessor for Only {
    fn process(&mut self, logits: &Array) -> Result<Array, mlx_rs::error::Exception> {
        select(&self.0, logits, Array::from_f32(-1e9))
    }
}

/// `(positions, vocab)` logits of row `row` of `(B, L, vocab)`, positions
/// `from..`.
pub fn positions(logits: &Array, row: i32, from: i32) -> Vec<Vec<f32>> {
    let v = logits
        .index((row, from.., ..))
        .as_dtype(Dtype::Float32)
        .unwrap();
    v.eval().unwrap();
    let vocab = v.dim(1) as usize;
    v.as_slice::<f32>()
        .chunks(vocab)
        .map(<[f32]>::to_vec)
        .collect()
}

/// The largest absolute difference between `ours` and `theirs`, a JSON
/// list of positions' logits of the same shape.
pub fn largest_difference(ours: &[Vec<f32>], theirs: &serde_json::Value) -> f32 {
    let theirs: Vec<Vec<f32>> = serde_json::from_value(theirs.clone()).unwrap();
    assert_eq!(ours.len(), theirs.len(), "positions");
    ours.iter()
        .zip(&theirs)
        .flat_map(|(a, b)| {
            assert_eq!(a.len(), b.len(), "vocabulary");
            a.iter().zip(b).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f32::max)
}

//! Logits at every position, ours against mlx_lm's: running a parity
//! script, reading positions out of a forward, the largest difference.

use std::path::Path;
use std::process::Command;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

/// Runs `tests/parity/<script> DIR REQUEST` with `python` and returns its
/// JSON, which must come from mlx_lm 0.32.2.
pub fn run_parity_script(
    python: &str,
    script: &str,
    dir: &Path,
    request: &Path,
) -> serde_json::Value {
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
    let reference: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        reference["version"], "0.32.2",
        "the reference must be mlx_lm 0.32.2 (cargo xtask test installs it beside the venv)"
    );
    reference
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

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
    let reference = run_script_on(python, script, dir, request, false, &[]);
    assert_eq!(
        reference["version"], "0.32.2",
        "the reference must be mlx_lm 0.32.2 (cargo xtask test installs it beside the venv)"
    );
    reference
}

/// The folder of MLX 0.32.4 that `cargo xtask test` keeps beside the venv
/// of `python`, for mlx_lm 0.32.2's quantized experts; `None`, said on
/// stderr as `test`'s reason to skip, when it is not there.
pub fn newer_mlx(python: &str, test: &str) -> Option<PathBuf> {
    let dir = Path::new(python).parent()?.parent()?.join("mlx-0.32.4");
    if !dir.is_dir() {
        eprintln!(
            "SKIP {test}: no {} (cargo xtask test provides it)",
            dir.display()
        );
        return None;
    }
    Some(dir)
}

/// [`run_parity_script`] with mlx_lm 0.32.2 on MLX 0.32.4 (see
/// [`newer_mlx`]).
pub fn run_parity_script_newer_mlx(
    python: &str,
    script: &str,
    dir: &Path,
    request: &Path,
) -> serde_json::Value {
    let reference = run_script_on(python, script, dir, request, true, &[]);
    assert_eq!(reference["version"], "0.32.2");
    assert_eq!(reference["mlx"], "0.32.4", "the reference's MLX");
    reference
}

/// Runs `tests/parity/<script> DIR REQUEST` with `python` and returns the
/// JSON it prints.
pub fn run_script(python: &str, script: &str, dir: &Path, request: &Path) -> serde_json::Value {
    run_script_on(python, script, dir, request, false, &[])
}

/// [`run_script`] with more arguments after the request.
#[allow(dead_code)]
pub fn run_script_with(
    python: &str,
    script: &str,
    dir: &Path,
    request: &Path,
    args: &[&str],
) -> serde_json::Value {
    run_script_on(python, script, dir, request, false, args)
}

fn run_script_on(
    python: &str,
    script: &str,
    dir: &Path,
    request: &Path,
    newer_mlx: bool,
    args: &[&str],
) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/parity")
        .join(script);
    let mut command = Command::new(python);
    command.arg(&script).arg(dir).arg(request).args(args);
    if newer_mlx {
        // The child's environment only: the scripts put MLX 0.32.4 first.
        command.env("MLX_LOWMEM_NEWER_MLX", "1");
    }
    with_the_engines_blas(&mut command);
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Runs the reference's matrix products on the BLAS the engine's MLX runs
/// them on. The MLX wheel in the venv multiplies with the reference BLAS it
/// bundles; where the engine's MLX was built against OpenBLAS
/// (`mlx_sys::BLAS`), the two sum f32 products in other orders, and a sum
/// near the midpoint of two half-precision numbers rounds to either (seen:
/// one element of a float16 gpt_oss expert's product, a logit 1 ulp
/// apart). Preloading the engine's OpenBLAS into the reference gives its
/// products the same bits. A no-op elsewhere (macOS: Accelerate on both
/// sides; an external MLX).
fn with_the_engines_blas(command: &mut Command) {
    if !cfg!(target_os = "linux") || mlx_sys::BLAS != "openblas" {
        return;
    }
    // mlx-sys's MLX reaches OpenBLAS through the wheel's BLAS file name.
    let libs = Path::new(mlx_sys::LIB_DIR).join("../../mlx_cpu.libs");
    let blas = std::fs::read_dir(&libs).ok().and_then(|entries| {
        entries.flatten().map(|e| e.path()).find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libblas"))
        })
    });
    if let Some(blas) = blas.and_then(|b| std::fs::canonicalize(b).ok()) {
        command.env("LD_PRELOAD", blas);
    }
}

/// A prefix of 40 tokens and rows of 1, 6 and 30 after it (of the word
/// tokenizer's first 40 ids): in a forward of a mixture of experts, fewer
/// than 64 (row, expert) choices and more, where mlx_lm sorts them by
/// expert; eight windows of the tiny Gemmas long.
#[allow(dead_code)]
pub fn moe_prompts() -> (Vec<u32>, Vec<Vec<u32>>) {
    let prefix: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 40).collect();
    let suffixes: Vec<Vec<u32>> = [1usize, 6, 30]
        .iter()
        .map(|&n| (0..n).map(|i| ((i * 13 + n) % 40) as u32).collect())
        .collect();
    (prefix, suffixes)
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
    let mut cache = shared.fork_padded(pads.clone()).unwrap();
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

/// `model`'s logits against `mlx_lm_positions.py`'s `reference` at every
/// position of each row — prefix and suffix in one forward, the suffix
/// after the prefix's cache, and the suffixes as one left-padded batch
/// after it — each within `tolerance`; `what` names the case in failures.
pub fn assert_every_position(
    model: &Model,
    reference: &serde_json::Value,
    prefix: &[u32],
    suffixes: &[Vec<u32>],
    tolerance: f32,
    what: &str,
) {
    let ids = |t: &[u32]| -> Vec<i32> { t.iter().map(|&x| x as i32).collect() };
    let forward = |tokens: &[i32], cache: &mut KvCache| {
        model
            .forward(&Array::from_slice(tokens, &[1, tokens.len() as i32]), cache)
            .unwrap()
    };
    let mut shared = KvCache::new();
    forward(&ids(prefix), &mut shared);
    for (row, suffix) in suffixes.iter().enumerate() {
        let whole = ids(&[prefix, suffix.as_slice()].concat());
        let logits = forward(&whole, &mut KvCache::new());
        let d = largest_difference(&positions(&logits, 0, 0), &reference["whole"][row]);
        assert!(
            d <= tolerance,
            "{what}: row {row}, prefix and suffix in one forward, differs by {d}"
        );
        let logits = forward(&ids(suffix), &mut shared.fork(1).unwrap());
        let d = largest_difference(&positions(&logits, 0, 0), &reference["after_prefix"][row]);
        assert!(
            d <= tolerance,
            "{what}: row {row} after the prefix differs by {d}"
        );
    }
    let (logits, pads) = padded_forward(model, &shared, suffixes);
    for (row, pad) in pads.iter().enumerate() {
        let d = largest_difference(
            &positions(&logits, row as i32, *pad),
            &reference["after_prefix"][row],
        );
        assert!(
            d <= tolerance,
            "{what}: row {row} of the padded batch differs by {d}"
        );
    }
}

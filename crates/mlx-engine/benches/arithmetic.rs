//! What mlx_lm's arithmetic costs on this device (`cargo bench -p
//! mlx-engine --bench arithmetic`): one forward of a prompt through a
//! Gemma 4 with E2B's widths and bfloat16 scales (the published 4-bit's
//! layout) in four layers of every kind, timed with its evaluation,
//!
//! - ours with `QuantizedWeights::Keep`: packed weights, MLX's quantized
//!   product, bfloat16 activations: mlx_lm's numbers, bit for bit;
//! - ours with `QuantizedWeights::DequantizeOnUse` (the CPU default): each
//!   matrix dequantized to f32 just before a BLAS product;
//! - mlx_lm 0.32.2's own forward (`MLX_LOWMEM_PYTHON`, as `cargo xtask
//!   bench` sets it), when its Python is there,
//!
//! and how far the f32 logits are from mlx_lm's. Arguments: `--tokens N`
//! (56), `--runs N` (3; the median is reported, mlx_lm runs once).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use mlx_engine::{KvCache, Model, QuantizedWeights};
use mlx_rs::{Array, Dtype};

use test_support::gemma4_e2b as e2b;

const VOCAB: i32 = 512;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The checkpoint, made once under `target/`.
fn checkpoint() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/bench-models/gemma4-e2b-every-kind-bf16");
    if !dir.join("model.safetensors.index.json").exists() {
        let base = e2b::E2bBase {
            vocab: VOCAB,
            depth: e2b::Depth::EVERY_KIND,
            legacy_kv: false,
            ..e2b::E2bBase::default()
        };
        e2b::write(&dir, &base);
    }
    dir
}

fn prompt(n: usize) -> Vec<i32> {
    let mut state = 7u64;
    let mut ids = vec![2];
    ids.extend((1..n).map(|_| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        6 + ((state >> 33) % (VOCAB as u64 - 6)) as i32
    }));
    ids
}

/// The median seconds of `runs` forwards, and the last one's logits.
fn ours(dir: &Path, mode: QuantizedWeights, tokens: &[i32], runs: usize) -> (f64, Array) {
    let model = Model::loader(dir)
        .quantized(mode)
        .load()
        .expect("the bench checkpoint loads");
    let input = Array::from_slice(tokens, &[1, tokens.len() as i32]);
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..runs {
        let start = Instant::now();
        let logits = model
            .forward(&input, &mut KvCache::new())
            .and_then(|l| Ok(l.as_dtype(Dtype::Float32)?))
            .expect("forward");
        logits.eval().expect("eval");
        times.push(start.elapsed().as_secs_f64());
        last = Some(logits);
    }
    times.sort_by(f64::total_cmp);
    (times[times.len() / 2], last.expect("at least one run"))
}

const MLX_LM: &str = r#"
import json, sys, time
from pathlib import Path
newer = Path(sys.prefix) / "mlx-lm-0.32.2"
if newer.is_dir():
    sys.path.insert(0, str(newer))
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
model, _ = load_model(Path(sys.argv[1]))
tokens = json.loads(sys.argv[2])
start = time.perf_counter()
logits = model(mx.array([tokens]), cache=make_prompt_cache(model))
mx.eval(logits)
seconds = time.perf_counter() - start
mx.save_safetensors(sys.argv[3], {"logits": logits.astype(mx.float32)})
print(seconds)
"#;

fn largest_difference(a: &Array, b: &Array) -> f32 {
    let d = a
        .subtract(b)
        .and_then(|d| d.abs())
        .and_then(|d| d.max(None));
    let d = d.expect("same shapes");
    d.item_exact::<f32>()
}

fn main() {
    let n = arg("--tokens", 56);
    let runs = arg("--runs", 3).max(1);
    let dir = checkpoint();
    let tokens = prompt(n);
    println!(
        "Gemma 4, E2B's widths, 4 layers of every kind, bfloat16 scales; one forward of {n} tokens"
    );
    println!(
        "BLAS: {}, kernels {} (OPENBLAS_CORETYPE {}; ours and mlx_lm run under the same)",
        mlx_sys::BLAS,
        mlx_support::kernels_in_use().unwrap_or_else(|| "none (no OpenBLAS)".into()),
        std::env::var("OPENBLAS_CORETYPE").unwrap_or_else(|_| "unset".into())
    );
    let (keep, keep_logits) = ours(&dir, QuantizedWeights::Keep, &tokens, runs);
    let (f32_time, f32_logits) = ours(&dir, QuantizedWeights::DequantizeOnUse, &tokens, runs);
    println!(
        "ours, Keep (bfloat16, mlx_lm's arithmetic): {keep:.3} s ({:.3} s/token)",
        keep / n as f64
    );
    println!(
        "ours, DequantizeOnUse (f32, the CPU default): {f32_time:.3} s ({:.4} s/token)",
        f32_time / n as f64
    );
    let python = std::env::var("MLX_LOWMEM_PYTHON").unwrap_or_else(|_| "python3".into());
    let out_file = dir.join("mlx_lm_logits.safetensors");
    let run = Command::new(&python)
        .args(["-c", MLX_LM])
        .arg(&dir)
        .arg(serde_json::to_string(&tokens).expect("ids"))
        .arg(&out_file)
        .output();
    match run {
        Ok(o) if o.status.success() => {
            let seconds: f64 = String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse()
                .unwrap_or(f64::NAN);
            let theirs = Array::load_safetensors(&out_file).expect("mlx_lm's logits");
            let theirs = &theirs["logits"];
            println!(
                "mlx_lm 0.32.2: {seconds:.3} s ({:.3} s/token)",
                seconds / n as f64
            );
            println!(
                "largest logit difference from mlx_lm: Keep {}, DequantizeOnUse {}",
                largest_difference(&keep_logits, theirs),
                largest_difference(&f32_logits, theirs)
            );
        }
        _ => println!(
            "mlx_lm: skipped ({python} lacks mlx_lm; cargo xtask bench sets MLX_LOWMEM_PYTHON)"
        ),
    }
}

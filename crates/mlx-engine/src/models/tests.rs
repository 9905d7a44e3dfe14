//! The decoder against itself (cache, padding, batching) and against mlx_lm.
//! Inside the crate: they build masks and caches by hand, which the public
//! API does not offer.

use std::path::Path;
use std::process::Command;
use test_support::python::mlx_lm_python;
use test_support::tiny_llama::{normal, Norms, TinyLlama};

use crate::error::Error;
use crate::models::{Model, QuantizedWeights};
use crate::nn::cache::KvCache;
use crate::weights::kernels::Kernels;
use mlx_rs::{Array, Dtype};

/// A tiny random model of `model_type` in mlx_lm's format.
fn write_model(dir: &Path, model_type: &'static str) {
    TinyLlama {
        vocab: 50,
        seed: 100,
        embed_std: 0.5,
        weight_std: 0.15,
        norms: Norms::Random { std: 0.1 },
        config: serde_json::json!({"head_dim": 16, "max_position_embeddings": 512}),
        ..TinyLlama::new(model_type)
    }
    .write(dir);
}

fn last_logits(logits: &Array, row: i32) -> Vec<f32> {
    use mlx_rs::ops::indexing::IndexOp;
    let l = logits.dim(1);
    let v = logits.index((row, l - 1)).as_dtype(Dtype::Float32).unwrap();
    v.eval().unwrap();
    v.as_slice::<f32>().to_vec()
}

fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= tol, "{what}: max |difference| {worst} > {tol}");
}

/// The last position's logits of `ids` run alone, from an empty cache.
fn alone(model: &Model, ids: &[i32]) -> Vec<f32> {
    let logits = model.forward(&tokens(ids), &mut KvCache::new());
    last_logits(&logits.unwrap(), 0)
}

fn tokens(ids: &[i32]) -> Array {
    Array::from_slice(ids, &[1, ids.len() as i32])
}

const PROMPT: [i32; 7] = [3, 17, 42, 5, 9, 31, 2];

#[test]
fn cached_decoding_equals_the_full_prompt() {
    for arch in ["llama", "mistral", "qwen2", "qwen3"] {
        let dir = tempfile::tempdir().unwrap();
        write_model(dir.path(), arch);
        let model = Model::loader(dir.path())
            .quantized(QuantizedWeights::Keep)
            .load()
            .unwrap();
        let full = alone(&model, &PROMPT);
        // The first four positions, then one at a time.
        let mut cache = KvCache::new();
        model.forward(&tokens(&PROMPT[..4]), &mut cache).unwrap();
        let mut logits = None;
        for &t in &PROMPT[4..] {
            logits = Some(model.forward(&tokens(&[t]), &mut cache).unwrap());
        }
        assert_eq!(cache.len(), PROMPT.len() as i32);
        assert_close(&last_logits(&logits.unwrap(), 0), &full, 1e-4, arch);
    }
}

#[test]
fn last_position_logits_equal_the_full_forwards_last_row() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), "llama");
    let model = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    let batch = Array::from_slice(&[PROMPT, [7, 6, 5, 4, 3, 2, 1]].concat(), &[2, 7]);
    let full = model.forward(&batch, &mut KvCache::new()).unwrap();
    let mut cache = KvCache::new();
    let last = model.forward_last(&batch, &mut cache).unwrap();
    assert_eq!(last.shape(), &[2, full.dim(2)]);
    assert_eq!(cache.len(), 7);
    for row in 0..2 {
        use mlx_rs::ops::indexing::IndexOp;
        let got = last.index((row, ..));
        got.eval().unwrap();
        let got: Vec<f32> = got.as_slice::<f32>().to_vec();
        assert_close(&got, &last_logits(&full, row), 1e-5, "forward_last");
    }
}

#[test]
fn shared_prefix_cache_equals_the_full_prompt_for_every_row() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), "llama");
    let model = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    let prefix = [3, 17, 42];
    let mut shared = KvCache::new();
    model.forward(&tokens(&prefix), &mut shared).unwrap();
    // Two suffixes of equal length after the one shared prefix.
    let suffixes = [[5, 9, 31], [8, 8, 1]];
    let mut cache = shared.fork(2).unwrap();
    let batch = Array::from_slice(&[suffixes[0], suffixes[1]].concat(), &[2, 3]);
    let logits = model.forward(&batch, &mut cache).unwrap();
    for (row, suffix) in suffixes.iter().enumerate() {
        let full: Vec<i32> = prefix.iter().chain(suffix).copied().collect();
        let want = alone(&model, &full);
        assert_close(
            &last_logits(&logits, row as i32),
            &want,
            1e-4,
            &format!("row {row}"),
        );
    }
}

#[test]
fn left_padded_batch_equals_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), "qwen2");
    let model = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    let rows: [&[i32]; 3] = [&[4, 8, 15, 16, 23, 42], &[7, 1], &[9, 9, 9, 9]];
    let width = 6;
    let pads: Vec<usize> = rows.iter().map(|r| width - r.len()).collect();
    let padded: Vec<i32> = rows
        .iter()
        .flat_map(|r| std::iter::repeat_n(0, width - r.len()).chain(r.iter().copied()))
        .collect();
    let batch = Array::from_slice(&padded, &[3, width as i32]);
    let mut cache = KvCache::new();
    cache
        .set_pads(pads.iter().map(|&p| p as i32).collect())
        .unwrap();
    let logits = model.forward(&batch, &mut cache).unwrap();
    for (i, row) in rows.iter().enumerate() {
        let want = last_logits(
            &model.forward(&tokens(row), &mut KvCache::new()).unwrap(),
            0,
        );
        assert_close(
            &last_logits(&logits, i as i32),
            &want,
            1e-4,
            &format!("row {i}"),
        );
    }
}

/// A copy of the model in `dir` whose weights `plan` quantizes (key →
/// group size and bits, `None` to keep it), as mlx_lm saves them, with
/// `quantization` as its config's entry.
fn quantized_copy(
    dir: &Path,
    plan: impl Fn(&str) -> Option<(i32, i32)>,
    quantization: serde_json::Value,
) -> tempfile::TempDir {
    let set = st_mmap::SafetensorsSet::open_dir(dir).unwrap();
    let mut out = Vec::new();
    for key in set.keys() {
        let v = set.tensor(key).unwrap();
        let a = mlx_support::array_from_bytes(key, v.dtype, v.shape, v.data).unwrap();
        match plan(key) {
            Some((group, bits)) => {
                let (w, s, b) = mlx_rs::ops::quantize(&a, group, bits).unwrap();
                let base = key.trim_end_matches(".weight");
                out.extend([
                    (key.to_owned(), w),
                    (format!("{base}.scales"), s),
                    (format!("{base}.biases"), b),
                ]);
            }
            None => out.push((key.to_owned(), a)),
        }
    }
    drop(set);
    let qdir = tempfile::tempdir().unwrap();
    Array::save_safetensors(
        out.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        qdir.path().join("model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    config["quantization"] = quantization;
    std::fs::write(qdir.path().join("config.json"), config.to_string()).unwrap();
    qdir
}

#[test]
fn quantized_weights_kept_or_dequantized_agree() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), "llama");
    // Quantize every projection to 4 bits, group 32, as mlx_lm would.
    let qdir = quantized_copy(
        dir.path(),
        |key| key.ends_with("proj.weight").then_some((32, 4)),
        serde_json::json!({"group_size": 32, "bits": 4}),
    );

    let logits = |mode| {
        let model = Model::loader(qdir.path()).quantized(mode).load().unwrap();
        let logits = model.forward(&tokens(&PROMPT), &mut KvCache::new());
        last_logits(&logits.unwrap(), 0)
    };
    let kept = logits(QuantizedWeights::Keep);
    let on_use = logits(QuantizedWeights::DequantizeOnUse);
    let dense = logits(QuantizedWeights::DequantizeF32);
    assert_close(
        &kept,
        &dense,
        1e-3,
        "quantized matmul vs dequantized at load",
    );
    // The same f32 matrices, dequantized at load or before each product;
    // only the operand layout differs (a transposed view against a
    // contiguous transpose), so BLAS may sum in another order: OpenBLAS's
    // Zen kernels differ by 6e-6 here, Haswell's by less than 1e-6.
    assert_close(&on_use, &dense, 2e-5, "dequantized on use vs at load");
}

#[test]
fn unknown_architecture_lists_the_supported_ones() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), "llama");
    let config = std::fs::read_to_string(dir.path().join("config.json"))
        .unwrap()
        .replace("\"llama\"", "\"gpt_neox\"");
    std::fs::write(dir.path().join("config.json"), config).unwrap();
    let err = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap_err();
    assert!(
        matches!(&err, Error::UnsupportedArchitecture { model_type, supported } if model_type == "gpt_neox" && supported.contains(&"qwen3")),
        "{err}"
    );
}

/// mlx_lm's last-position logits for `PROMPT` on the model in `dir`.
fn mlx_lm_logits(python: &str, dir: &Path) -> Vec<f32> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/mlx_lm_logits.py");
    let out = Command::new(python)
        .arg(&script)
        .arg(dir)
        .args(PROMPT.iter().map(|t| t.to_string()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Same logits as mlx_lm's own implementation of each architecture.
#[test]
fn logits_match_mlx_lm() {
    let Some(python) = mlx_lm_python("logits_match_mlx_lm") else {
        return;
    };
    for arch in ["llama", "mistral", "qwen2", "qwen3"] {
        let dir = tempfile::tempdir().unwrap();
        write_model(dir.path(), arch);
        let theirs = mlx_lm_logits(&python, dir.path());
        // Both ways: the few-rows kernel where this CPU has it, and MLX's
        // products alone (what every other machine runs).
        for kernels in [Kernels::Native, Kernels::Portable] {
            let model = Model::loader(dir.path())
                .quantized(QuantizedWeights::Keep)
                .kernels(kernels)
                .load()
                .unwrap();
            let ours = alone(&model, &PROMPT);
            assert_close(
                &ours,
                &theirs,
                1e-4,
                &format!("{arch} ({kernels:?} kernels) vs mlx_lm"),
            );
        }
    }
}

/// Per-row rotary offsets (used for padded batches) equal row-by-row rope.
#[test]
fn rope_with_per_row_offsets_equals_row_by_row() {
    use mlx_rs::fast;
    use mlx_rs::ops::indexing::IndexOp;
    let x = normal(&[2, 2, 3, 8], 5, 1.0);
    let offsets = Array::from_slice(&[0i32, 5], &[2]);
    let both = fast::rope_dynamic(&x, 8, false, 10000.0, 1.0, &offsets, None).unwrap();
    for (row, off) in [(0, 0), (1, 5)] {
        let one = fast::rope(x.index(row..row + 1), 8, false, 10000.0, 1.0, off, None).unwrap();
        let got = both.index(row..row + 1);
        let diff = got
            .subtract(&one)
            .unwrap()
            .abs()
            .unwrap()
            .max(None)
            .unwrap();
        diff.eval().unwrap();
        assert!(
            diff.item_exact::<f32>() < 1e-5,
            "row {row}: rope_dynamic differs by {}",
            diff.item_exact::<f32>()
        );
    }
}

/// Rows of different lengths after a shared prefix, padded between prefix
/// and suffix, equal each row run alone: the engine's batching.
#[test]
fn padded_suffixes_after_a_shared_prefix_equal_each_row_alone() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), "llama");
    let model = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    let prefix = [3, 17, 42, 8];
    let mut shared = KvCache::new();
    model.forward(&tokens(&prefix), &mut shared).unwrap();
    let rows: [&[i32]; 4] = [&[5, 9], &[8, 8, 1, 2, 3], &[7], &[11, 12, 13]];
    let width = 5;
    let pads: Vec<usize> = rows.iter().map(|r| width - r.len()).collect();
    let block: Vec<i32> = rows
        .iter()
        .flat_map(|r| std::iter::repeat_n(0, width - r.len()).chain(r.iter().copied()))
        .collect();
    let mut cache = shared.fork(4).unwrap();
    cache
        .set_pads(pads.iter().map(|&p| p as i32).collect())
        .unwrap();
    let logits = model
        .forward(&Array::from_slice(&block, &[4, width as i32]), &mut cache)
        .unwrap();
    for (i, row) in rows.iter().enumerate() {
        let full: Vec<i32> = prefix.iter().chain(row.iter()).copied().collect();
        let want = alone(&model, &full);
        assert_close(
            &last_logits(&logits, i as i32),
            &want,
            1e-4,
            &format!("row {i}"),
        );
    }
}

/// A padded prefill over a fork that discards the rows' keys and values
/// (what a classification runs) gives the logits of one that keeps them,
/// bit for bit, for a model with separate and with tied output weights.
#[test]
fn a_prefill_that_keeps_no_keys_gives_the_same_logits() {
    for model_type in ["llama", "mistral"] {
        let dir = tempfile::tempdir().unwrap();
        write_model(dir.path(), model_type);
        let model = Model::loader(dir.path())
            .quantized(QuantizedWeights::Keep)
            .load()
            .unwrap();
        let mut shared = KvCache::new();
        model
            .forward(&tokens(&[3, 17, 42, 8]), &mut shared)
            .unwrap();
        let block = Array::from_slice(&[0, 0, 5, 9, 8, 8, 1, 2, 0, 0, 0, 7], &[3, 4]);
        let logits = |discard: bool| -> Vec<u32> {
            let mut cache = shared.fork(3).unwrap();
            cache.set_pads(vec![2, 0, 3]).unwrap();
            if discard {
                cache.discard_owned();
            }
            let logits = model.forward_last(&block, &mut cache).unwrap();
            logits.eval().unwrap();
            logits
                .as_slice::<f32>()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert!(logits(true) == logits(false), "{model_type}");
    }
}

/// Rows prefilled apart (no padding) and stacked into one cache decode as
/// each row would alone, step after step: the stack left-pads the shorter
/// after the shared prefix; decoding fills its one spare slot in place,
/// then grows the cache, then appends in place again.
#[test]
fn stacked_caches_decode_like_each_row_alone() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), "qwen2");
    let model = Model::loader(dir.path())
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    let prefix = [3, 17, 42, 8];
    let mut shared = KvCache::new();
    model.forward(&tokens(&prefix), &mut shared).unwrap();
    let rows: [&[i32]; 3] = [&[5, 9], &[8, 8, 1, 2, 3], &[7]];
    let parts: Vec<KvCache> = rows
        .iter()
        .map(|row| {
            let mut cache = shared.fork(1).unwrap();
            model.forward(&tokens(row), &mut cache).unwrap();
            cache
        })
        .collect();
    let mut cache = KvCache::stack(parts, 1).unwrap();
    assert_eq!(cache.len(), (prefix.len() + 5) as i32);
    assert_eq!(cache.own_len(), 5);
    assert_eq!(cache.pads(), [3, 0, 4]);
    let mut seen: Vec<Vec<i32>> = rows
        .iter()
        .map(|row| prefix.iter().chain(row.iter()).copied().collect())
        .collect();
    for step in 0..4 {
        let next: Vec<i32> = (0..3).map(|i| 20 + 3 * step + i).collect();
        let logits = model
            .forward(&Array::from_slice(&next, &[3, 1]), &mut cache)
            .unwrap();
        for (i, full) in seen.iter_mut().enumerate() {
            full.push(next[i]);
            assert_close(
                &last_logits(&logits, i as i32),
                &alone(&model, full),
                1e-4,
                &format!("step {step}, row {i}"),
            );
        }
    }
}

/// A mixed-precision checkpoint as mlx_lm writes one (the "UD" models): a
/// 4-bit group-32 default, one module at 8 bits in groups of 64 by its own
/// `quantization` entry, one left in float by `false`, and a quantized
/// embedding table. Our logits equal mlx_lm's on it; before the engine read
/// per-module entries it loaded such a model with the default everywhere.
#[test]
fn mixed_precision_checkpoints_match_mlx_lm() {
    let Some(python) = mlx_lm_python("mixed_precision_checkpoints_match_mlx_lm") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), "llama");
    let eight = "model.layers.0.self_attn.q_proj";
    let float = "model.layers.1.mlp.down_proj";
    let qdir = quantized_copy(
        dir.path(),
        |key| {
            let base = key.trim_end_matches(".weight");
            let quantized = key.ends_with("proj.weight") || key == "model.embed_tokens.weight";
            match (quantized, base) {
                (false, _) => None,
                (true, b) if b == float => None,
                (true, b) if b == eight => Some((64, 8)),
                (true, _) => Some((32, 4)),
            }
        },
        serde_json::json!({
            "group_size": 32, "bits": 4,
            eight: {"group_size": 64, "bits": 8},
            float: false,
        }),
    );

    let model = Model::loader(qdir.path())
        .quantized(QuantizedWeights::DequantizeOnUse)
        .load()
        .unwrap();
    let ours = alone(&model, &PROMPT);
    let theirs = mlx_lm_logits(&python, qdir.path());
    assert_close(&ours, &theirs, 1e-4, "mixed precision vs mlx_lm");
}

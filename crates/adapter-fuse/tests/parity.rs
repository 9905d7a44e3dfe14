//! Bit-exact parity with mlx_lm's own fuse (`LoRALinear.fuse`), run by
//! `tests/parity/mlx_lm_fuse.py` in the Python that `cargo xtask test`
//! provides (mlx 0.32.2 + mlx-lm 0.31.3, with the same BLAS as our build:
//! matmul rounding depends on the BLAS, and with different ones the dense
//! cases differ in the last bit). Skips, saying so, without it.

use std::path::{Path, PathBuf};
use std::process::Command;

use adapter_codec::AdapterCodec;
use mlx_rs::{Array, Dtype};
use st_mmap::SafetensorsFile;

const MODULE: &str = "model.layers.3.mlp.down_proj";
const SCALE: f32 = 20.0;

fn python() -> Option<String> {
    let python = std::env::var("MLX_LOWMEM_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import mlx_lm, mlx.core"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(python)
}

fn random(shape: &[i32], seed: u64, std: f32) -> Array {
    let key = mlx_rs::random::key(seed).unwrap();
    mlx_rs::random::normal::<f32>(shape, None, std, &key).unwrap()
}

/// Builds base and adapter, fuses both ways, and compares every byte.
fn parity(case: &str, dtype: Dtype, adapter_dtype: Dtype, quant: Option<(i32, i32)>) {
    let Some(python) = python() else {
        eprintln!("SKIP mlx_lm parity ({case}): no Python with mlx and mlx_lm (cargo xtask test provides one)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("hub");
    let base_dir = dir.path().join("base");
    let adapter_dir = dir.path().join("adapter");
    for d in [&root, &base_dir, &adapter_dir] {
        std::fs::create_dir_all(d).unwrap();
    }
    let (out_dims, in_dims, rank) = (96, 256, 8);
    let w = random(&[out_dims, in_dims], 1, 0.05)
        .as_dtype(dtype)
        .unwrap();
    let bias = random(&[out_dims], 2, 0.05).as_dtype(dtype).unwrap();
    let mut base: Vec<(String, Array)> = vec![(format!("{MODULE}.bias"), bias)];
    let mut config = serde_json::json!({"model_type": "llama"});
    match quant {
        Some((group, bits)) => {
            let (qw, qs, qb) = mlx_rs::ops::quantize(&w, group, bits).unwrap();
            base.extend([
                (format!("{MODULE}.weight"), qw),
                (format!("{MODULE}.scales"), qs),
                (format!("{MODULE}.biases"), qb),
            ]);
            config["quantization"] = serde_json::json!({"group_size": group, "bits": bits});
        }
        None => base.push((format!("{MODULE}.weight"), w)),
    }
    let base_file = base_dir.join("model.safetensors");
    Array::save_safetensors(base.iter().map(|(k, v)| (k.as_str(), v)), None, &base_file).unwrap();
    std::fs::write(base_dir.join("config.json"), config.to_string()).unwrap();

    let a = random(&[in_dims, rank], 3, 0.02)
        .as_dtype(adapter_dtype)
        .unwrap();
    let b = random(&[rank, out_dims], 4, 0.02)
        .as_dtype(adapter_dtype)
        .unwrap();
    let adapter_file = adapter_dir.join("adapters.safetensors");
    let pairs = [
        (format!("{MODULE}.lora_a"), a),
        (format!("{MODULE}.lora_b"), b),
    ];
    Array::save_safetensors(
        pairs.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        &adapter_file,
    )
    .unwrap();
    std::fs::write(
        adapter_dir.join("adapter_config.json"),
        format!(r#"{{"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": {{"rank": {rank}, "scale": {SCALE}, "dropout": 0.0}}}}"#),
    )
    .unwrap();
    let codec = AdapterCodec::new(
        adapter_dir.join("adapters.safetensors.zst"),
        adapter_dir.join("adapter_config.json"),
    );
    codec.encode(&adapter_file).unwrap();

    let ours = adapter_fuse::FuseOptions::from_env()
        .with_cache_root(&root)
        .ensure_fused(base_dir.to_str().unwrap(), &codec, "parity--fused")
        .unwrap();
    let reference = dir.path().join("reference.safetensors");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/mlx_lm_fuse.py");
    let (group, bits) = quant.unwrap_or((0, 0));
    let out = Command::new(&python)
        .arg(&script)
        .args([base_file.as_path(), adapter_file.as_path()])
        .arg(MODULE)
        .args([SCALE.to_string(), group.to_string(), bits.to_string()])
        .arg(&reference)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let ours = SafetensorsFile::open(PathBuf::from(&ours).join("model.safetensors")).unwrap();
    let theirs = SafetensorsFile::open(&reference).unwrap();
    let mut compared = 0;
    for t in theirs.tensors() {
        let mine = ours
            .tensor(t.name)
            .unwrap_or_else(|| panic!("{case}: we lack {}", t.name));
        assert_eq!(
            (mine.dtype, mine.shape),
            (t.dtype, t.shape),
            "{case}: {}",
            t.name
        );
        assert!(
            mine.data == t.data,
            "{case}: {} differs from mlx_lm's",
            t.name
        );
        compared += 1;
    }
    assert_eq!(
        compared,
        if quant.is_some() { 4 } else { 2 },
        "{case}: tensors compared"
    );
}

#[test]
fn dense_f32_matches_mlx_lm() {
    parity("f32", Dtype::Float32, Dtype::Float32, None);
}

#[test]
fn dense_bf16_matches_mlx_lm() {
    parity("bf16", Dtype::Bfloat16, Dtype::Float32, None);
}

#[test]
fn quantized_4bit_matches_mlx_lm() {
    parity("4-bit", Dtype::Float32, Dtype::Float32, Some((64, 4)));
}

#[test]
fn quantized_8bit_bf16_scales_matches_mlx_lm() {
    parity("8-bit bf16", Dtype::Bfloat16, Dtype::Float32, Some((32, 8)));
}

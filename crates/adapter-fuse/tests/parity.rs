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
use test_support::python::python_with;

const MODULE: &str = "model.layers.3.mlp.down_proj";
const SCALE: f32 = 20.0;

fn random(shape: &[i32], seed: u64, std: f32) -> Array {
    let key = mlx_rs::random::key(seed).unwrap();
    mlx_rs::random::normal::<f32>(shape, None, std, &key).unwrap()
}

/// A base model of one linear and an adapter for it, written into a
/// temporary folder.
struct Case {
    dir: tempfile::TempDir,
    quant: Option<(i32, i32)>,
}

impl Case {
    fn base_dir(&self) -> PathBuf {
        self.dir.path().join("base")
    }

    fn adapter_dir(&self) -> PathBuf {
        self.dir.path().join("adapter")
    }

    fn write(dtype: Dtype, adapter_dtype: Dtype, quant: Option<(i32, i32)>) -> Case {
        let case = Case {
            dir: tempfile::tempdir().unwrap(),
            quant,
        };
        let (base_dir, adapter_dir) = (case.base_dir(), case.adapter_dir());
        for d in [&base_dir, &adapter_dir] {
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
        Array::save_safetensors(base.iter().map(|(k, v)| (k.as_str(), v)), None, &base_file)
            .unwrap();
        std::fs::write(base_dir.join("config.json"), config.to_string()).unwrap();

        let a = random(&[in_dims, rank], 3, 0.02)
            .as_dtype(adapter_dtype)
            .unwrap();
        let b = random(&[rank, out_dims], 4, 0.02)
            .as_dtype(adapter_dtype)
            .unwrap();
        let pairs = [
            (format!("{MODULE}.lora_a"), a),
            (format!("{MODULE}.lora_b"), b),
        ];
        Array::save_safetensors(
            pairs.iter().map(|(k, v)| (k.as_str(), v)),
            None,
            adapter_dir.join("adapters.safetensors"),
        )
        .unwrap();
        std::fs::write(
            adapter_dir.join("adapter_config.json"),
            format!(r#"{{"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": {{"rank": {rank}, "scale": {SCALE}, "dropout": 0.0}}}}"#),
        )
        .unwrap();
        case
    }

    /// mlx_lm's fuse of the case, by `python`, with `env` set for it.
    fn reference(&self, python: &str, env: &[(&str, &str)]) -> PathBuf {
        let reference = self.dir.path().join("reference.safetensors");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/mlx_lm_fuse.py");
        let (group, bits) = self.quant.unwrap_or((0, 0));
        let out = Command::new(python)
            .arg(&script)
            .arg(self.base_dir().join("model.safetensors"))
            .arg(self.adapter_dir().join("adapters.safetensors"))
            .arg(MODULE)
            .args([SCALE.to_string(), group.to_string(), bits.to_string()])
            .arg(&reference)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        reference
    }

    /// Every tensor of mlx_lm's `reference` equals ours in the fused
    /// folder `fused`, byte for byte.
    fn compare(&self, what: &str, fused: &Path, reference: &Path) {
        let ours = SafetensorsFile::open(fused.join("model.safetensors")).unwrap();
        let theirs = SafetensorsFile::open(reference).unwrap();
        let mut compared = 0;
        for t in theirs.tensors() {
            let mine = ours
                .tensor(t.name)
                .unwrap_or_else(|| panic!("{what}: we lack {}", t.name));
            assert_eq!(
                (mine.dtype, mine.shape),
                (t.dtype, t.shape),
                "{what}: {}",
                t.name
            );
            assert!(
                mine.data == t.data,
                "{what}: {} differs from mlx_lm's",
                t.name
            );
            compared += 1;
        }
        assert_eq!(
            compared,
            if self.quant.is_some() { 4 } else { 2 },
            "{what}: tensors compared"
        );
    }
}

/// Builds base and adapter, fuses both ways, and compares every byte.
fn parity(case: &str, dtype: Dtype, adapter_dtype: Dtype, quant: Option<(i32, i32)>) {
    let Some(python) = python_with(&format!("mlx_lm parity ({case})"), "mlx_lm, mlx.core") else {
        return;
    };
    let c = Case::write(dtype, adapter_dtype, quant);
    let codec = AdapterCodec::new(
        c.adapter_dir().join("adapters.safetensors.zst"),
        c.adapter_dir().join("adapter_config.json"),
    );
    codec
        .encode(c.adapter_dir().join("adapters.safetensors"))
        .unwrap();
    let ours = adapter_fuse::Fuse::new(c.base_dir().to_str().unwrap(), &codec, "parity--fused")
        .options(&adapter_fuse::FuseOptions::from_env().with_cache_root(c.dir.path().join("hub")))
        .run()
        .unwrap();
    let reference = c.reference(&python, &[]);
    c.compare(case, &ours, &reference);
}

/// The `fuse` example, built by `cargo test` beside this test.
fn fuse_example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = profile
        .join("examples")
        .join(format!("fuse{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "{} is missing: `cargo test` builds it",
        path.display()
    );
    path
}

/// What a user comparing with the stock Python original on Linux sets:
/// OpenBLAS's generic kernels, whose products round as the reference BLAS
/// in the `mlx[cpu]` wheel does (no fused multiply-adds). Both sides run
/// in child processes with `OPENBLAS_CORETYPE=PRESCOTT`, whatever kernels
/// this machine would pick, and give the same bytes.
#[test]
fn under_openblas_generic_kernels_the_fused_bytes_are_mlx_lms() {
    let test = "under_openblas_generic_kernels_the_fused_bytes_are_mlx_lms";
    let Some(python) = python_with(test, "mlx_lm, mlx.core") else {
        return;
    };
    let generic = [("OPENBLAS_CORETYPE", "PRESCOTT")];
    for (what, dtype, quant) in [
        ("f32", Dtype::Float32, None),
        ("4-bit", Dtype::Float32, Some((64, 4))),
    ] {
        let c = Case::write(dtype, Dtype::Float32, quant);
        let hub = c.dir.path().join("hub");
        let out = Command::new(fuse_example())
            .arg(c.base_dir())
            .arg(c.adapter_dir())
            .env("HF_HUB_CACHE", &hub)
            .envs(generic)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{what}: the fuse example failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let fused = stdout
            .lines()
            .find_map(|l| l.strip_prefix("first call: fused in ")?.split(" → ").nth(1))
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("{what}: the example names its fused folder: {stdout}"));
        assert!(fused.starts_with(&hub), "{what}: {}", fused.display());
        let reference = c.reference(&python, &generic);
        c.compare(&format!("{what}, generic kernels"), &fused, &reference);
    }
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

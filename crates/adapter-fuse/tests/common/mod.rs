//! Test helpers shared by the adapter-fuse integration tests: a hub cache
//! laid out as Python leaves it, a one-module base and its adapter.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};

use adapter_codec::AdapterCodec;
use st_mmap::SafetensorsFile;

pub const REPO: &str = "org/base";
pub const NS: &str = "org--fused";
pub const IN: usize = 64;
pub const OUT: usize = 32;
pub const RANK: usize = 4;
pub const SCALE: f32 = 2.0;
pub const Q: &str = "model.layers.0.self_attn.q_proj";

pub fn values(seed: u32, n: usize, amplitude: f32) -> Vec<f32> {
    (0..n)
        .map(|k| {
            (((k as u32).wrapping_mul(2654435761u32) ^ seed) % 1000) as f32 / 1000.0
                * 2.0
                * amplitude
                - amplitude
        })
        .collect()
}

/// Puts `files` into `root` as huggingface_hub does: content in `blobs/`,
/// relative symlinks in `snapshots/{rev}/`, the revision in `refs/main`.
pub fn put_in_hub_cache(root: &Path, repo: &str, files: &[(&str, Vec<u8>)]) {
    let folder = root.join(format!("models--{}", repo.replace('/', "--")));
    let rev = "0123456789abcdef0123456789abcdef01234567";
    std::fs::create_dir_all(folder.join("blobs")).unwrap();
    std::fs::create_dir_all(folder.join("snapshots").join(rev)).unwrap();
    std::fs::create_dir_all(folder.join("refs")).unwrap();
    for (i, (name, bytes)) in files.iter().enumerate() {
        let blob = format!("blob{i:04}");
        std::fs::write(folder.join("blobs").join(&blob), bytes).unwrap();
        std::os::unix::fs::symlink(
            format!("../../blobs/{blob}"),
            folder.join("snapshots").join(rev).join(name),
        )
        .unwrap();
    }
    std::fs::write(folder.join("refs/main"), rev).unwrap();
}

pub fn safetensors_bytes(tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(k, d, s, b)| {
            (
                k.to_string(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The adapter: `Q.lora_a` (IN, RANK) and `Q.lora_b` (RANK, OUT), f32.
pub fn adapter(dir: &Path, config: &str) -> (AdapterCodec, Vec<f32>, Vec<f32>) {
    adapter_with_b(dir, values(12, RANK * OUT, 0.5), config)
}

/// [`adapter`] with `b` as the values of `lora_b`.
pub fn adapter_with_b(dir: &Path, b: Vec<f32>, config: &str) -> (AdapterCodec, Vec<f32>, Vec<f32>) {
    let a = values(11, IN * RANK, 0.5);
    let bytes = safetensors_bytes(&[
        (
            &format!("{Q}.lora_a"),
            safetensors::Dtype::F32,
            vec![IN, RANK],
            f32_bytes(&a),
        ),
        (
            &format!("{Q}.lora_b"),
            safetensors::Dtype::F32,
            vec![RANK, OUT],
            f32_bytes(&b),
        ),
    ]);
    (encode_adapter(dir, bytes, config), a, b)
}

/// Writes an mlx_lm adapter (`adapters.safetensors` from `weights`, and
/// `adapter_config.json`) into `dir` and encodes it beside itself.
pub fn encode_adapter(dir: &Path, weights: Vec<u8>, config: &str) -> AdapterCodec {
    std::fs::write(dir.join("adapters.safetensors"), weights).unwrap();
    std::fs::write(dir.join("adapter_config.json"), config).unwrap();
    let codec = AdapterCodec::new(
        dir.join("adapters.safetensors.zst"),
        dir.join("adapter_config.json"),
    );
    codec.encode(dir.join("adapters.safetensors")).unwrap();
    codec
}

pub const CONFIG: &str = r#"{"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}}"#;

/// `(scale · Bᵀ) @ Aᵀ`, shape (OUT, IN), in f64.
pub fn delta(a: &[f32], b: &[f32]) -> Vec<f64> {
    let mut d = vec![0.0f64; OUT * IN];
    for o in 0..OUT {
        for i in 0..IN {
            d[o * IN + i] = (0..RANK)
                .map(|r| f64::from(SCALE * b[r * OUT + o]) * f64::from(a[i * RANK + r]))
                .sum();
        }
    }
    d
}

pub fn read_f32(file: &SafetensorsFile, key: &str) -> Vec<f32> {
    file.tensor(key)
        .unwrap()
        .data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub struct Setup {
    pub _dir: tempfile::TempDir,
    pub root: PathBuf,
    pub adapter_dir: PathBuf,
    /// The fuse's options: the cache at `root`, never the network.
    pub options: adapter_fuse::FuseOptions,
}

pub fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("hub");
    let adapter_dir = dir.path().join("adapter");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&adapter_dir).unwrap();
    let options = adapter_fuse::FuseOptions::from_env()
        .with_cache_root(&root)
        .with_offline(true);
    Setup {
        _dir: dir,
        root,
        adapter_dir,
        options,
    }
}

pub fn dense_base(root: &Path) -> (Vec<f32>, Vec<f32>) {
    let w = values(1, OUT * IN, 1.0);
    let bias = values(2, OUT, 1.0);
    let weights = safetensors_bytes(&[
        (
            &format!("{Q}.weight"),
            safetensors::Dtype::F32,
            vec![OUT, IN],
            f32_bytes(&w),
        ),
        (
            &format!("{Q}.bias"),
            safetensors::Dtype::F32,
            vec![OUT],
            f32_bytes(&bias),
        ),
        (
            "model.norm.weight",
            safetensors::Dtype::F32,
            vec![IN],
            f32_bytes(&values(3, IN, 1.0)),
        ),
    ]);
    put_in_hub_cache(
        root,
        REPO,
        &[
            ("config.json", br#"{"model_type": "llama"}"#.to_vec()),
            ("model.safetensors", weights),
            ("tokenizer.json", b"{}".to_vec()),
            ("generation_config.json", br#"{"eos_token_id": 2}"#.to_vec()),
        ],
    );
    (w, bias)
}

//! Builders for adapter files in tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use adapter_codec::AdapterCodec;

/// A safetensors file from a raw JSON header and body.
pub fn raw_file(json: &str, body: &[u8]) -> Vec<u8> {
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.extend_from_slice(body);
    bytes
}

/// A valid adapter: `tensors` of (name, dtype, element count), written by the
/// `safetensors` crate, with deterministic trained-looking bytes.
pub fn adapter(tensors: &[(&str, safetensors::Dtype, usize)]) -> Vec<u8> {
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .enumerate()
        .map(|(k, (_, dtype, n))| {
            let size = dtype.bitsize() / 8;
            (0..n * size)
                .map(|b| {
                    if b % size == size - 1 {
                        0x3c
                    } else {
                        (b * 31 + k * 7) as u8
                    }
                })
                .collect()
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&data)
        .map(|((name, dtype, n), d)| {
            (
                name.to_string(),
                safetensors::tensor::TensorView::new(*dtype, vec![*n], d).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// A folder with `adapters.safetensors` holding `bytes`, and a codec bound
/// to `adapters.safetensors.zst` + `adapter_config.json` in it.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub src: PathBuf,
    pub codec: AdapterCodec,
}

pub fn fixture(bytes: &[u8]) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("adapters.safetensors");
    std::fs::write(&src, bytes).unwrap();
    std::fs::write(
        dir.path().join("adapter_config.json"),
        br#"{"fine_tune_type":"lora"}"#,
    )
    .unwrap();
    let codec = AdapterCodec::new(
        dir.path().join("adapters.safetensors.zst"),
        dir.path().join("adapter_config.json"),
    );
    Fixture { dir, src, codec }
}

/// Files in `dir`, names only, sorted.
pub fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The interop Python (`cargo xtask test` provides one), or `None`, said on
/// stderr, when it cannot `import zstandard`.
pub fn python_with_zstandard(test: &str) -> Option<String> {
    let python = std::env::var("MLX_LOWMEM_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = std::process::Command::new(&python)
        .args(["-c", "import zstandard"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        eprintln!("SKIP {test}: {python} lacks `zstandard`");
    }
    has.then_some(python)
}

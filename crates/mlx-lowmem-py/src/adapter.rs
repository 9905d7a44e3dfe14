//! The adapter codec and the fuse, as functions of the codec's two files
//! (the Python `AdapterCodec` keeps them as class attributes, which its
//! subclasses override).

use std::path::PathBuf;

use adapter_codec::AdapterCodec;
use adapter_fuse::{Fuse, FuseProgress};
use pyo3::prelude::*;

use crate::errors;

fn codec(zst: PathBuf, config: PathBuf) -> AdapterCodec {
    AdapterCodec::new(zst, config)
}

/// Compresses the safetensors adapter `src` into `zst` at zstd `level`;
/// returns (bytes in, bytes out).
#[pyfunction]
pub(crate) fn codec_encode(
    py: Python<'_>,
    zst: PathBuf,
    config: PathBuf,
    src: PathBuf,
    level: i32,
) -> PyResult<(u64, u64)> {
    py.detach(|| {
        let codec = codec(zst, config).with_level(level)?;
        let stats = codec.encode(&src)?;
        Ok((stats.raw_bytes, stats.compressed_bytes))
    })
    .map_err(|e: adapter_codec::Error| errors::codec(&e))
}

/// Restores the adapter compressed in `zst` into `dst`; returns its size.
#[pyfunction]
pub(crate) fn codec_decode(
    py: Python<'_>,
    zst: PathBuf,
    config: PathBuf,
    dst: PathBuf,
) -> PyResult<u64> {
    py.detach(|| codec(zst, config).decode(&dst).map(|s| s.bytes))
        .map_err(|e| errors::codec(&e))
}

/// The first 16 hex digits of the SHA-256 of `zst`.
#[pyfunction]
pub(crate) fn codec_digest(py: Python<'_>, zst: PathBuf, config: PathBuf) -> PyResult<String> {
    py.detach(|| codec(zst, config).digest())
        .map_err(|e| errors::codec(&e))
}

/// The safetensors dtype all the compressed adapter's tensors share.
#[pyfunction]
pub(crate) fn codec_dtype(py: Python<'_>, zst: PathBuf, config: PathBuf) -> PyResult<String> {
    py.detach(|| codec(zst, config).dtype().map(|d| d.to_string()))
        .map_err(|e| errors::codec(&e))
}

/// Fuses the codec's adapter into `model_repo` into the hub cache entry
/// `models--{cache_namespace}-{digest}` (a hit returns at once); returns
/// the snapshot folder. `on_event(kind, *details)` is called on this
/// thread with the GIL for each step: ("hit",), ("waiting",),
/// ("downloading", file), ("downloaded", file, bytes, total bytes),
/// ("fusing", done, total), ("published",).
#[pyfunction]
#[pyo3(signature = (model_repo, zst, config, cache_namespace, on_event = None))]
pub(crate) fn fuse(
    py: Python<'_>,
    model_repo: String,
    zst: PathBuf,
    config: PathBuf,
    cache_namespace: String,
    on_event: Option<Py<PyAny>>,
) -> PyResult<PathBuf> {
    let codec = codec(zst, config);
    let mut failed_callback: Option<PyErr> = None;
    let fused = py.detach(|| {
        let report = |event: FuseProgress| {
            let Some(callback) = &on_event else { return };
            Python::attach(|py| {
                let called = match event {
                    FuseProgress::Hit => callback.call1(py, ("hit",)),
                    FuseProgress::Waiting => callback.call1(py, ("waiting",)),
                    FuseProgress::Downloading(file) => callback.call1(py, ("downloading", file)),
                    FuseProgress::Downloaded { file, done, total } => {
                        callback.call1(py, ("downloaded", file, done, total))
                    }
                    FuseProgress::Fusing { done, total } => {
                        callback.call1(py, ("fusing", done, total))
                    }
                    FuseProgress::Published => callback.call1(py, ("published",)),
                    _ => return,
                };
                if let Err(e) = called {
                    failed_callback.get_or_insert(e);
                }
            })
        };
        Fuse::new(&model_repo, &codec, &cache_namespace)
            .progress(report)
            .run()
    });
    let fused = fused.map_err(|e| errors::fuse(&e))?;
    // The fuse is complete and cached; a progress display that failed is
    // reported after it, not in its middle.
    match failed_callback {
        Some(e) => Err(e),
        None => Ok(fused),
    }
}

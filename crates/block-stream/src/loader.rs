//! Tensors as MLX's own lazy loads: each is read from the file straight into
//! the MLX buffer that holds it, when it is first evaluated.
//!
//! Why this path and not a memory map: on MLX's CPU backend an array cannot
//! use foreign memory, so a mapped tensor is faulted in and then copied,
//! while MLX's loader reads it once (`pread`, on its own I/O threads) into
//! the buffer the array keeps. docs/block-stream.md has the measurements.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};

use crate::error::{Error, Result};

/// One weights file's tensors as unevaluated MLX loads.
///
/// A tensor handed out is removed from the map, so that once evaluated its
/// buffer belongs to whoever holds the array and dies with it; asking for it
/// again re-reads the file's header and makes fresh loads (cheap: nothing is
/// read until evaluated).
#[derive(Debug)]
pub(crate) struct LazyFile {
    path: PathBuf,
    loads: HashMap<String, Array>,
}

impl LazyFile {
    pub(crate) fn new(path: &Path) -> LazyFile {
        LazyFile {
            path: path.to_path_buf(),
            loads: HashMap::new(),
        }
    }

    /// `key`'s tensor as a lazy load, checked against the shape and dtype
    /// that our own header validation found.
    pub(crate) fn take(&mut self, key: &str, shape: &[i32], dtype: Dtype) -> Result<Array> {
        if !self.loads.contains_key(key) {
            let _span = tracing::debug_span!("load_header", path = %self.path.display()).entered();
            self.loads = Array::load_safetensors(&self.path).map_err(|e| self.error(key, e))?;
        }
        let array = self
            .loads
            .remove(key)
            .ok_or_else(|| self.error(key, "MLX's loader does not list it"))?;
        if array.shape() != shape || array.dtype() != dtype {
            return Err(self.error(
                key,
                format!(
                    "MLX's loader reads it as {:?} {:?}, the header says {dtype:?} {shape:?}",
                    array.dtype(),
                    array.shape()
                ),
            ));
        }
        Ok(array)
    }

    fn error(&self, key: &str, message: impl std::fmt::Display) -> Error {
        Error::Load {
            path: self.path.clone(),
            key: key.to_owned(),
            message: message.to_string(),
        }
    }
}

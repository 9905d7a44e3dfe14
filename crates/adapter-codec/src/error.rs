//! The crate's error type: every variant names the file (and tensor) involved.

use std::path::PathBuf;

use st_mmap::{Dtype, HeaderError};

/// Errors from encoding, decoding and inspecting adapters.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file the codec is bound to does not exist.
    #[error("{path}: {what} not found")]
    Missing { path: PathBuf, what: &'static str },
    /// The adapter's safetensors header is invalid.
    #[error("{path}: invalid safetensors header: {source}")]
    Header {
        path: PathBuf,
        #[source]
        source: HeaderError,
    },
    /// The compressed data is not a valid zstd stream (corrupt, truncated
    /// mid-frame, or not zstd at all).
    #[error("{path}: not a valid zstd stream: {message}")]
    Zstd { path: PathBuf, message: String },
    /// The decompressed data ends before the header says it should.
    #[error("{path}: data ends early{}: expected {expected} more bytes", tensor.as_ref().map(|t| format!(" in tensor {t:?}")).unwrap_or_default())]
    Truncated {
        path: PathBuf,
        tensor: Option<String>,
        expected: u64,
    },
    /// Bytes follow the last tensor.
    #[error("{path}: unexpected bytes after the last tensor")]
    TrailingBytes { path: PathBuf },
    /// A tensor's dtype cannot be shuffled by this format.
    #[error("{path}: tensor {tensor:?} has dtype {dtype}; supported are F32, BF16 and F16")]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: Dtype,
    },
    /// Tensors of different dtypes in one adapter.
    #[error("{path}: tensor {tensor:?} is {dtype} but the adapter's other tensors are {expected}")]
    MixedDtypes {
        path: PathBuf,
        tensor: String,
        dtype: Dtype,
        expected: Dtype,
    },
    /// The adapter holds no tensor.
    #[error("{path}: the adapter holds no tensors")]
    NoTensors { path: PathBuf },
    /// `encode` was asked to write a codec whose `.zst` is embedded bytes.
    #[error("{name}: this codec's compressed adapter is embedded bytes, not a file; it cannot be written")]
    Embedded { name: String },
    /// The compression level is outside zstd's range.
    #[error("compression level {level} is outside zstd's range {min}..={max}")]
    InvalidLevel { level: i32, min: i32, max: i32 },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

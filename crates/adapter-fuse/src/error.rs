//! The crate's error type: variants name the repo, file and key involved.

use std::path::PathBuf;

/// Errors from fusing an adapter into a model and caching the result.
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
    /// The compressed adapter could not be read or decoded.
    #[error(transparent)]
    Codec(#[from] adapter_codec::Error),
    /// A weights file is invalid.
    #[error(transparent)]
    Safetensors(#[from] st_mmap::Error),
    /// A JSON file (config, adapter config, index) is not what it should be.
    #[error("{path}: {message}")]
    Json { path: PathBuf, message: String },
    /// The adapter is not a LoRA adapter this crate can fuse.
    #[error("{path}: {message}")]
    Adapter { path: PathBuf, message: String },
    /// An adapter key names a module with no weight in the base model.
    #[error("adapter key {key:?} has no base weight {weight:?}")]
    NoBaseWeight { key: String, weight: String },
    /// An adapter pair does not fit its base weight.
    #[error("adapter {key:?}: lora_a {a:?} (in, rank) and lora_b {b:?} (rank, out) do not fit base weight {weight:?} of shape (out, in) {base:?}")]
    ShapeMismatch {
        key: String,
        weight: String,
        a: Vec<i32>,
        b: Vec<i32>,
        base: Vec<i32>,
    },
    /// Fusing produced NaN or infinite weights (a NaN or huge adapter value,
    /// or a delta too large for the weight's dtype); nothing is written.
    #[error("fusing {module:?} gives non-finite values in {weight:?}: the adapter holds NaN or infinite values, or values too large for the base weight's dtype")]
    NotFinite { module: String, weight: String },
    /// A hub download received nothing for the stall timeout.
    #[error("downloading {file:?} of {repo:?} stalled: nothing received for {after:?}")]
    Stalled {
        repo: String,
        file: String,
        after: std::time::Duration,
    },
    /// The base model is not in the local cache and the hub may not be asked.
    #[error("base model {repo:?} is not in the hub cache at {cache} and the hub may not be asked (offline)")]
    Offline { repo: String, cache: PathBuf },
    /// Downloading from the hub failed.
    #[error("downloading {repo:?}: {message}")]
    Download { repo: String, message: String },
    /// The cache namespace would not make a valid cache folder name.
    #[error("cache namespace {0:?} must be non-empty and free of '/', '\\\\' and '..'")]
    InvalidNamespace(String),
    /// A tensor could not be turned into an MLX array or back.
    #[error(transparent)]
    Tensor(mlx_support::Error),
    /// An MLX operation failed.
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}

/// The adapter type's errors as this crate's: the same path and message.
impl From<block_stream::Error> for Error {
    fn from(e: block_stream::Error) -> Error {
        match e {
            block_stream::Error::Adapter { path, message } => Error::Adapter { path, message },
            block_stream::Error::Io { path, source } => Error::Io { path, source },
            block_stream::Error::Safetensors(e) => Error::Safetensors(e),
            block_stream::Error::Mlx(e) => Error::Mlx(e),
            other => Error::Adapter {
                path: std::path::PathBuf::new(),
                message: other.to_string(),
            },
        }
    }
}

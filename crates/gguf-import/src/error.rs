//! The crate's error type.

use std::path::PathBuf;

/// Errors of an import. Each names the file it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading the GGUF or writing the folder failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The GGUF file is corrupt, or holds what the importer cannot convert.
    #[error("{path}: GGUF: {message}")]
    Gguf { path: PathBuf, message: String },
    /// The GGUF's architecture has no converter here.
    #[error("architecture {model_type:?} is not supported; supported: {supported:?}")]
    UnsupportedArchitecture {
        model_type: String,
        supported: &'static [&'static str],
    },
    /// An MLX operation failed.
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

//! The crate's error type.

use std::path::PathBuf;

/// Errors from loading and running models.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading a model file failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `config.json` is missing a field or has a wrong one.
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    /// The model's architecture is not implemented here.
    #[error("model_type {model_type:?} is not supported; supported: {supported:?}")]
    UnsupportedArchitecture {
        model_type: String,
        supported: &'static [&'static str],
    },
    /// A weight the architecture needs is not in the files.
    #[error("weight {key:?} is missing")]
    MissingWeight { key: String },
    /// A weight has the wrong shape for the config.
    #[error("weight {key:?} has shape {actual:?}, expected {expected:?}")]
    WeightShape {
        key: String,
        expected: Vec<i32>,
        actual: Vec<i32>,
    },
    /// A weights file is invalid.
    #[error(transparent)]
    Safetensors(#[from] st_mmap::Error),
    /// A tensor could not become an MLX array.
    #[error(transparent)]
    Tensor(#[from] mlx_support::Error),
    /// A GGUF file is corrupt, or holds what the importer cannot convert.
    #[error("{path}: GGUF: {message}")]
    Gguf { path: PathBuf, message: String },
    /// Tokenizing or rendering the chat template failed.
    #[error("tokenizer or chat template: {0}")]
    Template(String),
    /// The shared prefix alone is longer than the prompt limit.
    #[error("the prefix messages are {tokens} tokens long; the prompt limit is {limit}")]
    PrefixTooLong { tokens: usize, limit: usize },
    /// A token id outside the model's embedding table.
    #[error("token id {id} is outside the model's vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    /// The logits processor returned logits of another shape.
    #[error("the logits processor returned shape {actual:?} for logits of shape {expected:?}")]
    ProcessorShape {
        expected: Vec<i32>,
        actual: Vec<i32>,
    },
    /// The model produced NaN logits (NaN or infinite weights, or a
    /// processor that wrote NaN).
    #[error("the model produced NaN logits: its weights hold NaN or infinite values, or the logits processor wrote NaN")]
    NotFiniteLogits,
    /// An MLX operation failed.
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

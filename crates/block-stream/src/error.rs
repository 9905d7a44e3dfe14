//! The crate's error type: variants name the file, block and parameter.

use std::path::PathBuf;

/// Errors from streaming blocks and fusing LoRA.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Opening, mapping or indexing a safetensors file failed.
    #[error(transparent)]
    Safetensors(#[from] st_mmap::Error),
    /// MLX's loader could not make a lazy load of a tensor (or read it
    /// with another shape or dtype than the validated header says).
    #[error("{path}: {key}: {message}")]
    Load {
        path: PathBuf,
        key: String,
        message: String,
    },
    /// No key starts with the block prefix.
    #[error("no key in {paths:?} starts with block prefix {prefix:?}")]
    NoBlocks { prefix: String, paths: Vec<PathBuf> },
    /// A block index that the files do not have.
    #[error("block {block} does not exist; the blocks are {known:?}")]
    UnknownBlock { block: usize, known: Vec<usize> },
    /// The module has a parameter the block does not provide.
    #[error("block {block}: the module's parameter {param:?} is not in the weights")]
    MissingParam { block: usize, param: String },
    /// The block provides a parameter the module does not have.
    #[error("block {block}: the weights hold {param:?}, which the module does not have")]
    UnexpectedParam { block: usize, param: String },
    /// A weight's shape differs from the module's parameter.
    #[error("block {block}: {param:?} has shape {actual:?} but the module expects {expected:?}")]
    ShapeMismatch {
        block: usize,
        param: String,
        expected: Vec<i32>,
        actual: Vec<i32>,
    },
    /// A weight's dtype differs from the module's parameter.
    #[error("block {block}: {param:?} is {actual:?} but the module expects {expected:?}")]
    DtypeMismatch {
        block: usize,
        param: String,
        expected: mlx_rs::Dtype,
        actual: mlx_rs::Dtype,
    },
    /// A tensor cannot become an MLX array (dtype, shape, byte length).
    #[error(transparent)]
    Tensor(#[from] mlx_support::Error),
    /// LoRA sources were given to `bind` but the streamer has no fuser.
    #[error("LoRA sources were passed to bind, but this streamer has no LoRA fuser")]
    NoFuser,
    /// A LoRA pair that cannot be applied: a weight the block does not
    /// have, a shape that does not fit it, or a block the model does not
    /// have. `key` is the pair's down projection as the adapter file
    /// stores it.
    #[error("{}: {key} (block {block}, {param:?}): {message}", adapter.display())]
    Lora {
        adapter: PathBuf,
        key: String,
        block: usize,
        param: String,
        message: String,
    },
    /// An adapter file's key that is half of a pair without the other half.
    #[error("{}: {key} has no {missing} beside it: a LoRA pair needs both halves", path.display())]
    HalfPair {
        path: PathBuf,
        key: String,
        /// The suffix of the missing half (e.g. `.lora_B.weight`).
        missing: String,
    },
    /// An adapter file none of whose pairs lies under the block prefix (or
    /// that holds no tensor at all): applied, it would change nothing.
    #[error(
        "{}: no LoRA pair matches a block under {prefix:?}{}",
        path.display(),
        if outside.is_empty() { " (the file holds no pair at all)".to_owned() } else { format!("; its pairs are under other names, e.g. {outside:?}") }
    )]
    NoPairs {
        path: PathBuf,
        prefix: String,
        /// Up to three of the file's keys (after any key mapper) that end
        /// like a pair's half but lie outside the prefix.
        outside: Vec<String>,
    },
    /// An mlx_lm adapter folder that cannot be used: its config or its
    /// pairs (see [`MlxLmAdapter::open`](crate::MlxLmAdapter::open)).
    #[error("{path}: {message}")]
    Adapter { path: PathBuf, message: String },
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// An MLX operation failed.
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

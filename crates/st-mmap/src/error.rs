//! The crate's error type: every variant names the file (and key) involved.

use std::path::PathBuf;

use crate::header::HeaderError;

/// Errors from opening and indexing safetensors files.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading or mapping a file failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The path names a directory or another non-file.
    #[error("{path}: not a regular file")]
    NotAFile { path: PathBuf },
    /// The file's header is invalid.
    #[error("{path}: invalid safetensors header: {source}")]
    Header {
        path: PathBuf,
        #[source]
        source: HeaderError,
    },
    /// Two files hold a tensor of the same name.
    #[error("tensor {key:?} is in both {first} and {second}")]
    DuplicateKey {
        key: String,
        first: PathBuf,
        second: PathBuf,
    },
    /// `model.safetensors.index.json` cannot be read as an index.
    #[error("{path}: invalid index: {message}")]
    InvalidIndex { path: PathBuf, message: String },
    /// The index and the shards disagree about where a tensor is.
    #[error("{index}: {key:?} {problem}")]
    IndexMismatch {
        index: PathBuf,
        key: String,
        problem: String,
    },
    /// A directory holds no `.safetensors` file.
    #[error("{dir}: no .safetensors files")]
    NoSafetensors { dir: PathBuf },
    /// Rows were asked of a tensor that does not have them.
    #[error("{path}: rows {}..{} of {key:?}, which has {len}", rows.start, rows.end)]
    RowsOutOfRange {
        path: PathBuf,
        key: String,
        rows: std::ops::Range<usize>,
        len: usize,
    },
    /// A destination for rows is not their byte length.
    #[error("{path}: {key:?}'s rows are {expected} bytes, the buffer for them {actual}")]
    BufferLength {
        path: PathBuf,
        key: String,
        expected: usize,
        actual: usize,
    },
    /// A key starts with the block prefix but its block number is not a
    /// plain decimal (see [`BlockPrefix`](crate::BlockPrefix)).
    #[error("{key:?} starts with block prefix {prefix:?} but {reason}")]
    MalformedBlockKey {
        key: String,
        prefix: String,
        reason: &'static str,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_error(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}

//! Memory-mapped `.safetensors` files, one or many shards, with validated
//! headers and keys indexed by transformer block.
//!
//! Why: a model's weights should be read straight from the page cache, not
//! copied into private memory, so that a process can run a model larger than
//! its memory budget. This crate has no MLX dependency and builds anywhere.
//!
//! ```
//! use st_mmap::{BlockIndex, BlockPrefix, Dtype, SafetensorsFile};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A tiny file: two blocks with one F32 weight each.
//! let header = br#"{"blocks.0.w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"blocks.1.w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#;
//! let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
//! bytes.extend_from_slice(header);
//! for v in [1.0f32, 2.0, 3.0, 4.0] {
//!     bytes.extend_from_slice(&v.to_le_bytes());
//! }
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("model.safetensors");
//! std::fs::write(&path, &bytes)?;
//!
//! let file = SafetensorsFile::open(&path)?;
//! let w = file.tensor("blocks.1.w").unwrap();
//! assert_eq!((w.dtype, w.shape), (Dtype::F32, &[2][..]));
//! assert_eq!(w.data, &[0, 0, 64, 64, 0, 0, 128, 64]); // 3.0, 4.0
//!
//! let index = BlockIndex::build(&BlockPrefix::new("blocks."), file.header().tensors().iter().map(|t| t.name.as_str()))?;
//! assert_eq!(index.blocks().collect::<Vec<_>>(), [0, 1]);
//! # Ok(())
//! # }
//! ```
//!
//! # Errors
//!
//! Every error names the file involved (and the key where there is one):
//! hostile headers — length past the end or over 100 MiB, invalid JSON or
//! UTF-8, unknown dtypes, offsets out of range, overlapping, with gaps or
//! trailing bytes, sizes that disagree with the shape — are
//! [`HeaderError`]s wrapped in [`Error::Header`] with the path.

mod block;
mod dtype;
mod error;
mod file;
mod header;
mod index;
pub mod json;
mod set;

pub use block::{BlockIndex, BlockPrefix};
pub use dtype::{Dtype, UnknownDtype};
pub use error::{Error, Result};
pub use file::{read_exact_at, SafetensorsFile, TensorView};
pub use header::{
    json_len, parse_header, parse_header_json, Header, HeaderError, TensorInfo, MAX_HEADER_LEN,
};
pub use index::{ShardIndex, INDEX_FILE};
pub use set::SafetensorsSet;

/// Compiles the README's example with the doc-tests, so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

//! The compact shipping format for LoRA adapters: each tensor byte-shuffled
//! (bytes grouped by position within the dtype), the whole file one zstd
//! frame, and a digest of the compressed bytes that names fused models.
//!
//! Why: adapters ship inside applications, and shuffled floats compress far
//! better than raw ones. The format is byte-compatible with the Python
//! original's `AdapterCodec`: the same input and level give the same `.zst`,
//! so digests agree across implementations. This crate has no MLX dependency.
//!
//! ```
//! use adapter_codec::AdapterCodec;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! // A one-tensor F32 adapter: 8-byte header length, JSON, data.
//! let json = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
//! let mut adapter = (json.len() as u64).to_le_bytes().to_vec();
//! adapter.extend_from_slice(json);
//! adapter.extend((0u8..16).collect::<Vec<_>>());
//! std::fs::write(dir.path().join("adapters.safetensors"), &adapter)?;
//!
//! let codec = AdapterCodec::new(
//!     dir.path().join("adapters.safetensors.zst"),
//!     dir.path().join("adapter_config.json"),
//! );
//! let stats = codec.encode(dir.path().join("adapters.safetensors"))?;
//! assert_eq!(stats.tensors, 1);
//! assert_eq!(codec.dtype()?.as_str(), "F32");
//! assert_eq!(codec.digest()?.len(), 16);
//!
//! codec.decode(dir.path().join("restored.safetensors"))?;
//! assert_eq!(std::fs::read(dir.path().join("restored.safetensors"))?, adapter);
//! # Ok(())
//! # }
//! ```
//!
//! # The Python original's API, here
//!
//! spawnllm's `AdapterCodec` with `ZST` and `CONFIG` class attributes is an
//! [`AdapterCodec`] value ([`AdapterCodec::new`] for files,
//! [`AdapterCodec::embedded`] for bytes in the binary); `encode(src)`,
//! `decode(dst)`, `digest()` and `dtype()` keep their names and results.
//!
//! # Errors
//!
//! Every [`Error`] names the file (and the tensor where there is one):
//! corrupt or truncated zstd, hostile headers, unsupported or mixed dtypes,
//! trailing bytes, missing files. `encode` and `decode` write a temporary
//! file and rename it, so a failure never leaves a partial output.
//!
//! # Memory
//!
//! Decoding streams: the largest tensor plus a 1 MiB chunk. Encoding holds
//! one shuffled copy of the adapter, because zstd must see the whole input
//! at once to produce the reference's exact frame; the output is streamed.

mod codec;
mod compress;
mod error;
mod layout;
mod shuffle;
mod stream;

pub use codec::AdapterCodec;
pub use compress::DEFAULT_LEVEL;
pub use error::{Error, Result};
pub use shuffle::{shuffle_bytes, unshuffle_bytes};
pub use st_mmap::Dtype;
pub use stream::{decode_stream, encode_stream, DecodeStats, EncodeStats, Ends, Progress};

/// Compiles the README's example with the doc-tests, so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

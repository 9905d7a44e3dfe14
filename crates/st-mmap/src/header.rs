//! Parsing and validating a safetensors header from bytes (no I/O).
//!
//! Layout: 8 bytes little-endian `n`, then `n` bytes of JSON, then the data
//! body. The JSON maps tensor names to `{dtype, shape, data_offsets}` (offsets
//! relative to the body) plus an optional `__metadata__` string map. A valid
//! header describes the body exactly: tensors tile it without gaps, overlaps
//! or trailing bytes, and each tensor's byte length is `shape × dtype size`.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::dtype::Dtype;

/// The largest header accepted. Real headers are kilobytes to a few
/// megabytes; a larger declared length is a corrupt or hostile file.
pub const MAX_HEADER_LEN: u64 = 100 << 20;

const METADATA_KEY: &str = "__metadata__";

/// Why a header is invalid. The caller adds the file's path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderError {
    #[error("file is {file_len} bytes, shorter than the 8-byte header length")]
    TooShort { file_len: u64 },
    #[error("header length {declared} exceeds the limit of {limit} bytes")]
    HeaderTooLarge { declared: u64, limit: u64 },
    #[error("header length {declared} runs past the end of the {file_len}-byte file")]
    HeaderPastEnd { declared: u64, file_len: u64 },
    #[error("header is not UTF-8 (invalid byte at {valid_up_to})")]
    NotUtf8 { valid_up_to: usize },
    #[error("header is not valid JSON: {message}")]
    InvalidJson { message: String },
    #[error("header entry {key:?} is not a tensor description: {message}")]
    InvalidEntry { key: String, message: String },
    #[error("__metadata__ must map strings to strings: {message}")]
    InvalidMetadata { message: String },
    #[error("header names {key:?} twice")]
    DuplicateKey { key: String },
    #[error("tensor {tensor:?} has unknown dtype {dtype:?}")]
    UnknownDtype { tensor: String, dtype: String },
    #[error("tensor {tensor:?} has data_offsets [{start}, {end}] with start after end")]
    ReversedOffsets {
        tensor: String,
        start: usize,
        end: usize,
    },
    #[error("tensor {tensor:?}: shape {shape:?} overflows")]
    ShapeOverflow { tensor: String, shape: Vec<usize> },
    #[error(
        "tensor {tensor:?}: {dtype} × {shape:?} needs {expected} bytes but data_offsets span {actual}"
    )]
    SizeMismatch {
        tensor: String,
        dtype: Dtype,
        shape: Vec<usize>,
        expected: usize,
        actual: usize,
    },
    #[error("tensor {tensor:?} ends at byte {end} of a {body_len}-byte data section")]
    OutOfRange {
        tensor: String,
        end: usize,
        body_len: usize,
    },
    #[error("tensor {tensor:?} overlaps {previous:?}")]
    Overlap { tensor: String, previous: String },
    #[error(
        "gap before tensor {tensor:?}: it starts at {start}, the data before it ends at {expected}"
    )]
    Gap {
        tensor: String,
        expected: usize,
        start: usize,
    },
    #[error("{count} trailing bytes after the last tensor")]
    TrailingBytes { count: usize },
}

/// One tensor as the header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The key, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Byte range within the data section (not the file).
    pub data_offsets: (usize, usize),
}

impl TensorInfo {
    /// Number of bytes of data.
    pub fn byte_len(&self) -> usize {
        self.data_offsets.1 - self.data_offsets.0
    }
}

/// A validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    json_len: usize,
    body_len: usize,
    tensors: Vec<TensorInfo>,
    metadata: Option<BTreeMap<String, String>>,
}

impl Header {
    /// Length of the JSON text (the `n` of the 8-byte prefix).
    pub fn json_len(&self) -> usize {
        self.json_len
    }

    /// File offset where the data section starts: `8 + n`.
    pub fn data_start(&self) -> usize {
        8 + self.json_len
    }

    /// Length of the data section.
    pub fn body_len(&self) -> usize {
        self.body_len
    }

    /// Total file length this header describes.
    pub fn file_len(&self) -> usize {
        self.data_start() + self.body_len
    }

    /// The tensors in order of their position in the data section.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The `__metadata__` map, if the file has one.
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        self.metadata.as_ref()
    }
}

impl Header {
    /// The header of a file holding only the tensors of this one that
    /// `keep` accepts, in the same order and packed without gaps: the
    /// 8-byte length and the JSON, padded with spaces to a multiple of 8
    /// as the safetensors library writes it, and the new descriptions
    /// (whose `data_offsets` say where each kept tensor's bytes go).
    pub fn subset(&self, keep: impl Fn(&TensorInfo) -> bool) -> (Vec<u8>, Vec<TensorInfo>) {
        let mut at = 0;
        let mut kept = Vec::new();
        for t in self.tensors.iter().filter(|t| keep(t)) {
            let len = t.byte_len();
            kept.push(TensorInfo {
                data_offsets: (at, at + len),
                ..t.clone()
            });
            at += len;
        }
        let mut json = serde_json::Map::new();
        if let Some(metadata) = &self.metadata {
            json.insert(METADATA_KEY.into(), serde_json::json!(metadata));
        }
        for t in &kept {
            json.insert(
                t.name.clone(),
                serde_json::json!({
                    "dtype": t.dtype.as_str(),
                    "shape": t.shape,
                    "data_offsets": [t.data_offsets.0, t.data_offsets.1],
                }),
            );
        }
        let json = crate::json::sorted(&serde_json::Value::Object(json));
        let mut text = serde_json::to_vec(&json).expect("a JSON map serializes");
        text.resize(text.len().next_multiple_of(8), b' ');
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend(text);
        (bytes, kept)
    }
}

/// Reads the JSON length from the first 8 bytes and checks it against the
/// file length and [`MAX_HEADER_LEN`].
pub fn json_len(first_bytes: &[u8], file_len: u64) -> Result<usize, HeaderError> {
    let Some(prefix) = first_bytes.get(..8) else {
        return Err(HeaderError::TooShort { file_len });
    };
    let declared = u64::from_le_bytes(prefix.try_into().expect("8 bytes"));
    if declared > MAX_HEADER_LEN {
        return Err(HeaderError::HeaderTooLarge {
            declared,
            limit: MAX_HEADER_LEN,
        });
    }
    if declared > file_len.saturating_sub(8) {
        return Err(HeaderError::HeaderPastEnd { declared, file_len });
    }
    Ok(declared as usize)
}

/// Parses and validates the header at the start of `prefix`, for a file of
/// `file_len` bytes. `prefix` must hold at least the 8-byte length and the
/// JSON; it may hold the whole file.
pub fn parse_header(prefix: &[u8], file_len: u64) -> Result<Header, HeaderError> {
    let n = json_len(prefix, file_len)?;
    let json = prefix.get(8..8 + n).ok_or(HeaderError::HeaderPastEnd {
        declared: n as u64,
        file_len: prefix.len() as u64,
    })?;
    let body_len = (file_len - 8 - n as u64) as usize;
    parse_json(json, Some(body_len))
}

/// Parses and validates header JSON on its own, when the file's length is
/// not known yet (e.g. while decompressing a stream). The data section is
/// taken to end where the last tensor ends; the tensors must still tile it
/// exactly. Whoever reads the data must check that nothing follows it.
pub fn parse_header_json(json: &[u8]) -> Result<Header, HeaderError> {
    parse_json(json, None)
}

fn parse_json(json: &[u8], body_len: Option<usize>) -> Result<Header, HeaderError> {
    let text = std::str::from_utf8(json).map_err(|e| HeaderError::NotUtf8 {
        valid_up_to: e.valid_up_to(),
    })?;
    let entries: Entries = serde_json::from_str(text).map_err(|e| HeaderError::InvalidJson {
        message: e.to_string(),
    })?;
    let mut seen = std::collections::HashSet::new();
    let mut tensors = Vec::new();
    let mut metadata = None;
    for (key, value) in entries.0 {
        if !seen.insert(key.clone()) {
            return Err(HeaderError::DuplicateKey { key });
        }
        if key == METADATA_KEY {
            metadata = parse_metadata(value)?;
            continue;
        }
        tensors.push(parse_tensor(key, value)?);
    }
    let body_len =
        body_len.unwrap_or_else(|| tensors.iter().map(|t| t.data_offsets.1).max().unwrap_or(0));
    check_layout(&mut tensors, body_len)?;
    Ok(Header {
        json_len: json.len(),
        body_len,
        tensors,
        metadata,
    })
}

#[derive(Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

fn parse_tensor(name: String, value: serde_json::Value) -> Result<TensorInfo, HeaderError> {
    let raw: RawTensor = serde_json::from_value(value).map_err(|e| HeaderError::InvalidEntry {
        key: name.clone(),
        message: e.to_string(),
    })?;
    let dtype: Dtype = raw.dtype.parse().map_err(|_| HeaderError::UnknownDtype {
        tensor: name.clone(),
        dtype: raw.dtype.clone(),
    })?;
    let (start, end) = raw.data_offsets;
    if start > end {
        return Err(HeaderError::ReversedOffsets {
            tensor: name,
            start,
            end,
        });
    }
    let expected = raw
        .shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| HeaderError::ShapeOverflow {
            tensor: name.clone(),
            shape: raw.shape.clone(),
        })?;
    if expected != end - start {
        return Err(HeaderError::SizeMismatch {
            tensor: name,
            dtype,
            shape: raw.shape,
            expected,
            actual: end - start,
        });
    }
    Ok(TensorInfo {
        name,
        dtype,
        shape: raw.shape,
        data_offsets: (start, end),
    })
}

fn parse_metadata(
    value: serde_json::Value,
) -> Result<Option<BTreeMap<String, String>>, HeaderError> {
    if value.is_null() {
        return Ok(None);
    }
    serde_json::from_value(value)
        .map(Some)
        .map_err(|e| HeaderError::InvalidMetadata {
            message: e.to_string(),
        })
}

/// Sorts tensors by position and checks that they tile the body exactly.
fn check_layout(tensors: &mut [TensorInfo], body_len: usize) -> Result<(), HeaderError> {
    tensors.sort_by_key(|t| t.data_offsets);
    let mut cursor = 0;
    let mut previous: Option<&TensorInfo> = None;
    for t in tensors.iter() {
        let (start, end) = t.data_offsets;
        if end > body_len {
            return Err(HeaderError::OutOfRange {
                tensor: t.name.clone(),
                end,
                body_len,
            });
        }
        if start < cursor {
            return Err(HeaderError::Overlap {
                tensor: t.name.clone(),
                previous: previous.map(|p| p.name.clone()).unwrap_or_default(),
            });
        }
        if start > cursor {
            return Err(HeaderError::Gap {
                tensor: t.name.clone(),
                expected: cursor,
                start,
            });
        }
        cursor = end;
        previous = Some(t);
    }
    if cursor != body_len {
        return Err(HeaderError::TrailingBytes {
            count: body_len - cursor,
        });
    }
    Ok(())
}

/// A JSON object's entries in file order, duplicates kept (serde_json's own
/// maps would silently keep only the last of two equal keys).
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;
        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object of tensor descriptions")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        deserializer.deserialize_map(EntriesVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subset_header_parses_back_with_packed_offsets() {
        let json = br#"{"__metadata__":{"format":"mlx"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]},"c":{"dtype":"BF16","shape":[2,2],"data_offsets":[11,19]}}"#;
        let header = parse_header_json(json).unwrap();
        let (bytes, kept) = header.subset(|t| t.name != "b");
        assert_eq!(bytes.len() % 8, 0);
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(n + 8, bytes.len());
        let parsed = parse_header_json(&bytes[8..]).unwrap();
        assert_eq!(parsed.tensors(), &kept[..]);
        assert_eq!(parsed.tensors()[1].name, "c");
        assert_eq!(parsed.tensors()[1].data_offsets, (8, 16));
        assert_eq!(parsed.metadata(), header.metadata());
        assert_eq!(parsed.body_len(), 16);
    }
}

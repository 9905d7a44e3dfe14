//! Reads a GGUF file's header, metadata and tensor table, checked.
//!
//! MLX's GGUF reader trusts the file: counts and lengths from a corrupt or
//! truncated file make it read past the end or allocate what the file
//! claims (crashes, not errors). This walks the header, metadata and tensor
//! table with every count and length checked against the bytes that are
//! really left, allocating nothing by what the file says, and checks that
//! each tensor's data lies inside the file and has a type the importer can
//! convert. It keeps the metadata values and where each tensor's bytes are,
//! for the importers that read tensors themselves (Gemma 3: MLX's loader
//! rejects Q5_0 and misreads Q4_K).

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
/// ggml's limit on tensor dimensions.
const MAX_DIMS: u64 = 4;
const DEFAULT_ALIGNMENT: u64 = 32;

/// A ggml tensor type the importer converts: its id, name, and how many
/// elements a block of how many bytes holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GgmlType {
    pub id: u32,
    pub name: &'static str,
    pub block: u64,
    pub block_bytes: u64,
}

const fn ggml(id: u32, name: &'static str, block: u64, block_bytes: u64) -> GgmlType {
    GgmlType {
        id,
        name,
        block,
        block_bytes,
    }
}

pub(crate) const F32: GgmlType = ggml(0, "F32", 1, 4);
pub(crate) const F16: GgmlType = ggml(1, "F16", 1, 2);
pub(crate) const Q4_0: GgmlType = ggml(2, "Q4_0", 32, 18);
pub(crate) const Q4_1: GgmlType = ggml(3, "Q4_1", 32, 20);
pub(crate) const Q5_0: GgmlType = ggml(6, "Q5_0", 32, 22);
pub(crate) const Q8_0: GgmlType = ggml(8, "Q8_0", 32, 34);
pub(crate) const Q4_K: GgmlType = ggml(12, "Q4_K", 256, 144);
pub(crate) const Q6_K: GgmlType = ggml(14, "Q6_K", 256, 210);
pub(crate) const BF16: GgmlType = ggml(30, "BF16", 1, 2);

/// Every type some importer converts.
const SUPPORTED_TYPES: &[GgmlType] = &[F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, BF16];

/// One tensor of the table, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorEntry {
    pub name: String,
    /// Dimensions as GGUF lists them (innermost first).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Where its bytes start in the file, and how many there are (both
    /// checked to lie inside the file).
    pub start: u64,
    pub size: u64,
}

/// One metadata value. Integers of every width and floats are `Number`s
/// (the importers use them as sizes, ids and constants).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Meta {
    Number(f64),
    Bool(bool),
    Text(String),
    Numbers(Vec<f64>),
    Texts(Vec<String>),
}

/// What the check found: the metadata and the tensors, in file order.
#[derive(Debug, Clone)]
pub(crate) struct Checked {
    /// The file, for errors.
    pub path: std::path::PathBuf,
    pub metadata: std::collections::BTreeMap<String, Meta>,
    pub tensors: Vec<TensorEntry>,
}

impl Checked {
    /// An error about this file.
    pub fn bad(&self, message: impl std::fmt::Display) -> Error {
        Error::Gguf {
            path: self.path.clone(),
            message: message.to_string(),
        }
    }

    /// The finite number at `key`, or an error naming it.
    pub fn float(&self, key: &str) -> Result<f64> {
        self.number(key)
            .filter(|v| v.is_finite())
            .ok_or_else(|| self.bad(format!("metadata {key} is missing or not a number")))
    }

    /// A count or size at `key`: a whole number from 1 to `i32::MAX` (MLX's
    /// shapes), or an error naming it.
    pub fn count(&self, key: &str) -> Result<usize> {
        let v = self.float(key)?;
        if !(v >= 1.0 && v <= f64::from(i32::MAX) && v.fract() == 0.0) {
            return Err(self.bad(format!(
                "metadata {key} = {v} is not a count from 1 to {}",
                i32::MAX
            )));
        }
        Ok(v as usize)
    }

    /// A token id at `key`: a whole number below `vocab`.
    pub fn token_id(&self, key: &str, vocab: usize) -> Result<usize> {
        let v = self.float(key)?;
        if !(v >= 0.0 && v < vocab as f64 && v.fract() == 0.0) {
            return Err(self.bad(format!(
                "metadata {key} = {v} is not a token id of the {vocab}-token vocabulary"
            )));
        }
        Ok(v as usize)
    }

    /// The metadata value of `key`, if it is a number.
    pub fn number(&self, key: &str) -> Option<f64> {
        match self.metadata.get(key)? {
            Meta::Number(n) => Some(*n),
            _ => None,
        }
    }

    /// The metadata value of `key`, if it is a string.
    pub fn text(&self, key: &str) -> Option<&str> {
        match self.metadata.get(key)? {
            Meta::Text(t) => Some(t),
            _ => None,
        }
    }

    /// The metadata value of `key`, if it is an array of strings.
    pub fn texts(&self, key: &str) -> Option<&[String]> {
        match self.metadata.get(key)? {
            Meta::Texts(t) => Some(t),
            _ => None,
        }
    }

    /// The metadata value of `key`, if it is an array of numbers.
    pub fn numbers(&self, key: &str) -> Option<&[f64]> {
        match self.metadata.get(key)? {
            Meta::Numbers(n) => Some(n),
            _ => None,
        }
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// A reader that knows how many bytes are left and refuses to go past them.
struct Bounded<R> {
    inner: R,
    left: u64,
    path: std::path::PathBuf,
}

impl<R: Read> Bounded<R> {
    fn bad(&self, message: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.clone(),
            message: message.into(),
        }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<()> {
        if n > self.left {
            return Err(self.bad(format!(
                "{what} needs {n} bytes but only {} are left in the file",
                self.left
            )));
        }
        self.left -= n;
        Ok(())
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        self.take(N as u64, what)?;
        let mut buf = [0u8; N];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| self.bad(format!("reading {what}: {e}")))?;
        Ok(buf)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(what)?))
    }

    /// A length-prefixed string, its length checked before it is read.
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        self.take(len, what)?;
        let mut bytes = Vec::new();
        (&mut self.inner)
            .take(len)
            .read_to_end(&mut bytes)
            .map_err(|e| self.bad(format!("reading {what}: {e}")))?;
        if bytes.len() as u64 != len {
            return Err(self.bad(format!("{what}: the file ends early")));
        }
        String::from_utf8(bytes).map_err(|_| self.bad(format!("{what} is not UTF-8")))
    }
}

/// Bytes of one scalar of GGUF metadata type `t` (strings: `None`).
fn scalar_size(t: u32) -> Option<Option<u64>> {
    Some(match t {
        0 | 1 | 7 => Some(1), // u8, i8, bool
        2 | 3 => Some(2),     // u16, i16
        4..=6 => Some(4),     // u32, i32, f32
        10..=12 => Some(8),   // u64, i64, f64
        8 => None,            // string
        _ => return None,
    })
}

/// Reads one scalar of type `t` (not a string) as a number or bool.
fn scalar<R: Read>(r: &mut Bounded<R>, key: &str, t: u32) -> Result<Meta> {
    Ok(Meta::Number(match t {
        0 => f64::from(r.bytes::<1>(key)?[0]),
        1 => f64::from(i8::from_le_bytes(r.bytes(key)?)),
        2 => f64::from(u16::from_le_bytes(r.bytes(key)?)),
        3 => f64::from(i16::from_le_bytes(r.bytes(key)?)),
        4 => f64::from(r.u32(key)?),
        5 => f64::from(i32::from_le_bytes(r.bytes(key)?)),
        6 => f64::from(f32::from_le_bytes(r.bytes(key)?)),
        7 => return Ok(Meta::Bool(r.bytes::<1>(key)?[0] != 0)),
        10 => r.u64(key)? as f64,
        11 => i64::from_le_bytes(r.bytes(key)?) as f64,
        12 => f64::from_le_bytes(r.bytes(key)?),
        _ => return Err(r.bad(format!("{key}: unknown metadata type {t}"))),
    }))
}

/// Reads one metadata value of type `t`.
fn read_value<R: Read>(r: &mut Bounded<R>, key: &str, t: u32) -> Result<Meta> {
    match (t, scalar_size(t)) {
        (_, Some(Some(_))) => scalar(r, key, t),
        (_, Some(None)) => Ok(Meta::Text(r.string(key)?)),
        (9, None) => {
            let inner = r.u32(key)?;
            let count = r.u64(key)?;
            match scalar_size(inner) {
                Some(Some(size)) => {
                    // Checked against the bytes left before anything is
                    // allocated by the count.
                    let total = count
                        .checked_mul(size)
                        .ok_or_else(|| r.bad(format!("{key}: array of {count} overflows")))?;
                    if total > r.left {
                        return Err(r.bad(format!(
                            "{key}: {count} values need {total} bytes but only {} are left",
                            r.left
                        )));
                    }
                    let mut values = Vec::with_capacity(count as usize);
                    for _ in 0..count {
                        values.push(match scalar(r, key, inner)? {
                            Meta::Number(n) => n,
                            Meta::Bool(b) => f64::from(u8::from(b)),
                            _ => unreachable!("scalars are numbers or bools"),
                        });
                    }
                    Ok(Meta::Numbers(values))
                }
                Some(None) => {
                    // Each string is at least its 8-byte length: a count the
                    // file cannot hold fails here, not after a long loop.
                    if count > r.left / 8 {
                        return Err(r.bad(format!(
                            "{key}: {count} strings cannot fit in the {} bytes left",
                            r.left
                        )));
                    }
                    let mut texts = Vec::with_capacity(count as usize);
                    for _ in 0..count {
                        texts.push(r.string(key)?);
                    }
                    Ok(Meta::Texts(texts))
                }
                None => Err(r.bad(format!("{key}: arrays of type {inner} are not valid"))),
            }
        }
        _ => Err(r.bad(format!("{key}: unknown metadata type {t}"))),
    }
}

/// Checks the GGUF file at `path`; see the module docs.
pub(crate) fn check(path: &Path) -> Result<Checked> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let mut r = Bounded {
        inner: BufReader::new(file),
        left: len,
        path: path.to_path_buf(),
    };
    if &r.bytes::<4>("the magic number")? != MAGIC {
        return Err(r.bad("not a GGUF file (no GGUF magic number)"));
    }
    let version = r.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(r.bad(format!(
            "GGUF version {version} is not supported (2 and 3 are)"
        )));
    }
    let n_tensors = r.u64("the tensor count")?;
    let n_kv = r.u64("the metadata count")?;
    // Every entry takes bytes of the file; counts it cannot hold are lies.
    if n_kv > r.left / 13 || n_tensors > r.left / 24 {
        return Err(r.bad(format!(
            "claims {n_tensors} tensors and {n_kv} metadata entries, more than its {len} bytes can hold"
        )));
    }
    let mut alignment = DEFAULT_ALIGNMENT;
    let mut metadata = std::collections::BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string("a metadata key")?;
        let t = r.u32(&key)?;
        let value = read_value(&mut r, &key, t)?;
        if key == "general.alignment" {
            match value {
                Meta::Number(a) if a >= 1.0 && a.fract() == 0.0 && (a as u64).is_power_of_two() => {
                    alignment = a as u64;
                }
                _ => {
                    return Err(r.bad(format!("general.alignment {value:?} is not a power of two")))
                }
            }
        }
        metadata.insert(key, value);
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let name = r.string("a tensor name")?;
        let n_dims = u64::from(r.u32(&name)?);
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(r.bad(format!("tensor {name:?} has {n_dims} dimensions (1 to 4)")));
        }
        let mut dims = Vec::new();
        for _ in 0..n_dims {
            dims.push(r.u64(&name)?);
        }
        let type_id = r.u32(&name)?;
        let offset = r.u64(&name)?;
        let Some(&ty) = SUPPORTED_TYPES.iter().find(|t| t.id == type_id) else {
            let names: Vec<&str> = SUPPORTED_TYPES.iter().map(|t| t.name).collect();
            return Err(r.bad(format!(
                "tensor {name:?} has ggml type {type_id}, which this importer does not convert (supported: {})",
                names.join(", ")
            )));
        };
        let GgmlType {
            name: type_name,
            block,
            block_bytes,
            ..
        } = ty;
        let elements = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d).filter(|_| d > 0))
            .ok_or_else(|| r.bad(format!("tensor {name:?} has dimensions {dims:?}")))?;
        if dims[0] % block != 0 {
            return Err(r.bad(format!(
                "tensor {name:?}: rows of {} are not whole {type_name} blocks of {block}",
                dims[0]
            )));
        }
        let size = (elements / block)
            .checked_mul(block_bytes)
            .ok_or_else(|| r.bad(format!("tensor {name:?} is too large")))?;
        if offset % alignment != 0 {
            return Err(r.bad(format!(
                "tensor {name:?} starts at unaligned offset {offset}"
            )));
        }
        tensors.push(TensorEntry {
            name,
            dims,
            ty,
            start: offset,
            size,
        });
    }
    let table_end = len - r.left;
    let data_start = table_end.div_ceil(alignment) * alignment;
    for t in &mut tensors {
        let (offset, size) = (t.start, t.size);
        let end = data_start
            .checked_add(offset)
            .and_then(|s| s.checked_add(size));
        if end.is_none_or(|end| end > len) {
            return Err(r.bad(format!(
                "tensor {:?} ({size} bytes at offset {offset}) runs past the end of the {len}-byte file",
                t.name
            )));
        }
        t.start = data_start + offset;
    }
    Ok(Checked {
        path: path.to_path_buf(),
        metadata,
        tensors,
    })
}

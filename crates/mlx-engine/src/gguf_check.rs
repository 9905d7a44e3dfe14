//! Checks a GGUF file's structure before MLX's loader reads it.
//!
//! MLX's GGUF reader trusts the file: counts and lengths from a corrupt or
//! truncated file make it read past the end or allocate what the file
//! claims (crashes, not errors). This walks the header, metadata and tensor
//! table with every count and length checked against the bytes that are
//! really left, allocating nothing by what the file says, and checks that
//! each tensor's data lies inside the file and has a type the importer can
//! convert.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
/// ggml's limit on tensor dimensions.
const MAX_DIMS: u64 = 4;
const DEFAULT_ALIGNMENT: u64 = 32;

/// Tensor types the importer converts (through MLX's loader): id, name,
/// elements per block, bytes per block.
const SUPPORTED_TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (8, "Q8_0", 32, 34),
];

/// One tensor of the table, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorEntry {
    pub name: String,
    /// Dimensions as GGUF lists them (innermost first).
    pub dims: Vec<u64>,
    pub type_name: &'static str,
}

/// What the check found: the tensors, in file order.
#[derive(Debug, Clone)]
pub(crate) struct Checked {
    pub tensors: Vec<TensorEntry>,
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

    /// Skips `n` bytes (checked first).
    fn skip(&mut self, n: u64, what: &str) -> Result<()> {
        self.take(n, what)?;
        let copied = std::io::copy(&mut (&mut self.inner).take(n), &mut std::io::sink())
            .map_err(|e| self.bad(format!("reading {what}: {e}")))?;
        if copied != n {
            return Err(self.bad(format!("{what}: the file ends early")));
        }
        Ok(())
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

/// Skips one metadata value of type `t`; returns the alignment when the
/// key is `general.alignment`.
fn skip_value<R: Read>(r: &mut Bounded<R>, key: &str, t: u32) -> Result<Option<u64>> {
    match (t, scalar_size(t)) {
        (4, _) if key == "general.alignment" => return Ok(Some(u64::from(r.u32(key)?))),
        (_, Some(Some(size))) => r.skip(size, key)?,
        (_, Some(None)) => {
            let len = r.u64(key)?;
            r.skip(len, key)?;
        }
        (9, None) => {
            let inner = r.u32(key)?;
            let count = r.u64(key)?;
            match scalar_size(inner) {
                Some(Some(size)) => {
                    let total = count
                        .checked_mul(size)
                        .ok_or_else(|| r.bad(format!("{key}: array of {count} overflows")))?;
                    r.skip(total, key)?;
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
                    for _ in 0..count {
                        let len = r.u64(key)?;
                        r.skip(len, key)?;
                    }
                }
                None => return Err(r.bad(format!("{key}: arrays of type {inner} are not valid"))),
            }
        }
        _ => return Err(r.bad(format!("{key}: unknown metadata type {t}"))),
    }
    Ok(None)
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
    for _ in 0..n_kv {
        let key = r.string("a metadata key")?;
        let t = r.u32(&key)?;
        if let Some(a) = skip_value(&mut r, &key, t)? {
            if a == 0 || !a.is_power_of_two() {
                return Err(r.bad(format!("general.alignment {a} is not a power of two")));
            }
            alignment = a;
        }
    }
    let mut tensors = Vec::new();
    let mut extents = Vec::new();
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
        let Some(&(_, type_name, block, block_bytes)) =
            SUPPORTED_TYPES.iter().find(|(id, ..)| *id == type_id)
        else {
            return Err(r.bad(format!(
                "tensor {name:?} has ggml type {type_id}, which this importer does not convert (supported: F32, F16, Q4_0, Q4_1, Q8_0)"
            )));
        };
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
        extents.push((name.clone(), offset, size));
        tensors.push(TensorEntry {
            name,
            dims,
            type_name,
        });
    }
    let table_end = len - r.left;
    let data_start = table_end.div_ceil(alignment) * alignment;
    for (name, offset, size) in &extents {
        let end = data_start
            .checked_add(*offset)
            .and_then(|s| s.checked_add(*size));
        if end.is_none_or(|end| end > len) {
            return Err(r.bad(format!(
                "tensor {name:?} ({size} bytes at offset {offset}) runs past the end of the {len}-byte file"
            )));
        }
    }
    Ok(Checked { tensors })
}

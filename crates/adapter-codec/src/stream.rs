//! Encoding and decoding between any reader and writer.

use std::io::{self, Read, Write};
use std::path::Path;

use st_mmap::{json_len, parse_header, parse_header_json, Dtype, Header};

use crate::compress::compress_frame;
use crate::error::{Error, Result};
use crate::layout::{adapter_dtype, typesize};
use crate::shuffle::{shuffle_chunk, unshuffle_chunk};

/// Bytes moved per step; bounds the working memory beside the tensor buffers.
const CHUNK: usize = 1 << 20;

/// What an encode did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeStats {
    /// The adapter's dtype.
    pub dtype: Dtype,
    /// Number of tensors.
    pub tensors: usize,
    /// Size of the safetensors input.
    pub raw_bytes: u64,
    /// Size of the `.zst` output.
    pub compressed_bytes: u64,
}

impl EncodeStats {
    /// `raw / compressed`.
    pub fn ratio(&self) -> f64 {
        self.raw_bytes as f64 / self.compressed_bytes.max(1) as f64
    }
}

/// What a decode did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeStats {
    /// The adapter's dtype.
    pub dtype: Dtype,
    /// Number of tensors.
    pub tensors: usize,
    /// Size of the restored safetensors file.
    pub bytes: u64,
}

/// Names used in errors for the two ends of a stream.
#[derive(Debug, Clone, Copy)]
pub struct Ends<'a> {
    /// The input (a `.safetensors` when encoding, a `.zst` when decoding).
    pub source: &'a Path,
    /// The output.
    pub sink: &'a Path,
}

/// Progress callback: `(bytes done, bytes in total)`.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64);

/// Reads until `buf` is full or the input ends; returns how much was read.
fn read_full(reader: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Reads and validates the 8-byte length and the header JSON. `read_err`
/// turns a reader error into this side's error (I/O or zstd). With the
/// input's length known, the header is also checked against it (offsets out
/// of range, trailing bytes); otherwise the caller checks the end.
fn read_header(
    reader: &mut dyn Read,
    known_len: Option<u64>,
    path: &Path,
    read_err: &dyn Fn(io::Error) -> Error,
) -> Result<(Vec<u8>, Header, Dtype)> {
    let header_err = |source| Error::Header {
        path: path.to_path_buf(),
        source,
    };
    let mut prefix = [0u8; 8];
    let got = read_full(reader, &mut prefix).map_err(read_err)?;
    if got < 8 {
        return Err(header_err(st_mmap::HeaderError::TooShort {
            file_len: got as u64,
        }));
    }
    let n = json_len(&prefix, known_len.unwrap_or(u64::MAX)).map_err(header_err)?;
    let mut bytes = prefix.to_vec();
    // The declared length may be a lie (a few compressed bytes can claim
    // 100 MB): the buffer grows with what actually arrives.
    let got = read_growing(reader, &mut bytes, n).map_err(read_err)?;
    if got < n {
        return Err(Error::Truncated {
            path: path.to_path_buf(),
            tensor: None,
            expected: (n - got) as u64,
        });
    }
    let header = match known_len {
        Some(len) => parse_header(&bytes, len),
        None => parse_header_json(&bytes[8..]),
    }
    .map_err(header_err)?;
    let dtype = adapter_dtype(&header, path)?;
    Ok((bytes, header, dtype))
}

/// Appends up to `len` bytes from `reader` to `buf`, growing `buf` only as
/// bytes arrive (never by what `len` claims); returns how many came.
fn read_growing(reader: &mut dyn Read, buf: &mut Vec<u8>, len: usize) -> io::Result<usize> {
    let before = buf.len();
    reader.take(len as u64).read_to_end(buf)?;
    Ok(buf.len() - before)
}

/// Reads one tensor's `len` bytes into `buf` (replacing its contents), or
/// reports where the data ended. Memory follows the bytes read, so a header
/// that declares terabytes over a short stream costs nothing.
fn read_tensor(
    reader: &mut dyn Read,
    buf: &mut Vec<u8>,
    len: usize,
    name: &str,
    path: &Path,
    read_err: &dyn Fn(io::Error) -> Error,
) -> Result<()> {
    buf.clear();
    let got = read_growing(reader, buf, len).map_err(read_err)?;
    if got < len {
        return Err(Error::Truncated {
            path: path.to_path_buf(),
            tensor: Some(name.to_owned()),
            expected: (len - got) as u64,
        });
    }
    Ok(())
}

fn expect_end(
    reader: &mut dyn Read,
    path: &Path,
    read_err: &dyn Fn(io::Error) -> Error,
) -> Result<()> {
    let mut probe = [0u8; 1];
    match read_full(reader, &mut probe).map_err(read_err)? {
        0 => Ok(()),
        _ => Err(Error::TrailingBytes {
            path: path.to_path_buf(),
        }),
    }
}

/// Encodes a safetensors adapter read from `src` into one zstd frame on
/// `dst`: header verbatim, each tensor byte-shuffled, level `level`.
/// `src_len`, when known, lets the header be checked against the input's
/// length before any data is read.
///
/// Memory: one shuffled copy of the adapter and the compressed output (zstd
/// needs the whole input at once, and an output buffer of its bound, to
/// produce the reference's exact frame), the largest tensor's raw bytes,
/// and zstd's own tables.
pub fn encode_stream(
    src: &mut dyn Read,
    src_len: Option<u64>,
    dst: &mut dyn Write,
    level: i32,
    ends: Ends<'_>,
    progress: Progress<'_>,
) -> Result<EncodeStats> {
    let read_err = |source| Error::Io {
        path: ends.source.to_path_buf(),
        source,
    };
    let (header_bytes, header, dtype) = read_header(src, src_len, ends.source, &read_err)?;
    let t = typesize(dtype).expect("adapter_dtype accepts only shuffleable dtypes");
    let total = header.file_len();
    let mut shuffled = Vec::new();
    if src_len.is_some() {
        // The header was checked against the input's real length.
        shuffled.reserve_exact(total);
    }
    shuffled.extend_from_slice(&header_bytes);
    let mut raw = Vec::new();
    for info in header.tensors() {
        // Tensors tile the body in this order, so each one's shuffled bytes
        // go right after the previous one's.
        read_tensor(
            src,
            &mut raw,
            info.byte_len(),
            &info.name,
            ends.source,
            &read_err,
        )?;
        let start = shuffled.len();
        shuffled.resize(start + raw.len(), 0);
        shuffle_chunk(&raw, t, 0, raw.len() / t, &mut shuffled[start..]);
        progress(shuffled.len() as u64, total as u64);
    }
    expect_end(src, ends.source, &read_err)?;
    let compressed_bytes = compress_frame(&shuffled, level, dst).map_err(|source| Error::Io {
        path: ends.sink.to_path_buf(),
        source,
    })?;
    Ok(EncodeStats {
        dtype,
        tensors: header.tensors().len(),
        raw_bytes: total as u64,
        compressed_bytes,
    })
}

/// Decodes a compressed adapter from `src` (any valid zstd data: one or more
/// frames, with or without content size or checksum) and writes the
/// restored safetensors bytes to `dst`.
///
/// Memory: the largest tensor (its shuffled bytes) plus a small chunk; it
/// grows with the bytes actually decompressed, whatever the header claims.
pub fn decode_stream(
    src: &mut dyn Read,
    dst: &mut dyn Write,
    ends: Ends<'_>,
    progress: Progress<'_>,
) -> Result<DecodeStats> {
    let zstd_err = |e: io::Error| Error::Zstd {
        path: ends.source.to_path_buf(),
        message: e.to_string(),
    };
    let write_err = |source| Error::Io {
        path: ends.sink.to_path_buf(),
        source,
    };
    let mut decoder = zstd::stream::read::Decoder::new(src).map_err(zstd_err)?;
    let (header_bytes, header, dtype) = read_header(&mut decoder, None, ends.source, &zstd_err)?;
    let t = typesize(dtype).expect("adapter_dtype accepts only shuffleable dtypes");
    let total = header.file_len() as u64;
    dst.write_all(&header_bytes).map_err(write_err)?;
    let mut shuffled = Vec::new();
    let mut chunk = vec![0u8; CHUNK - CHUNK % t];
    let mut done = header_bytes.len() as u64;
    for info in header.tensors() {
        read_tensor(
            &mut decoder,
            &mut shuffled,
            info.byte_len(),
            &info.name,
            ends.source,
            &zstd_err,
        )?;
        let n = info.byte_len() / t;
        let mut first = 0;
        while first < n {
            let count = (n - first).min(chunk.len() / t);
            let out = &mut chunk[..count * t];
            unshuffle_chunk(&shuffled, t, first, n, out);
            dst.write_all(out).map_err(write_err)?;
            first += count;
        }
        done += info.byte_len() as u64;
        progress(done, total);
    }
    expect_end(&mut decoder, ends.source, &zstd_err)?;
    dst.flush().map_err(write_err)?;
    Ok(DecodeStats {
        dtype,
        tensors: header.tensors().len(),
        bytes: total,
    })
}

/// Decodes only as far as the header and returns it with the adapter's dtype.
pub(crate) fn peek_header(src: &mut dyn Read, source: &Path) -> Result<(Header, Dtype)> {
    let zstd_err = |e: io::Error| Error::Zstd {
        path: source.to_path_buf(),
        message: e.to_string(),
    };
    let mut decoder = zstd::stream::read::Decoder::new(src).map_err(zstd_err)?;
    let (_, header, dtype) = read_header(&mut decoder, None, source, &zstd_err)?;
    Ok((header, dtype))
}

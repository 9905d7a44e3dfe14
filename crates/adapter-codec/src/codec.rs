//! `AdapterCodec`: a compressed adapter and its config, as files or as bytes
//! embedded in the application.

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use st_mmap::{Dtype, Header};

use crate::compress::DEFAULT_LEVEL;
use crate::error::{Error, Result};
use crate::stream::{decode_stream, encode_stream, peek_header, DecodeStats, EncodeStats, Ends};

#[derive(Debug, Clone)]
enum Source {
    File(PathBuf),
    Embedded { name: PathBuf, bytes: &'static [u8] },
}

impl Source {
    fn name(&self) -> &Path {
        match self {
            Source::File(path) => path,
            Source::Embedded { name, .. } => name,
        }
    }

    fn open(&self, what: &'static str) -> Result<Box<dyn Read + '_>> {
        match self {
            Source::File(path) => match File::open(path) {
                Ok(file) => Ok(Box::new(BufReader::new(file))),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::Missing {
                    path: path.clone(),
                    what,
                }),
                Err(source) => Err(Error::Io {
                    path: path.clone(),
                    source,
                }),
            },
            Source::Embedded { bytes, .. } => Ok(Box::new(*bytes)),
        }
    }
}

/// A LoRA adapter shipped compressed: the `.zst` and the adapter's
/// `adapter_config.json`, bound together.
///
/// Applications ship their adapter as files next to the binary
/// ([`AdapterCodec::new`]) or inside it with `include_bytes!`
/// ([`AdapterCodec::embedded`]).
#[derive(Debug, Clone)]
pub struct AdapterCodec {
    zst: Source,
    config: Source,
    level: i32,
}

impl AdapterCodec {
    /// A codec bound to a `.zst` file and an `adapter_config.json` file.
    /// Neither needs to exist yet: `encode` creates the `.zst`.
    pub fn new(zst: impl Into<PathBuf>, config: impl Into<PathBuf>) -> AdapterCodec {
        AdapterCodec {
            zst: Source::File(zst.into()),
            config: Source::File(config.into()),
            level: DEFAULT_LEVEL,
        }
    }

    /// A codec over bytes compiled into the program, e.g.
    /// `AdapterCodec::embedded("adapters.safetensors.zst",
    /// include_bytes!("adapters.safetensors.zst"), include_bytes!("adapter_config.json"))`.
    /// `name` appears in errors. Such a codec decodes but cannot `encode`.
    pub fn embedded(
        name: impl Into<PathBuf>,
        zst: &'static [u8],
        config: &'static [u8],
    ) -> AdapterCodec {
        let name = name.into();
        AdapterCodec {
            config: Source::Embedded {
                name: name.with_file_name("adapter_config.json"),
                bytes: config,
            },
            zst: Source::Embedded { name, bytes: zst },
            level: DEFAULT_LEVEL,
        }
    }

    /// Uses zstd level `level` for `encode` (default 19, the reference's;
    /// digests only match the reference at the same level).
    ///
    /// # Errors
    /// [`Error::InvalidLevel`] outside zstd's range.
    pub fn with_level(mut self, level: i32) -> Result<AdapterCodec> {
        let range = zstd::compression_level_range();
        if !range.contains(&level) {
            return Err(Error::InvalidLevel {
                level,
                min: *range.start(),
                max: *range.end(),
            });
        }
        self.level = level;
        Ok(self)
    }

    /// The compression level `encode` uses.
    pub fn level(&self) -> i32 {
        self.level
    }

    /// The `.zst`'s path (or its name, when embedded).
    pub fn zst_path(&self) -> &Path {
        self.zst.name()
    }

    /// Compresses the safetensors adapter at `src` into this codec's `.zst`.
    ///
    /// The `.zst` is written to a temporary file beside it and renamed into
    /// place, so an interrupted encode never leaves a truncated file.
    ///
    /// # Errors
    /// [`Error::Embedded`] for an embedded codec; any header, dtype or I/O
    /// error, naming the file and tensor.
    pub fn encode(&self, src: impl AsRef<Path>) -> Result<EncodeStats> {
        self.encode_with_progress(src, |_, _| {})
    }

    /// [`encode`](Self::encode), calling `progress(done, total)` in bytes read.
    pub fn encode_with_progress(
        &self,
        src: impl AsRef<Path>,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<EncodeStats> {
        let src = src.as_ref();
        let Source::File(zst) = &self.zst else {
            return Err(Error::Embedded {
                name: self.zst.name().display().to_string(),
            });
        };
        let src_source = Source::File(src.to_path_buf());
        let mut input = src_source.open("adapter safetensors")?;
        let src_len = std::fs::metadata(src).ok().map(|m| m.len());
        write_atomically(zst, |out| {
            encode_stream(
                &mut input,
                src_len,
                out,
                self.level,
                Ends {
                    source: src,
                    sink: zst,
                },
                &mut progress,
            )
        })
    }

    /// Decompresses the adapter into the safetensors file `dst`, written to a
    /// temporary file beside it and renamed into place: a failed or
    /// interrupted decode leaves no partial `dst`.
    pub fn decode(&self, dst: impl AsRef<Path>) -> Result<DecodeStats> {
        self.decode_with_progress(dst, |_, _| {})
    }

    /// [`decode`](Self::decode), calling `progress(done, total)` in bytes written.
    pub fn decode_with_progress(
        &self,
        dst: impl AsRef<Path>,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<DecodeStats> {
        let dst = dst.as_ref();
        let mut input = self.zst.open("compressed adapter (.zst)")?;
        write_atomically(dst, |out| {
            decode_stream(
                &mut input,
                out,
                Ends {
                    source: self.zst.name(),
                    sink: dst,
                },
                &mut progress,
            )
        })
    }

    /// Decompresses the adapter into any writer. On error the writer may
    /// have received part of the data; use [`decode`](Self::decode) for files.
    pub fn decode_to_writer(&self, sink: &mut dyn Write) -> Result<DecodeStats> {
        let mut input = self.zst.open("compressed adapter (.zst)")?;
        decode_stream(
            &mut input,
            sink,
            Ends {
                source: self.zst.name(),
                sink: Path::new("<writer>"),
            },
            &mut |_, _| {},
        )
    }

    /// The first 16 hex digits of the SHA-256 of the compressed bytes. It
    /// names fused-model cache entries, and equals the reference's digest
    /// for the same `.zst`.
    pub fn digest(&self) -> Result<String> {
        let mut input = self.zst.open("compressed adapter (.zst)")?;
        let mut hasher = Sha256::new();
        std::io::copy(&mut input, &mut hasher).map_err(|source| Error::Io {
            path: self.zst.name().to_path_buf(),
            source,
        })?;
        let hex: String = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(hex[..16].to_owned())
    }

    /// The dtype all the adapter's tensors share, e.g. `BF16`. Decodes only
    /// the header.
    pub fn dtype(&self) -> Result<Dtype> {
        let mut input = self.zst.open("compressed adapter (.zst)")?;
        Ok(peek_header(&mut input, self.zst.name())?.1)
    }

    /// The adapter's safetensors header (tensor names, shapes, sizes).
    /// Decodes only the header.
    pub fn header(&self) -> Result<Header> {
        let mut input = self.zst.open("compressed adapter (.zst)")?;
        Ok(peek_header(&mut input, self.zst.name())?.0)
    }

    /// The bytes of `adapter_config.json`.
    pub fn config_bytes(&self) -> Result<Cow<'static, [u8]>> {
        match &self.config {
            Source::Embedded { bytes, .. } => Ok(Cow::Borrowed(bytes)),
            Source::File(path) => {
                let mut bytes = Vec::new();
                self.config
                    .open("adapter config")?
                    .read_to_end(&mut bytes)
                    .map_err(|source| Error::Io {
                        path: path.clone(),
                        source,
                    })?;
                Ok(Cow::Owned(bytes))
            }
        }
    }

    /// Where the config comes from (its path, or its name when embedded).
    pub fn config_path(&self) -> &Path {
        self.config.name()
    }
}

/// Runs `write` against a temporary file beside `dst`, then fsyncs and
/// renames it to `dst`. On any error the temporary file is removed and
/// `dst` is untouched.
///
/// The temporary file is `.{name}.partial-*`, locked (an OS file lock, which
/// dies with its process) while it is written. A process killed mid-write
/// cannot remove its file; the next write to the same `dst` removes every
/// such file whose lock nobody holds, so orphans do not pile up.
pub(crate) fn write_atomically<T>(
    dst: &Path,
    write: impl FnOnce(&mut dyn Write) -> Result<T>,
) -> Result<T> {
    let io_err = |source| Error::Io {
        path: dst.to_path_buf(),
        source,
    };
    let dir = match dst.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = dst
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let prefix = format!(".{name}.partial-");
    remove_orphans(dir, &prefix);
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix);
    // Temporary files are private (0600) by default; the renamed result
    // should be an ordinary file.
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644));
    let temp = builder.tempfile_in(dir).map_err(io_err)?;
    temp.as_file().try_lock().map_err(|e| io_err(e.into()))?;
    let mut out = BufWriter::new(temp);
    let value = write(&mut out)?;
    let temp = out.into_inner().map_err(|e| io_err(e.into_error()))?;
    temp.as_file().sync_all().map_err(io_err)?;
    temp.persist(dst).map_err(|e| io_err(e.error))?;
    Ok(value)
}

/// Removes the `{prefix}*` files in `dir` that no live writer holds locked.
/// Best effort: a file that cannot be opened or removed is left alone.
fn remove_orphans(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(prefix) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = std::fs::OpenOptions::new().write(true).open(&path) else {
            continue;
        };
        if file.try_lock().is_ok() {
            let _ = std::fs::remove_file(&path);
        }
    }
}

//! What the ranks of a group compare at load: every file of the model
//! folder that changes an answer — `config.json`, every weights file whole,
//! the tokenizer and its configuration, the chat template, the generation
//! config — each by its SHA-256 (or as absent).
//!
//! Hashing a multi-gigabyte checkpoint takes seconds, so each file's digest
//! is kept in a small cache file keyed by the file's canonical path, size
//! and modification time (nanoseconds): a later load of an unchanged file
//! reads it back. A file rewritten in place keeps its path but not its
//! modification time, so it is hashed again.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use rayon::prelude::*;
use sha2::{Digest, Sha256};
use st_mmap::SafetensorsSet;

use crate::error::{Error, Result};

/// One file of a model folder, by name within the folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileDigest {
    pub name: String,
    /// `None`: the folder has no such file (a chat template one rank has
    /// and another lacks is a difference too).
    pub digest: Option<[u8; 32]>,
}

/// A model folder's files that change an answer, sorted by name.
pub(crate) fn model_files(dir: &Path, set: &SafetensorsSet) -> Result<Vec<FileDigest>> {
    let mut paths: Vec<PathBuf> = set.files().iter().map(|f| f.path().to_path_buf()).collect();
    paths.push(dir.join("config.json"));
    paths.extend(crate::tokenizer::FILES.iter().map(|name| dir.join(name)));
    let cache = DigestCache::default_location();
    let mut files = paths
        .par_iter()
        .map(|path| {
            let name = path
                .strip_prefix(dir)
                .unwrap_or(path)
                .to_string_lossy()
                .into_owned();
            let digest = match path.is_file() {
                true => Some(cache.digest(path)?),
                false => None,
            };
            Ok(FileDigest { name, digest })
        })
        .collect::<Result<Vec<_>>>()?;
    files.sort_by(|a, b| a.name.cmp(&b.name));
    files.dedup_by(|a, b| a.name == b.name);
    Ok(files)
}

/// The model folder's files as one digest, in hex: what a prefix cache
/// on disk is bound to.
pub(crate) fn model_digest(dir: &Path, set: &SafetensorsSet) -> Result<String> {
    Ok(hex(&combined(&model_files(dir, set)?)))
}

/// The files `paths` (each named by its path, absent ones as absent) as
/// one digest, in hex.
pub(crate) fn files_digest(paths: &[PathBuf]) -> Result<String> {
    let cache = DigestCache::default_location();
    let files = paths
        .iter()
        .map(|path| {
            let digest = match path.is_file() {
                true => Some(cache.digest(path)?),
                false => None,
            };
            Ok(FileDigest {
                name: path.display().to_string(),
                digest,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(hex(&combined(&files)))
}

/// One digest of all of `files`, names included.
pub(crate) fn combined(files: &[FileDigest]) -> [u8; 32] {
    let mut h = Sha256::new();
    for f in files {
        h.update((f.name.len() as u64).to_le_bytes());
        h.update(f.name.as_bytes());
        match &f.digest {
            Some(d) => {
                h.update([1]);
                h.update(d);
            }
            None => h.update([0]),
        }
    }
    h.finalize().into()
}

/// Where file digests are kept between loads: `MLX_LOWMEM_CACHE`, else
/// `$XDG_CACHE_HOME/mlx-lowmem`, else `~/.cache/mlx-lowmem`, under
/// `file-digests/`. Without a usable folder every load hashes again.
struct DigestCache {
    dir: Option<PathBuf>,
}

impl DigestCache {
    fn default_location() -> DigestCache {
        let root = std::env::var_os("MLX_LOWMEM_CACHE")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("mlx-lowmem"))
            })
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/mlx-lowmem"))
            });
        DigestCache {
            dir: root.map(|r| r.join("file-digests")),
        }
    }

    /// `path`'s SHA-256: from the cache when its entry matches the file's
    /// path, size and modification time, else computed (and kept).
    fn digest(&self, path: &Path) -> Result<[u8; 32]> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let canonical = path.canonicalize().map_err(io)?;
        let meta = std::fs::metadata(&canonical).map_err(io)?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let stamp = format!("{} {} {mtime}", canonical.display(), meta.len());
        let entry = self.dir.as_ref().map(|d| {
            let key: [u8; 32] = Sha256::digest(canonical.to_string_lossy().as_bytes()).into();
            d.join(hex(&key[..16]))
        });
        if let Some(text) = entry.as_ref().and_then(|e| std::fs::read_to_string(e).ok()) {
            if let Some((kept, digest)) = text.rsplit_once('\n') {
                if kept == stamp {
                    if let Some(d) = unhex(digest.trim()) {
                        return Ok(d);
                    }
                }
            }
        }
        tracing::info!(file = %canonical.display(), bytes = meta.len(), "hashing a model file");
        let digest = sha256_of(&canonical).map_err(io)?;
        if let Some(entry) = entry {
            if let Err(e) = keep(&entry, &format!("{stamp}\n{}", hex(&digest))) {
                tracing::warn!(entry = %entry.display(), error = %e, "cannot keep a file digest");
            }
        }
        Ok(digest)
    }
}

fn sha256_of(path: &Path) -> std::io::Result<[u8; 32]> {
    let mut file = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(h.finalize().into());
        }
        h.update(&buf[..n]);
    }
}

/// Writes `text` to `entry` through a sibling temporary file, so that a
/// reader never sees half an entry.
fn keep(entry: &Path, text: &str) -> std::io::Result<()> {
    let dir = entry.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    std::io::Write::write_all(&mut tmp, text.as_bytes())?;
    tmp.persist(entry).map_err(|e| e.error)?;
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    if text.len() != 64 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_digest_is_used_only_while_the_file_is_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DigestCache {
            dir: Some(dir.path().join("cache")),
        };
        let file = dir.path().join("weights.bin");
        std::fs::write(&file, b"first contents").unwrap();
        let first = cache.digest(&file).unwrap();
        assert_eq!(first, <[u8; 32]>::from(Sha256::digest(b"first contents")));
        assert_eq!(cache.digest(&file).unwrap(), first);
        // A planted entry with the file's stamp is believed: the cache is
        // read, not bypassed.
        let entry = std::fs::read_dir(dir.path().join("cache"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let text = std::fs::read_to_string(&entry).unwrap();
        let (stamp, _) = text.rsplit_once('\n').unwrap();
        std::fs::write(&entry, format!("{stamp}\n{}", hex(&[7; 32]))).unwrap();
        assert_eq!(cache.digest(&file).unwrap(), [7; 32]);
        // Rewritten (another size, another time): hashed again.
        std::thread::sleep(std::time::Duration::from_millis(10));
        std::fs::write(&file, b"second, longer contents").unwrap();
        assert_eq!(
            cache.digest(&file).unwrap(),
            <[u8; 32]>::from(Sha256::digest(b"second, longer contents"))
        );
        // No cache folder: computed every time.
        let none = DigestCache { dir: None };
        assert_eq!(
            none.digest(&file).unwrap(),
            <[u8; 32]>::from(Sha256::digest(b"second, longer contents"))
        );
    }
}

//! A shared prefix's cache kept on disk across restarts, so that every
//! start after the first reads the prefix instead of computing it.
//!
//! A computed prefix is written as one safetensors file per prefix, its
//! keys and values per layer as they are held, with a `__metadata__` that
//! binds it to everything that changes them: the model's files (their
//! SHA-256, as the ranks of a distributed job compare them), the adapters'
//! files, the token ids, what the cache holds (the prefix alone, or with
//! the token generated after it) and the engine's arithmetic (how packed
//! weights are multiplied, which kernels, the device, MLX's version and the
//! engine's). The file's name is the digest of all of that; a file is used
//! only if its metadata equals the binding field by field, so a renamed,
//! truncated, corrupt or foreign file is a warning naming it, then the
//! prefix is computed again: never a crash, never a wrong answer.
//!
//! Writes go to a temporary file beside the target, synced, then renamed:
//! a process killed while writing leaves a temporary file, never a
//! `<digest>.safetensors` that is half written. The folder is bounded by a
//! size the user sets: after each write, the oldest files (by modification
//! time) go first until the rest fit.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use mlx_rs::Array;
use sha2::{Digest, Sha256};

use crate::distributed::identity;
use crate::models::checkpoint::Checkpoint;
use crate::nn::cache::KvCache;

/// What the format of a stored prefix is called; a later change of the
/// layout changes this, and older files are then ignored (and aged out).
const FORMAT: &str = "mlx-lowmem prefix cache 1";

/// A folder of stored prefixes, at most `max_bytes` of them.
#[derive(Debug, Clone)]
pub(crate) struct PrefixDisk {
    dir: PathBuf,
    max_bytes: u64,
}

/// What a stored prefix is bound to, besides its tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PrefixBinding {
    /// The model's files, as one digest (hex).
    pub model: String,
    /// Each adapter's files, as one digest each (hex), in the order given.
    pub adapters: Vec<String>,
    /// The engine's arithmetic (see the module's docs).
    pub arithmetic: String,
    /// What the cache holds: `clean`, or the prefix and its generated
    /// token.
    pub holds: String,
}

/// The model's files and each adapter's (folders, then sources made by
/// hand with their strength), as digests in hex: what a stored prefix is
/// bound to besides its tokens, what it holds and the arithmetic.
pub(crate) fn file_digests(
    checkpoint: &Checkpoint,
    adapters: &[PathBuf],
    lora: &[block_stream::BlockLoraSource],
) -> crate::Result<(String, Vec<String>)> {
    let model = identity::model_digest(checkpoint.dir(), checkpoint.set())?;
    let mut digests = Vec::new();
    for dir in adapters {
        let files = ["adapter_config.json", "adapters.safetensors"].map(|f| dir.join(f));
        digests.push(identity::files_digest(&files)?);
    }
    for source in lora {
        let file = identity::files_digest(&[source.path().to_path_buf()])?;
        digests.push(format!("{file}×{}", source.strength()));
    }
    Ok((model, digests))
}

impl PrefixDisk {
    pub(crate) fn new(dir: PathBuf, max_bytes: u64) -> PrefixDisk {
        PrefixDisk { dir, max_bytes }
    }

    /// The metadata a file for `tokens` under `binding` must carry.
    fn metadata(binding: &PrefixBinding, tokens: &[u32]) -> BTreeMap<String, String> {
        let tokens: Vec<String> = tokens.iter().map(u32::to_string).collect();
        BTreeMap::from([
            ("format".to_owned(), FORMAT.to_owned()),
            ("model".to_owned(), binding.model.clone()),
            ("adapters".to_owned(), binding.adapters.join(",")),
            ("arithmetic".to_owned(), binding.arithmetic.clone()),
            ("holds".to_owned(), binding.holds.clone()),
            ("tokens".to_owned(), tokens.join(",")),
        ])
    }

    /// Where the prefix of `tokens` under `binding` is stored.
    fn path(&self, metadata: &BTreeMap<String, String>) -> PathBuf {
        let mut h = Sha256::new();
        for (k, v) in metadata {
            h.update(k.as_bytes());
            h.update([0]);
            h.update(v.as_bytes());
            h.update([0]);
        }
        let digest: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("{digest}.safetensors"))
    }

    /// The stored cache of `tokens` under `binding`, when there is one that
    /// matches it exactly and reads whole; `None` (with a warning naming
    /// the file when one was there and could not be used) otherwise.
    pub(crate) fn load(&self, binding: &PrefixBinding, tokens: &[u32]) -> Option<KvCache> {
        let metadata = Self::metadata(binding, tokens);
        let path = self.path(&metadata);
        if !path.exists() {
            return None;
        }
        match read(&path, &metadata) {
            Ok(cache) => {
                tracing::info!(path = %path.display(), tokens = tokens.len(), "prefix read from the cache folder");
                // Used: the newest again, for the folder's bound.
                touch(&path);
                Some(cache)
            }
            Err(why) => {
                tracing::warn!(path = %path.display(), %why, "a stored prefix is not used; computing it");
                None
            }
        }
    }

    /// Stores `cache` (a prefix forked for one row) as the prefix of
    /// `tokens` under `binding`, then ages the folder down to its bound.
    /// A failure is a warning: the engine runs on without the file.
    pub(crate) fn store(&self, binding: &PrefixBinding, tokens: &[u32], cache: &KvCache) {
        let metadata = Self::metadata(binding, tokens);
        let path = self.path(&metadata);
        match write(&self.dir, &path, &metadata, cache) {
            Ok(()) => {
                tracing::info!(path = %path.display(), "prefix written to the cache folder");
                self.age_out(&path);
            }
            Err(why) => {
                tracing::warn!(path = %path.display(), %why, "could not store the prefix");
            }
        }
    }

    /// Removes the oldest stored prefixes (never `keep`, just written)
    /// until the folder's prefixes fit `max_bytes`.
    fn age_out(&self, keep: &Path) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut files: Vec<(std::time::SystemTime, u64, PathBuf)> = entries
            .flatten()
            .filter(|e| is_stored_prefix(&e.path()))
            .filter_map(|e| {
                let meta = e.metadata().ok()?;
                Some((meta.modified().ok()?, meta.len(), e.path()))
            })
            .collect();
        files.sort();
        let mut total: u64 = files.iter().map(|(_, len, _)| len).sum();
        for (_, len, path) in files {
            if total <= self.max_bytes {
                break;
            }
            if path == keep {
                continue;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => total -= len,
                Err(e) => {
                    tracing::warn!(path = %path.display(), %e, "could not remove an old prefix")
                }
            }
        }
    }
}

/// Whether `path` is a stored prefix's name (`<64 hex>.safetensors`), not a
/// temporary file or anything else in the folder.
fn is_stored_prefix(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    name.strip_suffix(".safetensors")
        .is_some_and(|stem| stem.len() == 64 && stem.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The cache in `path`, checked against `metadata`.
fn read(path: &Path, metadata: &BTreeMap<String, String>) -> Result<KvCache, String> {
    let file = st_mmap::SafetensorsFile::open(path).map_err(|e| e.to_string())?;
    let header = file.header();
    let stored = header.metadata().cloned().unwrap_or_default();
    let meta = |k: &str| stored.get(k).cloned().unwrap_or_default();
    for (key, want) in metadata {
        if &meta(key) != want {
            return Err(format!("its {key} is not this engine's"));
        }
    }
    let number = |k: &str| -> Result<i64, String> {
        meta(k)
            .parse::<i64>()
            .map_err(|_| format!("its {k} is not a number"))
    };
    let (layers, len) = (number("kv_layers")?, number("length")?);
    let len = i32::try_from(len).map_err(|_| "its length is out of range".to_owned())?;
    let mut shared = Vec::new();
    for layer in 0..layers {
        let array = |part: &str| -> Result<Option<Array>, String> {
            let key = format!("kv.{layer}.{part}");
            let Some(view) = file.tensor(&key) else {
                return Ok(None);
            };
            mlx_support::array_from_bytes(&key, view.dtype, view.shape, view.data)
                .map(Some)
                .map_err(|e| e.to_string())
        };
        shared.push(match (array("keys")?, array("values")?) {
            (Some(k), Some(v)) => Some((k, v)),
            (None, None) => None,
            _ => return Err(format!("layer {layer} has half of its keys and values")),
        });
    }
    Ok(KvCache::from_shared(shared, len))
}

/// Writes `cache` with `metadata` to `path`, atomically.
fn write(
    dir: &Path,
    path: &Path,
    metadata: &BTreeMap<String, String>,
    cache: &KvCache,
) -> Result<(), String> {
    let (layers, len) = cache
        .shared_parts()
        .ok_or("the cache holds more than a prefix")?;
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let mut arrays: Vec<(String, &Array)> = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        if let Some((k, v)) = layer {
            arrays.push((format!("kv.{i}.keys"), k));
            arrays.push((format!("kv.{i}.values"), v));
        }
    }
    let mut all: HashMap<String, String> = metadata.clone().into_iter().collect();
    all.insert("kv_layers".into(), layers.len().to_string());
    all.insert("length".into(), len.to_string());
    let temp = dir.join(format!(
        ".{}.{}.tmp.safetensors",
        path.file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("prefix"),
        std::process::id()
    ));
    let result = (|| {
        Array::save_safetensors(arrays, &all, &temp).map_err(|e| e.to_string())?;
        std::fs::File::open(&temp)
            .and_then(|f| f.sync_all())
            .map_err(|e| e.to_string())?;
        std::fs::rename(&temp, path).map_err(|e| e.to_string())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}

/// Marks `path` as used now (its modification time), so that the folder's
/// bound removes the prefixes used least recently first.
fn touch(path: &Path) {
    let now = std::time::SystemTime::now();
    if let Err(e) = std::fs::File::options()
        .append(true)
        .open(path)
        .and_then(|f| f.set_modified(now))
    {
        tracing::debug!(path = %path.display(), %e, "could not mark a stored prefix as used");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding() -> PrefixBinding {
        PrefixBinding {
            model: "m".repeat(64),
            adapters: vec!["a".repeat(64)],
            arithmetic: "DequantizeOnUse Native Cpu".into(),
            holds: "clean".into(),
        }
    }

    fn cache(seed: u64) -> KvCache {
        let key = mlx_rs::random::key(seed).unwrap();
        let kv = |shape: &[i32]| mlx_rs::random::normal::<f32>(shape, None, None, &key).unwrap();
        // Three layers, the middle one reading another's keys and values.
        KvCache::from_shared(
            vec![
                Some((kv(&[2, 5, 8]), kv(&[2, 5, 8]))),
                None,
                Some((kv(&[2, 3, 8]), kv(&[2, 3, 8]))),
            ],
            5,
        )
    }

    fn bits(cache: &KvCache) -> Vec<Vec<u32>> {
        let (layers, len) = cache.shared_parts().unwrap();
        let mut out = vec![vec![len as u32]];
        for (k, v) in layers.iter().flatten() {
            for a in [k, v] {
                let a = a.as_dtype(mlx_rs::Dtype::Float32).unwrap();
                out.push(a.as_slice::<f32>().iter().map(|x| x.to_bits()).collect());
            }
        }
        out.push(vec![layers.len() as u32]);
        out
    }

    /// Written and read back bit for bit; another token, adapter or
    /// arithmetic is another file; a corrupt, truncated or renamed file is
    /// not used; no temporary file stays behind.
    #[test]
    fn a_stored_prefix_reads_back_only_under_its_own_binding() {
        let dir = tempfile::tempdir().unwrap();
        let disk = PrefixDisk::new(dir.path().join("prefixes"), u64::MAX);
        let tokens = [1, 2, 3, 4, 5];
        assert!(
            disk.load(&binding(), &tokens).is_none(),
            "nothing stored yet"
        );
        let stored = cache(1);
        disk.store(&binding(), &tokens, &stored);
        let back = disk.load(&binding(), &tokens).expect("read back");
        assert_eq!(bits(&back), bits(&stored));
        assert!(back.shared(1).is_none() && back.shared(2).is_some());

        assert!(disk.load(&binding(), &[1, 2, 3, 4, 6]).is_none());
        let other = PrefixBinding {
            adapters: vec!["b".repeat(64)],
            ..binding()
        };
        assert!(disk.load(&other, &tokens).is_none());
        let other = PrefixBinding {
            arithmetic: "Keep Native Cpu".into(),
            ..binding()
        };
        assert!(disk.load(&other, &tokens).is_none());

        let files: Vec<PathBuf> = std::fs::read_dir(dir.path().join("prefixes"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1, "one file, no temporary one: {files:?}");
        let path = &files[0];
        assert!(is_stored_prefix(path));
        // Truncated: not used.
        let bytes = std::fs::read(path).unwrap();
        std::fs::write(path, &bytes[..bytes.len() - 7]).unwrap();
        assert!(disk.load(&binding(), &tokens).is_none());
        // A header that claims another binding, under the right name
        // (another engine's file renamed): not used.
        disk.store(&other, &tokens, &stored);
        let foreign = disk.path(&PrefixDisk::metadata(&other, &tokens));
        std::fs::rename(&foreign, path).unwrap();
        assert!(disk.load(&binding(), &tokens).is_none());
        // Garbage: not used.
        std::fs::write(path, b"not a safetensors file").unwrap();
        assert!(disk.load(&binding(), &tokens).is_none());
        // Stored again: used again.
        disk.store(&binding(), &tokens, &stored);
        assert_eq!(
            bits(&disk.load(&binding(), &tokens).unwrap()),
            bits(&stored)
        );
    }

    /// The folder keeps to its bound: the prefixes used least recently go
    /// first, the one just written stays.
    #[test]
    fn the_folder_keeps_to_its_bound_oldest_out_first() {
        let dir = tempfile::tempdir().unwrap();
        let one = {
            let probe = PrefixDisk::new(dir.path().join("probe"), u64::MAX);
            probe.store(&binding(), &[9], &cache(2));
            std::fs::read_dir(dir.path().join("probe"))
                .unwrap()
                .map(|e| e.unwrap().metadata().unwrap().len())
                .sum::<u64>()
        };
        // Room for two files of this size.
        let disk = PrefixDisk::new(dir.path().join("prefixes"), 2 * one + one / 2);
        let stored = cache(2);
        let exists = |t: u32| disk.path(&PrefixDisk::metadata(&binding(), &[t])).exists();
        let pause = || std::thread::sleep(std::time::Duration::from_millis(20));
        for t in 0..3u32 {
            disk.store(&binding(), &[t], &stored);
            pause();
        }
        assert_eq!((exists(0), exists(1), exists(2)), (false, true, true));
        // Prefix 1 used: now the newest, so 2 goes when 3 comes.
        assert!(disk.load(&binding(), &[1]).is_some());
        pause();
        disk.store(&binding(), &[3], &stored);
        assert_eq!((exists(1), exists(2), exists(3)), (true, false, true));
    }
}

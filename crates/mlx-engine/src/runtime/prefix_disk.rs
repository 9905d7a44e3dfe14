//! A shared prefix's cache kept on disk across restarts, so that every
//! start after the first reads the prefix instead of computing it.
//!
//! A computed prefix is written as one safetensors file per prefix: its
//! keys and values per layer as they are held, and the hidden state of its
//! last position, from which the token after the prefix is picked (by the
//! engine or by a logits processor); so a prefix whose cache also holds
//! that token is one head and one token's forward away from its file, and
//! the engine's prefix and the server's shared prefixes read the same
//! files. A `__metadata__` binds the file to everything that changes what
//! it holds: the model's files (their SHA-256, as the ranks of a
//! distributed job compare them), the adapters' files, the token ids and
//! the engine's arithmetic (how packed weights are multiplied, which
//! kernels, the device, MLX's version and the engine's). The file's name
//! is the digest of all of that; a file is used only if its metadata
//! equals the binding field by field, so a renamed, truncated, corrupt or
//! foreign file is a warning naming it, then the prefix is computed again:
//! never a crash, never a wrong answer.
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
use crate::evaluation::{evaluate, Why};
use crate::models::checkpoint::Checkpoint;
use crate::models::Model;
use crate::nn::cache::KvCache;
use crate::runtime::prefill::prefill_into;

/// What the format of a stored prefix is called; a later change of the
/// layout changes this, and older files are then ignored (and aged out).
const FORMAT: &str = "mlx-lowmem prefix cache 2";

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
}

impl PrefixBinding {
    /// This binding for a prefix computed under the per-row adapter whose
    /// files' digest is `digest`.
    pub(crate) fn under_row_adapter(&self, digest: &str) -> PrefixBinding {
        let mut binding = self.clone();
        binding.adapters.push(format!("per row {digest}"));
        binding
    }

    /// This binding for the prefix of `prefix` tokens with one more fed
    /// after it in a pass of its own ([`then_token`]): not the arithmetic
    /// of one prefill of them all, so never read as one.
    fn then_one_token(&self, prefix: usize) -> PrefixBinding {
        let mut binding = self.clone();
        binding.arithmetic = format!(
            "{}; the last token fed after the first {prefix} in a pass of its own",
            binding.arithmetic
        );
        binding
    }
}

/// A prefix as it is stored: the one-row cache of exactly its tokens, and
/// the hidden state of its last position (see
/// [`prefill_into`](crate::runtime::prefill::prefill_into)).
#[derive(Debug, Clone)]
pub(crate) struct StoredPrefix {
    pub cache: KvCache,
    pub last_hidden: Array,
}

/// The key of the last position's hidden state in a stored prefix.
const LAST_HIDDEN: &str = "last_hidden";

/// The model's files and each adapter's (folders, then sources made by
/// hand with their strength), as digests in hex: what a stored prefix is
/// bound to besides its tokens and the arithmetic.
pub(crate) fn file_digests(
    checkpoint: &Checkpoint,
    adapters: &[PathBuf],
    lora: &[block_stream::BlockLoraSource],
) -> crate::Result<(String, Vec<String>)> {
    let model = identity::model_digest(checkpoint.dir(), checkpoint.set())?;
    let mut digests = Vec::new();
    for dir in adapters {
        digests.push(crate::runtime::adapters::folder_digest(dir)?);
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

    /// The folder `(dir, max_bytes)` and the binding of its files to the
    /// model's and adapters' `digests` (see [`file_digests`]) and the
    /// engine's `arithmetic`.
    pub(crate) fn bound(
        (dir, max_bytes): (PathBuf, u64),
        (model, adapters): (String, Vec<String>),
        arithmetic: &str,
    ) -> (PrefixDisk, PrefixBinding) {
        let binding = PrefixBinding {
            model,
            adapters,
            arithmetic: arithmetic.to_owned(),
        };
        (PrefixDisk::new(dir, max_bytes), binding)
    }

    /// The metadata a file for `tokens` under `binding` must carry.
    fn metadata(binding: &PrefixBinding, tokens: &[u32]) -> BTreeMap<String, String> {
        let tokens: Vec<String> = tokens.iter().map(u32::to_string).collect();
        BTreeMap::from([
            ("format".to_owned(), FORMAT.to_owned()),
            ("model".to_owned(), binding.model.clone()),
            ("adapters".to_owned(), binding.adapters.join(",")),
            ("arithmetic".to_owned(), binding.arithmetic.clone()),
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

    /// The stored prefix of `tokens` under `binding`, when there is one
    /// that matches it exactly and reads whole; `None` (with a warning
    /// naming the file when one was there and could not be used) otherwise.
    pub(crate) fn load(&self, binding: &PrefixBinding, tokens: &[u32]) -> Option<StoredPrefix> {
        let metadata = Self::metadata(binding, tokens);
        let path = self.path(&metadata);
        if !path.exists() {
            return None;
        }
        match read(&path, &metadata) {
            Ok(stored) => {
                tracing::info!(path = %path.display(), tokens = tokens.len(), "prefix read from the cache folder");
                // Used: the newest again, for the folder's bound.
                touch(&path);
                Some(stored)
            }
            Err(why) => {
                tracing::warn!(path = %path.display(), %why, "a stored prefix is not used; computing it");
                None
            }
        }
    }

    /// Stores `prefix` (its cache forked for one row) as the prefix of
    /// `tokens` under `binding`, then ages the folder down to its bound.
    /// A failure is a warning: the engine runs on without the file.
    pub(crate) fn store(&self, binding: &PrefixBinding, tokens: &[u32], prefix: &StoredPrefix) {
        let metadata = Self::metadata(binding, tokens);
        let path = self.path(&metadata);
        match write(&self.dir, &path, &metadata, prefix) {
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

/// Where a prefix came from (see [`load_or_compute`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    Folder,
    Computed,
}

/// The prefix of `tokens` (not empty): read from `disk` when it holds it,
/// else computed and stored there. Evaluated either way: computed once,
/// and before lanes or rows read it.
pub(crate) fn load_or_compute(
    model: &Model,
    tokens: &[u32],
    adapter: Option<usize>,
    disk: Option<&(PrefixDisk, PrefixBinding)>,
) -> crate::Result<(StoredPrefix, Origin)> {
    if let Some(stored) = disk.and_then(|(disk, binding)| disk.load(binding, tokens)) {
        evaluate(
            Why::Load,
            stored.cache.arrays().chain([&stored.last_hidden]),
        )?;
        return Ok((stored, Origin::Folder));
    }
    let _span = tracing::info_span!("prefix_prefill", tokens = tokens.len()).entered();
    let mut cache = KvCache::new();
    let last_hidden =
        model.with_adapters(&[adapter], || prefill_into(model, &mut cache, &[tokens]))?;
    // Held as every fork reads it.
    let cache = cache.fork(1)?;
    evaluate(Why::Step, cache.arrays().chain([&last_hidden]))?;
    let computed = StoredPrefix { cache, last_hidden };
    if let Some((disk, binding)) = disk {
        disk.store(binding, tokens, &computed);
    }
    Ok((computed, Origin::Computed))
}

/// `prefix` (the cache of the prefix `tokens`) with `next` fed after it in
/// a pass of its own — the token a processor picked after the prefix,
/// which [`PrefixCache::WithGeneratedToken`](crate::PrefixCache) keeps in
/// the cache: read from `disk` when it holds it, else computed and stored
/// there. Without this, every start from the folder ran that pass: one
/// forward of the whole model, most of a warm start on a model whose
/// products unpack their weights.
pub(crate) fn then_token(
    model: &Model,
    mut prefix: KvCache,
    tokens: &[u32],
    next: u32,
    adapter: Option<usize>,
    disk: Option<&(PrefixDisk, PrefixBinding)>,
) -> crate::Result<KvCache> {
    let fed: Vec<u32> = tokens.iter().copied().chain([next]).collect();
    let disk = disk.map(|(disk, binding)| (disk, binding.then_one_token(tokens.len())));
    if let Some(stored) = disk
        .as_ref()
        .and_then(|(disk, binding)| disk.load(binding, &fed))
    {
        evaluate(Why::Load, stored.cache.arrays())?;
        return Ok(stored.cache);
    }
    let last_hidden =
        model.with_adapter(adapter, || prefill_into(model, &mut prefix, &[&[next]]))?;
    // Held as every fork reads it.
    let cache = prefix.fork(1)?;
    evaluate(Why::Step, cache.arrays().chain([&last_hidden]))?;
    let computed = StoredPrefix { cache, last_hidden };
    if let Some((disk, binding)) = &disk {
        disk.store(binding, &fed, &computed);
    }
    Ok(computed.cache)
}

/// The prefix folder and its binding for a prefix computed under
/// `adapter`, one of `model`'s per-row adapters (none without its digest).
pub(crate) fn disk_under_adapter(
    disk: Option<&(PrefixDisk, PrefixBinding)>,
    model: &crate::models::Model,
    adapter: Option<usize>,
) -> Option<(PrefixDisk, PrefixBinding)> {
    let (disk, binding) = disk?;
    let binding = match adapter {
        Some(slot) => binding.under_row_adapter(&model.row_adapters()?.digest(slot)?),
        None => binding.clone(),
    };
    Some((disk.clone(), binding))
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

/// The prefix in `path`, checked against `metadata`.
fn read(path: &Path, metadata: &BTreeMap<String, String>) -> Result<StoredPrefix, String> {
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
    let array = |key: &str| -> Result<Option<Array>, String> {
        let Some(view) = file.tensor(key) else {
            return Ok(None);
        };
        mlx_support::array_from_bytes(key, view.dtype, view.shape, view.data)
            .map(Some)
            .map_err(|e| e.to_string())
    };
    let mut shared = Vec::new();
    for layer in 0..layers {
        let part = |p: &str| array(&format!("kv.{layer}.{p}"));
        shared.push(match (part("keys")?, part("values")?) {
            (Some(k), Some(v)) => Some((k, v)),
            (None, None) => None,
            _ => return Err(format!("layer {layer} has half of its keys and values")),
        });
    }
    let last_hidden = array(LAST_HIDDEN)?.ok_or(format!("it has no {LAST_HIDDEN}"))?;
    Ok(StoredPrefix {
        cache: KvCache::from_shared(shared, len),
        last_hidden,
    })
}

/// Writes `prefix` with `metadata` to `path`, atomically.
fn write(
    dir: &Path,
    path: &Path,
    metadata: &BTreeMap<String, String>,
    prefix: &StoredPrefix,
) -> Result<(), String> {
    let (layers, len) = prefix
        .cache
        .shared_parts()
        .ok_or("the cache holds more than a prefix")?;
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let mut arrays: Vec<(String, &Array)> = vec![(LAST_HIDDEN.to_owned(), &prefix.last_hidden)];
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
        }
    }

    fn cache(seed: u64) -> StoredPrefix {
        let key = mlx_rs::random::key(seed).unwrap();
        let kv = |shape: &[i32]| mlx_rs::random::normal::<f32>(shape, None, None, &key).unwrap();
        // Three layers, the middle one reading another's keys and values.
        let cache = KvCache::from_shared(
            vec![
                Some((kv(&[2, 5, 8]), kv(&[2, 5, 8]))),
                None,
                Some((kv(&[2, 3, 8]), kv(&[2, 3, 8]))),
            ],
            5,
        );
        StoredPrefix {
            cache,
            last_hidden: kv(&[1, 16]),
        }
    }

    fn bits(prefix: &StoredPrefix) -> Vec<Vec<u32>> {
        let (layers, len) = prefix.cache.shared_parts().unwrap();
        let mut out = vec![vec![len as u32]];
        for (k, v) in layers.iter().flatten() {
            for a in [k, v, &prefix.last_hidden] {
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
        assert!(back.cache.shared(1).is_none() && back.cache.shared(2).is_some());

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

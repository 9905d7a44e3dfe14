//! `BlockStreamer`: one block's weights at a time, bound into one module.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlx_rs::module::ModuleParameters;
use mlx_rs::{Array, Dtype};
use st_mmap::{BlockIndex, BlockPrefix, SafetensorsSet};

use crate::error::{Error, Result};
use crate::lora::{BlockLoraSource, LoraFuser};
use mlx_support::{checked_dtype, checked_shape};

use crate::loader::LazyFile;

/// Streams transformer blocks from safetensors files into one shared block
/// module.
///
/// Each [`bind`](Self::bind) swaps block `i`'s tensors into the module as
/// MLX's own lazy loads: nothing is read until the module's output is
/// evaluated, and then each tensor is read once, straight into the buffer
/// MLX keeps for it. The streamer keeps no reference to a bound block's
/// arrays, so the previous block's arrays are freed as they are replaced:
/// resident memory stays near one block.
///
/// The files must not change while the streamer or any array loaded from
/// it is alive (headers are validated once, at [`new`](Self::new)).
pub struct BlockStreamer {
    set: Arc<SafetensorsSet>,
    prefix: BlockPrefix,
    index: BlockIndex,
    fuser: Option<Box<dyn LoraFuser>>,
    prefetch: bool,
    prefetcher: Option<std::thread::JoinHandle<()>>,
    clear_cache: bool,
    /// One per file of `set`, in its order.
    files: Vec<LazyFile>,
}

impl std::fmt::Debug for BlockStreamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockStreamer")
            .field("prefix", &self.prefix)
            .field("blocks", &self.index.len())
            .field("fuser", &self.fuser.is_some())
            .field("prefetch", &self.prefetch)
            .field("clear_cache", &self.clear_cache)
            .finish()
    }
}

impl BlockStreamer {
    /// Opens the weight files and indexes keys `{prefix}{i}.{param}`.
    ///
    /// # Errors
    /// Any header or file error (naming the file), duplicate keys across
    /// files, a malformed block key, or [`Error::NoBlocks`] when no key starts
    /// with `prefix`.
    pub fn new<P: AsRef<Path>>(
        weight_paths: impl IntoIterator<Item = P>,
        block_prefix: &str,
    ) -> Result<BlockStreamer> {
        let paths: Vec<PathBuf> = weight_paths
            .into_iter()
            .map(|p| p.as_ref().to_path_buf())
            .collect();
        let set = SafetensorsSet::open_files(&paths)?;
        BlockStreamer::from_set(Arc::new(set), block_prefix)
    }

    /// [`new`](Self::new) on a set the caller has already opened (an
    /// engine that reads the rest of the model from it too): its headers
    /// are not read again, and its files are mapped once.
    ///
    /// # Errors
    /// A malformed block key, or [`Error::NoBlocks`] when no key starts
    /// with `block_prefix`.
    pub fn from_set(set: Arc<SafetensorsSet>, block_prefix: &str) -> Result<BlockStreamer> {
        let prefix = BlockPrefix::new(block_prefix);
        let index = BlockIndex::build(&prefix, set.keys())?;
        if index.is_empty() {
            return Err(Error::NoBlocks {
                prefix: block_prefix.to_owned(),
                paths: set.files().iter().map(|f| f.path().to_path_buf()).collect(),
            });
        }
        Ok(BlockStreamer {
            files: set
                .files()
                .iter()
                .map(|f| LazyFile::new(f.path()))
                .collect(),
            set,
            prefix,
            index,
            fuser: None,
            prefetch: true,
            prefetcher: None,
            clear_cache: true,
        })
    }

    /// Fuses LoRA sources passed to [`bind`](Self::bind) with `fuser`.
    pub fn with_fuser(mut self, fuser: impl LoraFuser + 'static) -> BlockStreamer {
        self.fuser = Some(Box::new(fuser));
        self
    }

    /// When on (the default), each `bind(i)` starts a background thread that
    /// asks the OS to read block `i + 1`'s bytes into its page cache
    /// (`posix_fadvise(WILLNEED)` on Linux, a plain read loop elsewhere), so
    /// that the disk works while block `i` computes. It pays off when the
    /// file is not in the page cache (a quarter off a cold pass on the
    /// bench model) and costs nothing measurable when it is
    /// (docs/block-stream.md has the figures).
    pub fn with_prefetch(mut self, on: bool) -> BlockStreamer {
        self.prefetch = on;
        self
    }

    /// Whether `bind` keeps MLX's buffer cache from growing past one block
    /// (default on). The replaced block's buffers go to that cache when
    /// freed, and the new block's tensors are read into them when they are
    /// the same sizes, which saves faulting in fresh memory for every block.
    /// So `bind` returns the cache to the OS only when it holds more bytes
    /// than the block just bound (blocks of other shapes); off, it never
    /// does. (The Python original clears the cache after every block.)
    pub fn with_cache_clearing(mut self, on: bool) -> BlockStreamer {
        self.clear_cache = on;
        self
    }

    /// Number of distinct blocks.
    pub fn block_count(&self) -> usize {
        self.index.len()
    }

    /// The key prefix that marks block weights.
    pub fn block_prefix(&self) -> &str {
        self.prefix.as_str()
    }

    /// The block numbers, ascending.
    pub fn blocks(&self) -> Vec<usize> {
        self.index.blocks().collect()
    }

    /// Block `idx`'s parameter names, relative to the block, sorted.
    pub fn block_keys(&self, idx: usize) -> Result<Vec<String>> {
        Ok(self.params(idx)?.keys().cloned().collect())
    }

    /// Keys that are not block weights (embeddings, final norm, head, …).
    pub fn other_keys(&self) -> Vec<String> {
        self.set
            .keys()
            .filter(|k| matches!(self.prefix.parse(k), Ok(None)))
            .map(str::to_owned)
            .collect()
    }

    /// Any tensor (e.g. a non-block parameter) as a lazy load, read when
    /// first evaluated.
    pub fn tensor(&mut self, key: &str) -> Result<Array> {
        self.array(key)
    }

    fn params(&self, idx: usize) -> Result<&BTreeMap<String, String>> {
        self.index.params(idx).ok_or_else(|| Error::UnknownBlock {
            block: idx,
            known: self.index.blocks().collect(),
        })
    }

    fn file_index(&self, key: &str) -> Result<usize> {
        Ok(self
            .set
            .file_index_of(key)
            .expect("indexed keys are in the set"))
    }

    /// `key`'s tensor as MLX's lazy load from its file.
    fn array(&mut self, key: &str) -> Result<Array> {
        let file = self.file_index(key)?;
        let (_, shape, dtype) = self.expected(key, key)?;
        self.files[file].take(key, &shape, dtype)
    }

    /// The file bytes of `key`.
    fn byte_range(&self, file: usize, key: &str) -> (u64, u64) {
        let header = self.set.files()[file].header();
        let info = header.tensor(key).expect("indexed keys are in their file");
        let base = header.data_start() as u64;
        (
            base + info.data_offsets.0 as u64,
            base + info.data_offsets.1 as u64,
        )
    }

    fn expected(&self, param: &str, key: &str) -> Result<(String, Vec<i32>, Dtype)> {
        let file = self.file_index(key)?;
        let info = self.set.files()[file]
            .header()
            .tensor(key)
            .expect("indexed");
        let dtype = checked_dtype(key, info.dtype)?;
        let shape = checked_shape(key, &info.shape)?;
        Ok((param.to_owned(), shape, dtype))
    }

    /// Bytes of block `idx`'s tensors.
    fn block_bytes(&self, idx: usize) -> Result<usize> {
        let mut bytes = 0;
        for key in self.params(idx)?.values() {
            let (start, end) = self.byte_range(self.file_index(key)?, key);
            bytes += (end - start) as usize;
        }
        Ok(bytes)
    }

    /// For each file, the smallest byte range holding all of block `idx`.
    fn block_spans(&self, idx: usize) -> Result<Vec<(usize, u64, u64)>> {
        let mut spans: HashMap<usize, (u64, u64)> = HashMap::new();
        for key in self.params(idx)?.values() {
            let file = self.file_index(key)?;
            let (start, end) = self.byte_range(file, key);
            let span = spans.entry(file).or_insert((start, end));
            *span = (span.0.min(start), span.1.max(end));
        }
        let mut spans: Vec<_> = spans.into_iter().map(|(f, (s, e))| (f, s, e)).collect();
        spans.sort_unstable();
        Ok(spans)
    }

    /// Reads block `idx`'s bytes into the page cache on a background thread,
    /// unless the previous read-ahead is still running.
    fn prefetch(&mut self, idx: usize) -> Result<()> {
        if self.prefetcher.as_ref().is_some_and(|h| !h.is_finished()) {
            return Ok(());
        }
        let mut work = Vec::new();
        for (file, start, end) in self.block_spans(idx)? {
            if let Ok(handle) = self.set.files()[file].file().try_clone() {
                work.push((handle, start, end));
            }
        }
        self.prefetcher = Some(std::thread::spawn(move || {
            for (file, start, end) in work {
                read_ahead(&file, start, end);
            }
        }));
        Ok(())
    }

    /// Block `idx`'s weights, LoRA fused, as `(param, array)` pairs sorted
    /// by parameter name (relative to the block): what [`bind`](Self::bind)
    /// puts into a module, for callers that hold a block's weights in their
    /// own structures instead.
    ///
    /// Without LoRA for this block the arrays are MLX's lazy loads: nothing
    /// is read until they are evaluated, and then each tensor is read once
    /// into the buffer the array keeps, which dies with the caller's last
    /// reference. The fuser needs the whole block, so with LoRA the result
    /// is the fuser's (its own arrays, lazy or not). With prefetch on, the
    /// next block's bytes are read ahead as in `bind`.
    ///
    /// `lora_sources` are fused by the streamer's fuser (an error without
    /// one); sources without LoRA for this block are skipped. A source with
    /// a pair for a block the files do not hold, or for a weight the block
    /// does not have, is [`Error::Lora`] naming its file and key.
    pub fn block_weights(
        &mut self,
        idx: usize,
        lora_sources: &[&BlockLoraSource],
    ) -> Result<Vec<(String, Array)>> {
        let params = self.params(idx)?.clone();
        if !lora_sources.is_empty() && self.fuser.is_none() {
            return Err(Error::NoFuser);
        }
        self.check_blocks(lora_sources)?;
        let with_lora: Vec<&BlockLoraSource> = lora_sources
            .iter()
            .copied()
            .filter(|s| s.has_block(idx))
            .collect();
        let mut weights = Vec::with_capacity(params.len());
        for (param, key) in &params {
            weights.push((param.clone(), self.array(key)?));
        }
        if let (Some(fuser), false) = (&self.fuser, with_lora.is_empty()) {
            weights = fuser.fuse(idx, weights, &with_lora)?;
        }
        if self.prefetch {
            let next = self.index.blocks().find(|&b| b > idx);
            if let Some(next) = next {
                self.prefetch(next)?;
            }
        }
        Ok(weights)
    }

    /// Checks that every block the sources adapt is one of the streamer's:
    /// a pair for a block the model lacks would otherwise never be applied.
    fn check_blocks(&self, lora_sources: &[&BlockLoraSource]) -> Result<()> {
        for source in lora_sources {
            for block in source.blocks() {
                if self.index.params(block).is_none() {
                    let known: Vec<usize> = self.index.blocks().collect();
                    return Err(Error::Lora {
                        adapter: source.path().to_path_buf(),
                        key: source.first_key(block).unwrap_or_default().to_owned(),
                        block,
                        param: String::new(),
                        message: format!(
                            "the model has no block {block} under {:?} (its blocks: {}..={})",
                            self.prefix.as_str(),
                            known.first().copied().unwrap_or(0),
                            known.last().copied().unwrap_or(0),
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Binds block `idx`'s weights into `block`'s parameters.
    ///
    /// Strict: the block's parameters (after LoRA fusion) and the module's
    /// must match exactly in names, shapes and dtypes; otherwise nothing is
    /// changed and the error names the block and parameter.
    ///
    /// The block bound before is evicted by this call: its weights are freed
    /// as they are replaced in `block` (the streamer holds none), and MLX's
    /// buffer cache is returned to the OS afterwards unless
    /// [`with_cache_clearing(false)`](Self::with_cache_clearing).
    ///
    /// `lora_sources` are fused by the streamer's fuser (an error without
    /// one); sources without LoRA for this block are skipped.
    pub fn bind<M: ModuleParameters>(
        &mut self,
        block: &mut M,
        idx: usize,
        lora_sources: &[&BlockLoraSource],
    ) -> Result<()> {
        let _span =
            tracing::debug_span!("bind", block = idx, lora_sources = lora_sources.len()).entered();
        // All of the block's arrays are made (lazy loads: nothing of the new
        // block is read before the old one is replaced) and checked before
        // any is assigned, so that an error changes nothing.
        let weights = self.block_weights(idx, lora_sources)?;
        let expected = weights
            .iter()
            .map(|(n, a)| (n.clone(), a.shape().to_vec(), a.dtype()))
            .collect();
        check_against(block, idx, expected)?;
        let mut slots = block.parameters_mut().flatten();
        for (name, array) in weights {
            **slots.get_mut(name.as_str()).expect("checked") = array;
        }
        if self.clear_cache && mlx_rs::memory::cache_memory()? > self.block_bytes(idx)? {
            // The replaced block's buffers are in MLX's cache; the new
            // block's reads will reuse as many bytes as it has, and what is
            // beyond that would only sit there.
            mlx_rs::memory::clear_cache()?;
        }
        Ok(())
    }
}

/// Brings bytes `start..end` of `file` into the page cache. On Linux the
/// kernel does the reading (`POSIX_FADV_WILLNEED`), which costs this thread
/// no copying; elsewhere the bytes are read into a scratch buffer.
fn read_ahead(file: &File, start: u64, end: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor; the call only advises the kernel.
        let done = unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                start as libc::off_t,
                (end - start) as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        } == 0;
        if done {
            return;
        }
    }
    let mut buf = vec![0u8; 1 << 20];
    let mut at = start;
    while at < end {
        let want = buf.len().min((end - at) as usize);
        if st_mmap::read_exact_at(file, &mut buf[..want], at).is_err() {
            break;
        }
        at += want as u64;
    }
}

/// Checks that the module's parameters and `expected` (name, shape, dtype)
/// match exactly, before anything is assigned.
fn check_against<M: ModuleParameters>(
    block: &mut M,
    idx: usize,
    expected: Vec<(String, Vec<i32>, Dtype)>,
) -> Result<()> {
    let slots = block.parameters_mut().flatten();
    let incoming: HashMap<String, (Vec<i32>, Dtype)> =
        expected.into_iter().map(|(n, s, d)| (n, (s, d))).collect();
    let mut names: Vec<&str> = slots.keys().map(|k| &**k).collect();
    names.sort();
    for name in names {
        let Some((shape, dtype)) = incoming.get(name) else {
            return Err(Error::MissingParam {
                block: idx,
                param: name.to_owned(),
            });
        };
        let slot = &slots[name];
        if slot.shape() != shape.as_slice() {
            return Err(Error::ShapeMismatch {
                block: idx,
                param: name.to_owned(),
                expected: slot.shape().to_vec(),
                actual: shape.clone(),
            });
        }
        if slot.dtype() != *dtype {
            return Err(Error::DtypeMismatch {
                block: idx,
                param: name.to_owned(),
                expected: slot.dtype(),
                actual: *dtype,
            });
        }
    }
    let mut extra: Vec<&String> = incoming
        .keys()
        .filter(|k| !slots.contains_key(k.as_str()))
        .collect();
    extra.sort();
    if let Some(param) = extra.first() {
        return Err(Error::UnexpectedParam {
            block: idx,
            param: (*param).clone(),
        });
    }
    Ok(())
}

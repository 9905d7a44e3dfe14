//! `BlockStreamer`: one block's weights at a time, bound into one module.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlx_rs::module::ModuleParameters;
use mlx_rs::Array;
use st_mmap::{BlockIndex, BlockPrefix, SafetensorsSet};

use crate::error::{Error, Result};
use crate::lora::{BlockLoraSource, LoraFuser};
use crate::mapped::{array_over, MappedRange, TensorAt};

/// The mappings that back one block's arrays, one per file it spans.
type BlockMaps = Vec<(usize, Arc<MappedRange>)>;

/// Streams transformer blocks from memory-mapped safetensors into one shared
/// block module.
///
/// Each [`bind`](Self::bind) maps block `i`'s bytes (copy-on-write, lazily
/// paged in), makes zero-copy MLX arrays over them and swaps them into the
/// module. The streamer keeps no reference to a bound block's arrays, so when
/// the module is rebound to the next block the previous arrays are freed and
/// their mapping is unmapped: resident memory stays near one block.
///
/// The memory-map contract of [`st_mmap::SafetensorsFile::open`] applies to
/// every weights file: it must not change while the streamer or any array
/// made from it is alive.
pub struct BlockStreamer {
    set: SafetensorsSet,
    files: Vec<File>,
    prefix: BlockPrefix,
    index: BlockIndex,
    fuser: Option<Box<dyn LoraFuser>>,
    prefetch: bool,
    prefetched: Option<(usize, BlockMaps)>,
    zero_copy: (usize, usize),
    closed: bool,
}

impl std::fmt::Debug for BlockStreamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockStreamer")
            .field("prefix", &self.prefix)
            .field("blocks", &self.index.len())
            .field("fuser", &self.fuser.is_some())
            .field("prefetch", &self.prefetch)
            .field("closed", &self.closed)
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
        let prefix = BlockPrefix::new(block_prefix);
        let index = BlockIndex::build(&prefix, set.keys())?;
        if index.is_empty() {
            return Err(Error::NoBlocks {
                prefix: block_prefix.to_owned(),
                paths,
            });
        }
        let files = paths
            .iter()
            .map(|p| {
                File::open(p).map_err(|source| {
                    Error::Safetensors(st_mmap::Error::Io {
                        path: p.clone(),
                        source,
                    })
                })
            })
            .collect::<Result<_>>()?;
        Ok(BlockStreamer {
            set,
            files,
            prefix,
            index,
            fuser: None,
            prefetch: false,
            prefetched: None,
            zero_copy: (0, 0),
            closed: false,
        })
    }

    /// Fuses LoRA sources passed to [`bind`](Self::bind) with `fuser`.
    pub fn with_fuser(mut self, fuser: impl LoraFuser + 'static) -> BlockStreamer {
        self.fuser = Some(Box::new(fuser));
        self
    }

    /// When on, each `bind(i)` also maps block `i + 1` and asks the OS to
    /// read it ahead, so that its I/O overlaps block `i`'s compute.
    pub fn with_prefetch(mut self, on: bool) -> BlockStreamer {
        self.prefetch = on;
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
        self.check_open()?;
        Ok(self.params(idx)?.keys().cloned().collect())
    }

    /// How many arrays were made without copying, out of all made.
    pub fn zero_copy_stats(&self) -> (usize, usize) {
        self.zero_copy
    }

    /// Keys that are not block weights (embeddings, final norm, head, …).
    pub fn other_keys(&self) -> Vec<String> {
        self.set
            .keys()
            .filter(|k| matches!(self.prefix.parse(k), Ok(None)))
            .map(str::to_owned)
            .collect()
    }

    /// A zero-copy array of any tensor, e.g. a non-block parameter.
    pub fn tensor(&mut self, key: &str) -> Result<Array> {
        self.check_open()?;
        let file = self.file_index(key)?;
        let (start, end) = self.byte_range(file, key);
        let range = MappedRange::map(self.set.files()[file].path(), &self.files[file], start, end)?;
        self.array(&range, file, key)
    }

    fn check_open(&self) -> Result<()> {
        if self.closed {
            return Err(Error::Closed {
                what: "the block streamer",
            });
        }
        Ok(())
    }

    fn params(&self, idx: usize) -> Result<&BTreeMap<String, String>> {
        self.index.params(idx).ok_or_else(|| Error::UnknownBlock {
            block: idx,
            known: self.index.blocks().collect(),
        })
    }

    fn file_index(&self, key: &str) -> Result<usize> {
        let path = self.set.file_of(key).expect("indexed keys are in the set");
        Ok(self
            .set
            .files()
            .iter()
            .position(|f| f.path() == path)
            .expect("the file is in the set"))
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

    fn array(&mut self, range: &Arc<MappedRange>, file: usize, key: &str) -> Result<Array> {
        let info = self.set.files()[file]
            .header()
            .tensor(key)
            .expect("indexed");
        let (start, end) = self.byte_range(file, key);
        let (array, zero_copy) = array_over(
            range,
            TensorAt {
                key,
                dtype: info.dtype,
                shape: &info.shape,
                file_offset: start,
                len: (end - start) as usize,
            },
        )?;
        self.zero_copy.0 += usize::from(zero_copy);
        self.zero_copy.1 += 1;
        Ok(array)
    }

    /// Maps the smallest range of each file that holds all of block `idx`.
    fn map_block(&self, idx: usize) -> Result<BlockMaps> {
        let mut spans: HashMap<usize, (u64, u64)> = HashMap::new();
        for key in self.params(idx)?.values() {
            let file = self.file_index(key)?;
            let (start, end) = self.byte_range(file, key);
            let span = spans.entry(file).or_insert((start, end));
            *span = (span.0.min(start), span.1.max(end));
        }
        let mut maps: BlockMaps = spans
            .into_iter()
            .map(|(file, (start, end))| {
                MappedRange::map(self.set.files()[file].path(), &self.files[file], start, end)
                    .map(|m| (file, m))
            })
            .collect::<Result<_>>()?;
        maps.sort_by_key(|(file, _)| *file);
        Ok(maps)
    }

    /// Binds block `idx`'s weights into `block`'s parameters.
    ///
    /// Strict: the block's parameters (after LoRA fusion) and the module's
    /// must match exactly in names, shapes and dtypes; otherwise nothing is
    /// changed and the error names the block and parameter.
    ///
    /// `evict_previous` names the block bound before: anything the streamer
    /// still holds for it (a prefetched mapping) is dropped and MLX's buffer
    /// cache is cleared. Its weights themselves are freed as soon as nothing
    /// references them, which is when this call replaces them in `block`.
    ///
    /// `lora_sources` are fused by the streamer's fuser (an error without
    /// one); sources without LoRA for this block are skipped.
    pub fn bind<M: ModuleParameters>(
        &mut self,
        block: &mut M,
        idx: usize,
        evict_previous: Option<usize>,
        lora_sources: &[&BlockLoraSource],
    ) -> Result<()> {
        self.check_open()?;
        let params = self.params(idx)?.clone();
        if !lora_sources.is_empty() && self.fuser.is_none() {
            return Err(Error::NoFuser);
        }
        if let Some(previous) = evict_previous {
            if self
                .prefetched
                .as_ref()
                .is_some_and(|(i, _)| *i == previous)
            {
                self.prefetched = None;
            }
            mlx_rs::memory::clear_cache()?;
        }
        let maps = match self.prefetched.take() {
            Some((i, maps)) if i == idx => maps,
            _ => self.map_block(idx)?,
        };
        let mut weights = Vec::with_capacity(params.len());
        for (param, key) in &params {
            let file = self.file_index(key)?;
            let range = &maps.iter().find(|(f, _)| *f == file).expect("mapped").1;
            weights.push((param.clone(), self.array(range, file, key)?));
        }
        drop(maps);

        let with_lora: Vec<&BlockLoraSource> = lora_sources
            .iter()
            .copied()
            .filter(|s| s.has_block(idx))
            .collect();
        if let (Some(fuser), false) = (&self.fuser, with_lora.is_empty()) {
            weights = fuser.fuse(idx, weights, &with_lora)?;
        }
        assign_strictly(block, idx, weights)?;

        if self.prefetch {
            let next = self.index.blocks().find(|&b| b > idx);
            if let Some(next) = next {
                let maps = self.map_block(next)?;
                for (_, range) in &maps {
                    range.prefetch();
                }
                self.prefetched = Some((next, maps));
            }
        }
        Ok(())
    }

    /// Releases the files and mappings; the streamer is unusable afterwards.
    /// Arrays already bound stay valid (they keep their own mapping alive).
    pub fn close(&mut self) {
        self.prefetched = None;
        self.files.clear();
        self.closed = true;
    }
}

/// Checks every weight against the module first, then assigns them all, so
/// a failed bind leaves the module as it was.
fn assign_strictly<M: ModuleParameters>(
    block: &mut M,
    idx: usize,
    weights: Vec<(String, Array)>,
) -> Result<()> {
    let mut slots = block.parameters_mut().flatten();
    let mut incoming: HashMap<String, Array> = weights.into_iter().collect();
    let mut names: Vec<String> = slots.keys().map(|k| k.to_string()).collect();
    names.sort();
    for name in &names {
        let Some(array) = incoming.get(name) else {
            return Err(Error::MissingParam {
                block: idx,
                param: name.clone(),
            });
        };
        let slot = &slots[name.as_str()];
        if slot.shape() != array.shape() {
            return Err(Error::ShapeMismatch {
                block: idx,
                param: name.clone(),
                expected: slot.shape().to_vec(),
                actual: array.shape().to_vec(),
            });
        }
        if slot.dtype() != array.dtype() {
            return Err(Error::DtypeMismatch {
                block: idx,
                param: name.clone(),
                expected: slot.dtype(),
                actual: array.dtype(),
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
    for name in names {
        let array = incoming.remove(&name).expect("checked above");
        **slots.get_mut(name.as_str()).expect("checked above") = array;
    }
    Ok(())
}

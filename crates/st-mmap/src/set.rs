//! Several safetensors files (the shards of one model) seen as one.

use std::collections::BTreeMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::error::{io_error, Error, Result};
use crate::file::{SafetensorsFile, TensorView};
use crate::index::{ShardIndex, INDEX_FILE};

/// Several mapped files whose keys are unique across all of them.
#[derive(Debug)]
pub struct SafetensorsSet {
    files: Vec<SafetensorsFile>,
    /// Key → position in `files`; sorted for stable iteration.
    keys: BTreeMap<String, usize>,
}

impl SafetensorsSet {
    /// Maps every file in `paths` (see [`SafetensorsFile::open`] for the
    /// memory-map contract).
    ///
    /// # Errors
    /// Any error opening a file, or [`Error::DuplicateKey`] when two files
    /// hold the same key (nothing is silently overwritten).
    pub fn open_files<P: AsRef<Path>>(paths: impl IntoIterator<Item = P>) -> Result<Self> {
        let files = paths
            .into_iter()
            .map(SafetensorsFile::open)
            .collect::<Result<Vec<_>>>()?;
        Self::from_files(files)
    }

    /// Opens a model directory: the shards listed by
    /// `model.safetensors.index.json` when present (cross-checked against the
    /// shards' own headers), else every `*.safetensors` file in it.
    ///
    /// # Errors
    /// [`Error::InvalidIndex`] / [`Error::IndexMismatch`] for an unreadable
    /// or lying index, [`Error::NoSafetensors`] for a directory without
    /// weights, and any error of [`SafetensorsSet::open_files`].
    pub fn open_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let index_path = dir.join(INDEX_FILE);
        if index_path.is_file() {
            return Self::open_indexed(dir, &index_path);
        }
        let mut paths: Vec<PathBuf> = fs::read_dir(dir)
            .map_err(io_error(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        if paths.is_empty() {
            return Err(Error::NoSafetensors {
                dir: dir.to_path_buf(),
            });
        }
        paths.sort();
        Self::open_files(paths)
    }

    fn open_indexed(dir: &Path, index_path: &Path) -> Result<Self> {
        let index = ShardIndex::read(index_path)?;
        let set = Self::open_files(index.shard_names().iter().map(|n| dir.join(n)))?;
        let mismatch = |key: &str, problem: String| Error::IndexMismatch {
            index: index_path.to_path_buf(),
            key: key.to_owned(),
            problem,
        };
        for (key, shard) in index.weight_map() {
            match set.file_of(key) {
                None => {
                    return Err(mismatch(
                        key,
                        format!("is listed in {shard} but no shard holds it"),
                    ))
                }
                Some(actual) if actual.file_name().is_some_and(|f| f != shard.as_str()) => {
                    return Err(mismatch(
                        key,
                        format!("is listed in {shard} but is in {}", actual.display()),
                    ))
                }
                Some(_) => {}
            }
        }
        for (key, &file) in &set.keys {
            if !index.weight_map().contains_key(key) {
                let path = set.files[file].path().display().to_string();
                return Err(mismatch(key, format!("is in {path} but not in the index")));
            }
        }
        Ok(set)
    }

    fn from_files(files: Vec<SafetensorsFile>) -> Result<Self> {
        let mut keys = BTreeMap::new();
        for (i, file) in files.iter().enumerate() {
            for info in file.header().tensors() {
                if let Some(&first) = keys.get(&info.name) {
                    let first: &SafetensorsFile = &files[first];
                    return Err(Error::DuplicateKey {
                        key: info.name.clone(),
                        first: first.path().to_path_buf(),
                        second: file.path().to_path_buf(),
                    });
                }
                keys.insert(info.name.clone(), i);
            }
        }
        Ok(SafetensorsSet { files, keys })
    }

    /// The position in [`files`](Self::files) of the file holding `key`.
    pub fn file_index_of(&self, key: &str) -> Option<usize> {
        self.keys.get(key).copied()
    }

    /// The mapped files, in the order they were opened.
    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }

    /// Every key, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// Number of tensors across all files.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no file holds any tensor.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// A view of the tensor `key`, wherever it is.
    pub fn tensor(&self, key: &str) -> Option<TensorView<'_>> {
        self.files[*self.keys.get(key)?].tensor(key)
    }

    /// Drops the pages of `key` from resident memory once it has been
    /// copied out; see [`SafetensorsFile::release`].
    pub fn release(&self, key: &str) -> bool {
        self.keys
            .get(key)
            .is_some_and(|&i| self.files[i].release(key))
    }

    /// Rows `rows` of tensor `key`, wherever it is, by positioned reads; see
    /// [`SafetensorsFile::read_rows`].
    ///
    /// # Errors
    /// As [`SafetensorsFile::read_rows`].
    pub fn read_rows(&self, key: &str, rows: Range<usize>) -> Result<Option<Vec<u8>>> {
        match self.keys.get(key) {
            Some(&i) => self.files[i].read_rows(key, rows),
            None => Ok(None),
        }
    }

    /// Rows `rows` of tensor `key` read into `out`; see
    /// [`SafetensorsFile::read_rows_into`]. `false` for an unknown key.
    ///
    /// # Errors
    /// As [`SafetensorsFile::read_rows_into`].
    pub fn read_rows_into(&self, key: &str, rows: Range<usize>, out: &mut [u8]) -> Result<bool> {
        match self.keys.get(key) {
            Some(&i) => self.files[i].read_rows_into(key, rows, out),
            None => Ok(false),
        }
    }

    /// [`SafetensorsFile::advise_will_read`] for `key` in the file that
    /// holds it; `false` for an unknown key.
    ///
    /// # Errors
    /// As that method.
    pub fn advise_will_read(&self, key: &str, rows: Range<usize>) -> Result<bool> {
        match self.keys.get(key) {
            Some(&i) => self.files[i].advise_will_read(key, rows),
            None => Ok(false),
        }
    }

    /// The file that holds `key`.
    pub fn file_of(&self, key: &str) -> Option<&Path> {
        self.keys.get(key).map(|&i| self.files[i].path())
    }

    /// The mapped file that holds `key`.
    pub fn mapped_file_of(&self, key: &str) -> Option<&SafetensorsFile> {
        self.keys.get(key).map(|&i| &self.files[i])
    }
}

//! `model.safetensors.index.json`: which shard holds each tensor. Read and
//! written here only.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Component, Path};

use serde::{Deserialize, Serialize};

use crate::error::{io_error, Error, Result};

/// The file name of a sharded model's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A sharded model's index: tensor key → shard file name, and the total
/// size of the tensors' data.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardIndex {
    weight_map: BTreeMap<String, String>,
    total_size: Option<u64>,
}

#[derive(Deserialize, Serialize)]
struct IndexFile {
    #[serde(default)]
    metadata: Metadata,
    weight_map: BTreeMap<String, String>,
}

#[derive(Default, Deserialize, Serialize)]
struct Metadata {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    total_size: Option<u64>,
}

impl ShardIndex {
    /// An index of `weight_map` (key → shard file name).
    pub fn new(weight_map: BTreeMap<String, String>, total_size: u64) -> ShardIndex {
        ShardIndex {
            weight_map,
            total_size: Some(total_size),
        }
    }

    /// Reads and checks an index file: valid JSON with a `weight_map`, and
    /// every shard a plain file name in the index's folder (not `.`, `..` or
    /// a path elsewhere).
    ///
    /// # Errors
    /// [`Error::Io`], or [`Error::InvalidIndex`] naming the problem.
    pub fn read(path: &Path) -> Result<ShardIndex> {
        let text = fs::read_to_string(path).map_err(io_error(path))?;
        let invalid = |message: String| Error::InvalidIndex {
            path: path.to_path_buf(),
            message,
        };
        let file: IndexFile = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let index = ShardIndex {
            weight_map: file.weight_map,
            total_size: file.metadata.total_size,
        };
        for name in index.shard_names() {
            let mut parts = Path::new(name).components();
            let plain = matches!(
                (parts.next(), parts.next()),
                (Some(Component::Normal(_)), None)
            );
            if !plain {
                return Err(invalid(format!(
                    "shard name {name:?} is not a plain file name"
                )));
            }
        }
        Ok(index)
    }

    /// Writes the index as mlx_lm and transformers do (`metadata.total_size`
    /// and `weight_map`, keys sorted).
    pub fn write(&self, path: &Path) -> Result<()> {
        let file = IndexFile {
            metadata: Metadata {
                total_size: self.total_size,
            },
            weight_map: self.weight_map.clone(),
        };
        let text = serde_json::to_vec_pretty(&file).expect("an index serializes");
        fs::write(path, text).map_err(io_error(path))
    }

    /// Key → shard file name.
    pub fn weight_map(&self) -> &BTreeMap<String, String> {
        &self.weight_map
    }

    /// The shards' file names, sorted, each once.
    pub fn shard_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.weight_map.values().map(String::as_str).collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// `metadata.total_size`, when the index records it.
    pub fn total_size(&self) -> Option<u64> {
        self.total_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_indexes_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(INDEX_FILE);
        let map: BTreeMap<String, String> = [("b", "s2"), ("a", "s1"), ("c", "s1")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let index = ShardIndex::new(map, 1234);
        index.write(&path).unwrap();
        let back = ShardIndex::read(&path).unwrap();
        assert_eq!(back, index);
        assert_eq!(back.shard_names(), ["s1", "s2"]);
        let json: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(json["metadata"]["total_size"], 1234);
    }
}

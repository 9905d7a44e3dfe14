//! Every tensor of a model folder, for tests that compare two folders
//! byte for byte (a fuse against the Python original's, or against itself
//! called another way).

use std::collections::BTreeMap;
use std::path::Path;

/// A tensor as stored: dtype name, shape, bytes.
pub type Stored = (String, Vec<usize>, Vec<u8>);

/// Every tensor of `dir`'s safetensors (one file or shards): name → stored.
pub fn in_folder(dir: &Path) -> BTreeMap<String, Stored> {
    let set =
        st_mmap::SafetensorsSet::open_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    set.keys()
        .map(|k| {
            let v = set.tensor(k).unwrap();
            (
                k.to_owned(),
                (v.dtype.to_string(), v.shape.to_vec(), v.data.to_vec()),
            )
        })
        .collect()
}

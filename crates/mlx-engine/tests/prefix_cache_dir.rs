//! The prefix's cache kept in a folder across restarts: a later engine
//! reads it instead of computing it and answers as the first did; a file
//! that is corrupt is not used (the prefix is computed again and the file
//! written anew); another prefix is another file.

use std::path::{Path, PathBuf};

use mlx_engine::{EngineConfig, GenerateOptions, Message, MlxEngine, QuantizedWeights};

mod common;

use common::*;

fn engine_with_folder(model: &Path, folder: &Path, prefix: Message) -> MlxEngine {
    MlxEngine::new(
        EngineConfig::new(model)
            .prefix_messages(vec![prefix])
            .batch_size(4)
            .worker_name("mlx-test")
            .quantized(QuantizedWeights::Keep)
            .prefix_cache_dir(folder, 1 << 30),
    )
    .unwrap()
}

fn answers(engine: &MlxEngine) -> Vec<String> {
    engine
        .generate(conversations(), GenerateOptions::new().max_tokens(5))
        .unwrap()
        .texts
}

/// The stored prefixes in `folder` (temporary files would show up too).
fn files(folder: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(folder)
        .map(|entries| entries.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    files.sort();
    files
}

#[cfg(unix)]
fn inode(path: &Path) -> u64 {
    std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(path).unwrap())
}

#[test]
fn a_later_engine_reads_the_prefix_from_the_folder_and_answers_the_same() {
    let model = tempfile::tempdir().unwrap();
    write_model(model.path());
    let work = tempfile::tempdir().unwrap();
    let folder = work.path().join("prefixes");
    let without = answers(&engine(model.path(), 4));

    let first = answers(&engine_with_folder(model.path(), &folder, system()));
    assert_eq!(first, without, "the folder changes no answer");
    let stored = files(&folder);
    assert_eq!(stored.len(), 1, "one prefix, no temporary file: {stored:?}");
    #[cfg(unix)]
    let written = inode(&stored[0]);

    let second = answers(&engine_with_folder(model.path(), &folder, system()));
    assert_eq!(second, first);
    assert_eq!(files(&folder), stored);
    // Read, not computed and written again (a write renames a new file
    // into place).
    #[cfg(unix)]
    assert_eq!(inode(&stored[0]), written);

    // Corrupt: not used, computed again, the same answers, written anew.
    std::fs::write(&stored[0], b"not a prefix").unwrap();
    let third = answers(&engine_with_folder(model.path(), &folder, system()));
    assert_eq!(third, first);
    assert_eq!(files(&folder), stored);
    assert!(
        std::fs::metadata(&stored[0]).unwrap().len() > 100,
        "written anew"
    );

    // Another prefix: another file beside the first.
    let other = Message::new("system", "w1 w2 w3 w4");
    let conversation = vec![other.clone(), Message::new("user", "w7")];
    engine_with_folder(model.path(), &folder, other)
        .generate(vec![conversation], GenerateOptions::new())
        .unwrap();
    assert_eq!(files(&folder).len(), 2);
}

//! The prefix's cache kept in a folder across restarts: a later engine
//! reads it instead of computing it and answers as the first did; a file
//! that is corrupt is not used (the prefix is computed again and the file
//! written anew); another prefix is another file. A prefix whose cache
//! holds the token a logits processor picks after it starts from the
//! folder too.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use mlx_engine::{
    EngineConfig, GenerateOptions, Message, MlxEngine, PrefixCache, QuantizedWeights, Tokenizer,
};
use mlx_rs::Array;

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

/// An engine whose prefix's cache holds the token a processor picks after
/// it: one that allows only `w9` at every position, and keeps the bits of
/// every logit it is handed in `seen`.
fn forcing_engine(model: &Path, folder: Option<&Path>, seen: Arc<Mutex<Vec<u32>>>) -> MlxEngine {
    let mut config = EngineConfig::new(model)
        .prefix_messages(vec![system()])
        .batch_size(4)
        .worker_name("mlx-test")
        .quantized(QuantizedWeights::Keep)
        .prefix_cache(PrefixCache::WithGeneratedToken)
        // One lane: the processor sees the chunks in one order.
        .lanes(1)
        .logits_processor(move |tokenizer: &Tokenizer| {
            let allowed = tokenizer.token_id("w9").unwrap() as i32;
            let seen = Arc::clone(&seen);
            Box::new(move |logits: &Array| {
                let f32s = logits.as_dtype(mlx_rs::Dtype::Float32)?;
                let bits = f32s.as_slice::<f32>().iter().map(|x| x.to_bits());
                seen.lock().unwrap().extend(bits);
                let ids = mlx_rs::ops::arange::<_, i32>(None, VOCAB, None)?;
                let keep = ids.eq(Array::from_int(allowed))?;
                mlx_rs::ops::select(&keep, logits, Array::from_f32(f32::NEG_INFINITY))
            })
        });
    if let Some(folder) = folder {
        config = config.prefix_cache_dir(folder, 1 << 30);
    }
    MlxEngine::new(config).unwrap()
}

#[test]
fn a_prefix_holding_a_processors_token_starts_from_the_folder() {
    let model = tempfile::tempdir().unwrap();
    write_model(model.path());
    let work = tempfile::tempdir().unwrap();
    let folder = work.path().join("prefixes");
    // The logits the processor was handed, the prefix's first: the texts
    // are all "w9…".
    let logits = |folder: Option<&Path>| {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let texts = answers(&forcing_engine(model.path(), folder, Arc::clone(&seen)));
        assert!(texts.iter().all(|t| t.starts_with("w9")), "{texts:?}");
        let seen = seen.lock().unwrap().clone();
        seen
    };
    let without = logits(None);
    let first = logits(Some(&folder));
    assert_eq!(first, without, "the folder changes no logit");
    // The prefix, and the prefix with the processor's token fed after it
    // (a pass of the whole model that a start from the folder skips).
    let stored = files(&folder);
    assert_eq!(stored.len(), 2, "{stored:?}");
    #[cfg(unix)]
    let written: Vec<u64> = stored.iter().map(|p| inode(p)).collect();
    let second = logits(Some(&folder));
    assert_eq!(
        second, first,
        "read from the folder: the same logits, bit for bit"
    );
    assert_eq!(files(&folder), stored);
    #[cfg(unix)]
    assert_eq!(
        stored.iter().map(|p| inode(p)).collect::<Vec<_>>(),
        written,
        "read, not written again"
    );
    // The clean prefix of the same tokens is one of those files.
    answers(&engine_with_folder(model.path(), &folder, system()));
    assert_eq!(files(&folder), stored);
}

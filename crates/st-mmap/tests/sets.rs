//! Many files as one: duplicates, model directories and their index.

use std::fs;
use std::path::{Path, PathBuf};

use st_mmap::{BlockIndex, BlockPrefix, Error, SafetensorsSet, INDEX_FILE};

/// Writes a file of U8 tensors named `keys`, each two bytes long.
fn write(dir: &Path, name: &str, keys: &[&str]) -> PathBuf {
    let data: Vec<Vec<u8>> = keys
        .iter()
        .enumerate()
        .map(|(i, _)| vec![i as u8, 7])
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = keys
        .iter()
        .zip(&data)
        .map(|(k, d)| {
            (
                k.to_string(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![2], d).unwrap(),
            )
        })
        .collect();
    let path = dir.join(name);
    fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
    path
}

fn write_index(dir: &Path, entries: &[(&str, &str)]) {
    let map: serde_json::Map<String, serde_json::Value> = entries
        .iter()
        .map(|(k, f)| (k.to_string(), serde_json::Value::from(*f)))
        .collect();
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
}

#[test]
fn keys_from_all_files_are_found_and_blocks_indexed() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "a.safetensors", &["m.layers.0.w", "m.embed"]);
    let b = write(
        dir.path(),
        "b.safetensors",
        &["m.layers.1.w", "m.layers.1.v"],
    );
    let set = SafetensorsSet::open_files([&a, &b]).unwrap();
    assert_eq!(set.len(), 4);
    assert_eq!(set.file_of("m.layers.1.v"), Some(b.as_path()));
    assert_eq!(set.tensor("m.embed").unwrap().data, &[1, 7]);
    let index = BlockIndex::build(&BlockPrefix::new("m.layers."), set.keys()).unwrap();
    assert_eq!(index.blocks().collect::<Vec<_>>(), [0, 1]);
    assert_eq!(index.params(1).unwrap().len(), 2);
}

#[test]
fn duplicate_keys_across_files_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "a.safetensors", &["w"]);
    let b = write(dir.path(), "b.safetensors", &["v", "w"]);
    match SafetensorsSet::open_files([&a, &b]) {
        Err(Error::DuplicateKey { key, first, second }) => {
            assert_eq!((key.as_str(), first, second), ("w", a, b));
        }
        other => panic!("expected DuplicateKey, got {other:?}"),
    }
}

#[test]
fn directory_without_index_opens_every_shard() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "model-00002-of-00002.safetensors", &["y"]);
    write(dir.path(), "model-00001-of-00002.safetensors", &["x"]);
    fs::write(dir.path().join("config.json"), "{}").unwrap();
    let set = SafetensorsSet::open_dir(dir.path()).unwrap();
    assert_eq!(set.keys().collect::<Vec<_>>(), ["x", "y"]);
    assert!(set.files()[0]
        .path()
        .ends_with("model-00001-of-00002.safetensors"));
}

#[test]
fn empty_directory_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        SafetensorsSet::open_dir(dir.path()),
        Err(Error::NoSafetensors { .. })
    ));
}

#[test]
fn index_routes_and_is_cross_checked() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "s1.safetensors", &["x"]);
    write(dir.path(), "s2.safetensors", &["y"]);
    // A stray file not named by the index is not opened.
    write(dir.path(), "stray.safetensors", &["x"]);
    write_index(
        dir.path(),
        &[("x", "s1.safetensors"), ("y", "s2.safetensors")],
    );
    let set = SafetensorsSet::open_dir(dir.path()).unwrap();
    assert_eq!(set.len(), 2);

    // The index lies about where y is.
    write_index(
        dir.path(),
        &[("x", "s1.safetensors"), ("y", "s1.safetensors")],
    );
    let err = SafetensorsSet::open_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&err, Error::IndexMismatch { key, .. } if key == "y"),
        "{err}"
    );

    // The index names a tensor no shard has.
    write_index(
        dir.path(),
        &[
            ("x", "s1.safetensors"),
            ("y", "s2.safetensors"),
            ("z", "s2.safetensors"),
        ],
    );
    let err = SafetensorsSet::open_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&err, Error::IndexMismatch { key, .. } if key == "z"),
        "{err}"
    );

    // A shard holds a tensor the index does not list.
    write(dir.path(), "s2.safetensors", &["y", "extra"]);
    write_index(
        dir.path(),
        &[("x", "s1.safetensors"), ("y", "s2.safetensors")],
    );
    let err = SafetensorsSet::open_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&err, Error::IndexMismatch { key, .. } if key == "extra"),
        "{err}"
    );

    // The index points outside the directory.
    write_index(dir.path(), &[("x", "../s1.safetensors")]);
    assert!(matches!(
        SafetensorsSet::open_dir(dir.path()),
        Err(Error::InvalidIndex { .. })
    ));

    // The index names the directory itself, or its parent, as a shard.
    for name in [".", "..", "./", "sub/.."] {
        write_index(dir.path(), &[("x", name)]);
        let err = SafetensorsSet::open_dir(dir.path()).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidIndex { message, .. } if message.contains("plain file name")),
            "{name}: {err}"
        );
    }
    // A shard name that is a folder inside the model directory.
    fs::create_dir_all(dir.path().join("folder.safetensors")).unwrap();
    write_index(dir.path(), &[("x", "folder.safetensors")]);
    let err = SafetensorsSet::open_dir(dir.path()).unwrap_err();
    assert!(
        matches!(&err, Error::NotAFile { path } if path.ends_with("folder.safetensors")),
        "{err}"
    );
    fs::remove_dir(dir.path().join("folder.safetensors")).unwrap();

    // The index is not an index.
    fs::write(dir.path().join(INDEX_FILE), "{\"weights\": 1}").unwrap();
    assert!(matches!(
        SafetensorsSet::open_dir(dir.path()),
        Err(Error::InvalidIndex { .. })
    ));
}

mod block_keys {
    use proptest::prelude::*;
    use st_mmap::{BlockIndex, BlockPrefix};

    proptest! {
        #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

        /// Every key built from a prefix, block and parameter parses back to
        /// the same block and parameter, and indexes under that block.
        #[test]
        fn built_keys_parse_back(prefix in "[a-z_.]{0,12}", block in 0usize..100_000, param in "[a-z][a-z0-9_.]{0,20}") {
            let p = BlockPrefix::new(prefix);
            let key = p.key(block, &param);
            prop_assert_eq!(p.parse(&key).unwrap(), Some((block, param.as_str())));
            let index = BlockIndex::build(&p, [key.as_str()]).unwrap();
            prop_assert_eq!(index.params(block).unwrap().get(&param), Some(&key));
        }

        /// Block numbers with a leading zero, a sign or an underscore are
        /// rejected rather than read as another block.
        #[test]
        fn non_canonical_numbers_are_rejected(block in 0usize..1000, junk in prop::sample::select(vec!["0", "+", "_", " "])) {
            let p = BlockPrefix::new("layers.");
            let key = format!("layers.{junk}{block}.w");
            prop_assert!(p.parse(&key).is_err(), "{} accepted", key);
        }
    }
}

/// The resident kilobytes of this process's mappings of `path`, from
/// `/proc/self/smaps`.
#[cfg(target_os = "linux")]
fn resident_kib(path: &Path) -> u64 {
    let smaps = fs::read_to_string("/proc/self/smaps").unwrap();
    let name = path.to_str().unwrap();
    let mut inside = false;
    let mut kib = 0;
    for line in smaps.lines() {
        if line.contains('-') && line.split_whitespace().count() >= 5 {
            // A mapping's first line: "start-end perms offset dev inode [path]".
            inside = line.ends_with(name);
        } else if inside && line.starts_with("Rss:") {
            kib += line
                .split_whitespace()
                .nth(1)
                .unwrap()
                .parse::<u64>()
                .unwrap();
        }
    }
    kib
}

#[test]
fn a_released_tensor_leaves_resident_memory_and_still_reads_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..8 << 20).map(|i: u32| (i * 31 % 251) as u8).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![8 << 20], &data).unwrap();
    let path = dir.path().join("big.safetensors");
    fs::write(
        &path,
        safetensors::serialize([("big", view)], None).unwrap(),
    )
    .unwrap();
    let set = SafetensorsSet::open_files([&path]).unwrap();
    let sum = |set: &SafetensorsSet| -> u64 {
        let bytes = set.tensor("big").unwrap().data;
        assert_eq!(bytes, data.as_slice());
        bytes.iter().map(|&b| u64::from(b)).sum()
    };
    let before = sum(&set);
    #[cfg(target_os = "linux")]
    let touched = resident_kib(&path);
    assert!(set.release("big") == cfg!(unix));
    assert!(!set.release("missing"));
    #[cfg(target_os = "linux")]
    {
        let released = resident_kib(&path);
        assert!(
            touched >= 8 * 1024 && released < 1024,
            "resident KiB of the map: {touched} after reading, {released} after release"
        );
    }
    assert_eq!(sum(&set), before);
}

#[test]
fn rows_are_read_by_position_from_the_file_holding_them() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.safetensors", &["small"]);
    // A (5, 3) table of u16 whose element (r, c) is 100·r + c.
    let table: Vec<u8> = (0..5u16)
        .flat_map(|r| (0..3u16).map(move |c| 100 * r + c))
        .flat_map(u16::to_le_bytes)
        .collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::U16, vec![5, 3], &table).unwrap();
    let scalar = [9u8];
    let scalar =
        safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![], &scalar).unwrap();
    let path = dir.path().join("b.safetensors");
    fs::write(
        &path,
        safetensors::serialize([("table", view), ("scalar", scalar)], None).unwrap(),
    )
    .unwrap();
    let set = SafetensorsSet::open_dir(dir.path()).unwrap();

    let rows = set.read_rows("table", 1..3).unwrap().unwrap();
    let values: Vec<u16> = rows
        .chunks(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    assert_eq!(values, [100, 101, 102, 200, 201, 202]);
    assert_eq!(
        set.read_rows("table", 4..4).unwrap().unwrap(),
        Vec::<u8>::new()
    );
    assert_eq!(set.read_rows("small", 0..2).unwrap().unwrap(), [0, 7]);
    assert!(set.read_rows("missing", 0..1).unwrap().is_none());

    // Into a caller's buffer: the same bytes; a buffer of another length
    // is a typed error and the buffer is left as it was.
    let mut out = vec![0u8; 12];
    assert!(set.read_rows_into("table", 1..3, &mut out).unwrap());
    assert_eq!(out, set.read_rows("table", 1..3).unwrap().unwrap());
    assert!(!set.read_rows_into("missing", 0..1, &mut out).unwrap());
    let mut short = vec![9u8; 5];
    match set.read_rows_into("table", 1..3, &mut short) {
        Err(Error::BufferLength {
            path: p,
            key,
            expected: 12,
            actual: 5,
        }) => assert_eq!((p, key.as_str()), (path.clone(), "table")),
        other => panic!("{other:?}"),
    }
    assert_eq!(short, [9u8; 5]);
    // Advised of scattered reads, the file reads the same bytes.
    let file = set.mapped_file_of("table").unwrap();
    assert_eq!(
        file.advise_random_reads(),
        cfg!(any(target_os = "linux", target_os = "macos"))
    );
    let mut again = vec![0u8; 12];
    assert!(set.read_rows_into("table", 1..3, &mut again).unwrap());
    assert_eq!(again, out);
    assert!(matches!(
        set.read_rows_into("table", 4..6, &mut out),
        Err(Error::RowsOutOfRange { .. })
    ));
    // Rows asked for ahead: advice given (where the system takes it), the
    // same bytes read after; an unknown key is no advice, rows outside the
    // tensor the same typed error as a read.
    assert_eq!(
        set.advise_will_read("table", 1..3).unwrap(),
        cfg!(any(target_os = "linux", target_os = "macos"))
    );
    assert!(set.read_rows_into("table", 1..3, &mut again).unwrap());
    assert_eq!(again, out);
    assert!(!set.advise_will_read("missing", 0..1).unwrap());
    assert!(matches!(
        set.advise_will_read("table", 4..6),
        Err(Error::RowsOutOfRange { .. })
    ));

    // Past the end, reversed, and a scalar, which has no rows.
    let reversed = std::ops::Range { start: 3, end: 2 };
    for (key, rows, len) in [
        ("table", 4..6, 5),
        ("table", reversed, 5),
        ("scalar", 0..1, 0),
    ] {
        match set.read_rows(key, rows.clone()) {
            Err(Error::RowsOutOfRange {
                path: p,
                key: k,
                rows: r,
                len: l,
            }) => {
                assert_eq!((p, k.as_str(), r, l), (path.clone(), key, rows, len));
            }
            other => panic!("{key} {rows:?}: {other:?}"),
        }
    }
}

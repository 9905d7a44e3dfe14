//! Repository tidiness: every crate's `lib.rs` opens with a `//!` doc, and no
//! Rust source file grows past 800 lines.

use std::fs;
use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | "corpus" | "artifacts") {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_crate_lib_starts_with_a_crate_doc() {
    let crates = workspace_root().join("crates");
    let mut checked = 0;
    for entry in fs::read_dir(&crates).expect("crates/ exists").flatten() {
        let lib = entry.path().join("src/lib.rs");
        if lib.exists() {
            let text = fs::read_to_string(&lib).unwrap();
            assert!(
                text.starts_with("//!"),
                "{} must start with a //! crate doc",
                lib.display()
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 6,
        "expected at least six crates, found {checked}"
    );
}

#[test]
fn no_source_file_is_over_800_lines() {
    let mut files = Vec::new();
    rust_files(&workspace_root(), &mut files);
    assert!(files.len() > 10, "found only {} Rust files", files.len());
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = fs::read_to_string(f).ok()?.lines().count();
            (lines > 800).then(|| format!("{} ({lines} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "split these files: {long:?}");
}

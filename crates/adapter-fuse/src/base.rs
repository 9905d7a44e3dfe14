//! Finding the base model: a local folder, the hub cache as Python leaves
//! it, or a download through `hf-hub` into that same cache.

use std::fs;
use std::path::{Path, PathBuf};

use crate::cache::repo_folder;
use crate::error::{Error, Result};

/// Files of a model repo that a loader needs; other files (PyTorch or GGUF
/// weights, images) are not downloaded.
fn wanted(file: &str) -> bool {
    [
        ".safetensors",
        ".json",
        ".jinja",
        ".txt",
        ".model",
        ".tiktoken",
    ]
    .iter()
    .any(|ext| file.ends_with(ext))
}

/// Whether `HF_HUB_OFFLINE` asks for no network.
pub(crate) fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// The snapshot folder of `repo` in the cache, if it holds a complete model:
/// `config.json` and every weights file its index names (or one
/// `*.safetensors` without an index). Python's cache keeps files as
/// relative symlinks into `blobs/`; following them is all it takes.
pub(crate) fn cached_snapshot(root: &Path, repo: &str) -> Option<PathBuf> {
    let folder = repo_folder(root, repo);
    let revision = fs::read_to_string(folder.join("refs").join("main")).ok()?;
    let snapshot = folder.join("snapshots").join(revision.trim());
    complete(&snapshot).then_some(snapshot)
}

fn complete(dir: &Path) -> bool {
    if !dir.join("config.json").is_file() {
        return false;
    }
    let index = dir.join(st_mmap::INDEX_FILE);
    if let Ok(text) = fs::read_to_string(&index) {
        let Ok(json) = serde_json::from_str::<serde_json::Value>(&text) else {
            return false;
        };
        let Some(map) = json["weight_map"].as_object() else {
            return false;
        };
        return map
            .values()
            .filter_map(|v| v.as_str())
            .all(|shard| dir.join(shard).is_file());
    }
    fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.path().extension().is_some_and(|x| x == "safetensors") && e.path().is_file())
    })
}

/// The folder holding the base model `model`: a local folder as given, the
/// cached snapshot of a hub repo, or that snapshot after downloading it.
pub(crate) fn resolve(model: &str, root: &Path, progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let local = Path::new(model);
    if local.is_dir() {
        return Ok(local.to_path_buf());
    }
    if let Some(snapshot) = cached_snapshot(root, model) {
        return Ok(snapshot);
    }
    if offline() {
        return Err(Error::Offline {
            repo: model.to_owned(),
            cache: root.to_path_buf(),
        });
    }
    download(model, root, progress)
}

fn download(repo: &str, root: &Path, progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let fail = |message: String| Error::Download {
        repo: repo.to_owned(),
        message,
    };
    let mut builder = hf_hub::api::sync::ApiBuilder::from_env()
        .with_cache_dir(root.to_path_buf())
        .with_progress(false);
    if let Ok(token) = std::env::var("HF_TOKEN") {
        builder = builder.with_token(Some(token));
    }
    let api = builder.build().map_err(|e| fail(e.to_string()))?;
    let remote = api.model(repo.to_owned());
    let info = remote.info().map_err(|e| fail(e.to_string()))?;
    let mut snapshot = None;
    for sibling in info.siblings.iter().filter(|s| wanted(&s.rfilename)) {
        progress(&sibling.rfilename);
        let path = remote
            .get(&sibling.rfilename)
            .map_err(|e| fail(format!("{}: {e}", sibling.rfilename)))?;
        // Files land in snapshots/{sha}/…; remember that folder.
        let mut dir = path.clone();
        for _ in sibling.rfilename.split('/') {
            dir.pop();
        }
        snapshot = Some(dir);
    }
    let snapshot = snapshot.ok_or_else(|| fail("the repo has no model files".to_owned()))?;
    if !complete(&snapshot) {
        return Err(fail(format!(
            "{} is incomplete after download",
            snapshot.display()
        )));
    }
    Ok(snapshot)
}

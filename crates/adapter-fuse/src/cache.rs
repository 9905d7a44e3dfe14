//! The Hugging Face hub cache: where it is, and how an entry is published.
//!
//! Layout (shared with Python's huggingface_hub):
//! `{root}/models--{name}/snapshots/{revision}/…` and `refs/main`
//! holding the revision. A fused entry is
//! `models--{namespace}-{digest}` with revision `digest`.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{io, Error, Result};

/// The hub cache root, with Python's precedence: `HF_HUB_CACHE`, else
/// `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub`.
pub fn hub_cache_root() -> PathBuf {
    cache_root_from(|k| std::env::var_os(k).map(PathBuf::from))
}

pub(crate) fn cache_root_from(var: impl Fn(&str) -> Option<PathBuf>) -> PathBuf {
    var("HF_HUB_CACHE")
        .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| var("XDG_CACHE_HOME").map(|x| x.join("huggingface").join("hub")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
        .unwrap_or_else(|| PathBuf::from(".cache/huggingface/hub"))
}

/// The folder of hub repo `org/name`: `models--org--name`.
pub(crate) fn repo_folder(root: &Path, repo: &str) -> PathBuf {
    root.join(format!("models--{}", repo.replace('/', "--")))
}

/// A fused entry's paths.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub folder: PathBuf,
    pub digest: String,
}

impl Entry {
    pub fn new(root: &Path, namespace: &str, digest: &str) -> Result<Entry> {
        let bad =
            namespace.is_empty() || namespace.contains(['/', '\\']) || namespace.contains("..");
        if bad {
            return Err(Error::InvalidNamespace(namespace.to_owned()));
        }
        Ok(Entry {
            folder: root.join(format!("models--{namespace}-{digest}")),
            digest: digest.to_owned(),
        })
    }

    pub fn snapshot(&self) -> PathBuf {
        self.folder.join("snapshots").join(&self.digest)
    }

    fn ref_main(&self) -> PathBuf {
        self.folder.join("refs").join("main")
    }

    /// A hit needs the published ref *and* the snapshot: the ref is written
    /// last, so a crash anywhere before it leaves no hit.
    pub fn is_complete(&self) -> bool {
        fs::read_to_string(self.ref_main()).is_ok_and(|r| r == self.digest)
            && self.snapshot().join("config.json").is_file()
    }

    /// Moves a fully written, fsynced folder into place as the snapshot and
    /// then publishes `refs/main`. Leftovers of an interrupted earlier
    /// attempt (a snapshot without a ref) are replaced.
    pub fn publish(&self, built: &Path) -> Result<()> {
        let snapshots = self.folder.join("snapshots");
        fs::create_dir_all(&snapshots).map_err(io(&snapshots))?;
        let snapshot = self.snapshot();
        if snapshot.exists() {
            fs::remove_dir_all(&snapshot).map_err(io(&snapshot))?;
        }
        fs::rename(built, &snapshot).map_err(io(&snapshot))?;
        sync_dir(&snapshots);
        let refs = self.folder.join("refs");
        fs::create_dir_all(&refs).map_err(io(&refs))?;
        write_atomically(&self.ref_main(), self.digest.as_bytes())
    }
}

/// Writes `bytes` to `path` through a fsynced sibling temp file and rename.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut temp = tempfile::NamedTempFile::new_in(dir).map_err(io(path))?;
    std::io::Write::write_all(&mut temp, bytes).map_err(io(path))?;
    temp.as_file().sync_all().map_err(io(path))?;
    temp.persist(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e.error,
    })?;
    sync_dir(dir);
    Ok(())
}

/// Makes a rename in `dir` durable (best effort; not possible everywhere).
pub(crate) fn sync_dir(dir: &Path) {
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_root_precedence_matches_huggingface_hub() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| PathBuf::from(v))
            }
        };
        static ALL: [(&str, &str); 4] = [
            ("HF_HUB_CACHE", "/a"),
            ("HUGGINGFACE_HUB_CACHE", "/b"),
            ("HF_HOME", "/c"),
            ("HOME", "/h"),
        ];
        let all: &'static [(&str, &str)] = &ALL;
        assert_eq!(cache_root_from(env(all)), PathBuf::from("/a"));
        assert_eq!(cache_root_from(env(&all[1..])), PathBuf::from("/b"));
        assert_eq!(cache_root_from(env(&all[2..])), PathBuf::from("/c/hub"));
        assert_eq!(
            cache_root_from(env(&all[3..])),
            PathBuf::from("/h/.cache/huggingface/hub")
        );
    }

    #[test]
    fn entry_names_follow_the_hub_layout() {
        let e = Entry::new(Path::new("/r"), "org--fused", "0123456789abcdef").unwrap();
        assert_eq!(
            e.folder,
            PathBuf::from("/r/models--org--fused-0123456789abcdef")
        );
        assert_eq!(
            e.snapshot(),
            PathBuf::from("/r/models--org--fused-0123456789abcdef/snapshots/0123456789abcdef")
        );
        assert_eq!(
            repo_folder(Path::new("/r"), "mlx-community/Foo"),
            PathBuf::from("/r/models--mlx-community--Foo")
        );
        for bad in ["", "a/b", "..", "a\\b"] {
            assert!(matches!(
                Entry::new(Path::new("/r"), bad, "d"),
                Err(Error::InvalidNamespace(_))
            ));
        }
    }
}

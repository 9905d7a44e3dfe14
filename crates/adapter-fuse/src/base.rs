//! Finding the base model: a local folder, the hub cache as Python leaves
//! it, or a download through `hf-hub` into that same cache.

use std::fs;
use std::path::{Path, PathBuf};

use crate::cache::repo_folder;
use crate::error::{Error, Result};
use crate::options::FuseOptions;

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
    if index.exists() {
        return st_mmap::ShardIndex::read(&index).is_ok_and(|index| {
            index
                .shard_names()
                .iter()
                .all(|shard| dir.join(shard).is_file())
        });
    }
    fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.path().extension().is_some_and(|x| x == "safetensors") && e.path().is_file())
    })
}

/// What a download reports while it runs.
pub(crate) enum Download<'a> {
    /// This file of the repo is next.
    File(&'a str),
    /// `done` of the file's `total` bytes have arrived.
    Bytes {
        file: &'a str,
        done: u64,
        total: u64,
    },
}

/// The folder holding the base model `model`: a local folder as given, the
/// cached snapshot of a hub repo, or that snapshot after downloading it.
pub(crate) fn resolve(
    model: &str,
    options: &FuseOptions,
    progress: &mut dyn FnMut(Download<'_>),
) -> Result<PathBuf> {
    let local = Path::new(model);
    if local.is_dir() {
        return Ok(local.to_path_buf());
    }
    let root = options.cache_root();
    if let Some(snapshot) = cached_snapshot(root, model) {
        tracing::debug!(repo = model, snapshot = %snapshot.display(), "base model found in the hub cache");
        return Ok(snapshot);
    }
    if options.offline {
        return Err(Error::Offline {
            repo: model.to_owned(),
            cache: root.to_path_buf(),
        });
    }
    download(model, options, progress)
}

fn download(
    repo: &str,
    options: &FuseOptions,
    progress: &mut dyn FnMut(Download<'_>),
) -> Result<PathBuf> {
    let fail = |message: String| Error::Download {
        repo: repo.to_owned(),
        message,
    };
    let mut builder = hf_hub::api::sync::ApiBuilder::from_cache(hf_hub::Cache::new(
        options.cache_root().to_path_buf(),
    ))
    .with_progress(false);
    if let Some(endpoint) = &options.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    if let Some(token) = &options.token {
        builder = builder.with_token(Some(token.clone()));
    }
    let api = builder.build().map_err(|e| fail(e.to_string()))?;
    let info = {
        let _span = tracing::info_span!("repo_info", repo).entered();
        let remote = api.model(repo.to_owned());
        watched(
            repo,
            "repo info",
            options.stall_timeout,
            &mut |_| {},
            move |_| remote.info(),
        )?
        .map_err(|e| fail(e.to_string()))?
    };
    let cache = hf_hub::Cache::new(options.cache_root().to_path_buf());
    let mut snapshot = None;
    for sibling in info.siblings.iter().filter(|s| wanted(&s.rfilename)) {
        let file = sibling.rfilename.clone();
        let _span = tracing::info_span!("download", repo, file = %file).entered();
        progress(Download::File(&file));
        let path = match cache.model(repo.to_owned()).get(&file) {
            Some(path) => {
                tracing::debug!("already in the cache");
                path
            }
            None => {
                let remote = api.model(repo.to_owned());
                let name = file.clone();
                let (mut done, mut total) = (0u64, 0u64);
                let mut on_tick = |tick: Tick| {
                    match tick {
                        Tick::Start(size) => total = size,
                        Tick::Bytes(n) => done += n,
                    }
                    progress(Download::Bytes {
                        file: &file,
                        done,
                        total,
                    });
                };
                watched(
                    repo,
                    &file,
                    options.stall_timeout,
                    &mut on_tick,
                    move |tick| remote.download_with_progress(&name, Ticks(tick)),
                )?
                .map_err(|e| fail(format!("{file}: {e}")))?
            }
        };
        // Files land in snapshots/{sha}/…; remember that folder.
        let mut dir = path.clone();
        for _ in file.split('/') {
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

/// What hf-hub tells the watcher while it downloads a file.
enum Tick {
    /// The file's size in bytes (hf-hub resumes a partial file: the bytes
    /// that follow count from where it resumed).
    Start(u64),
    /// More bytes written.
    Bytes(u64),
}

/// Tells the watcher each time hf-hub writes downloaded bytes.
struct Ticks(crossbeam_channel::Sender<Tick>);

impl hf_hub::api::Progress for Ticks {
    fn init(&mut self, size: usize, _filename: &str) {
        let _ = self.0.send(Tick::Start(size as u64));
    }

    fn update(&mut self, size: usize) {
        let _ = self.0.send(Tick::Bytes(size as u64));
    }

    fn finish(&mut self) {}
}

/// Runs a hub request on its own thread and waits for it while it makes
/// progress: a wait of `timeout` with no byte received is
/// [`Error::Stalled`] naming `file`.
///
/// hf-hub builds its HTTP agent itself and sets no timeouts, so a peer that
/// accepts and then goes silent would block forever in a read. The watcher
/// returns instead; the blocked thread is left behind (detached) until the
/// peer closes the connection or the process ends. A later attempt resumes
/// the download where the data stopped.
fn watched<T: Send + 'static>(
    repo: &str,
    file: &str,
    timeout: std::time::Duration,
    on_tick: &mut dyn FnMut(Tick),
    job: impl FnOnce(crossbeam_channel::Sender<Tick>) -> T + Send + 'static,
) -> Result<T> {
    let (done_tx, done_rx) = crossbeam_channel::bounded::<T>(1);
    let (tick_tx, mut ticks) = crossbeam_channel::unbounded::<Tick>();
    let spawned = std::thread::Builder::new()
        .name("hub-download".into())
        .spawn(move || {
            let value = job(tick_tx);
            let _ = done_tx.send(value);
        });
    spawned.map_err(|e| Error::Download {
        repo: repo.to_owned(),
        message: format!("cannot start a download thread: {e}"),
    })?;
    loop {
        crossbeam_channel::select! {
            recv(done_rx) -> msg => match msg {
                Ok(value) => {
                    // The job sent its last ticks before its result, but
                    // `select!` picks among ready channels at random:
                    // report them first, so that progress reaches the
                    // file's size.
                    for tick in ticks.try_iter() {
                        on_tick(tick);
                    }
                    return Ok(value);
                }
                Err(_) => {
                    return Err(Error::Download {
                        repo: repo.to_owned(),
                        message: format!("{file}: the download thread panicked"),
                    })
                }
            },
            recv(ticks) -> tick => {
                match tick {
                    Ok(tick) => on_tick(tick),
                    // The job has finished with its ticks; its result is next.
                    Err(_) => ticks = crossbeam_channel::never(),
                }
            }
            default(timeout) => {
                tracing::warn!(repo, file, ?timeout, "download stalled; giving up");
                return Err(Error::Stalled {
                    repo: repo.to_owned(),
                    file: file.to_owned(),
                    after: timeout,
                });
            }
        }
    }
}

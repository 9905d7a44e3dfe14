//! Fuse a shipped LoRA adapter into a base model (`W' = W + (scale·Bᵀ)@Aᵀ`,
//! requantizing quantized bases) and keep the result in the Hugging Face hub
//! cache layout, keyed by the adapter's digest, so the next call is a hit.
//!
//! Why: an application ships a small adapter, not a fused model, and pays the
//! fusing cost once per machine.
//!
//! ```
//! use adapter_codec::AdapterCodec;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # use safetensors::{serialize_to_file, tensor::TensorView, Dtype};
//! # let tmp = tempfile::tempdir()?;
//! # let (model, adapter) = (tmp.path().join("model"), tmp.path().join("adapter"));
//! # std::fs::create_dir_all(&model)?;
//! # std::fs::create_dir_all(&adapter)?;
//! # let (w, a, b) = (vec![0u8; 4 * 3 * 4], vec![0u8; 3 * 2 * 4], vec![0u8; 2 * 4 * 4]);
//! # let w = [("m.q.weight", TensorView::new(Dtype::F32, vec![4, 3], &w)?)];
//! # serialize_to_file(w, None, &model.join("model.safetensors"))?;
//! # std::fs::write(model.join("config.json"), r#"{"model_type": "llama"}"#)?;
//! # let a = ("m.q.lora_a", TensorView::new(Dtype::F32, vec![3, 2], &a)?);
//! # let b = ("m.q.lora_b", TensorView::new(Dtype::F32, vec![2, 4], &b)?);
//! # serialize_to_file([a, b], None, &adapter.join("adapters.safetensors"))?;
//! # std::fs::write(adapter.join("adapter_config.json"), r#"{"lora_parameters": {"rank": 2, "scale": 2.0}}"#)?;
//! # let model_repo = model.to_str().unwrap();
//! // `model_repo`: a hub repo id such as "mlx-community/SmolLM2-135M-Instruct",
//! // or a local model folder.
//! let codec = AdapterCodec::new(adapter.join("adapters.safetensors.zst"), adapter.join("adapter_config.json"));
//! # codec.encode(adapter.join("adapters.safetensors"))?;
//! // The hub cache from the environment, as Python's huggingface_hub finds
//! // it; `adapter_fuse::ensure_fused` does the same in one call.
//! let options = adapter_fuse::FuseOptions::from_env();
//! # let options = options.with_cache_root(tmp.path().join("hub"));
//! let fuse = || adapter_fuse::Fuse::new(model_repo, &codec, "acme--fused").options(&options);
//! let fused = fuse().run()?;
//! assert!(fused.join("model.safetensors").is_file());
//! // The entry is keyed by the adapter's digest; the next call is a hit.
//! assert!(fused.ends_with(format!("snapshots/{}", codec.digest()?)));
//! assert_eq!(fuse().run()?, fused);
//! # Ok(())
//! # }
//! ```
//!
//! # The cache entry
//!
//! `{cache}/models--{namespace}-{digest}/snapshots/{digest}/` with
//! `refs/main` = digest, where `{cache}` follows huggingface_hub's
//! precedence (see [`hub_cache_root`]). The entry is built in a temporary
//! folder inside the cache root, fsynced, renamed into place, and only then
//! is `refs/main` written: a crash leaves no entry that counts as a hit. A
//! lock file per entry (`{cache}/.locks/…`, an OS file lock that dies with
//! its process) makes concurrent callers wait for one fuser and share its
//! result.
//!
//! # The Python original's API, here
//!
//! spawnllm's `ensure_fused(model_repo, *, codec, cache_namespace,
//! tqdm_class=None)` is [`ensure_fused`]`(model_repo, &codec,
//! cache_namespace)`; [`Fuse`] is the same with progress (a closure or
//! [`ProgressBars`] in place of `tqdm_class`) and explicit
//! [`FuseOptions`] (cache, hub, offline switch).
//!
//! # Errors
//!
//! [`Error`] names the repo, file and key: an adapter key without a base
//! weight, shapes that do not fit (with both shapes), a missing `scale`, an
//! offline miss, a failed download.

mod base;
mod cache;
mod error;
mod fuse;
mod options;

use std::path::PathBuf;

use adapter_codec::AdapterCodec;

pub use cache::hub_cache_root;
pub use error::{Error, Result};
pub use options::{FuseOptions, DEFAULT_STALL_TIMEOUT};

/// What a [`Fuse`] is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FuseProgress {
    /// The entry was already complete.
    Hit,
    /// Another process holds the entry's lock; waiting for it.
    Waiting,
    /// Downloading this file of the base model.
    Downloading(String),
    /// `done` of `total` bytes of this file of the base model have arrived
    /// (reported as they arrive).
    Downloaded { file: String, done: u64, total: u64 },
    /// Fused `done` of `total` adapted modules.
    Fusing { done: usize, total: usize },
    /// The entry is published.
    Published,
}

/// Receives [`FuseProgress`] events. Closures `FnMut(FuseProgress)`
/// implement it; [`ProgressBars`] draws them with indicatif.
pub trait FuseReporter {
    /// Called for each event, on the calling thread.
    fn report(&mut self, event: FuseProgress);
}

impl<F: FnMut(FuseProgress)> FuseReporter for F {
    fn report(&mut self, event: FuseProgress) {
        self(event)
    }
}

/// Terminal progress for [`Fuse::progress`]: a spinner while
/// downloading and waiting, a bar while fusing.
#[derive(Debug, Default)]
pub struct ProgressBars {
    bar: Option<indicatif::ProgressBar>,
}

impl FuseReporter for ProgressBars {
    fn report(&mut self, event: FuseProgress) {
        match event {
            FuseProgress::Hit => {}
            FuseProgress::Waiting => {
                self.spinner("waiting for another process fusing the same adapter")
            }
            FuseProgress::Downloading(file) => self.spinner(&format!("downloading {file}")),
            FuseProgress::Downloaded { file, done, total } => self.spinner(&format!(
                "downloading {file}: {:.1} of {:.1} MB",
                done as f64 / 1e6,
                total as f64 / 1e6
            )),
            FuseProgress::Fusing { done, total } => {
                let bar = self.bar.get_or_insert_with(|| {
                    let bar = indicatif::ProgressBar::new(total as u64);
                    bar.set_style(
                        indicatif::ProgressStyle::with_template(
                            "fusing [{bar:30}] {pos}/{len} modules",
                        )
                        .expect("valid template")
                        .progress_chars("=> "),
                    );
                    bar
                });
                bar.set_length(total as u64);
                bar.set_position(done as u64);
            }
            FuseProgress::Published => {
                if let Some(bar) = self.bar.take() {
                    bar.finish_and_clear();
                }
            }
        }
    }
}

impl ProgressBars {
    fn spinner(&mut self, message: &str) {
        let bar = self
            .bar
            .get_or_insert_with(indicatif::ProgressBar::new_spinner);
        bar.set_message(message.to_owned());
        bar.tick();
    }
}

/// Returns the fused model's snapshot folder, fusing on a miss: the
/// Python original's `ensure_fused(model_repo, codec=…, cache_namespace=…)`.
/// See the crate docs for the cache layout and its guarantees. The cache,
/// hub and offline switch come from the environment
/// ([`FuseOptions::from_env`]); [`Fuse`] takes them explicitly, and a
/// progress reporter.
pub fn ensure_fused(
    model_repo: &str,
    codec: &AdapterCodec,
    cache_namespace: &str,
) -> Result<PathBuf> {
    Fuse::new(model_repo, codec, cache_namespace).run()
}

/// One fuse, set up then [`run`](Self::run): which base, adapter and cache
/// entry, with which options, reporting progress to whom.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use adapter_fuse::{Fuse, FuseOptions, ProgressBars};
///
/// let codec = adapter_codec::AdapterCodec::new("adapters.safetensors.zst", "adapter_config.json");
/// let options = FuseOptions::from_env().with_offline(true);
/// let fused = Fuse::new("mlx-community/SmolLM2-135M-Instruct", &codec, "acme--fused")
///     .options(&options)
///     .progress(ProgressBars::default())
///     .run()?;
/// # Ok(())
/// # }
/// ```
#[must_use = "a fuse does nothing until `run` is called"]
pub struct Fuse<'a> {
    model_repo: &'a str,
    codec: &'a AdapterCodec,
    cache_namespace: &'a str,
    options: Option<&'a FuseOptions>,
    reporter: Option<Box<dyn FuseReporter + 'a>>,
}

impl std::fmt::Debug for Fuse<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fuse")
            .field("model_repo", &self.model_repo)
            .field("cache_namespace", &self.cache_namespace)
            .field("options", &self.options)
            .field("reporter", &self.reporter.is_some())
            .finish_non_exhaustive()
    }
}

impl<'a> Fuse<'a> {
    /// Fuses `codec`'s adapter into `model_repo` (a hub repo id, or a local
    /// model folder) under the cache entry `cache_namespace`, with options
    /// from the environment and no progress reporting unless told.
    pub fn new(model_repo: &'a str, codec: &'a AdapterCodec, cache_namespace: &'a str) -> Fuse<'a> {
        Fuse {
            model_repo,
            codec,
            cache_namespace,
            options: None,
            reporter: None,
        }
    }

    /// The cache root, hub, offline switch and stall timeout to use instead
    /// of the environment's.
    pub fn options(mut self, options: &'a FuseOptions) -> Fuse<'a> {
        self.options = Some(options);
        self
    }

    /// Reports progress to `reporter` (a closure `FnMut(FuseProgress)`, or
    /// [`ProgressBars`] for a terminal), on the calling thread.
    pub fn progress(mut self, reporter: impl FuseReporter + 'a) -> Fuse<'a> {
        self.reporter = Some(Box::new(reporter));
        self
    }

    /// Returns the fused model's snapshot folder, fusing on a miss.
    ///
    /// # Errors
    /// [`Error`], naming the repo, file and key.
    pub fn run(self) -> Result<PathBuf> {
        let from_env;
        let options = match self.options {
            Some(options) => options,
            None => {
                from_env = FuseOptions::from_env();
                &from_env
            }
        };
        let mut reporter = self.reporter;
        let mut report = |event: FuseProgress| {
            if let Some(reporter) = reporter.as_mut() {
                reporter.report(event);
            }
        };
        options.fuse(
            self.model_repo,
            self.codec,
            self.cache_namespace,
            &mut report,
        )
    }
}

impl FuseOptions {
    fn fuse(
        &self,
        model_repo: &str,
        codec: &AdapterCodec,
        cache_namespace: &str,
        mut reporter: impl FuseReporter,
    ) -> Result<PathBuf> {
        let _span = tracing::info_span!("ensure_fused", model_repo, cache_namespace).entered();
        let mut progress = |event| reporter.report(event);
        let root = self.cache_root();
        let entry = cache::Entry::new(root, cache_namespace, &codec.digest()?)?;
        if entry.is_complete() {
            tracing::info!(entry = %entry.snapshot().display(), "fused model cache hit");
            progress(FuseProgress::Hit);
            return Ok(entry.snapshot());
        }
        let _lock = lock_entry(root, &entry, &mut progress)?;
        if entry.is_complete() {
            // Another process fused it while we waited.
            tracing::info!(entry = %entry.snapshot().display(), "fused by another process while waiting");
            progress(FuseProgress::Hit);
            return Ok(entry.snapshot());
        }
        let base = base::resolve(model_repo, self, &mut |event| match event {
            base::Download::File(file) => progress(FuseProgress::Downloading(file.to_owned())),
            base::Download::Bytes { file, done, total } => progress(FuseProgress::Downloaded {
                file: file.to_owned(),
                done,
                total,
            }),
        })?;
        // Holding the lock, any `.fuse-{digest}-*` folder is a killed
        // predecessor's work: nobody else builds this digest now.
        let prefix = format!(".fuse-{}-", entry.digest);
        remove_leftovers(root, &prefix);
        let work = tempfile::Builder::new()
            .prefix(&prefix)
            .tempdir_in(root)
            .map_err(error::io(root))?;
        let adapter_dir = work.path().join("adapter");
        std::fs::create_dir_all(&adapter_dir).map_err(error::io(&adapter_dir))?;
        codec.decode(adapter_dir.join("adapters.safetensors"))?;
        let config = adapter_dir.join("adapter_config.json");
        std::fs::write(&config, codec.config_bytes()?).map_err(error::io(&config))?;
        let built = work.path().join("snapshot");
        // Errors name the shipped files, not their decoded copies here.
        let adapter = block_stream::MlxLmAdapter::open_named(
            &adapter_dir,
            codec.config_path(),
            codec.zst_path(),
        )?;
        fuse::fuse_model(&base, &adapter, &built, &mut |done, total| {
            progress(FuseProgress::Fusing { done, total })
        })?;
        cache::sync_dir(&built);
        entry.publish(&built)?;
        tracing::info!(entry = %entry.snapshot().display(), "fused model published");
        progress(FuseProgress::Published);
        Ok(entry.snapshot())
    }
}

fn remove_leftovers(root: &std::path::Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(prefix) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Takes the entry's lock, waiting for another holder. The lock is an OS
/// file lock, so a holder that dies releases it.
fn lock_entry(
    root: &std::path::Path,
    entry: &cache::Entry,
    progress: &mut dyn FnMut(FuseProgress),
) -> Result<std::fs::File> {
    let locks = root.join(".locks");
    std::fs::create_dir_all(&locks).map_err(error::io(&locks))?;
    let name = entry.folder.file_name().expect("entry folder name");
    let path = locks.join(format!("{}.lock", name.to_string_lossy()));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(error::io(&path))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            progress(FuseProgress::Waiting);
            file.lock().map_err(error::io(&path))?;
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(Error::Io { path, source: e }),
    }
    Ok(file)
}

/// Compiles the README's example with the doc-tests, so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

//! A process for the crate's multi-process tests (`tests/processes.rs`):
//! they start it, watch its output and kill it at chosen points. It is an
//! example so that `cargo test` builds it beside the tests; it also shows
//! `FuseOptions` with an explicit cache and the progress events.
//!
//! ```text
//! fuse_child fuse CACHE ADAPTER_DIR REPO NAMESPACE [HOLD_AT]
//! fuse_child hold-lock PATH
//! ```
//!
//! `fuse` fuses `ADAPTER_DIR/adapters.safetensors.zst` into `REPO` with
//! the hub cache at `CACHE`, printing `EVENT {event:?}` for each progress
//! event, then `PATH {snapshot}` and `PUBLISHED {bool}`. With `HOLD_AT=N`
//! it sleeps after the N-th event, so that a parent can kill it exactly
//! there. `hold-lock` takes an exclusive lock on `PATH`, prints `LOCKED`
//! and sleeps until killed.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use adapter_codec::AdapterCodec;
use adapter_fuse::{Fuse, FuseOptions, FuseProgress};
use anyhow::{bail, Context, Result};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["fuse", cache, adapter_dir, repo, namespace, rest @ ..] => {
            let hold_at = match rest {
                [] => None,
                [n] => Some(n.parse::<usize>().context("HOLD_AT is a number")?),
                _ => bail!("too many arguments"),
            };
            fuse(cache, adapter_dir, repo, namespace, hold_at)
        }
        ["hold-lock", path] => hold_lock(path),
        _ => bail!(
            "usage: fuse_child fuse CACHE ADAPTER_DIR REPO NAMESPACE [HOLD_AT] | fuse_child hold-lock PATH"
        ),
    }
}

fn fuse(
    cache: &str,
    adapter_dir: &str,
    repo: &str,
    namespace: &str,
    hold_at: Option<usize>,
) -> Result<()> {
    let adapter_dir = PathBuf::from(adapter_dir);
    let codec = AdapterCodec::new(
        adapter_dir.join("adapters.safetensors.zst"),
        adapter_dir.join("adapter_config.json"),
    );
    let options = FuseOptions::from_env()
        .with_cache_root(cache)
        .with_offline(true);
    let mut events = Vec::new();
    let path = Fuse::new(repo, &codec, namespace)
        .options(&options)
        .progress(|e: FuseProgress| {
            println!("EVENT {e:?}");
            let _ = std::io::stdout().flush();
            events.push(e);
            if hold_at == Some(events.len()) {
                std::thread::sleep(Duration::from_secs(60));
            }
        })
        .run()?;
    println!("PATH {}", path.display());
    println!("PUBLISHED {}", events.contains(&FuseProgress::Published));
    Ok(())
}

fn hold_lock(path: &str) -> Result<()> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .with_context(|| path.to_owned())?;
    file.lock().with_context(|| path.to_owned())?;
    println!("LOCKED");
    std::io::stdout().flush()?;
    std::thread::sleep(Duration::from_secs(60));
    Ok(())
}

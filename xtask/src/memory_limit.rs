//! `cargo xtask memory-limit`: the engine's classification example run
//! under a memory limit smaller than the model's weights, once per memory
//! mode, to show which modes complete.
//!
//! The method: a Linux memory cgroup (v2 `memory.max`, or v1
//! `memory.limit_in_bytes`) made for the run, which needs root and a
//! writable cgroup file system; each run is a fresh process that moves
//! itself into the cgroup (`sh -c 'echo $$ > cgroup.procs; exec …'`)
//! before the example starts. The limit counts the process's anonymous
//! memory and the page cache it brings in; the kernel reclaims clean page
//! cache under the limit, and without swap it kills the process (SIGKILL)
//! when the anonymous memory alone would pass it. So a mode whose resident
//! weights exceed the limit is killed, and one that reads them from the
//! files a layer at a time completes.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// A cgroup made for the run, removed when dropped.
pub(crate) struct Cgroup {
    pub(crate) dir: PathBuf,
    /// `memory.max` (v2) or `memory.limit_in_bytes` (v1).
    limit_file: &'static str,
    v2: bool,
}

impl Cgroup {
    pub(crate) fn create(limit: u64) -> Result<Cgroup> {
        Cgroup::create_named(&format!("mlx-lowmem-{}", std::process::id()), limit)
    }

    /// A cgroup `name` under the memory hierarchy's root.
    pub(crate) fn create_named(name: &str, limit: u64) -> Result<Cgroup> {
        let root = Path::new("/sys/fs/cgroup");
        let (dir, limit_file, v2) = if root.join("cgroup.controllers").exists() {
            let controllers =
                std::fs::read_to_string(root.join("cgroup.subtree_control")).unwrap_or_default();
            if !controllers.split_whitespace().any(|c| c == "memory") {
                bail!(
                    "cgroup v2 without the memory controller for children of {} \
                     (add it to cgroup.subtree_control as root)",
                    root.display()
                );
            }
            (root.join(name), "memory.max", true)
        } else if root.join("memory").is_dir() {
            (
                root.join("memory").join(name),
                "memory.limit_in_bytes",
                false,
            )
        } else {
            bail!("no memory cgroup under {}", root.display());
        };
        std::fs::create_dir(&dir).with_context(|| {
            format!(
                "creating {} (needs root and a writable cgroup file system)",
                dir.display()
            )
        })?;
        let cgroup = Cgroup {
            dir,
            limit_file,
            v2,
        };
        cgroup.write(limit_file, &limit.to_string())?;
        if !cgroup.v2 {
            // v1 would otherwise let the group swap past the limit where
            // swap exists; the limit on memory + swap must be at least the
            // memory limit, so it is written after it.
            let _ = cgroup.write("memory.memsw.limit_in_bytes", &limit.to_string());
        } else {
            let _ = cgroup.write("memory.swap.max", "0");
        }
        Ok(cgroup)
    }

    fn write(&self, file: &str, value: &str) -> Result<()> {
        let path = self.dir.join(file);
        std::fs::write(&path, value).with_context(|| format!("writing {}", path.display()))
    }

    fn read(&self, file: &str) -> Option<String> {
        std::fs::read_to_string(self.dir.join(file)).ok()
    }

    /// The limit the kernel applies (rounded to pages).
    fn limit(&self) -> Option<u64> {
        self.read(self.limit_file)?.trim().parse().ok()
    }

    /// OOM kills in the group so far (v2 `memory.events`, v1
    /// `memory.oom_control`).
    pub(crate) fn oom_kills(&self) -> Option<u64> {
        let (file, key) = if self.v2 {
            ("memory.events", "oom_kill")
        } else {
            ("memory.oom_control", "oom_kill")
        };
        self.read(file)?.lines().find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok())?
        })
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Empty by now: every run has exited.
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Runs the `classify` example on `model_dir` under `limit_mb` (default:
/// three quarters of the weights' size) with each memory mode.
pub fn run(model_dir: &Path, limit_mb: Option<u64>, conversations: usize) -> Result<()> {
    let weights: u64 = std::fs::read_dir(model_dir)
        .with_context(|| format!("reading {}", model_dir.display()))?
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|e| std::fs::metadata(e.path()).ok())
        .map(|m| m.len())
        .sum();
    if weights == 0 {
        bail!("{}: no .safetensors files", model_dir.display());
    }
    let limit = limit_mb.map_or(weights / 4 * 3, |mb| mb * 1_000_000);
    let status = Command::new(crate::cargo_bin())
        .args([
            "build",
            "--release",
            "--quiet",
            "-p",
            "mlx-engine",
            "--example",
            "classify",
        ])
        .status()
        .context("building the classify example")?;
    if !status.success() {
        bail!("building the classify example failed");
    }
    let example = Path::new("target/release/examples/classify").canonicalize()?;
    let cgroup = Cgroup::create(limit)?;
    println!(
        "model: {} ({} MB of weights); memory limit {} MB ({}, {})",
        model_dir.display(),
        weights / 1_000_000,
        cgroup.limit().unwrap_or(limit) / 1_000_000,
        if cgroup.v2 { "cgroup v2" } else { "cgroup v1" },
        cgroup.dir.display()
    );
    let mut completed = Vec::new();
    for mode in ["resident", "mapped", "streamed", "auto"] {
        let before = cgroup.oom_kills().unwrap_or(0);
        let procs = cgroup.dir.join("cgroup.procs");
        let out = Command::new("sh")
            .arg("-c")
            .arg(r#"echo $$ > "$0" && exec "$@""#)
            .arg(&procs)
            .arg(&example)
            .arg(model_dir)
            .args(["--memory", mode, "--conversations"])
            .arg(conversations.to_string())
            .output()
            .context("running the classify example")?;
        let killed = cgroup.oom_kills().unwrap_or(0) > before;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let outcome = if out.status.success() {
            completed.push(mode);
            format!("completed: {}", stdout.trim().replace('\n', "; "))
        } else if killed {
            format!("killed by the OOM killer under the limit ({})", out.status)
        } else {
            let stderr = String::from_utf8_lossy(&out.stderr);
            format!(
                "failed ({}): {}",
                out.status,
                stderr.lines().last().unwrap_or_default()
            )
        };
        println!("--memory {mode:<8} {outcome}");
    }
    println!("completed under the limit: {completed:?}");
    Ok(())
}

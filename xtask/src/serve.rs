//! `cargo xtask serve` (the OpenAI-compatible server, release build) and
//! `cargo xtask bench serve` (it against mlx_lm.server).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::{cargo, cargo_bin, fixtures, prereqs};

/// Serves `model_dir` (default: the SmolLM2 fixture's f32 weights) with
/// `args` passed on to `mlx-serve`. On Unix this process becomes the
/// server (through cargo), so that SIGTERM and Ctrl-C reach it and it
/// shuts down gracefully.
pub fn run(model_dir: Option<PathBuf>, args: &[String]) -> Result<()> {
    let model_dir = match model_dir {
        Some(dir) => dir,
        None => fixtures::ensure()?.join("f32"),
    };
    let mut cargo = Command::new(cargo_bin());
    cargo
        .args(["run", "--quiet", "--release", "-p", "mlx-serve", "--"])
        .arg("--model-dir")
        .arg(&model_dir)
        .args(args);
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let err = cargo.exec();
        Err(err).context("running cargo run -p mlx-serve")
    }
    #[cfg(not(unix))]
    {
        let status = cargo.status()?;
        if !status.success() {
            bail!("the server failed ({status})");
        }
        Ok(())
    }
}

/// Builds the server (release) and runs `crates/mlx-serve/benches/serve.py`
/// on the SmolLM2 fixture, with mlx_lm.server beside it from the interop
/// Python; `args` go to the script.
pub fn bench(args: &[String]) -> Result<()> {
    cargo(&["build", "--release", "--package", "mlx-serve"], &[])?;
    let model = fixtures::ensure()?.join("f32");
    let python = prereqs::interop_python().context("the serving bench needs the interop Python")?;
    let mut command = Command::new(&python);
    command
        .arg("crates/mlx-serve/benches/serve.py")
        .arg("--model-dir")
        .arg(&model)
        .args(["--mlx-serve", "target/release/mlx-serve"])
        .arg("--mlx-lm-python")
        .arg(&python)
        .args(args);
    eprintln!("xtask: {command:?}");
    let status = command.status().context("running the serving bench")?;
    if !status.success() {
        bail!("the serving bench failed ({status})");
    }
    Ok(())
}

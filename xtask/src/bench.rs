//! `cargo xtask bench`: each benchmark with what it needs (fixtures, the
//! interop Python, a memory cgroup).

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::{
    cargo, distributed_bench, fast_blas, fixtures, memory_limit, prereqs, python_face, serve,
    Bench, CC_SENTIMENT_VAR, GEMMA3_VAR, INTEROP_PYTHON_VAR,
};

pub(crate) fn bench(which: Bench, args: &[String]) -> Result<()> {
    prereqs::ensure()?;
    fast_blas();
    let all = which == Bench::All;
    if all || which == Bench::Matmul {
        cargo(&["bench", "--package", "demo", "--bench", "matmul"], &[])?;
    }
    if all || which == Bench::Codec {
        cargo(
            &["bench", "--package", "adapter-codec", "--bench", "codec"],
            &[],
        )?;
    }
    if let Some(python) = prereqs::interop_python() {
        // The stream, fuse and engine benches run the Python originals
        // beside ours when they find it.
        std::env::set_var(INTEROP_PYTHON_VAR, python);
    }
    if all || which == Bench::Stream {
        cargo(&["bench", "--package", "demo", "--bench", "stream"], &[])?;
    }
    if all || which == Bench::Distributed {
        distributed_bench::run_all(&fixtures::ensure()?)?;
    }
    if all || which == Bench::PythonFace {
        let face = python_face::face_python()
            .context("the Python face's bench needs a Python 3.13 environment")?;
        python_face::build_and_install(&face, &[&face])?;
        python_face::bench(&face, &fixtures::ensure()?, if all { &[] } else { args })?;
    }
    if all || which == Bench::Serve {
        serve::bench(if all { &[] } else { args })?;
    }
    if all || which == Bench::Arithmetic {
        cargo(
            &[
                "bench",
                "--package",
                "mlx-engine",
                "--bench",
                "arithmetic",
                "--",
            ],
            if all { &[] } else { args },
        )?;
    }
    if all || which == Bench::Adapters {
        std::env::set_var("MLX_LOWMEM_SMOLLM2", fixtures::ensure()?);
        if args.iter().any(|a| a == "--e2b") {
            std::env::set_var(CC_SENTIMENT_VAR, fixtures::cc_sentiment()?);
        }
        cargo(
            &[
                "bench",
                "--package",
                "mlx-engine",
                "--bench",
                "adapters",
                "--",
            ],
            if all { &[] } else { args },
        )?;
    }
    if all || which == Bench::ExpertReads {
        expert_reads(if all { &[] } else { args })?;
    }
    for (bench, package) in [(Bench::Fuse, "adapter-fuse"), (Bench::Engine, "mlx-engine")] {
        if !(all || which == bench) {
            continue;
        }
        std::env::set_var("MLX_LOWMEM_SMOLLM2", fixtures::ensure()?);
        if bench == Bench::Engine {
            std::env::set_var(GEMMA3_VAR, fixtures::gemma3()?);
            if args.iter().any(|a| a == "--llama-cpp") {
                let python = prereqs::interop_python()
                    .context("llama.cpp's side needs the interop Python environment")?;
                prereqs::llama_cpp(&python)?;
            }
        }
        let name = if bench == Bench::Fuse {
            "fuse"
        } else {
            "engine"
        };
        let mut args = if all { Vec::new() } else { args.to_vec() };
        // `--memory-cap MB`: a memory cgroup the bench runs its children in,
        // removed when the bench is done.
        let _cgroup = match args.iter().position(|a| a == "--memory-cap") {
            Some(i) if bench == Bench::Engine => {
                let mb: u64 = args
                    .get(i + 1)
                    .and_then(|v| v.parse().ok())
                    .context("--memory-cap takes megabytes")?;
                let cgroup = memory_limit::Cgroup::create(mb * 1_000_000)?;
                args.push("--cgroup-procs".into());
                args.push(cgroup.dir.join("cgroup.procs").display().to_string());
                Some(cgroup)
            }
            _ => None,
        };
        cargo(
            &["bench", "--package", package, "--bench", name, "--"],
            &args,
        )?;
    }
    Ok(())
}

/// st-mmap's `expert_reads` bench on `--dir` or, by default, the
/// 26B-A4B-shaped bench model that the engine bench makes.
fn expert_reads(args: &[String]) -> Result<()> {
    let mut args = args.to_vec();
    if !args.iter().any(|a| a == "--dir") {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let model = root.join("target/bench-fixtures/gemma4-26b-a4b-shaped");
        if !model.join("complete-v1").is_file() {
            bail!(
                "no {}: make it once with `cargo xtask bench engine --models gemma4-moe \
                 --batches 1 --max-tokens 1 --conversations 1 --mlx-lm-conversations 0`",
                model.display()
            );
        }
        args.extend(["--dir".to_owned(), model.join("q4").display().to_string()]);
    }
    cargo(
        &[
            "bench",
            "--package",
            "st-mmap",
            "--bench",
            "expert_reads",
            "--",
        ],
        &args,
    )
}

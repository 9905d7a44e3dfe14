//! `cargo xtask demo`: shows the toolkit working on this machine.
//!
//! 1. What MLX runs on here: version, device, BLAS, matmul throughput.
//! 2. Block streaming: a generated 12-block model run all-loaded and
//!    streamed, each in its own process, with their peak memory.

use std::path::PathBuf;

use anyhow::{Context, Result};
use block_stream::{best_device, use_device};
use demo::streaming::{child_main, measure, Mode};
use demo::synthetic::{generate, Spec};
use mlx_rs::Dtype;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if child_main(&args)? {
        return Ok(());
    }
    if args.first().map(String::as_str) == Some("import-gguf") {
        return import_gguf(&args[1..]);
    }
    let device = use_device(best_device())?;
    println!("== MLX on this machine");
    println!(
        "MLX {} (mlx-rs 0.33.0, mlx-c 0.7.0)",
        block_stream::mlx_version()
    );
    println!("device: {device}");
    println!("BLAS: {} (libmlx from {})", mlx_sys::BLAS, mlx_sys::LIB_DIR);
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
    streaming()
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
fn import_gguf(args: &[String]) -> Result<()> {
    let f32 = args.iter().any(|a| a == "--f32");
    let paths: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let [src, dst] = paths.as_slice() else {
        anyhow::bail!("usage: import-gguf SRC.gguf DST [--f32]");
    };
    let weights = if f32 {
        mlx_engine::ImportWeights::F32
    } else {
        mlx_engine::ImportWeights::Quantized
    };
    mlx_engine::import_gguf(src.as_ref(), dst.as_ref(), weights)?;
    println!("imported {src} into {dst} ({weights:?})");
    Ok(())
}

//! Fuse an mlx_lm LoRA adapter into a model, cached in the hub layout.
//!
//! ```sh
//! cargo run -p adapter-fuse --example fuse                      # self-contained, in a temp dir
//! cargo run -p adapter-fuse --example fuse -- MODEL ADAPTER_DIR # MODEL: a hub repo id or a folder
//! ```
//!
//! Without arguments it writes a one-matrix model and a rank-2 adapter into a
//! temporary hub cache, fuses twice (a miss, then a hit) and checks the fused
//! matrix against `W + scale · (A @ B)ᵀ` computed here. With arguments it
//! encodes `ADAPTER_DIR` (`adapters.safetensors` + `adapter_config.json`) and
//! fuses it into `MODEL` in your hub cache, with progress bars.

use std::path::Path;
use std::time::Instant;

use adapter_codec::AdapterCodec;
use adapter_fuse::{Fuse, FuseOptions, FuseProgress, FuseReporter, ProgressBars};
use anyhow::{ensure, Context, Result};
use safetensors::{serialize_to_file, tensor::TensorView, Dtype};

const KEY: &str = "model.layers.0.self_attn.q_proj";
const IN: usize = 3;
const OUT: usize = 4;
const RANK: usize = 2;
const SCALE: f32 = 2.0;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => self_contained(),
        [model, adapter] => fuse(
            &FuseOptions::from_env(),
            model,
            Path::new(adapter),
            Path::new(adapter),
        ),
        _ => anyhow::bail!("usage: fuse [MODEL ADAPTER_DIR]"),
    }
}

/// Encodes the adapter next to itself and fuses it into `model`, twice.
fn fuse(options: &FuseOptions, model: &str, adapter: &Path, out: &Path) -> Result<()> {
    let codec = AdapterCodec::new(
        out.join("adapters.safetensors.zst"),
        adapter.join("adapter_config.json"),
    );
    let stats = codec.encode(adapter.join("adapters.safetensors"))?;
    println!(
        "adapter: {} tensors, {} → {} bytes, digest {}",
        stats.tensors,
        stats.raw_bytes,
        stats.compressed_bytes,
        codec.digest()?
    );
    for call in ["first", "second"] {
        let start = Instant::now();
        let mut hit = false;
        let mut bars = ProgressBars::default();
        let path = Fuse::new(model, &codec, "example--fused")
            .options(options)
            .progress(|e: FuseProgress| {
                hit |= e == FuseProgress::Hit;
                bars.report(e);
            })
            .run()?;
        let what = if hit { "cache hit" } else { "fused" };
        let secs = start.elapsed().as_secs_f64();
        println!("{call} call: {what} in {secs:.3} s → {}", path.display());
    }
    Ok(())
}

fn self_contained() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    // Everything, the hub cache included, stays inside the temp dir.
    let options = FuseOptions::from_env().with_cache_root(tmp.path().join("hub"));
    let (model, adapter) = (tmp.path().join("model"), tmp.path().join("adapter"));
    std::fs::create_dir_all(&model)?;
    std::fs::create_dir_all(&adapter)?;

    let w: Vec<f32> = (0..OUT * IN).map(|i| i as f32 / 10.0).collect();
    let a: Vec<f32> = (0..IN * RANK).map(|i| 0.5 - i as f32 / 8.0).collect();
    let b: Vec<f32> = (0..RANK * OUT).map(|i| i as f32 / 4.0 - 1.0).collect();
    write_f32(
        &model.join("model.safetensors"),
        &[(format!("{KEY}.weight"), &w, [OUT, IN])],
    )?;
    std::fs::write(model.join("config.json"), r#"{"model_type": "llama"}"#)?;
    write_f32(
        &adapter.join("adapters.safetensors"),
        &[
            (format!("{KEY}.lora_a"), &a, [IN, RANK]),
            (format!("{KEY}.lora_b"), &b, [RANK, OUT]),
        ],
    )?;
    let config = format!(
        r#"{{"fine_tune_type": "lora", "lora_parameters": {{"rank": {RANK}, "scale": {SCALE}}}}}"#
    );
    std::fs::write(adapter.join("adapter_config.json"), config)?;

    fuse(
        &options,
        model.to_str().context("temp path is not UTF-8")?,
        &adapter,
        &adapter,
    )?;

    // The fused weight against W + scale · (A @ B)ᵀ, computed here.
    let codec = AdapterCodec::new(
        adapter.join("adapters.safetensors.zst"),
        adapter.join("adapter_config.json"),
    );
    let fused_dir = Fuse::new(model.to_str().unwrap_or_default(), &codec, "example--fused")
        .options(&options)
        .run()?;
    let bytes = std::fs::read(fused_dir.join("model.safetensors"))?;
    let fused = safetensors::SafeTensors::deserialize(&bytes)?;
    let got: Vec<f32> = fused
        .tensor(&format!("{KEY}.weight"))?
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut worst = 0f32;
    for o in 0..OUT {
        for i in 0..IN {
            let delta: f32 = (0..RANK).map(|r| a[i * RANK + r] * b[r * OUT + o]).sum();
            worst = worst.max((got[o * IN + i] - (w[o * IN + i] + SCALE * delta)).abs());
        }
    }
    println!("fused {KEY}.weight: largest difference from W + scale·(A@B)ᵀ = {worst:e}");
    ensure!(worst < 1e-5, "the fused weight is wrong");
    Ok(())
}

fn write_f32(path: &Path, tensors: &[(String, &Vec<f32>, [usize; 2])]) -> Result<()> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, v, _)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, _, shape), data)| {
            Ok((
                name.clone(),
                TensorView::new(Dtype::F32, shape.to_vec(), data)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    serialize_to_file(views, None, path)?;
    Ok(())
}

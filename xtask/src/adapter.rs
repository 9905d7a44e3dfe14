//! `encode-adapter`, `decode-adapter` and `adapter-info`: the adapter codec
//! from the command line.

use std::path::{Path, PathBuf};
use std::time::Instant;

use adapter_codec::AdapterCodec;
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

/// Inputs above this size get a progress bar.
const PROGRESS_FROM: u64 = 16 << 20;

fn bar(total: u64, what: &str) -> ProgressBar {
    if total < PROGRESS_FROM {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar
}

/// The config that travels with an adapter: `adapter_config.json` beside it.
fn sibling_config(path: &Path) -> PathBuf {
    path.with_file_name("adapter_config.json")
}

/// `encode-adapter SRC [--out FILE.zst] [--level N]`.
pub fn encode(src: &Path, out: Option<&Path>, level: i32) -> Result<()> {
    let out = out.map_or_else(
        || PathBuf::from(format!("{}.zst", src.display())),
        Path::to_path_buf,
    );
    let codec = AdapterCodec::new(&out, sibling_config(&out)).with_level(level)?;
    let total = std::fs::metadata(src).map(|m| m.len()).unwrap_or(0);
    let progress = bar(total, "encoding");
    let start = Instant::now();
    let stats = codec.encode_with_progress(src, |done, _| progress.set_position(done))?;
    progress.finish_and_clear();
    println!("wrote {}", out.display());
    println!(
        "{} tensors, {}, {} -> {} bytes (ratio {:.3}) at level {} in {:.1}s",
        stats.tensors,
        stats.dtype,
        stats.raw_bytes,
        stats.compressed_bytes,
        stats.ratio(),
        codec.level(),
        start.elapsed().as_secs_f64()
    );
    println!("digest {}", codec.digest()?);
    Ok(())
}

/// `decode-adapter FILE.zst DST`.
pub fn decode(zst: &Path, dst: &Path) -> Result<()> {
    let codec = AdapterCodec::new(zst, sibling_config(zst));
    let total = codec.header().map(|h| h.file_len() as u64)?;
    let progress = bar(total, "decoding");
    let stats = codec.decode_with_progress(dst, |done, _| progress.set_position(done))?;
    progress.finish_and_clear();
    println!(
        "wrote {}: {} tensors, {}, {} bytes",
        dst.display(),
        stats.tensors,
        stats.dtype,
        stats.bytes
    );
    Ok(())
}

/// `adapter-info FILE.zst`.
pub fn info(zst: &Path) -> Result<()> {
    let codec = AdapterCodec::new(zst, sibling_config(zst));
    let header = codec.header()?;
    let compressed = std::fs::metadata(zst)
        .with_context(|| zst.display().to_string())?
        .len();
    println!("file        {}", zst.display());
    println!("digest      {}", codec.digest()?);
    println!("dtype       {}", codec.dtype()?);
    println!("tensors     {}", header.tensors().len());
    println!("raw size    {} bytes", header.file_len());
    println!(
        "compressed  {compressed} bytes (ratio {:.3})",
        header.file_len() as f64 / compressed.max(1) as f64
    );
    let largest = header.tensors().iter().max_by_key(|t| t.byte_len());
    if let Some(t) = largest {
        println!(
            "largest     {} {:?} ({} bytes)",
            t.name,
            t.shape,
            t.byte_len()
        );
    }
    Ok(())
}

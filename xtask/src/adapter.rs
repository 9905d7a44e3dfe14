//! `encode-adapter`, `decode-adapter` and `adapter-info`: the adapter codec
//! from the command line.

use std::path::PathBuf;
use std::time::Instant;

use adapter_codec::AdapterCodec;
use anyhow::{bail, Context, Result};
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

/// Positional arguments and `--flag value` pairs.
type Parsed = (Vec<String>, Vec<(String, String)>);

/// Splits `args` into positional arguments and `--flag value` pairs.
fn parse(args: &[String], flags: &[&str]) -> Result<Parsed> {
    let mut positional = Vec::new();
    let mut options = Vec::new();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        if let Some(name) = arg.strip_prefix("--") {
            if !flags.contains(&name) {
                bail!("unknown option --{name}; expected one of {flags:?}");
            }
            let value = iter
                .next()
                .with_context(|| format!("--{name} needs a value"))?;
            options.push((name.to_owned(), value.clone()));
        } else {
            positional.push(arg.clone());
        }
    }
    Ok((positional, options))
}

/// The config that travels with an adapter: `adapter_config.json` beside it.
fn sibling_config(path: &std::path::Path) -> PathBuf {
    path.with_file_name("adapter_config.json")
}

pub fn encode(args: &[String]) -> Result<()> {
    let (positional, options) = parse(args, &["out", "level"])?;
    let [src] = positional.as_slice() else {
        bail!("usage: cargo xtask encode-adapter SRC.safetensors [--out FILE.zst] [--level N]");
    };
    let src = PathBuf::from(src);
    let mut out = PathBuf::from(format!("{}.zst", src.display()));
    let mut codec_level = adapter_codec::DEFAULT_LEVEL;
    for (name, value) in options {
        match name.as_str() {
            "out" => out = PathBuf::from(value),
            _ => {
                codec_level = value
                    .parse()
                    .with_context(|| format!("--level {value:?} is not a number"))?
            }
        }
    }
    let codec = AdapterCodec::new(&out, sibling_config(&out)).with_level(codec_level)?;
    let total = std::fs::metadata(&src).map(|m| m.len()).unwrap_or(0);
    let progress = bar(total, "encoding");
    let start = Instant::now();
    let stats = codec.encode_with_progress(&src, |done, _| progress.set_position(done))?;
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

pub fn decode(args: &[String]) -> Result<()> {
    let (positional, _) = parse(args, &[])?;
    let [zst, dst] = positional.as_slice() else {
        bail!("usage: cargo xtask decode-adapter FILE.zst DST.safetensors");
    };
    let codec = AdapterCodec::new(zst, sibling_config(zst.as_ref()));
    let total = codec.header().map(|h| h.file_len() as u64)?;
    let progress = bar(total, "decoding");
    let stats = codec.decode_with_progress(dst, |done, _| progress.set_position(done))?;
    progress.finish_and_clear();
    println!(
        "wrote {dst}: {} tensors, {}, {} bytes",
        stats.tensors, stats.dtype, stats.bytes
    );
    Ok(())
}

pub fn info(args: &[String]) -> Result<()> {
    let (positional, _) = parse(args, &[])?;
    let [zst] = positional.as_slice() else {
        bail!("usage: cargo xtask adapter-info FILE.zst");
    };
    let codec = AdapterCodec::new(zst, sibling_config(zst.as_ref()));
    let header = codec.header()?;
    let compressed = std::fs::metadata(zst).with_context(|| zst.clone())?.len();
    println!("file        {zst}");
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

//! Forward passes through a synthetic model three ways — all blocks loaded,
//! streamed, streamed with prefetch — each in a fresh child process so that
//! its peak RSS is its own.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use block_stream::BlockStreamer;
use mlx_rs::module::ModuleParameters;
use mlx_rs::ops::indexing::IndexOp;
pub use mlx_support::evict_from_page_cache;
use mlx_support::ProcessMemory;

use crate::synthetic::{Block, Spec, PREFIX};

/// How the weights reach the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every block bound into its own module before the pass.
    AllLoaded,
    /// One module, rebound block by block, the previous one evicted, with
    /// prefetching turned off.
    Streamed,
    /// As `Streamed`, with the next block read ahead (the streamer's
    /// default).
    Prefetched,
}

impl Mode {
    /// All modes, in report order.
    pub const ALL: [Mode; 3] = [Mode::AllLoaded, Mode::Streamed, Mode::Prefetched];

    fn name(self) -> &'static str {
        match self {
            Mode::AllLoaded => "all-loaded",
            Mode::Streamed => "streamed",
            Mode::Prefetched => "prefetched",
        }
    }

    fn parse(s: &str) -> Result<Mode> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .with_context(|| format!("unknown mode {s:?}"))
    }
}

/// One pass, measured in its own process.
#[derive(Debug, Clone)]
pub struct PassReport {
    /// How the weights were bound: a [`Mode`]'s name, or the Python
    /// script's mode (`arsenal`, `python-all-loaded`).
    pub name: String,
    /// Seconds spent binding weights (all-loaded: before the pass).
    pub bind_s: f64,
    /// Seconds of the whole pass, binding included.
    pub total_s: f64,
    /// The process's peak RSS, bytes.
    pub peak_rss: u64,
    /// Sum of the final activation, to check that all modes agree.
    pub checksum: f32,
}

impl PassReport {
    /// Mode name for printing.
    pub fn mode_name(&self) -> &str {
        &self.name
    }
}

fn pass(path: &Path, spec: Spec, mode: Mode, rows: i32) -> Result<PassReport> {
    let start = Instant::now();
    // All-loaded keeps every block: nothing is freed, so there is no cache
    // to keep in check after each bind (the original passes no
    // `evict_previous` there either).
    let mut streamer = BlockStreamer::new([path], PREFIX)?
        .with_prefetch(mode == Mode::Prefetched)
        .with_cache_clearing(mode != Mode::AllLoaded);
    // The non-block parameters stay resident in every mode, as in a model.
    let embed = streamer.tensor("transformer.embed.weight")?;
    let mut x = embed.index(0..rows);
    x.eval()?;
    let blocks = streamer.blocks();
    let mut bind_s = 0.0;
    // Outlives the timed region: freeing 2.5 GB takes a noticeable while,
    // and the Python side's figure does not include its teardown either.
    let mut modules = Vec::new();
    match mode {
        Mode::AllLoaded => {
            let t = Instant::now();
            modules.reserve(blocks.len());
            for &b in &blocks {
                let mut m = Block::new(spec)?;
                streamer.bind(&mut m, b, &[])?;
                modules.push(m);
            }
            // Bound arrays are lazy loads: read them all now, in one
            // evaluation as a model loader does, so that every block is
            // resident before the pass.
            mlx_rs::transforms::eval(
                modules
                    .iter()
                    .flat_map(|m| m.parameters().flatten().into_values()),
            )?;
            bind_s = t.elapsed().as_secs_f64();
            for m in &modules {
                x = m.forward(&x)?;
                x.eval()?;
            }
        }
        Mode::Streamed | Mode::Prefetched => {
            let mut m = Block::new(spec)?;
            for &b in &blocks {
                let t = Instant::now();
                streamer.bind(&mut m, b, &[])?;
                bind_s += t.elapsed().as_secs_f64();
                x = m.forward(&x)?;
                x.eval()?;
            }
        }
    }
    let checksum = x.sum(None)?;
    checksum.eval()?;
    let total_s = start.elapsed().as_secs_f64();
    Ok(PassReport {
        name: mode.name().to_owned(),
        bind_s,
        total_s,
        peak_rss: ProcessMemory::read().peak_rss.unwrap_or(0),
        checksum: checksum.item_exact::<f32>(),
    })
}

/// The argument that makes a binary run one pass as a child.
pub const CHILD_ARG: &str = "stream-pass";

/// In a binary's `main`: when started as a child (`CHILD_ARG MODE PATH ROWS
/// BLOCKS HIDDEN MLP VOCAB`), runs the pass, prints its report and returns
/// true.
pub fn child_main(args: &[String]) -> Result<bool> {
    if args.first().map(String::as_str) != Some(CHILD_ARG) {
        return Ok(false);
    }
    let [_, mode, path, rows, blocks, hidden, mlp, vocab] = args else {
        bail!("{CHILD_ARG} MODE PATH ROWS BLOCKS HIDDEN MLP VOCAB");
    };
    let spec = Spec {
        blocks: blocks.parse()?,
        hidden: hidden.parse()?,
        mlp: mlp.parse()?,
        vocab: vocab.parse()?,
    };
    mlx_support::use_device(mlx_support::best_device())?;
    let r = pass(Path::new(path), spec, Mode::parse(mode)?, rows.parse()?)?;
    println!(
        "{} {} {} {} {}",
        r.name, r.bind_s, r.total_s, r.peak_rss, r.checksum
    );
    Ok(true)
}

/// Runs one pass with an activation of `rows` rows in a fresh child process
/// (this same binary) and reads its report.
pub fn measure(path: &Path, spec: Spec, mode: Mode, rows: usize) -> Result<PassReport> {
    measure_with(&std::env::current_exe()?, path, spec, mode, rows)
}

/// [`measure`] with another binary whose `main` calls [`child_main`].
pub fn measure_with(
    exe: &Path,
    path: &Path,
    spec: Spec,
    mode: Mode,
    rows: usize,
) -> Result<PassReport> {
    let mut child = Command::new(exe);
    child
        .arg(CHILD_ARG)
        .arg(mode.name())
        .arg(path)
        .arg(rows.to_string())
        .args([spec.blocks, spec.hidden, spec.mlp, spec.vocab].map(|n| n.to_string()));
    run_pass(child, mode.name())
}

/// The Python original's side of a pass: `benches/arsenal_stream.py`
/// (mlx-arsenal's `BlockStreamer`, mode `arsenal`, or everything loaded with
/// `mx.load`, mode `python-all-loaded`) run by `python` on the same file.
pub fn measure_python(python: &Path, mode: &str, path: &Path, rows: usize) -> Result<PassReport> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/arsenal_stream.py");
    let mut child = Command::new(python);
    child.arg(script).arg(mode).arg(path).arg(rows.to_string());
    run_pass(child, mode)
}

/// Runs a pass's process and reads the report line it prints
/// (`NAME BIND_S TOTAL_S PEAK_RSS CHECKSUM`).
fn run_pass(mut child: Command, name: &str) -> Result<PassReport> {
    let out = child
        .output()
        .with_context(|| format!("starting the {name} pass"))?;
    if !out.status.success() {
        bail!(
            "{name} pass failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let fields: Vec<&str> = line.split_whitespace().collect();
    let [_, bind_s, total_s, peak, checksum] = fields.as_slice() else {
        bail!("unexpected report {line:?}");
    };
    Ok(PassReport {
        name: name.to_owned(),
        bind_s: bind_s.parse()?,
        total_s: total_s.parse()?,
        peak_rss: peak.parse()?,
        checksum: checksum.parse()?,
    })
}

/// Reads `path` once so the next pass finds it in the page cache.
pub fn warm_page_cache(path: &Path) -> Result<()> {
    let mut file = std::fs::File::open(path)?;
    std::io::copy(&mut file, &mut std::io::sink())?;
    Ok(())
}

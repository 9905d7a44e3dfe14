//! Block streaming vs all-loaded on a 2.5 GB synthetic transformer
//! (`cargo xtask bench stream`): peak RSS (VmHWM of a fresh process per
//! pass) and wall time, with the page cache warm and cold, and — where the
//! interop Python (`MLX_LOWMEM_PYTHON`) has mlx-arsenal — the Python
//! original on the same file with the same computation, in the same run,
//! the sides alternating.

use std::path::{Path, PathBuf};

use demo::streaming::{
    child_main, evict_from_page_cache, measure, measure_python, warm_page_cache, Mode, PassReport,
};
use demo::synthetic::{generate, Spec};

/// One side of a comparison: ours in a mode, or the Python script in one.
#[derive(Clone, Copy)]
enum Side {
    Ours(Mode),
    Python(&'static str),
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if child_main(&args)? {
        return Ok(());
    }
    let spec = Spec::BENCH;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-fixtures");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("synthetic-48x50MB.safetensors");
    if !path.exists() {
        eprintln!("generating {} …", path.display());
        generate(&path, spec)?;
    }
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "model: {} blocks × {:.1} MB + {:.1} MB non-block = {:.0} MB",
        spec.blocks,
        mb(spec.block_bytes()),
        mb(spec.other_bytes()),
        mb(std::fs::metadata(&path)?.len())
    );
    println!(
        "BLAS kernels: {}",
        mlx_support::kernels_in_use().unwrap_or_else(|| "none (no OpenBLAS)".into())
    );
    let python = python_with_arsenal();
    match &python {
        Some(p) => println!("Python original: mlx-arsenal 0.17.0 under {}", p.display()),
        None => println!(
            "Python original: not run (MLX_LOWMEM_PYTHON unset or without mlx_arsenal; \
             `cargo xtask bench stream` sets it up)"
        ),
    }

    let ours = |modes: &[Mode]| modes.iter().map(|&m| Side::Ours(m)).collect::<Vec<_>>();
    let with_python = |mut sides: Vec<Side>, names: &[&'static str]| {
        if python.is_some() {
            sides.extend(names.iter().map(|&n| Side::Python(n)));
        }
        sides
    };
    // A small activation (8 rows) as in token-by-token decoding; then, cold,
    // a large one (512 rows) so that each block's compute is long enough for
    // prefetching the next block's pages to overlap with it.
    let runs = [
        (
            "warm",
            8,
            5,
            with_python(ours(&Mode::ALL), &["python-all-loaded", "arsenal"]),
        ),
        (
            "cold",
            8,
            3,
            with_python(ours(&Mode::ALL), &["python-all-loaded", "arsenal"]),
        ),
        (
            "cold",
            512,
            1,
            with_python(ours(&Mode::ALL[1..]), &["arsenal"]),
        ),
    ];
    let mut summary = Vec::new();
    for (cache, rows, rounds, sides) in runs {
        let mut reports: Vec<Vec<PassReport>> = vec![Vec::new(); sides.len()];
        for _ in 0..rounds {
            for (side, seen) in sides.iter().zip(&mut reports) {
                if cache == "warm" {
                    warm_page_cache(&path)?;
                } else if !evict_from_page_cache(&path) {
                    println!("cold runs need posix_fadvise (Linux); skipped");
                    return Ok(());
                }
                let r = match *side {
                    Side::Ours(mode) => measure(&path, spec, mode, rows)?,
                    Side::Python(name) => {
                        measure_python(python.as_deref().expect("checked"), name, &path, rows)?
                    }
                };
                println!(
                    "{cache} {rows:>3} rows {:<17}: total {:6.2} s (binding {:5.2} s), peak RSS {:7.1} MB, checksum {}",
                    r.mode_name(),
                    r.total_s,
                    r.bind_s,
                    mb(r.peak_rss),
                    r.checksum
                );
                seen.push(r);
            }
        }
        for seen in reports {
            summary.push((cache, rows, seen));
        }
    }

    println!("\nmedian of each mode's passes (wall, peak RSS):");
    println!("| cache | rows | mode | passes | wall | peak RSS |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (cache, rows, seen) in &summary {
        println!(
            "| {cache} | {rows} | {} | {} | {:.2} s | {:.0} MB |",
            seen[0].mode_name(),
            seen.len(),
            median(seen.iter().map(|r| r.total_s)),
            mb(median(seen.iter().map(|r| r.peak_rss as f64)) as u64)
        );
    }
    let find = |cache: &str, rows: usize, name: &str| {
        summary
            .iter()
            .find(|(c, r, s)| *c == cache && *r == rows && s[0].mode_name() == name)
            .map(|(_, _, s)| median(s.iter().map(|r| r.total_s)))
    };
    for (cache, rows) in [("warm", 8), ("cold", 8), ("cold", 512)] {
        for (ours, theirs) in [("streamed", "arsenal"), ("prefetched", "arsenal")] {
            if let (Some(a), Some(b)) = (find(cache, rows, ours), find(cache, rows, theirs)) {
                println!("{cache} {rows} rows: {ours} / {theirs} wall = {:.2}", a / b);
            }
        }
    }
    if let (Some(a), Some(b)) = (
        find("warm", 8, "all-loaded"),
        find("warm", 8, "python-all-loaded"),
    ) {
        println!(
            "warm 8 rows: all-loaded / python-all-loaded wall = {:.2}",
            a / b
        );
    }
    println!(
        "one block + non-block parameters = {:.1} MB",
        mb(spec.block_bytes() + spec.other_bytes())
    );
    Ok(())
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The interop Python, if it can import mlx-arsenal.
fn python_with_arsenal() -> Option<PathBuf> {
    let python = PathBuf::from(std::env::var_os("MLX_LOWMEM_PYTHON")?);
    let ok = std::process::Command::new(&python)
        .args(["-c", "import mlx_arsenal.streaming"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(python)
}

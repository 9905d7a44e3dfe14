//! Block streaming vs all-loaded on a 2.5 GB synthetic transformer
//! (`cargo xtask bench stream`): peak RSS (VmHWM of a fresh process per
//! pass) and wall time, with the page cache warm and cold.

use std::path::Path;

use demo::streaming::{child_main, evict_from_page_cache, measure, warm_page_cache, Mode};
use demo::synthetic::{generate, Spec};

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
    // A small activation (8 rows) as in token-by-token decoding; then, cold,
    // a large one (512 rows) so that each block's compute is long enough for
    // prefetching the next block's pages to overlap with it.
    let runs = [
        ("warm", 8, &Mode::ALL[..]),
        ("cold", 8, &Mode::ALL[..]),
        ("cold", 512, &Mode::ALL[1..]),
    ];
    for (cache, rows, modes) in runs {
        for &mode in modes {
            if cache == "warm" {
                warm_page_cache(&path)?;
            } else if !evict_from_page_cache(&path) {
                println!("cold runs need posix_fadvise (Linux); skipped");
                return Ok(());
            }
            let r = measure(&path, spec, mode, rows)?;
            println!(
                "{cache} {rows:>3} rows {:<10}: total {:6.2} s (binding {:5.2} s), peak RSS {:7.1} MB, checksum {}",
                r.mode_name(),
                r.total_s,
                r.bind_s,
                mb(r.peak_rss),
                r.checksum
            );
        }
    }
    Ok(())
}

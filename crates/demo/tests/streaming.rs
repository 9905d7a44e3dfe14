//! Streaming a generated model gives the same output as loading it whole,
//! with a lower peak RSS (each pass measured in its own process).

use std::path::Path;

use demo::streaming::{measure_with, Mode};
use demo::synthetic::{generate, Spec};

#[test]
fn streamed_pass_matches_all_loaded_with_less_memory() {
    let spec = Spec {
        blocks: 6,
        hidden: 256,
        mlp: 1024,
        vocab: 2000,
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    generate(&path, spec).unwrap();
    let exe = Path::new(env!("CARGO_BIN_EXE_demo"));
    let run = |mode| measure_with(exe, &path, spec, mode, 8).unwrap();
    let (all, streamed, prefetched) = (
        run(Mode::AllLoaded),
        run(Mode::Streamed),
        run(Mode::Prefetched),
    );
    assert_eq!(all.checksum, streamed.checksum);
    assert_eq!(all.checksum, prefetched.checksum);
    assert!(all.checksum.is_finite());
    // All-loaded holds six blocks, streamed about one: the difference is at
    // least four blocks' worth.
    let saved = all.peak_rss.saturating_sub(streamed.peak_rss);
    assert!(
        saved > 4 * spec.block_bytes(),
        "streaming saved only {saved} bytes (all-loaded {}, streamed {})",
        all.peak_rss,
        streamed.peak_rss
    );
}

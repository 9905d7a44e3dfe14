//! What binding a block costs in memory, measured from the OS.
//!
//! A bound block is read, when first evaluated, by MLX's loader straight
//! into MLX's own buffers: it costs exactly one private copy (RssAnon) and
//! no file-backed memory (RssFile), since nothing is mapped. Rebinding
//! reads the next block into the buffers the previous one leaves, so
//! residency stays at one block.

use std::io::Write;
use std::path::Path;

use block_stream::BlockStreamer;
use mlx_rs::macros::ModuleParameters;
use mlx_rs::module::Param;
use mlx_rs::Array;
use mlx_support::ProcessMemory;

const MIB: u64 = 1 << 20;
const ELEMENTS: usize = 16 << 20; // 64 MiB of f32 per block

#[derive(Debug, ModuleParameters)]
struct Block {
    #[param]
    w: Param<Array>,
}

/// Two blocks of one 64 MiB f32 tensor each (block b filled with b + 1),
/// written piece by piece so the test itself never holds a block.
fn write_model(path: &Path) {
    let bytes = ELEMENTS * 4;
    let json = format!(
        r#"{{"blocks.0.w":{{"dtype":"F32","shape":[{ELEMENTS}],"data_offsets":[0,{bytes}]}},"blocks.1.w":{{"dtype":"F32","shape":[{ELEMENTS}],"data_offsets":[{bytes},{}]}}}}"#,
        2 * bytes
    );
    let padded = json.len().div_ceil(8) * 8;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    out.write_all(&(padded as u64).to_le_bytes()).unwrap();
    out.write_all(json.as_bytes()).unwrap();
    out.write_all(&vec![b' '; padded - json.len()]).unwrap();
    for value in [1.0f32, 2.0] {
        let chunk: Vec<u8> = std::iter::repeat_n(value.to_le_bytes(), 1 << 16)
            .flatten()
            .collect();
        for _ in 0..ELEMENTS / (1 << 16) {
            out.write_all(&chunk).unwrap();
        }
    }
    out.flush().unwrap();
}

fn sum(a: &Array) -> f32 {
    let s = a.sum(None).unwrap();
    s.eval().unwrap();
    s.item_exact::<f32>()
}

#[test]
fn a_bound_block_costs_one_block_of_memory() {
    if !cfg!(target_os = "linux") {
        eprintln!(
            "SKIP a_bound_block_costs_one_block_of_memory: RssAnon/RssFile are read from /proc"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write_model(&path);

    let mut streamer = BlockStreamer::new([&path], "blocks.").unwrap();
    let mut m = Block {
        w: Param::new(Array::zeros::<f32>(&[ELEMENTS as i32]).unwrap()),
    };
    let before = ProcessMemory::read();

    streamer.bind(&mut m, 0, &[]).unwrap();
    assert_eq!(sum(&m.w), ELEMENTS as f32, "block 0 holds ones");
    let bound = ProcessMemory::read();
    let grew = |now: &ProcessMemory| {
        (
            now.rss_anon.unwrap() as i64 - before.rss_anon.unwrap() as i64,
            now.rss_file.unwrap() as i64 - before.rss_file.unwrap() as i64,
        )
    };
    let (anon, file) = grew(&bound);
    println!(
        "after binding a 64 MiB block: RssAnon {:+} MiB, RssFile {:+} MiB",
        anon / MIB as i64,
        file / MIB as i64
    );
    let block = 64 * MIB as i64;
    // One copy, not two, and no mapping.
    assert!(
        anon > block * 7 / 8 && anon < block * 9 / 8,
        "RssAnon grew by {anon} bytes"
    );
    assert!(file < block / 8, "file-backed memory grew by {file} bytes");

    streamer.bind(&mut m, 1, &[]).unwrap();
    assert_eq!(sum(&m.w), 2.0 * ELEMENTS as f32, "block 1 holds twos");
    let (anon, file) = grew(&ProcessMemory::read());
    println!(
        "after rebinding to block 1: RssAnon {:+} MiB, RssFile {:+} MiB",
        anon / MIB as i64,
        file / MIB as i64
    );
    assert!(
        anon + file < block * 9 / 8,
        "two blocks resident: RssAnon {anon:+}, RssFile {file:+} bytes"
    );
}

//! Codec throughput, ratio and peak memory (`cargo xtask bench codec`).
//!
//! Fixtures come from the generator below, cached in `target/bench-fixtures`:
//! (a) a rank-16 BF16 LoRA adapter shaped for a 7B Llama (hidden 4096,
//! intermediate 11008, 32 layers, q/k/v/o/gate/up/down), with `lora_a` at its
//! initial scale and `lora_b` small and non-zero as after training;
//! (b) the same in F32; (c) an F32 rank-24 adapter (> 200 MB) for peak RSS.
//!
//! Each figure is one timed run after the fixture is in the page cache.
//! Peak RSS is measured in a fresh child process per operation (VmHWM).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use adapter_codec::AdapterCodec;
use half::bf16;

const LAYERS: usize = 32;
const HIDDEN: usize = 4096;
const INTERMEDIATE: usize = 11008;

/// xorshift64*: fast, deterministic, good enough for weights.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545F4914F6CDD1D) >> 40) as f32) / (1u64 << 24) as f32
    }

    /// Approximately normal (sum of four uniforms), mean 0, std `std`.
    fn normal(&mut self, std: f32) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform()).sum::<f32>() - 2.0;
        s * std * 1.732
    }
}

type Tensor = (String, Vec<usize>, Vec<u8>);

fn generate(path: &Path, rank: usize, f32_dtype: bool) {
    let modules = [
        ("self_attn.q_proj", HIDDEN, HIDDEN),
        ("self_attn.k_proj", HIDDEN, HIDDEN),
        ("self_attn.v_proj", HIDDEN, HIDDEN),
        ("self_attn.o_proj", HIDDEN, HIDDEN),
        ("mlp.gate_proj", HIDDEN, INTERMEDIATE),
        ("mlp.up_proj", HIDDEN, INTERMEDIATE),
        ("mlp.down_proj", INTERMEDIATE, HIDDEN),
    ];
    let mut rng = Rng(0x5eed);
    let mut tensors: Vec<Tensor> = Vec::new();
    for layer in 0..LAYERS {
        for (module, input, output) in modules {
            let bound = 1.0 / (input as f32).sqrt();
            for (suffix, shape, scale) in [
                ("lora_a", [input, rank], bound),
                ("lora_b", [rank, output], 0.004),
            ] {
                let n = shape[0] * shape[1];
                let values: Vec<f32> = (0..n)
                    .map(|_| {
                        if suffix == "lora_a" {
                            (rng.uniform() * 2.0 - 1.0) * scale
                        } else {
                            rng.normal(scale)
                        }
                    })
                    .collect();
                let bytes: Vec<u8> = if f32_dtype {
                    values.iter().flat_map(|v| v.to_le_bytes()).collect()
                } else {
                    values
                        .iter()
                        .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                        .collect()
                };
                tensors.push((
                    format!("model.layers.{layer}.{module}.{suffix}"),
                    shape.to_vec(),
                    bytes,
                ));
            }
        }
    }
    let dtype = if f32_dtype {
        safetensors::Dtype::F32
    } else {
        safetensors::Dtype::BF16
    };
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(dtype, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let tmp = path.with_extension("partial");
    safetensors::serialize_to_file(views, None, &tmp).unwrap();
    std::fs::rename(tmp, path).unwrap();
}

fn fixture(name: &str, rank: usize, f32_dtype: bool) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-fixtures");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    if !path.exists() {
        eprintln!("generating {}", path.display());
        generate(&path, rank, f32_dtype);
    }
    path
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// Plain zstd over the unshuffled file at `level`: (ratio, compress MB/s, decompress MB/s).
fn plain_zstd(raw: &[u8], level: i32) -> (f64, f64, f64) {
    let start = Instant::now();
    let z = zstd::bulk::compress(raw, level).unwrap();
    let c = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let back = zstd::decode_all(&z[..]).unwrap();
    let d = start.elapsed().as_secs_f64();
    assert_eq!(back.len(), raw.len());
    (
        raw.len() as f64 / z.len() as f64,
        mb(raw.len() as u64) / c,
        mb(raw.len() as u64) / d,
    )
}

fn throughput(label: &str, src: &Path) {
    let raw = std::fs::read(src).unwrap();
    let work = tempfile::tempdir().unwrap();
    for level in [19, 3] {
        let codec = AdapterCodec::new(work.path().join("a.zst"), work.path().join("c.json"))
            .with_level(level)
            .unwrap();
        let start = Instant::now();
        let stats = codec.encode(src).unwrap();
        let enc = start.elapsed().as_secs_f64();
        let start = Instant::now();
        codec.decode(work.path().join("back.safetensors")).unwrap();
        let dec = start.elapsed().as_secs_f64();
        // The shuffle's own cost: the same transform without zstd.
        let start = Instant::now();
        let mut sink = Vec::with_capacity(raw.len());
        shuffle_only(&raw, &mut sink);
        let shuffle = start.elapsed().as_secs_f64();
        let (p_ratio, p_c, p_d) = plain_zstd(&raw, level);
        println!(
            "{label} level {level}: {:.1} MB | shuffle+zstd: ratio {:.3}, encode {:.1} MB/s, decode {:.0} MB/s, shuffle = {:.1}% of encode time | plain zstd: ratio {:.3}, {:.1} MB/s, decode {:.0} MB/s",
            mb(stats.raw_bytes),
            stats.ratio(),
            mb(stats.raw_bytes) / enc,
            mb(stats.raw_bytes) / dec,
            100.0 * shuffle / enc,
            p_ratio,
            p_c,
            p_d,
        );
    }
}

/// Byte-shuffles a file with the codec's own transform, to time it alone.
fn shuffle_only(raw: &[u8], out: &mut Vec<u8>) {
    let header = st_mmap::parse_header(raw, raw.len() as u64).unwrap();
    out.extend_from_slice(&raw[..header.data_start()]);
    out.resize(raw.len(), 0);
    for t in header.tensors() {
        let range = header.data_start() + t.data_offsets.0..header.data_start() + t.data_offsets.1;
        adapter_codec::shuffle_bytes(&raw[range.clone()], t.dtype.size(), &mut out[range]);
    }
}

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Child mode: `codec rss encode|decode SRC WORKDIR` prints its peak RSS in KiB.
fn child(op: &str, src: &Path, work: &Path) {
    let codec = AdapterCodec::new(work.join("a.zst"), work.join("c.json"));
    if op == "encode" {
        codec.encode(src).unwrap();
    } else {
        codec.decode(work.join("back.safetensors")).unwrap();
    }
    println!("{}", peak_rss_kib().unwrap_or(0));
}

fn measure_rss(src: &Path) {
    let work = tempfile::tempdir().unwrap();
    let size = std::fs::metadata(src).unwrap().len();
    for op in ["encode", "decode"] {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["rss", op])
            .arg(src)
            .arg(work.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let kib: u64 = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0);
        println!(
            "peak RSS, {op} of a {:.0} MB F32 adapter at level 19: {:.0} MB ({:.2}x the adapter)",
            mb(size),
            kib as f64 * 1024.0 / 1e6,
            kib as f64 * 1024.0 / size as f64
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("rss") {
        child(&args[1], Path::new(&args[2]), Path::new(&args[3]));
        return;
    }
    throughput(
        "7B r16 BF16",
        &fixture("lora-7b-r16-bf16.safetensors", 16, false),
    );
    throughput(
        "7B r16 F32",
        &fixture("lora-7b-r16-f32.safetensors", 16, true),
    );
    if cfg!(target_os = "linux") {
        measure_rss(&fixture("lora-7b-r24-f32.safetensors", 24, true));
    } else {
        eprintln!("peak RSS is read from /proc; skipped on this platform");
    }
}

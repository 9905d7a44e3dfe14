//! Peak memory and time of fusing (`cargo xtask bench fuse`).
//!
//! A generated f32 base of 16 layers (q/k/v/o 1024², MLP 4096×1024), 805 MB
//! in two shards, and a rank-16 adapter on q, v and down of every layer.
//! The fuse runs in a fresh child process whose peak RSS (VmHWM) is its own.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use adapter_codec::AdapterCodec;

const LAYERS: usize = 16;
const HIDDEN: usize = 1024;
const MLP: usize = 4096;
const RANK: usize = 16;

fn modules() -> Vec<(&'static str, usize, usize)> {
    vec![
        ("self_attn.q_proj", HIDDEN, HIDDEN),
        ("self_attn.k_proj", HIDDEN, HIDDEN),
        ("self_attn.v_proj", HIDDEN, HIDDEN),
        ("self_attn.o_proj", HIDDEN, HIDDEN),
        ("mlp.up_proj", MLP, HIDDEN),
        ("mlp.down_proj", HIDDEN, MLP),
    ]
}

/// Writes a safetensors file of f32 tensors, streaming deterministic values.
fn write_file(path: &Path, tensors: &[(String, Vec<usize>)], amplitude: f32) {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (key, shape) in tensors {
        let len = shape.iter().product::<usize>() * 4;
        header.insert(key.clone(), serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len]}));
        offset += len;
    }
    let mut json = serde_json::Value::Object(header).to_string();
    while !json.len().is_multiple_of(8) {
        json.push(' ');
    }
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    out.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    out.write_all(json.as_bytes()).unwrap();
    let mut state = 0x9e3779b97f4a7c15u64;
    for (_, shape) in tensors {
        for _ in 0..shape.iter().product::<usize>() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let v = ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amplitude;
            out.write_all(&v.to_le_bytes()).unwrap();
        }
    }
    out.flush().unwrap();
}

fn generate(base: &Path, adapter: &Path) {
    std::fs::create_dir_all(base).unwrap();
    std::fs::create_dir_all(adapter).unwrap();
    for shard in 0..2 {
        let tensors: Vec<(String, Vec<usize>)> = (shard * LAYERS / 2..(shard + 1) * LAYERS / 2)
            .flat_map(|l| {
                modules()
                    .into_iter()
                    .map(move |(m, o, i)| (format!("model.layers.{l}.{m}.weight"), vec![o, i]))
            })
            .collect();
        write_file(
            &base.join(format!("model-0000{}-of-00002.safetensors", shard + 1)),
            &tensors,
            0.05,
        );
    }
    std::fs::write(base.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    let lora: Vec<(String, Vec<usize>)> = (0..LAYERS)
        .flat_map(|l| {
            modules()
                .into_iter()
                .filter(|(m, _, _)| {
                    m.ends_with("q_proj") || m.ends_with("v_proj") || m.ends_with("down_proj")
                })
                .flat_map(move |(m, o, i)| {
                    [
                        (format!("model.layers.{l}.{m}.lora_a"), vec![i, RANK]),
                        (format!("model.layers.{l}.{m}.lora_b"), vec![RANK, o]),
                    ]
                })
        })
        .collect();
    write_file(&adapter.join("adapters.safetensors"), &lora, 0.01);
    std::fs::write(
        adapter.join("adapter_config.json"),
        r#"{"fine_tune_type": "lora", "lora_parameters": {"rank": 16, "scale": 20.0}}"#,
    )
    .unwrap();
    AdapterCodec::new(adapter.join("a.zst"), adapter.join("adapter_config.json"))
        .with_level(3)
        .unwrap()
        .encode(adapter.join("adapters.safetensors"))
        .unwrap();
}

fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("child") {
        let (base, adapter) = (&args[1], Path::new(&args[2]));
        let codec = AdapterCodec::new(adapter.join("a.zst"), adapter.join("adapter_config.json"));
        let start = Instant::now();
        adapter_fuse::ensure_fused(base, &codec, "bench--fused").unwrap();
        println!("{} {}", start.elapsed().as_secs_f64(), peak_rss_kib());
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let (base, adapter, hub) = (
        work.path().join("base"),
        work.path().join("adapter"),
        work.path().join("hub"),
    );
    generate(&base, &adapter);
    std::fs::create_dir_all(&hub).unwrap();
    let size = |p: &Path| std::fs::metadata(p).unwrap().len() as f64 / 1e6;
    let shard = size(&base.join("model-00001-of-00002.safetensors"));
    let out = Command::new(std::env::current_exe().unwrap())
        .arg("child")
        .arg(&base)
        .arg(&adapter)
        .env("HF_HUB_CACHE", &hub)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut fields = text.split_whitespace();
    let seconds: f64 = fields.next().unwrap().parse().unwrap();
    let kib: f64 = fields.next().unwrap().parse().unwrap();
    let modified_per_shard =
        (LAYERS / 2) as f64 * (2 * HIDDEN * HIDDEN + HIDDEN * MLP) as f64 * 4.0 / 1e6;
    println!(
        "base {:.0} MB in 2 shards of {shard:.0} MB ({modified_per_shard:.0} MB of adapted weights per shard); adapter {:.1} MB",
        2.0 * shard,
        size(&adapter.join("adapters.safetensors"))
    );
    println!(
        "fuse: {seconds:.2} s, peak RSS {:.0} MB",
        kib * 1024.0 / 1e6
    );
}

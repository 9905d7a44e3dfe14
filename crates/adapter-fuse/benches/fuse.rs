//! Peak memory and time of fusing (`cargo xtask bench fuse`), ours and
//! `mlx_lm fuse`'s on the same inputs in the same run.
//!
//! A generated f32 llama base (16 layers, hidden 1024, MLP 4096, vocab
//! 32000; 1.2 GB in two shards) and a rank-16 adapter on q, v and down of
//! every layer, three rounds; then SmolLM2-135M-Instruct (f32 and 4-bit)
//! where `cargo xtask fixtures` has imported it. `cargo xtask bench fuse
//! --7b` instead runs one round on Llama-2-7B's shapes in bf16 (13.2 GB,
//! three shards; needs ~45 GB of disk), the memory figure. Each fuse runs
//! in a fresh process whose peak RSS is its own.
//! mlx_lm runs from the Python `cargo xtask test` sets up
//! (`target/interop-venv`) or `MLX_LOWMEM_PYTHON`; without it only ours runs.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use adapter_codec::AdapterCodec;

const RANK: usize = 16;
const VOCAB: usize = 32000;

/// A generated llama base.
#[derive(Debug, Clone, Copy)]
struct Shape {
    layers: usize,
    hidden: usize,
    mlp: usize,
    dtype: &'static str,
    shards: usize,
}

/// The default: 1.2 GB of f32, quick enough for three rounds.
const SMALL: Shape = Shape {
    layers: 16,
    hidden: 1024,
    mlp: 4096,
    dtype: "F32",
    shards: 2,
};

/// `--7b`: Llama-2-7B's shapes in bf16 (13.5 GB in three shards), for the
/// memory figure.
const SEVEN_B: Shape = Shape {
    layers: 32,
    hidden: 4096,
    mlp: 11008,
    dtype: "BF16",
    shards: 3,
};

impl Shape {
    fn modules(&self) -> Vec<(&'static str, usize, usize)> {
        let (h, m) = (self.hidden, self.mlp);
        vec![
            ("self_attn.q_proj", h, h),
            ("self_attn.k_proj", h, h),
            ("self_attn.v_proj", h, h),
            ("self_attn.o_proj", h, h),
            ("mlp.gate_proj", m, h),
            ("mlp.up_proj", m, h),
            ("mlp.down_proj", h, m),
        ]
    }
}

/// Writes a safetensors file of F32 or BF16 tensors, streaming
/// deterministic values of the given amplitude (0: all ones).
fn write_file(path: &Path, tensors: &[(String, Vec<usize>)], dtype: &str, amplitude: f32) {
    let size = if dtype == "BF16" { 2 } else { 4 };
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (key, shape) in tensors {
        let len = shape.iter().product::<usize>() * size;
        header.insert(key.clone(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len]}));
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
    let mut chunk = Vec::with_capacity(1 << 20);
    for (_, shape) in tensors {
        for _ in 0..shape.iter().product::<usize>() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let v = if amplitude == 0.0 {
                1.0
            } else {
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amplitude
            };
            let bytes = v.to_le_bytes();
            // BF16: the high half of the f32 (truncated; fine for made-up values).
            chunk.extend_from_slice(if size == 2 { &bytes[2..] } else { &bytes });
            if chunk.len() >= 1 << 20 {
                out.write_all(&chunk).unwrap();
                chunk.clear();
            }
        }
    }
    out.write_all(&chunk).unwrap();
    out.flush().unwrap();
}

fn generate(shape: Shape, base: &Path, adapter: &Path) {
    std::fs::create_dir_all(base).unwrap();
    std::fs::create_dir_all(adapter).unwrap();
    let (layers, shards) = (shape.layers, shape.shards);
    for shard in 0..shards {
        let mut tensors: Vec<(String, Vec<usize>)> = (shard * layers / shards
            ..(shard + 1) * layers / shards)
            .flat_map(|l| {
                shape
                    .modules()
                    .into_iter()
                    .map(move |(m, o, i)| (format!("model.layers.{l}.{m}.weight"), vec![o, i]))
            })
            .collect();
        if shard == 0 {
            tensors.push((
                "model.embed_tokens.weight".into(),
                vec![VOCAB, shape.hidden],
            ));
        }
        write_file(
            &base.join(format!("model-{:05}-of-{shards:05}.safetensors", shard + 1)),
            &tensors,
            shape.dtype,
            0.05,
        );
    }
    // Norm weights of 1.0 keep the model well-behaved.
    let norms: Vec<(String, Vec<usize>)> = (0..layers)
        .flat_map(|l| {
            ["input_layernorm", "post_attention_layernorm"]
                .map(|n| (format!("model.layers.{l}.{n}.weight"), vec![shape.hidden]))
        })
        .chain([("model.norm.weight".to_owned(), vec![shape.hidden])])
        .collect();
    write_file(
        &base.join("model-norms.safetensors"),
        &norms,
        shape.dtype,
        0.0,
    );
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": shape.hidden, "num_hidden_layers": layers,
        "intermediate_size": shape.mlp, "num_attention_heads": 16, "num_key_value_heads": 16,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "rope_theta": 10000.0, "tie_word_embeddings": true
    });
    std::fs::write(base.join("config.json"), config.to_string()).unwrap();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"}
    });
    std::fs::write(base.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(
        base.join("tokenizer_config.json"),
        r#"{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<unk>"}"#,
    )
    .unwrap();
    let adapted = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"];
    let lora: Vec<(String, Vec<usize>)> = (0..layers)
        .flat_map(|l| {
            shape
                .modules()
                .into_iter()
                .filter(|(m, _, _)| adapted.contains(m))
                .map(move |(m, o, i)| (format!("model.layers.{l}.{m}"), o, i))
        })
        .flat_map(|(module, o, i)| lora_pair(&module, o, i))
        .collect();
    write_adapter(adapter, &lora, &adapted, layers, shape.dtype);
}

/// `lora_a` (in, rank) and `lora_b` (rank, out) of one module.
fn lora_pair(module: &str, out: usize, inp: usize) -> [(String, Vec<usize>); 2] {
    [
        (format!("{module}.lora_a"), vec![inp, RANK]),
        (format!("{module}.lora_b"), vec![RANK, out]),
    ]
}

/// An adapter for a real model: rank-16 on every layer's q and v
/// projections, shaped from the base's (f32) headers.
fn adapter_for(base: &Path, adapter: &Path) {
    let set = st_mmap::SafetensorsSet::open_dir(base).unwrap();
    let adapted = ["self_attn.q_proj", "self_attn.v_proj"];
    let lora: Vec<(String, Vec<usize>)> = set
        .keys()
        .filter_map(|k| {
            let module = k.strip_suffix(".weight")?;
            adapted
                .iter()
                .any(|m| module.ends_with(m))
                .then_some(module)
        })
        .flat_map(|module| {
            let shape = set
                .tensor(&format!("{module}.weight"))
                .unwrap()
                .shape
                .to_vec();
            lora_pair(module, shape[0], shape[1])
        })
        .collect();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(base.join("config.json")).unwrap()).unwrap();
    // mlx_lm applies LoRA to the last `num_layers` layers only: all of them.
    let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
    write_adapter(adapter, &lora, &adapted, layers, "F32");
}

fn write_adapter(
    adapter: &Path,
    lora: &[(String, Vec<usize>)],
    keys: &[&str],
    layers: usize,
    dtype: &str,
) {
    std::fs::create_dir_all(adapter).unwrap();
    write_file(&adapter.join("adapters.safetensors"), lora, dtype, 0.01);
    let adapter_config = serde_json::json!({
        "fine_tune_type": "lora", "num_layers": layers,
        "lora_parameters": {"rank": RANK, "scale": 20.0, "dropout": 0.0, "keys": keys}
    });
    std::fs::write(
        adapter.join("adapter_config.json"),
        adapter_config.to_string(),
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
    let seven_b = args.iter().any(|a| a == "--7b");
    let (shape, rounds) = if seven_b { (SEVEN_B, 1) } else { (SMALL, 3) };
    // FUSE_BENCH_DIR keeps the generated inputs (for profiling a child by
    // hand); by default everything lives in a temp dir.
    let temp = tempfile::tempdir().unwrap();
    let work =
        std::env::var_os("FUSE_BENCH_DIR").map_or_else(|| temp.path().to_path_buf(), Into::into);
    let (base, adapter) = (work.join("base"), work.join("adapter"));
    if !adapter.join("a.zst").is_file() {
        let start = Instant::now();
        generate(shape, &base, &adapter);
        println!(
            "generated the base in {:.0} s",
            start.elapsed().as_secs_f64()
        );
    }
    // Nobody starts while the generated files are still being written back.
    for entry in std::fs::read_dir(&base).unwrap() {
        std::fs::File::open(entry.unwrap().path())
            .unwrap()
            .sync_all()
            .unwrap();
    }
    let size = |p: &Path| std::fs::metadata(p).unwrap().len() as f64 / 1e6;
    let shards: Vec<f64> = (1..=shape.shards)
        .map(|i| size(&base.join(format!("model-{i:05}-of-{:05}.safetensors", shape.shards))))
        .collect();
    println!("wall time of each whole process (start-up included), alternating, warm page cache");
    compare(
        &format!(
            "generated llama {}, {} layers, hidden {}, MLP {}: {:.0} MB in shards of {:.0?} MB (+ norms); adapter {:.1} MB on q, v, down",
            shape.dtype,
            shape.layers,
            shape.hidden,
            shape.mlp,
            shards.iter().sum::<f64>(),
            shards,
            size(&adapter.join("adapters.safetensors"))
        ),
        &base,
        &adapter,
        &work,
        rounds,
    );
    if seven_b {
        return;
    }
    // The real model, where `cargo xtask fixtures` has imported it.
    let Some(smollm2) = std::env::var_os("MLX_LOWMEM_SMOLLM2").map(std::path::PathBuf::from) else {
        println!("SmolLM2: skipped (MLX_LOWMEM_SMOLLM2 not set; `cargo xtask bench fuse` sets it)");
        return;
    };
    let smol_adapter = work.join("smollm2-adapter");
    adapter_for(&smollm2.join("f32"), &smol_adapter);
    for (variant, label) in [("f32", "f32"), ("q4", "4-bit")] {
        compare(
            &format!(
                "SmolLM2-135M-Instruct {label} ({:.0} MB); adapter {:.1} MB on q, v",
                size(&smollm2.join(variant).join("model.safetensors")),
                size(&smol_adapter.join("adapters.safetensors"))
            ),
            &smollm2.join(variant),
            &smol_adapter,
            &work,
            rounds,
        );
    }
}

/// Fuses `adapter` into `base` with ours and with mlx_lm, alternating, for
/// `rounds` rounds, and prints each run and the best of each side.
fn compare(label: &str, base: &Path, adapter: &Path, work: &Path, rounds: usize) {
    println!("{label}:");
    let python = std::env::var("MLX_LOWMEM_PYTHON").unwrap_or_else(|_| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/interop-venv/bin/python3")
            .display()
            .to_string()
    });
    let (mut best_ours, mut best_theirs) = (f64::INFINITY, f64::INFINITY);
    for round in 1..=rounds {
        let hub = work.join(format!("hub-{round}"));
        let _ = std::fs::remove_dir_all(&hub);
        std::fs::create_dir_all(&hub).unwrap();
        let mut ours = Command::new(std::env::current_exe().unwrap());
        ours.arg("child")
            .arg(base)
            .arg(adapter)
            .env("HF_HUB_CACHE", &hub);
        let (wall, out) = timed(&mut ours);
        let out = out.unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (inside, kib) = two_numbers(&String::from_utf8_lossy(&out.stdout));
        best_ours = best_ours.min(wall);
        println!(
            "  ours   #{round}: {wall:6.2} s ({inside:.2} s in ensure_fused), peak RSS {:6.0} MB",
            kib * 1024.0 / 1e6
        );
        let _ = std::fs::remove_dir_all(&hub);

        // mlx_lm's own fuse; its peak RSS measured inside its process.
        let save = work.join("mlx_lm_fused");
        let _ = std::fs::remove_dir_all(&save);
        let script = "import resource, runpy, sys\n\
                      sys.argv = ['fuse', '--model', sys.argv[1], '--adapter-path', sys.argv[2], '--save-path', sys.argv[3]]\n\
                      runpy.run_module('mlx_lm.fuse', run_name='__main__')\n\
                      print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)";
        let mut theirs = Command::new(&python);
        theirs
            .args(["-c", script])
            .arg(base)
            .arg(adapter)
            .arg(&save);
        match timed(&mut theirs) {
            (wall, Ok(out)) if out.status.success() => {
                let text = String::from_utf8_lossy(&out.stdout);
                let kib: f64 = text
                    .lines()
                    .last()
                    .unwrap_or_default()
                    .trim()
                    .parse()
                    .unwrap();
                best_theirs = best_theirs.min(wall);
                println!(
                    "  mlx_lm #{round}: {wall:6.2} s, peak RSS {:6.0} MB",
                    kib * 1024.0 / 1e6
                );
            }
            (_, Ok(out)) => {
                println!(
                    "  mlx_lm fuse failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                return;
            }
            (_, Err(e)) => {
                println!("  mlx_lm fuse not run: no Python at {python} ({e})");
                return;
            }
        }
        let _ = std::fs::remove_dir_all(&save);
    }
    println!(
        "  best of {rounds}: ours {best_ours:.2} s, mlx_lm {best_theirs:.2} s: {:.2}x mlx_lm's time",
        best_ours / best_theirs
    );
}

fn timed(cmd: &mut Command) -> (f64, std::io::Result<std::process::Output>) {
    let start = Instant::now();
    let out = cmd.output();
    (start.elapsed().as_secs_f64(), out)
}

fn two_numbers(text: &str) -> (f64, f64) {
    let mut fields = text.split_whitespace();
    (
        fields.next().unwrap().parse().unwrap(),
        fields.next().unwrap().parse().unwrap(),
    )
}

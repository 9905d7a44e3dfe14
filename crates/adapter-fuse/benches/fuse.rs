//! Peak memory and time of fusing (`cargo xtask bench fuse`), ours and
//! `mlx_lm fuse`'s on the same inputs in the same run.
//!
//! A generated f32 llama base (16 layers, hidden 1024, MLP 4096, vocab
//! 32000; 1.2 GB in two shards) and a rank-16 adapter on q, v and down of
//! every layer. Each fuse runs in a fresh process whose peak RSS is its own.
//! mlx_lm runs from the Python `cargo xtask test` sets up
//! (`target/interop-venv`) or `MLX_LOWMEM_PYTHON`; without it only ours runs.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use adapter_codec::AdapterCodec;

const LAYERS: usize = 16;
const HIDDEN: usize = 1024;
const MLP: usize = 4096;
const RANK: usize = 16;
const VOCAB: usize = 32000;

fn modules() -> Vec<(&'static str, usize, usize)> {
    vec![
        ("self_attn.q_proj", HIDDEN, HIDDEN),
        ("self_attn.k_proj", HIDDEN, HIDDEN),
        ("self_attn.v_proj", HIDDEN, HIDDEN),
        ("self_attn.o_proj", HIDDEN, HIDDEN),
        ("mlp.gate_proj", MLP, HIDDEN),
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
            let v = if amplitude == 0.0 {
                1.0
            } else {
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amplitude
            };
            out.write_all(&v.to_le_bytes()).unwrap();
        }
    }
    out.flush().unwrap();
}

fn generate(base: &Path, adapter: &Path) {
    std::fs::create_dir_all(base).unwrap();
    std::fs::create_dir_all(adapter).unwrap();
    for shard in 0..2 {
        let mut tensors: Vec<(String, Vec<usize>)> = (shard * LAYERS / 2..(shard + 1) * LAYERS / 2)
            .flat_map(|l| {
                modules()
                    .into_iter()
                    .map(move |(m, o, i)| (format!("model.layers.{l}.{m}.weight"), vec![o, i]))
            })
            .collect();
        if shard == 0 {
            tensors.push(("model.embed_tokens.weight".into(), vec![VOCAB, HIDDEN]));
        }
        write_file(
            &base.join(format!("model-0000{}-of-00002.safetensors", shard + 1)),
            &tensors,
            0.05,
        );
    }
    // Norm weights of 1.0 keep the model well-behaved.
    let norms: Vec<(String, Vec<usize>)> = (0..LAYERS)
        .flat_map(|l| {
            ["input_layernorm", "post_attention_layernorm"]
                .map(|n| (format!("model.layers.{l}.{n}.weight"), vec![HIDDEN]))
        })
        .chain([("model.norm.weight".to_owned(), vec![HIDDEN])])
        .collect();
    write_ones(&base.join("model-norms.safetensors"), &norms);
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "intermediate_size": MLP,
        "num_attention_heads": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
        "rope_theta": 10000.0, "tie_word_embeddings": true
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
    let lora: Vec<(String, Vec<usize>)> = (0..LAYERS)
        .flat_map(|l| {
            modules()
                .into_iter()
                .filter(|(m, _, _)| adapted.contains(m))
                .flat_map(move |(m, o, i)| {
                    [
                        (format!("model.layers.{l}.{m}.lora_a"), vec![i, RANK]),
                        (format!("model.layers.{l}.{m}.lora_b"), vec![RANK, o]),
                    ]
                })
        })
        .collect();
    write_file(&adapter.join("adapters.safetensors"), &lora, 0.01);
    let adapter_config = serde_json::json!({
        "fine_tune_type": "lora", "num_layers": LAYERS,
        "lora_parameters": {"rank": RANK, "scale": 20.0, "dropout": 0.0, "keys": adapted}
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

/// A file of f32 tensors that are all 1.0.
fn write_ones(path: &Path, tensors: &[(String, Vec<usize>)]) {
    write_file(path, tensors, 0.0);
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
    let shards = [1, 2].map(|i| size(&base.join(format!("model-0000{i}-of-00002.safetensors"))));
    println!(
        "base: llama, {LAYERS} layers, {:.0} MB in shards of {:.0} and {:.0} MB (+ norms); adapter {:.1} MB on q, v, down",
        shards[0] + shards[1],
        shards[0],
        shards[1],
        size(&adapter.join("adapters.safetensors"))
    );
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
    let (seconds, kib) = two_numbers(&String::from_utf8_lossy(&out.stdout));
    println!(
        "ours:   {seconds:6.2} s, peak RSS {:6.0} MB",
        kib * 1024.0 / 1e6
    );

    let python = std::env::var("MLX_LOWMEM_PYTHON").unwrap_or_else(|_| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/interop-venv/bin/python3")
            .display()
            .to_string()
    });
    // mlx_lm's own fuse, timed and measured inside its process.
    let script = "import resource, runpy, sys, time\n\
                  t = time.time()\n\
                  sys.argv = ['fuse', '--model', sys.argv[1], '--adapter-path', sys.argv[2], '--save-path', sys.argv[3]]\n\
                  runpy.run_module('mlx_lm.fuse', run_name='__main__')\n\
                  print(time.time() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)";
    let theirs = Command::new(&python)
        .args(["-c", script])
        .arg(&base)
        .arg(&adapter)
        .arg(work.path().join("mlx_lm_fused"))
        .output();
    match theirs {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            let last = text.lines().last().unwrap_or_default();
            let (seconds, kib) = two_numbers(last);
            println!(
                "mlx_lm: {seconds:6.2} s, peak RSS {:6.0} MB",
                kib * 1024.0 / 1e6
            );
        }
        Ok(out) => println!(
            "mlx_lm fuse failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => println!("mlx_lm fuse not run: no Python at {python} ({e})"),
    }
}

fn two_numbers(text: &str) -> (f64, f64) {
    let mut fields = text.split_whitespace();
    (
        fields.next().unwrap().parse().unwrap(),
        fields.next().unwrap().parse().unwrap(),
    )
}

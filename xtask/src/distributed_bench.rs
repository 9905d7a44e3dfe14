//! `cargo xtask bench distributed`: the engine across ranks on this
//! machine, each configuration a fresh job of the release binaries
//! (`mlx-generate`, started by `mlx-launch`).
//!
//! 1. Memory, on a synthetic llama of 2.9 GB (f32, random weights, 20
//!    layers of width 1536, SmolLM2's tokenizer; written once under
//!    `target/bench-distributed`): SmolLM2's 0.5 GB is too small for the
//!    point, as a process's own ~0.25 GB (libraries, activations) would be
//!    most of any cap. A cap of 60% of the weights on each process (a
//!    memory cgroup per rank: Linux, root): one process resident under the
//!    cap (expected to be killed), one process streaming its layers under
//!    the cap, and a two-rank pipeline, each rank under the cap (layers
//!    resident, tables mapped); the uncapped one-process run gives the
//!    reference texts.
//! 2. Data parallel and pipeline, on the SmolLM2 fixture (f32): two ranks
//!    against one process, no cap.
//! 3. The ring: one hop of a hidden state (SmolLM2's 576 floats, a batch
//!    of 8 of them, and a 256-token prefill piece of 8 rows) on loopback.
//!
//! Every figure is the job's own (`generate`'s seconds inside each rank,
//! peak RSS from the OS per rank); texts are compared with the reference.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::memory_limit::Cgroup;

const WORDS: [&str; 16] = [
    "the",
    "service",
    "was",
    "quick",
    "and",
    "the",
    "food",
    "arrived",
    "warm",
    "but",
    "parking",
    "near",
    "hotel",
    "felt",
    "expensive",
    "overall",
];

fn words(seed: usize, n: usize) -> String {
    (0..n)
        .map(|i| WORDS[(seed * 7 + i * 3) % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// A run's ranks' results (`RESULT` lines), or why it did not complete.
fn run(
    program: &[String],
    cgroups: Option<&[Cgroup]>,
) -> Result<std::result::Result<Vec<Value>, String>> {
    let mut command = Command::new(&program[0]);
    command.args(&program[1..]);
    if let Some(groups) = cgroups {
        // Each rank moves itself into its own cgroup before it starts.
        let dir = groups[0].dir.to_string_lossy();
        let base = dir.strip_suffix("-0").unwrap_or(&dir).to_owned();
        command.env("MLX_LOWMEM_CGROUP_BASE", base);
    }
    let out = command.output().context("running a job")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let results: Vec<Value> = stdout
        .lines()
        .filter_map(|l| l.split_once("RESULT ").map(|(_, r)| r))
        .filter_map(|r| serde_json::from_str(r).ok())
        .collect();
    if !out.status.success() || results.is_empty() {
        let killed = cgroups.is_some_and(|g| g.iter().any(|c| c.oom_kills().unwrap_or(0) > 0));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let why = if killed {
            "killed by the OOM killer under the cap".to_owned()
        } else {
            format!("failed: {}", stderr.lines().last().unwrap_or_default())
        };
        return Ok(Err(why));
    }
    Ok(Ok(results))
}

/// A tensor's shape and little-endian f32 bytes.
type Tensor = (Vec<usize>, Vec<u8>);

/// A random llama of `layers` layers of width `hidden` (f32, untied head)
/// with the tokenizer of `tokenizer_from`, in `dir` (once).
fn synthetic_llama(dir: &Path, tokenizer_from: &Path, layers: usize, hidden: usize) -> Result<()> {
    if dir.join("model.safetensors").is_file() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        if tokenizer_from.join(file).is_file() {
            std::fs::copy(tokenizer_from.join(file), dir.join(file))?;
        }
    }
    let (vocab, inter, heads) = (49152, hidden * 8 / 3, hidden / 96);
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": heads,
        "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 100000.0,
        "tie_word_embeddings": false, "max_position_embeddings": 8192
    });
    std::fs::write(dir.join("config.json"), config.to_string())?;
    // A xorshift stream scaled to about N(0, std²)'s spread: the values
    // only need to keep activations finite and tokens varied.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut tensor = |shape: Vec<usize>, std: f32| -> Tensor {
        let n: usize = shape.iter().product();
        let mut bytes = Vec::with_capacity(n * 4);
        for _ in 0..n {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32;
            bytes.extend_from_slice(&((u - 0.5) * 3.46 * std).to_le_bytes());
        }
        (shape, bytes)
    };
    let ones = |n: usize| (vec![n], 1.0f32.to_le_bytes().repeat(n));
    let mut tensors: Vec<(String, Tensor)> = vec![
        (
            "model.embed_tokens.weight".into(),
            tensor(vec![vocab, hidden], 1.0),
        ),
        ("model.norm.weight".into(), ones(hidden)),
        ("lm_head.weight".into(), tensor(vec![vocab, hidden], 0.02)),
    ];
    let std = (hidden as f32).powf(-0.5);
    for i in 0..layers {
        let p = format!("model.layers.{i}.");
        for (name, shape) in [
            ("self_attn.q_proj", vec![hidden, hidden]),
            ("self_attn.k_proj", vec![hidden, hidden]),
            ("self_attn.v_proj", vec![hidden, hidden]),
            ("self_attn.o_proj", vec![hidden, hidden]),
            ("mlp.gate_proj", vec![inter, hidden]),
            ("mlp.up_proj", vec![inter, hidden]),
            ("mlp.down_proj", vec![hidden, inter]),
        ] {
            tensors.push((format!("{p}{name}.weight"), tensor(shape, std)));
        }
        tensors.push((format!("{p}input_layernorm.weight"), ones(hidden)));
        tensors.push((format!("{p}post_attention_layernorm.weight"), ones(hidden)));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(k, (shape, bytes))| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                shape.clone(),
                bytes,
            )?;
            Ok((k.clone(), view))
        })
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    let tmp = dir.join("model.safetensors.tmp");
    safetensors::serialize_to_file(views, None, &tmp)?;
    std::fs::rename(tmp, dir.join("model.safetensors"))?;
    Ok(())
}

pub fn run_all(fixture: &Path) -> Result<()> {
    let status = Command::new(crate::cargo_bin())
        .args([
            "build",
            "--release",
            "--quiet",
            "-p",
            "mlx-engine",
            "--bin",
            "mlx-generate",
        ])
        .args([
            "-p",
            "mlx-support",
            "--bin",
            "mlx-launch",
            "--bin",
            "mlx-ring-check",
        ])
        .status()?;
    if !status.success() {
        bail!("building the release binaries failed");
    }
    let bin = |name: &str| -> Result<String> {
        Ok(Path::new("target/release")
            .join(name)
            .canonicalize()?
            .display()
            .to_string())
    };
    let (generate, launch, ring) = (
        bin("mlx-generate")?,
        bin("mlx-launch")?,
        bin("mlx-ring-check")?,
    );
    let dir = PathBuf::from("target/bench-distributed");
    let big = dir.join("llama-2.9gb");
    synthetic_llama(&big, &fixture.join("f32"), 20, 1536)?;
    let big = big.canonicalize()?;
    let smollm2 = fixture.join("f32");
    let write_conversations = |name: &str, n: usize| -> Result<PathBuf> {
        let list: Vec<Value> = (0..n)
            .map(
                |i| serde_json::json!([{"role": "user", "content": words(i, 20 + (i * 37) % 100)}]),
            )
            .collect();
        let path = dir.join(name);
        std::fs::write(&path, serde_json::to_string(&list)?)?;
        Ok(path.canonicalize()?)
    };
    let few = write_conversations("conversations-8.json", 8)?;
    let many = write_conversations("conversations-64.json", 64)?;
    let system = format!("You label customer reviews. {}", words(1, 170));
    // mlx-generate's arguments for a model, conversations and token limit.
    let args = |model: &Path, conversations: &Path, max_tokens: &str, extra: &[&str]| {
        let mut a = vec![
            "--model".to_owned(),
            model.display().to_string(),
            "--conversations".into(),
            conversations.display().to_string(),
            "--system".into(),
            system.clone(),
            "--max-tokens".into(),
            max_tokens.into(),
            "--all-ranks".into(),
        ];
        a.extend(extra.iter().map(|s| (*s).to_owned()));
        a
    };
    let direct = |a: Vec<String>| -> Vec<String> {
        let mut p = vec![generate.clone()];
        p.extend(a);
        p
    };
    // A rank under a cap: `sh` moves itself into the rank's cgroup, then
    // becomes the program.
    let capped = |a: Vec<String>| -> Vec<String> {
        let mut p = vec![
            "sh".to_owned(),
            "-c".into(),
            r#"echo $$ > "$MLX_LOWMEM_CGROUP_BASE-${MLX_RANK:-0}/cgroup.procs" && exec "$@""#
                .into(),
            "sh".into(),
            generate.clone(),
        ];
        p.extend(a);
        p
    };
    let launched = |n: usize, program: Vec<String>| -> Vec<String> {
        let mut a = vec![launch.clone(), "-n".into(), n.to_string(), "--".into()];
        a.extend(program);
        a
    };
    let report = |what: &str,
                  reference: &Value,
                  outcome: std::result::Result<Vec<Value>, String>| match outcome {
        Ok(ranks) => {
            let same = ranks.iter().all(|r| &r["texts"] == reference);
            let per_rank: Vec<String> = ranks
                .iter()
                .map(|r| {
                    format!(
                        "rank {}: {:.2} conv/s, peak RSS {:.0} MB, MLX peak {:.0} MB",
                        r["rank"],
                        r["conversations_per_s"].as_f64().unwrap_or(0.0),
                        r["peak_rss_mb"].as_f64().unwrap_or(0.0),
                        r["mlx_peak_mb"].as_f64().unwrap_or(0.0)
                    )
                })
                .collect();
            let texts = if same { "= reference" } else { "DIFFER" };
            println!("{what:<46} texts {texts}; {}", per_rank.join("; "));
        }
        Err(why) => println!("{what:<46} {why}"),
    };

    // 1. Memory.
    let weights = std::fs::metadata(big.join("model.safetensors"))?.len();
    let cap = weights * 6 / 10;
    println!(
        "memory: {} ({} MB of weights), 8 conversations, 2 tokens; cap per process {} MB (60%)",
        big.display(),
        weights / 1_000_000,
        cap / 1_000_000
    );
    let big_args = |extra: &[&str]| args(&big, &few, "2", extra);
    let reference =
        run(&direct(big_args(&["--memory", "resident"])), None)?.map_err(anyhow::Error::msg)?;
    let texts = reference[0]["texts"].clone();
    report(
        "1 process, resident, no cap (reference)",
        &texts,
        Ok(reference),
    );
    let per_rank_groups = |n: usize| -> Result<Vec<Cgroup>> {
        let base = format!("mlx-lowmem-bench-{}", std::process::id());
        (0..n)
            .map(|r| Cgroup::create_named(&format!("{base}-{r}"), cap))
            .collect()
    };
    let capped_runs: [(&str, usize, Vec<String>); 3] = [
        (
            "1 process, resident, capped",
            1,
            capped(big_args(&["--memory", "resident"])),
        ),
        (
            "1 process, streamed, capped",
            1,
            capped(big_args(&["--memory", "streamed"])),
        ),
        (
            "2-rank pipeline, tables mapped, each capped",
            2,
            launched(
                2,
                capped(big_args(&["--memory", "mapped", "--placement", "pipeline"])),
            ),
        ),
    ];
    for (what, ranks, program) in capped_runs {
        // Fresh cgroups for each configuration: their OOM counts are its own.
        match per_rank_groups(ranks) {
            Ok(groups) => report(what, &texts, run(&program, Some(&groups))?),
            Err(e) => println!("{what:<46} skipped: {e:#}"),
        }
    }

    // 2. Throughput across ranks, no cap.
    println!(
        "throughput: {} (f32), 64 conversations, 8 tokens",
        smollm2.display()
    );
    let small_args = |extra: &[&str]| args(&smollm2, &many, "8", extra);
    let reference =
        run(&direct(small_args(&["--memory", "resident"])), None)?.map_err(anyhow::Error::msg)?;
    let texts = reference[0]["texts"].clone();
    report("1 process, resident", &texts, Ok(reference));
    for (what, placement) in [
        ("2-rank data parallel", "data"),
        ("2-rank pipeline", "pipeline"),
    ] {
        let program = launched(
            2,
            direct(small_args(&[
                "--memory",
                "resident",
                "--placement",
                placement,
            ])),
        );
        report(what, &texts, run(&program, None)?);
    }

    // 3. The ring.
    for floats in [576, 8 * 576, 8 * 256 * 576] {
        let trips = if floats > 100_000 { "20" } else { "200" };
        let hop = launched(
            2,
            vec![ring.clone(), "hop".into(), floats.to_string(), trips.into()],
        );
        match run(&hop, None)? {
            Ok(ranks) => println!(
                "ring hop on loopback, {:>8} bytes: {:.0} µs",
                floats * 4,
                ranks[0]["hop_us"].as_f64().unwrap_or(0.0)
            ),
            Err(why) => println!("ring hop, {} bytes: {why}", floats * 4),
        }
    }
    Ok(())
}

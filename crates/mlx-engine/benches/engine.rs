//! The engine against mlx_lm's `batch_generate` (`cargo xtask bench engine`):
//! conversations sharing a ~200-token system prompt, user messages of 20–120
//! tokens, SmolLM2-135M (the fixture `cargo xtask fixtures` imports), each
//! configuration in a fresh process for its peak RSS. The `mlx_lm` row does
//! what the original engine does (conversations sorted by length, one
//! `batch_generate` call per chunk of the batch size, the prefix cache
//! deep-copied per conversation); the `mlx_lm one call` row hands them all
//! to one call, as this benchmark did before.
//!
//! Arguments: `--conversations N` (256), `--batches 1,8,32`, `--max-tokens
//! 1,32`, `--variants f32,q4`.

use std::path::{Path, PathBuf};
use std::process::Command;

use mlx_engine::{EngineConfig, GenerateOptions, Message, MlxEngine};

fn words(seed: usize, n: usize) -> String {
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
    (0..n)
        .map(|i| WORDS[(seed * 7 + i * 3) % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

fn conversations(n: usize) -> Vec<Vec<Message>> {
    let system = Message::new(
        "system",
        format!("You label customer reviews. {}", words(1, 170)),
    );
    (0..n)
        .map(|i| {
            vec![
                system.clone(),
                Message::new("user", words(i, 20 + (i * 37) % 100)),
            ]
        })
        .collect()
}

fn child(dir: &Path, n: usize, batch: usize, max_tokens: usize) {
    // What an application running the engine on glibc should do (see its
    // docs). mlx_lm's runs keep the allocator's defaults: it was measured
    // no faster with this setting (docs/mlx-engine.md).
    mlx_support::retain_freed_memory();
    let convs = conversations(n);
    let engine = MlxEngine::new(
        EngineConfig::new(dir)
            .prefix_messages(convs[0][..1].to_vec())
            .batch_size(batch)
            .worker_name("bench"),
    )
    .unwrap();
    engine.ensure_loaded().unwrap();
    let s = engine
        .generate_async(convs, GenerateOptions::new().max_tokens(max_tokens))
        .wait()
        .unwrap()
        .stats;
    println!(
        "{} {} {} {} {}",
        s.seconds,
        s.conversations,
        s.prompt_tokens,
        s.generated_tokens,
        engine.peak_memory_bytes().unwrap_or(0) / 1024
    );
}

fn list(args: &[String], flag: &str, default: &str) -> Vec<String> {
    let value = args
        .iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map_or(default, String::as_str);
    value.split(',').map(str::to_owned).collect()
}

/// The matrix-product work of a model, from its `config.json`: FLOPs of
/// the decoder's linear layers for one token, and of the output head for
/// one position (attention scores, norms and activations left out).
struct LinearWork {
    per_token: f64,
    head: f64,
    hidden: i32,
    intermediate: i32,
}

impl LinearWork {
    fn read(dir: &Path) -> Option<LinearWork> {
        let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
        let c: serde_json::Value = serde_json::from_str(&text).ok()?;
        let get = |k: &str| c.get(k).and_then(serde_json::Value::as_f64);
        let (h, i, layers) = (
            get("hidden_size")?,
            get("intermediate_size")?,
            get("num_hidden_layers")?,
        );
        let heads = get("num_attention_heads")?;
        let head_dim = get("head_dim").unwrap_or(h / heads);
        let kv = get("num_key_value_heads").unwrap_or(heads) * head_dim;
        let q = heads * head_dim;
        let attention = h * (q + 2.0 * kv) + q * h;
        Some(LinearWork {
            per_token: 2.0 * layers * (attention + 3.0 * h * i),
            head: 2.0 * h * get("vocab_size")?,
            hidden: h as i32,
            intermediate: i as i32,
        })
    }

    /// GFLOP/s of a run that prefilled `prompt` tokens and generated
    /// `generated` for `conversations` conversations in `seconds`.
    fn gflops(&self, seconds: f64, conversations: f64, prompt: f64, generated: f64) -> f64 {
        // The first token of each comes from the prefill's last position;
        // every later one is a decode step through the whole decoder.
        let decoded = (generated - conversations).max(0.0);
        let flops = (prompt + decoded) * self.per_token + generated.max(conversations) * self.head;
        flops / seconds / 1e9
    }
}

/// Prints one configuration's line; with `work`, also the rate of its
/// linear layers against the GEMM rate measured in this run.
fn report(label: &str, line: &str, work: Option<(&LinearWork, f64)>) {
    let f: Vec<f64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    if f.len() != 5 {
        println!("{label}: no result ({line:?})");
        return;
    }
    let rate = |x: f64| if f[0] > 0.0 { x / f[0] } else { 0.0 };
    let linear = match work {
        Some((work, gemm)) if f[0] > 0.0 => {
            let achieved = work.gflops(f[0], f[1], f[2], f[3]);
            format!(
                ", linear layers {achieved:.1} GFLOP/s = {:.0}% of the GEMM rate",
                100.0 * achieved / gemm
            )
        }
        _ => String::new(),
    };
    println!(
        "{label}: {:.2} conv/s, {:.0} prompt tok/s, {:.1} decode tok/s, peak RSS {:.0} MB{linear}",
        rate(f[1]),
        rate(f[2]),
        rate(f[3]),
        f[4] * 1024.0 / 1e6
    );
}

/// The median f32 GEMM rate, in this process, of the product that
/// dominates the model's prefill (rows × hidden by hidden × intermediate,
/// 512 rows), and of 1024³ for reference; prints both.
fn gemm_rate(work: &LinearWork) -> f64 {
    let median = |shape| {
        let runs = mlx_support::gemm_gflops(shape, mlx_rs::Dtype::Float32, 2, 9).unwrap();
        runs[runs.len() / 2]
    };
    let mlp = median((512, work.hidden, work.intermediate));
    let square = median((1024, 1024, 1024));
    println!(
        "GEMM f32, this run: {mlp:.1} GFLOP/s for 512×{}·{}×{} (the MLP's shape), {square:.1} GFLOP/s for 1024³",
        work.hidden, work.hidden, work.intermediate
    );
    mlp
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("child") {
        child(
            Path::new(&args[1]),
            args[2].parse().unwrap(),
            args[3].parse().unwrap(),
            args[4].parse().unwrap(),
        );
        return;
    }
    let Some(fixture) = std::env::var_os("MLX_LOWMEM_SMOLLM2").map(PathBuf::from) else {
        println!("no SmolLM2 fixture: run through `cargo xtask bench engine`");
        return;
    };
    let n: usize = list(&args, "--conversations", "256")[0].parse().unwrap();
    // Figures from different machines are read with the kernels beside them.
    println!(
        "BLAS: {}, kernels {} (OPENBLAS_CORETYPE {}; ours and mlx_lm run under the same)",
        mlx_sys::BLAS,
        mlx_support::kernels_in_use().unwrap_or_else(|| "none (no OpenBLAS)".into()),
        std::env::var("OPENBLAS_CORETYPE").unwrap_or_else(|_| "unset".into())
    );
    let python = std::env::var("MLX_LOWMEM_PYTHON").ok();
    let work = tempfile::tempdir().unwrap();
    let convs_path = work.path().join("conversations.json");
    let json: Vec<Vec<serde_json::Value>> = conversations(n)
        .iter()
        .map(|c| {
            c.iter()
                .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                .collect()
        })
        .collect();
    std::fs::write(&convs_path, serde_json::to_string(&json).unwrap()).unwrap();
    let work = LinearWork::read(&fixture.join("f32"));
    let gemm = work.as_ref().map(gemm_rate);
    for variant in list(&args, "--variants", "f32,q4") {
        let dir = fixture.join(&variant);
        for max_tokens in list(&args, "--max-tokens", "1,32") {
            for batch in list(&args, "--batches", "1,8,32") {
                let exe = std::env::current_exe().unwrap();
                let ours = Command::new(exe)
                    .args(["child"])
                    .arg(&dir)
                    .args([n.to_string(), batch.clone(), max_tokens.clone()])
                    .output()
                    .unwrap();
                report(
                    &format!("{variant} max_tokens {max_tokens} batch {batch:>2} ours  "),
                    &String::from_utf8_lossy(&ours.stdout),
                    work.as_ref().zip(gemm),
                );
                if let Some(python) = &python {
                    // The original's way first (a batch_generate call per
                    // chunk), then every conversation in one call.
                    for (mode, label) in [("per-chunk", "mlx_lm"), ("one-call", "mlx_lm one call")]
                    {
                        let script =
                            Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/mlx_lm_batch.py");
                        let theirs = Command::new(python)
                            .arg(script)
                            .arg(&dir)
                            .arg(&convs_path)
                            .args([batch.clone(), max_tokens.clone()])
                            .arg(mode)
                            .output()
                            .unwrap();
                        let text = String::from_utf8_lossy(&theirs.stdout);
                        let line = text.lines().last().unwrap_or_default().to_owned();
                        if theirs.status.success() {
                            report(
                                &format!(
                                    "{variant} max_tokens {max_tokens} batch {batch:>2} {label}"
                                ),
                                &line,
                                None,
                            );
                        } else {
                            println!(
                                "{label} failed: {}",
                                String::from_utf8_lossy(&theirs.stderr)
                                    .lines()
                                    .last()
                                    .unwrap_or_default()
                            );
                        }
                    }
                }
            }
        }
    }
}

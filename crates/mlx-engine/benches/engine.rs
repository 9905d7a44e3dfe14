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

fn report(label: &str, line: &str) {
    let f: Vec<f64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    if f.len() != 5 {
        println!("{label}: no result ({line:?})");
        return;
    }
    let rate = |x: f64| if f[0] > 0.0 { x / f[0] } else { 0.0 };
    println!(
        "{label}: {:.2} conv/s, {:.0} prompt tok/s, {:.1} decode tok/s, peak RSS {:.0} MB",
        rate(f[1]),
        rate(f[2]),
        rate(f[3]),
        f[4] * 1024.0 / 1e6
    );
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

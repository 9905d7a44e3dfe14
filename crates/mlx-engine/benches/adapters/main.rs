//! Many adapters on one base (`cargo xtask bench adapters`): adapters
//! served unfused, per row (`EngineConfig::named_adapter`), against fused
//! copies of the model held at once, and against reloading a fused copy
//! for each adapter; on SmolLM2-135M 4-bit (the fixture), with adapters
//! shaped as mlx_lm trains them by default (rank 8, every linear layer of
//! the last 16 layers, ~5 MB of f32 each; random, made once).
//!
//! Each configuration runs in a fresh process for its peak RSS: a batch of
//! 8 requests, 32 tokens each (end of sequence banned, so that every row
//! runs as long), sent at once after one warm-up request; the time is the
//! batch's, from the first request sent to the last token. Rows are spread
//! over 1, 2 or 8 adapters (row `i` takes adapter `i mod n`).
//!
//! The speed rows run each configuration in several processes, in turn,
//! and give the median; a batch over several adapters runs both ways a
//! forward can take their deltas (`MLX_LOWMEM_ROW_LORA`: each row's pair
//! gathered and one batched product, or each adapter's rows gathered and
//! one product per adapter).
//!
//! Arguments: `--adapters 1,4,16` (the K of the memory rows),
//! `--spreads 1,2,8`, `--tokens 32`.
//!
//! `--e2b` measures instead how close a row under cc-sentiment's shipped
//! adapter (the fixture, `MLX_LOWMEM_CC_SENTIMENT`), served unfused on a
//! random Gemma 4 with E2B's shapes, comes to the same base fused with it
//! by adapter-fuse: the application's 693-word system prompt, its texts,
//! one token each with the top 5 log-probabilities, both arithmetics
//! (`keep`, `dequantize_on_use`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use adapter_codec::AdapterCodec;
use mlx_engine::{Completion, EngineConfig, Message, MlxEngine, Sampling, Tokenizer};

mod e2b;

const ROWS: usize = 8;

const PROMPTS: [&str; ROWS] = [
    "The lid leaks and the motor is loud.",
    "Great blender, crushed ice in seconds.",
    "What is the capital of France?",
    "Name three colours and say why you like them.",
    "Arrived late but works.",
    "Tell me a story about a dragon.",
    "Terrible customer service.",
    "Why is the sky blue?",
];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        child(&args[1..]);
        return;
    }
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-adapters");
    if args.iter().any(|a| a == "--e2b") {
        e2b::exactness(&work.join("e2b"));
        return;
    }
    let list = |flag: &str, default: &str| -> Vec<usize> {
        let value = args
            .iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map_or(default, String::as_str);
        value.split(',').map(|v| v.parse().unwrap()).collect()
    };
    let ks = list("--adapters", "1,4,16");
    let spreads = list("--spreads", "1,2,8");
    let tokens = list("--tokens", "32")[0];
    let Some(fixture) = std::env::var_os("MLX_LOWMEM_SMOLLM2") else {
        eprintln!("SKIP adapters bench: MLX_LOWMEM_SMOLLM2 is not set (cargo xtask fixtures)");
        return;
    };
    let base = PathBuf::from(fixture).join("q4");
    let most = ks.iter().chain(&spreads).copied().max().unwrap_or(1);
    let (adapters, fused) = prepare(&base, &work, most);
    let base_s = base.display().to_string();
    let dirs = |dirs: &[PathBuf], n: usize| -> Vec<String> {
        dirs[..n].iter().map(|d| d.display().to_string()).collect()
    };

    println!(
        "{} rows, {tokens} tokens each, SmolLM2-135M 4-bit ({}), MLX {}",
        ROWS,
        base.display(),
        mlx_support::mlx_version()
    );
    let one_fused = run(&["fused", "1", &tokens.to_string()], &dirs(&fused, 1), None);
    println!("\nmemory (peak RSS; MLX's own peak beside it), rows spread over min(K, 8) adapters:");
    print_row("one fused model", &one_fused, None);
    print_row(
        "base, no adapter",
        &run(&["unfused", &base_s, "0", &tokens.to_string()], &[], None),
        Some(&one_fused),
    );
    for &k in &ks {
        let spread = k.min(ROWS).to_string();
        let m = run(
            &["unfused", &base_s, &spread, &tokens.to_string()],
            &dirs(&adapters, k),
            None,
        );
        print_row(&format!("{k} unfused adapters"), &m, Some(&one_fused));
        if k > 1 {
            let m = run(
                &["fused", &k.to_string(), &tokens.to_string()],
                &dirs(&fused, k),
                None,
            );
            print_row(&format!("{k} fused copies held"), &m, Some(&one_fused));
        }
    }
    println!(
        "\nspeed, a batch of {ROWS} rows spread over n adapters (each the median of {REPEATS} processes, run in turn):"
    );
    let tokens_s = tokens.to_string();
    for &n in &spreads {
        let unfused = ["unfused", base_s.as_str(), &n.to_string(), &tokens_s];
        let mut sides: Vec<(String, Vec<Measured>)> = Vec::new();
        let strategies: &[&str] = if n > 1 {
            &["gather", "segments"]
        } else {
            &["gather"]
        };
        for _ in 0..REPEATS {
            let mut i = 0;
            let mut record = |label: String, m: Measured| {
                match sides.get_mut(i) {
                    Some((_, runs)) => runs.push(m),
                    None => sides.push((label, vec![m])),
                }
                i += 1;
            };
            record(
                "one fused model".into(),
                run(&["fused", "1", &tokens_s], &dirs(&fused, 1), None),
            );
            for strategy in strategies {
                let m = run(&unfused, &dirs(&adapters, n), Some(strategy));
                record(format!("unfused, {strategy}"), m);
            }
        }
        let medians: Vec<(String, Measured)> = sides
            .into_iter()
            .map(|(label, runs)| (label, median(runs)))
            .collect();
        println!("  n = {n}:");
        for (label, m) in &medians {
            print_row(label, m, Some(&medians[0].1));
        }
        if n > 1 {
            let m = run(
                &["reload", &n.to_string(), &tokens_s],
                &dirs(&fused, n),
                None,
            );
            print_row("reloading fused copies (once)", &m, Some(&medians[0].1));
        }
    }
}

/// Processes per configuration in the speed rows: one run of a few
/// seconds on this 2-core machine varies by ±15% from one process to the
/// next.
const REPEATS: usize = 3;

/// The run of median speed.
fn median(mut runs: Vec<Measured>) -> Measured {
    runs.sort_by(|a, b| (a.tokens / a.seconds).total_cmp(&(b.tokens / b.seconds)));
    runs.swap_remove(runs.len() / 2)
}

/// `n` adapters under `work` (made once) and the model fused with each.
fn prepare(base: &Path, work: &Path, n: usize) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut adapters = Vec::new();
    let mut fused = Vec::new();
    for i in 0..n {
        let dir = work.join(format!("adapter-{i}"));
        if !dir.join("adapters.safetensors.zst").is_file() {
            eprintln!("making adapter {i} and its fused copy");
            test_support::smollm2_adapter::write_smollm2_default_adapter(&dir, 1000 * i as u64);
            AdapterCodec::new(
                dir.join("adapters.safetensors.zst"),
                dir.join("adapter_config.json"),
            )
            .encode(dir.join("adapters.safetensors"))
            .unwrap();
        }
        let codec = AdapterCodec::new(
            dir.join("adapters.safetensors.zst"),
            dir.join("adapter_config.json"),
        );
        let copy = adapter_fuse::Fuse::new(base.to_str().unwrap(), &codec, &format!("bench-{i}"))
            .options(&adapter_fuse::FuseOptions::from_env().with_cache_root(work.join("hub")))
            .run()
            .unwrap();
        adapters.push(dir);
        fused.push(copy);
    }
    (adapters, fused)
}

/// What a child measured.
struct Measured {
    seconds: f64,
    tokens: f64,
    peak_rss_mb: f64,
    mlx_peak_mb: f64,
}

/// One child: `args`, the folders `dirs`, and with `strategy` the row
/// strategy of a forward whose rows use several adapters.
fn run(args: &[&str], dirs: &[String], strategy: Option<&str>) -> Measured {
    let mut command = Command::new(std::env::current_exe().unwrap());
    if let Some(strategy) = strategy {
        command.env("MLX_LOWMEM_ROW_LORA", strategy);
    }
    let out = command
        .arg("--child")
        .args(args)
        .args(dirs)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Vec<f64> = text
        .lines()
        .last()
        .unwrap()
        .split(' ')
        .map(|x| x.parse().unwrap())
        .collect();
    Measured {
        seconds: v[0],
        tokens: v[1],
        peak_rss_mb: v[2],
        mlx_peak_mb: v[3],
    }
}

fn print_row(label: &str, m: &Measured, against: Option<&Measured>) {
    let rate = m.tokens / m.seconds;
    let relative = against.map_or(String::new(), |a| {
        format!(
            " ({:.2}× the memory, {:.2}× the speed of one fused model)",
            m.peak_rss_mb / a.peak_rss_mb,
            rate / (a.tokens / a.seconds)
        )
    });
    println!(
        "  {label:32} {rate:6.1} tok/s, {:.2} s, peak RSS {:.0} MB (MLX {:.0} MB){relative}",
        m.seconds, m.peak_rss_mb, m.mlx_peak_mb
    );
}

/// One configuration: `unfused BASE SPREAD TOKENS DIRS…` (the base with
/// the adapters of DIRS, rows spread over SPREAD of them, 0: none),
/// `fused K TOKENS DIRS…` (K fused copies loaded at once, the batch on
/// the first), `reload N TOKENS DIRS…` (each fused copy loaded in turn
/// for its share of the rows, load times counted). Prints seconds,
/// generated tokens, peak RSS and MLX's peak (MB).
fn child(args: &[String]) {
    mlx_support::retain_freed_memory();
    let mode = args[0].as_str();
    let (seconds, generated) = match mode {
        "unfused" => {
            let base = &args[1];
            let spread: usize = args[2].parse().unwrap();
            let tokens: usize = args[3].parse().unwrap();
            let mut config = EngineConfig::new(base).batch_size(ROWS);
            for (i, dir) in args[4..].iter().enumerate() {
                config = config.named_adapter(format!("a{i}"), dir);
            }
            let engine = MlxEngine::new(config).unwrap();
            let names: Vec<Option<String>> = (0..ROWS)
                .map(|i| (spread > 0).then(|| format!("a{}", i % spread)))
                .collect();
            warm(&engine, base);
            median_of_three(|| batch(&engine, base, &names, tokens))
        }
        "fused" => {
            let tokens: usize = args[2].parse().unwrap();
            let dirs = &args[3..];
            let engines: Vec<MlxEngine> = dirs
                .iter()
                .map(|d| {
                    let e = MlxEngine::new(EngineConfig::new(d).batch_size(ROWS)).unwrap();
                    e.ensure_loaded().unwrap();
                    e
                })
                .collect();
            warm(&engines[0], &dirs[0]);
            median_of_three(|| batch(&engines[0], &dirs[0], &vec![None; ROWS], tokens))
        }
        "reload" => {
            let tokens: usize = args[2].parse().unwrap();
            let dirs = &args[3..];
            let n = dirs.len();
            let start = Instant::now();
            let mut generated = 0.0;
            for (i, dir) in dirs.iter().enumerate() {
                let engine = MlxEngine::new(EngineConfig::new(dir).batch_size(ROWS)).unwrap();
                let share = (0..ROWS).filter(|r| r % n == i).count();
                generated += batch(&engine, dir, &vec![None; share], tokens).1;
            }
            (start.elapsed().as_secs_f64(), generated)
        }
        other => panic!("unknown child mode {other}"),
    };
    let memory = mlx_support::ProcessMemory::read();
    let mb = |b: Option<u64>| b.unwrap_or(0) as f64 / 1e6;
    let mlx_peak = mlx_rs::memory::peak_memory().ok().map(|b| b as u64);
    println!(
        "{seconds} {generated} {} {}",
        mb(memory.peak_rss),
        mb(mlx_peak)
    );
}

/// The median of three runs of `batch`.
fn median_of_three(mut batch: impl FnMut() -> (f64, f64)) -> (f64, f64) {
    let mut runs: Vec<(f64, f64)> = (0..3).map(|_| batch()).collect();
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    runs[1]
}

/// One short request: the model loaded and its first products run.
fn warm(engine: &MlxEngine, dir: &str) {
    batch(engine, dir, &[None], 2);
}

/// The rows (one per adapter name, `None`: the base) sent at once, each
/// `tokens` long; returns the seconds and the tokens generated.
fn batch(engine: &MlxEngine, dir: &str, names: &[Option<String>], tokens: usize) -> (f64, f64) {
    let tokenizer = Tokenizer::load(Path::new(dir)).unwrap();
    let no_end: Vec<(u32, f32)> = tokenizer.eos_ids().iter().map(|&id| (id, -100.0)).collect();
    let start = Instant::now();
    let streams: Vec<_> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let messages = vec![Message::new("user", PROMPTS[i % ROWS])];
            let mut completion = Completion::new(messages)
                .max_tokens(tokens)
                .sampling(Sampling::greedy().logit_bias(no_end.clone()));
            if let Some(name) = name {
                completion = completion.adapter(name.clone());
            }
            engine.complete(completion).unwrap()
        })
        .collect();
    let generated: usize = streams
        .into_iter()
        .map(|s| s.collect().unwrap().tokens.len())
        .sum();
    (start.elapsed().as_secs_f64(), generated as f64)
}

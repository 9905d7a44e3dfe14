//! The engine against mlx_lm's `batch_generate` (`cargo xtask bench engine`):
//! conversations sharing a system prompt, user messages of 20–120 tokens,
//! on SmolLM2-135M (a ~200-token prompt), Gemma 3 270M (a ~700-token
//! prompt, longer than its 512-token sliding window; classification), the
//! fixtures `cargo xtask fixtures` imports, and a Gemma 4 with E2B's shapes
//! and random 4-bit weights that the benchmark makes (`gemma4_e2b`; what
//! cc-sentiment runs: a ~700-token prompt, classification at batch 2), each
//! configuration in a fresh process for its peak RSS. The `mlx_lm` row does
//! what the original engine does (conversations sorted by length, one
//! `batch_generate` call per chunk of the batch size, the prefix cache
//! deep-copied per conversation); the `mlx_lm one call` row hands them all
//! to one call, as this benchmark did before.
//!
//! `--models gemma4-moe` (not run by default) is a Gemma 4 with 26B-A4B's
//! widths in 6 layers and random 4-bit weights (`gemma4_moe_shaped`), run
//! as the qwen3_moe one below (no llama.cpp beside it).
//!
//! `--models qwen3-moe` (not run by default) is a qwen3_moe with
//! Qwen3-30B-A3B's widths in 6 layers and random 4-bit weights
//! (`qwen3_moe_shaped`), resident, with its experts left in the files, and
//! streamed, at batch 1, 8 and 32; ours print the experts' bytes read;
//! mlx_lm runs there on MLX 0.32.4 only when asked
//! (`--mlx-lm-conversations N`).
//!
//! Arguments: `--models smollm2,gemma3,gemma4-e2b`, and to override each
//! model's own settings `--conversations N` (256; Gemma 3 64, its 4-bit
//! runs 8; E2B 8), `--mlx-lm-conversations N` for mlx_lm's side alone
//! (E2B's 4-bit runs 1; 0 skips it), `--batches 1,8,32` (Gemma 3
//! 2,8,32; E2B 2,8), `--max-tokens 1,32` (Gemma 1), `--variants f32,q4`,
//! `--memory resident,experts,mapped,streamed` (ours with every weight
//! resident, a mixture of experts' experts alone left in the files, the
//! embedding tables (and experts) left in the files, or with the decoder layers streamed from
//! the files as well; default resident and mapped, Gemma 3 resident only),
//! `--lanes 1,2` (each of our rows again with that many chunks run side by
//! side, labelled with the count; default: the engine's own choice),
//! `--cold` (every run of either side starts with the model's files dropped
//! from the page cache: Linux), `--llama-cpp` (xtask installs
//! llama-cpp-python, built for this CPU, into the interop venv).
//!
//! `--memory-cap MB` runs every side's processes inside a memory cgroup of
//! that limit (`cargo xtask bench engine` makes it: Linux, root), each
//! run starting with the model's files dropped from the page cache; a
//! run killed under the cap says so.
//!
//! Each row also gives the process's reads over the timed part as the
//! kernel counts them (`/proc/self/io`): bytes returned by read calls, and
//! bytes fetched from storage; beside ours, the experts' bytes the engine
//! read.
//!
//! `--profile` prints, under each of our rows, the busy time of the
//! engine's spans (prefill and decode per chunk) summed over the run.
//!
//! llama.cpp (`llama_cpp_peer.py`) runs beside SmolLM2's 4-bit folder on
//! the GGUF that folder was imported from, and beside the qwen3-moe model
//! on the same values exported to a `qwen3moe` GGUF (`qwen3_moe_gguf.py`,
//! once, beside the made folder), one conversation at a time (the
//! prefix's state saved once and loaded per conversation), once per
//! `max_tokens`, wherever `MLX_LOWMEM_PYTHON` can import `llama_cpp`.

use std::path::{Path, PathBuf};

use mlx_engine::{EngineConfig, GenerateOptions, MemoryMode, Message, MlxEngine};

mod gemma4_e2b;
mod gemma4_moe_shaped;
mod models;
mod peers;
mod qwen3_moe_shaped;

use models::{Gguf, ModelBench};

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

/// `n` conversations: a shared system prompt of `system_words` words and
/// user messages of 20–120 words.
fn conversations(n: usize, system_words: usize) -> Vec<Vec<Message>> {
    let system = Message::new(
        "system",
        format!("You label customer reviews. {}", words(1, system_words)),
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

fn child(
    dir: &Path,
    n: usize,
    system_words: usize,
    batch: usize,
    max_tokens: usize,
    options: &str,
) {
    // What an application running the engine on glibc should do (see its
    // docs). mlx_lm's runs keep the allocator's defaults: it was measured
    // no faster with this setting (docs/mlx-engine.md).
    mlx_support::retain_freed_memory();
    if options.split(',').any(|o| o == "profile") {
        // The engine's spans, each printed with its time as it closes.
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("mlx_engine=debug"))
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .init();
    }
    let at_start = mlx_support::ProcessMemory::read();
    let convs = conversations(n, system_words);
    let mut config = EngineConfig::new(dir)
        .prefix_messages(convs[0][..1].to_vec())
        .batch_size(batch)
        .worker_name("bench");
    let options: Vec<&str> = options.split(',').collect();
    if options.contains(&"f32-at-load") {
        config = config.quantized(mlx_engine::QuantizedWeights::DequantizeF32);
    }
    let memory = config_memory(&options);
    config = config.memory(memory);
    // `lanes=N` sets them; without it, the engine's default. Either way
    // OpenBLAS's threads are shared out between them, as an application
    // does at its start (before the engine's first MLX work).
    let lanes = match options.iter().find_map(|o| o.strip_prefix("lanes=")) {
        Some(lanes) => lanes.parse().unwrap(),
        None => mlx_engine::default_lanes(mlx_support::best_device(), memory),
    };
    config = config
        .lanes(lanes)
        .blas_threads(mlx_engine::BlasThreads::SharedByLanes);
    let engine = MlxEngine::new(config).unwrap();
    engine.ensure_loaded().unwrap();
    let loaded = mlx_support::ProcessMemory::read();
    let (io_before, experts_before) = (peers::ProcessIo::read(), mlx_engine::expert_bytes_read());
    let s = engine
        .generate_async(convs, GenerateOptions::new().max_tokens(max_tokens))
        .wait()
        .unwrap()
        .stats;
    let io = peers::ProcessIo::read().since(io_before);
    // Where the peak comes from: the process before the engine, after the
    // load, and the load's own peak; and MLX's own peak of live buffers,
    // which the C heap's layout does not move (peak RSS varies by a few MB
    // between runs of the same configuration).
    let kib = |b: Option<u64>| b.unwrap_or(0) / 1024;
    let mlx_peak = mlx_rs::memory::peak_memory()
        .ok()
        .and_then(|b| u64::try_from(b).ok());
    // Then the bytes of experts read from the files while generating
    // (mixture-of-experts models whose experts stay there), and the
    // kernel's count of the process's reads over the same time.
    println!(
        "{} {} {} {} {} {} {} {} {} {} {io}",
        s.seconds,
        s.conversations,
        s.prompt_tokens,
        s.generated_tokens,
        kib(engine.peak_memory_bytes()),
        kib(at_start.rss),
        kib(loaded.rss),
        kib(loaded.peak_rss),
        kib(mlx_peak),
        mlx_engine::expert_bytes_read() - experts_before,
    );
    // How the routers spread their choices (on stderr: the line above is
    // read as numbers).
    if let Some(routing) = describe_routing(&mlx_engine::routing_counts(), dir) {
        eprintln!("ROUTING {routing}");
    }
}

/// The routers' choices of a run, against what uniform routing would give:
/// each expert's share of the choices (over every layer), and the distinct
/// experts per layer of a decode step beside `E·(1 − (1 − k/E)^rows)`, the
/// expectation if each row chose its k experts uniformly. `None` for a
/// model without experts taken per forward.
fn describe_routing(counts: &mlx_engine::RoutingCounts, dir: &Path) -> Option<String> {
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).ok()?).ok()?;
    let field = |names: &[&str]| names.iter().find_map(|n| config[*n].as_u64());
    let experts = field(&["num_experts", "num_local_experts"])? as f64;
    let k = field(&["num_experts_per_tok", "top_k_experts"])? as f64;
    let total: u64 = counts.choices.iter().sum();
    if total == 0 {
        return None;
    }
    let mean = total as f64 / experts;
    let mut shares: Vec<f64> = (0..experts as usize)
        .map(|e| counts.choices.get(e).copied().unwrap_or(0) as f64 / mean)
        .collect();
    shares.sort_by(f64::total_cmp);
    let cv = (shares.iter().map(|s| (s - 1.0).powi(2)).sum::<f64>() / experts).sqrt();
    let quantile = |q: f64| shares[((experts - 1.0) * q).round() as usize];
    let mut said = format!(
        "each expert's share of the {total} choices, as a multiple of 1/{experts}: min {:.2}, quartiles {:.2} / {:.2} / {:.2}, max {:.2} (coefficient of variation {cv:.2})",
        shares[0],
        quantile(0.25),
        quantile(0.5),
        quantile(0.75),
        shares[shares.len() - 1],
    );
    let steps = &counts.decode_steps;
    if !steps.is_empty() {
        let n = steps.len() as f64;
        let measured = steps.iter().map(|s| s.distinct as f64).sum::<f64>() / n;
        let uniform = steps
            .iter()
            .map(|s| experts * (1.0 - (1.0 - k / experts).powi(s.rows as i32)))
            .sum::<f64>()
            / n;
        said.push_str(&format!(
            "; decode steps: {measured:.1} distinct experts per layer (uniform chance {uniform:.1}) over {} layer steps",
            steps.len()
        ));
        // Of the steps after a decode step, the share of their experts the
        // same layer chose the step before (what a prefetch of those
        // finds).
        let (reused, of): (u64, u64) = steps
            .iter()
            .filter_map(|s| s.reused.map(|r| (r as u64, s.distinct as u64)))
            .fold((0, 0), |(a, b), (r, d)| (a + r, b + d));
        if of > 0 {
            said.push_str(&format!(
                ", {:.0}% of them chosen by the same layer at the step before",
                100.0 * reused as f64 / of as f64
            ));
        }
    }
    Some(said)
}

/// The child's memory mode: set either way, so that the rows do not depend
/// on the machine's memory (the engine's default does).
fn config_memory(options: &[&str]) -> MemoryMode {
    if options.contains(&"experts") {
        MemoryMode::ExpertsInFiles
    } else if options.contains(&"mapped") {
        MemoryMode::MappedTables
    } else if options.contains(&"streamed") {
        MemoryMode::Streamed
    } else {
        MemoryMode::Resident
    }
}

/// Drops the `.safetensors` files of `dir` (links followed) from the page
/// cache, for `--cold`.
fn evict_model_files(dir: &Path) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "safetensors")
            && !mlx_support::evict_from_page_cache(&path)
        {
            println!("--cold: could not evict {} (Linux only)", path.display());
        }
    }
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
    /// FLOPs of a token through every layer (a decode step).
    per_token: f64,
    /// Of `per_token`, what a prefill runs on each row's last position
    /// only: everything after the last key/value projections (the rest of
    /// that layer, and Gemma 4's KV-shared layers after it).
    last_only_per_token: f64,
    head: f64,
    hidden: i32,
    intermediate: i32,
}

impl LinearWork {
    fn read(dir: &Path) -> Option<LinearWork> {
        let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
        let c: serde_json::Value = serde_json::from_str(&text).ok()?;
        let c = c.get("text_config").unwrap_or(&c);
        let get = |k: &str| c.get(k).and_then(serde_json::Value::as_f64);
        let (h, i, layers) = (
            get("hidden_size")?,
            get("intermediate_size")?,
            get("num_hidden_layers")?,
        );
        let heads = get("num_attention_heads")?;
        let head_dim = get("head_dim").unwrap_or(h / heads);
        let kv_heads = get("num_key_value_heads").unwrap_or(heads);
        // Gemma 4: wider heads on full-attention layers, no key/value
        // projections and a double-wide MLP on the KV-shared layers, and
        // the per-layer input embeddings' gate and projection.
        let types = c.get("layer_types").and_then(serde_json::Value::as_array);
        let shared = get("num_kv_shared_layers").unwrap_or(0.0);
        let double_wide = c.get("use_double_wide_mlp") == Some(&serde_json::Value::Bool(true));
        let per_layer = get("hidden_size_per_layer_input").unwrap_or(0.0);
        let mut per_token = 0.0;
        let mut last_only_per_token = 0.0;
        let last_writer = layers - shared - 1.0;
        for layer in 0..layers as usize {
            let full = types
                .and_then(|t| t.get(layer))
                .is_some_and(|t| t == "full_attention");
            let hd = match get("global_head_dim") {
                Some(global) if full => global,
                _ => head_dim,
            };
            let is_shared = (layer as f64) >= layers - shared;
            let q = heads * hd;
            let kv = if is_shared { 0.0 } else { 2.0 * kv_heads * hd };
            let inter = if is_shared && double_wide { 2.0 * i } else { i };
            let writes = 2.0 * h * kv;
            // The layer's gate and projection of its per-layer input, and
            // the model's projection of the embedding onto that input
            // (computed in the layer that reads it).
            let rest = 2.0 * (h * q + q * h + 3.0 * h * inter + 3.0 * h * per_layer);
            per_token += writes + rest;
            if (layer as f64) >= last_writer {
                last_only_per_token += rest;
            }
        }
        Some(LinearWork {
            per_token,
            last_only_per_token,
            head: 2.0 * h * get("vocab_size")?,
            hidden: h as i32,
            intermediate: i as i32,
        })
    }

    /// GFLOP/s of a run that prefilled `prompt` tokens and generated
    /// `generated` for `conversations` conversations in `seconds`.
    fn gflops(&self, seconds: f64, conversations: f64, prompt: f64, generated: f64) -> f64 {
        // The first token of each comes from the prefill's last position
        // (the only one the layers after the last keys and values see);
        // every later one is a decode step through the whole decoder.
        let decoded = (generated - conversations).max(0.0);
        let prefill = prompt * (self.per_token - self.last_only_per_token)
            + conversations * self.last_only_per_token;
        let flops = prefill + decoded * self.per_token + generated.max(conversations) * self.head;
        flops / seconds / 1e9
    }
}

/// Prints one configuration's line; with `work`, also the rate of its
/// linear layers against the GEMM rate measured in this run.
/// The first `n` conversations as JSON at `path`, for the Python peers.
fn write_conversations(path: &Path, n: usize, system_words: usize) {
    let json: Vec<Vec<serde_json::Value>> = conversations(n, system_words)
        .iter()
        .map(|c| {
            c.iter()
                .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                .collect()
        })
        .collect();
    std::fs::write(path, serde_json::to_string(&json).unwrap()).unwrap();
}

fn report(label: &str, line: &str, work: Option<(&LinearWork, f64)>) {
    let f: Vec<f64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // Ours print five more: RSS at the start and after the load, the
    // load's peak, and MLX's peak of live buffers (KiB); the bytes of
    // experts read from the files.
    if f.len() != 5 && f.len() != 10 {
        println!("{label}: no result ({line:?})");
        return;
    }
    let mb = |kib: f64| kib * 1024.0 / 1e6;
    let breakdown = match f.get(5..9) {
        Some(&[start, loaded, load_peak, mlx_peak]) => format!(
            " (at start {:.0} MB, loaded {:.0} MB, load's peak {:.0} MB, MLX's buffers at most {:.1} MB)",
            mb(start),
            mb(loaded),
            mb(load_peak),
            mb(mlx_peak)
        ),
        _ => String::new(),
    };
    let experts = match f.get(9) {
        Some(&bytes) if bytes > 0.0 => format!(
            ", experts read {:.0} MB = {:.1} MB per generated token",
            bytes / 1e6,
            bytes / 1e6 / f[3].max(1.0)
        ),
        _ => String::new(),
    };
    let io = peers::ProcessIo::parse(line).map_or(String::new(), |io| io.describe(f[3]));
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
        "{label}: {:.2} conv/s, {:.0} prompt tok/s, {:.1} decode tok/s, peak RSS {:.0} MB{breakdown}{experts}{io}{linear}",
        rate(f[1]),
        rate(f[2]),
        rate(f[3]),
        mb(f[4])
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
            args[5].parse().unwrap(),
            args.get(6).map_or("", String::as_str),
        );
        return;
    }
    // Figures from different machines are read with the kernels beside them.
    println!(
        "BLAS: {}, kernels {} (OPENBLAS_CORETYPE {}; ours and mlx_lm run under the same)",
        mlx_sys::BLAS,
        mlx_support::kernels_in_use().unwrap_or_else(|| "none (no OpenBLAS)".into()),
        std::env::var("OPENBLAS_CORETYPE").unwrap_or_else(|_| "unset".into())
    );
    let python = std::env::var("MLX_LOWMEM_PYTHON").ok();
    for name in list(&args, "--models", "smollm2,gemma3,gemma4-e2b") {
        let Some(bench) = ModelBench::named(&name) else {
            println!(
                "unknown model {name:?}: smollm2, gemma3, gemma4-e2b, qwen3-moe or gemma4-moe"
            );
            continue;
        };
        let Some(fixture) = std::env::var_os(bench.fixture_var).map(PathBuf::from) else {
            println!(
                "no {} fixture ({} unset): run through `cargo xtask bench engine`",
                bench.name, bench.fixture_var
            );
            continue;
        };
        bench.run(&fixture, &args, python.as_deref());
    }
}

impl ModelBench {
    /// `fixture/variant`, or a folder beside `work` that links its files
    /// and adds the chat template.
    fn folder(&self, fixture: &Path, variant: &str, work: &Path) -> PathBuf {
        let dir = fixture.join(variant);
        let Some(template) = self.chat_template else {
            return dir;
        };
        let with = work.join(variant);
        std::fs::create_dir_all(&with).unwrap();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name();
            if name == "tokenizer_config.json" {
                let mut config: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(entry.path()).unwrap()).unwrap();
                config["chat_template"] = template.into();
                std::fs::write(with.join(&name), config.to_string()).unwrap();
            } else {
                let target = with.join(&name);
                if !target.exists() {
                    std::os::unix::fs::symlink(entry.path(), target).unwrap();
                }
            }
        }
        with
    }

    fn run(&self, fixture: &Path, args: &[String], python: Option<&str>) {
        let original = fixture;
        let made;
        let fixture = match self.make {
            Some(make) => match make(fixture) {
                Ok(dir) => {
                    made = dir;
                    made.as_path()
                }
                Err(e) => {
                    println!("{}: could not make the model: {e:#}", self.name);
                    return;
                }
            },
            None => fixture,
        };
        let gguf = match self.gguf {
            Some(Gguf::Imported(path)) => Some(fixture.join(path)),
            Some(Gguf::Exported { vocab }) => {
                peers::exported_gguf(&fixture.join("q4"), &original.join(vocab), python)
            }
            None => None,
        };
        let work = LinearWork::read(&fixture.join("f32"));
        let gemm = work.as_ref().map(gemm_rate);
        let temp = tempfile::tempdir().unwrap();
        for variant in list(args, "--variants", self.variants) {
            let (default_n, default_python_n) = match variant.as_str() {
                "q4" => (
                    self.q4_conversations,
                    self.q4_python_conversations
                        .unwrap_or(self.q4_conversations),
                ),
                _ => (self.conversations, self.conversations),
            };
            let n: usize = list(args, "--conversations", default_n)[0].parse().unwrap();
            let default_python_n = list(args, "--conversations", default_python_n);
            let python_n: usize = list(args, "--mlx-lm-conversations", &default_python_n[0])[0]
                .parse()
                .unwrap();
            let python = match python {
                Some(_) if python_n == 0 => {
                    println!("(mlx_lm not run: --mlx-lm-conversations 0)");
                    None
                }
                other => other,
            };
            println!(
                "\n{} {variant}: {n} conversations ({python_n} for mlx_lm), a {}-word shared system prompt{}",
                self.name,
                self.system_words,
                if args.iter().any(|a| a == "--cold") {
                    "; cold: the model's files dropped from the page cache before each run"
                } else {
                    ""
                }
            );
            // mlx_lm's side reads its conversations from a file; ours makes
            // the same ones (the first `n` of one list).
            let convs_path = temp.path().join(format!("conversations-{python_n}.json"));
            write_conversations(&convs_path, python_n, self.system_words);
            self.run_variant(
                &variant,
                n,
                &convs_path,
                fixture,
                temp.path(),
                args,
                python,
                work.as_ref().zip(gemm),
                gguf.as_deref(),
            );
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_variant(
        &self,
        variant: &str,
        n: usize,
        convs_path: &Path,
        fixture: &Path,
        temp: &Path,
        args: &[String],
        python: Option<&str>,
        work: Option<(&LinearWork, f64)>,
        gguf: Option<&Path>,
    ) {
        let dir = self.folder(fixture, variant, temp);
        // Ours as configured by default, resident and with the embedding
        // tables left in the files, and, for a quantized model, also
        // dequantized at load (faster on the CPU, at an f32 model's memory).
        let mut ours_modes: Vec<(&str, &str)> = Vec::new();
        for memory in list(args, "--memory", self.memory) {
            match memory.as_str() {
                "resident" => {
                    ours_modes.push(("", "ours  "));
                    if variant == "q4" && self.q4_f32_at_load {
                        ours_modes.push(("f32-at-load", "ours, f32 at load"));
                    }
                }
                "experts" => ours_modes.push(("experts", "ours, experts in the files")),
                "mapped" => ours_modes.push(("mapped", "ours, tables mapped")),
                "streamed" => ours_modes.push(("streamed", "ours, layers streamed")),
                other => {
                    println!("unknown --memory {other:?}: resident, experts, mapped or streamed")
                }
            }
        }
        // `--lanes 1,2`: each mode also with that many chunks side by side
        // (`default`: the engine's own choice, the only row without it).
        let mut runs: Vec<(String, String)> = Vec::new();
        for &(flag, label) in &ours_modes {
            for lanes in list(args, "--lanes", "default") {
                runs.push(match lanes.as_str() {
                    "default" => (flag.to_owned(), label.to_owned()),
                    n => (
                        format!("{flag},lanes={n}"),
                        format!(
                            "{}, {n} lane{}",
                            label.trim_end(),
                            if n == "1" { "" } else { "s" }
                        ),
                    ),
                });
            }
        }
        // Under `--memory-cap`, each run starts with the model's files out of
        // the page cache: pages cached by an earlier run count against no
        // cap, and would be read from memory for free.
        let cgroup_procs = list(args, "--cgroup-procs", "");
        let cgroup = Some(Path::new(&cgroup_procs[0])).filter(|p| !p.as_os_str().is_empty());
        for max_tokens in list(args, "--max-tokens", self.max_tokens) {
            for batch in list(args, "--batches", self.batches) {
                let cold = cgroup.is_some() || args.iter().any(|a| a == "--cold");
                for (flag, label) in &runs {
                    if cold {
                        evict_model_files(&dir);
                    }
                    let exe = std::env::current_exe().unwrap();
                    let profile = args.iter().any(|a| a == "--profile");
                    let ours = peers::command_in(cgroup, exe)
                        .args(["child"])
                        .arg(&dir)
                        .args([
                            n.to_string(),
                            self.system_words.to_string(),
                            batch.clone(),
                            max_tokens.clone(),
                            if profile {
                                format!("{flag},profile")
                            } else {
                                flag.clone()
                            },
                        ])
                        .output()
                        .unwrap();
                    if profile {
                        peers::print_profile(&String::from_utf8_lossy(&ours.stderr));
                    }
                    if !ours.status.success() {
                        println!(
                            "{label} failed ({}): {}",
                            ours.status,
                            String::from_utf8_lossy(&ours.stderr)
                                .lines()
                                .last()
                                .unwrap_or_default()
                        );
                    }
                    report(
                        &format!("{variant} max_tokens {max_tokens} batch {batch:>2} {label}"),
                        &String::from_utf8_lossy(&ours.stdout),
                        work,
                    );
                    for routing in String::from_utf8_lossy(&ours.stderr)
                        .lines()
                        .filter_map(|l| l.strip_prefix("ROUTING "))
                    {
                        println!("    routing: {routing}");
                    }
                }
                if variant == "q4" && list(args, "--batches", self.batches).first() == Some(&batch)
                {
                    // One conversation at a time: the same for every batch.
                    if let Some(gguf) = gguf {
                        if cold {
                            mlx_support::evict_from_page_cache(gguf);
                        }
                        peers::llama_cpp(
                            gguf,
                            &dir,
                            temp,
                            (n, self.system_words),
                            &max_tokens,
                            cgroup,
                        );
                    }
                }
                let Some(python) = python else { continue };
                for &(mode, label) in self.modes {
                    if cold {
                        evict_model_files(&dir);
                    }
                    let script =
                        Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/mlx_lm_batch.py");
                    let mut theirs = peers::command_in(cgroup, python);
                    if self.newer_mlx {
                        // The child's environment alone.
                        theirs.env("MLX_BENCH_NEWER_MLX", "1");
                    }
                    let theirs = theirs
                        .arg(script)
                        .arg(&dir)
                        .arg(convs_path)
                        .args([batch.clone(), max_tokens.clone()])
                        .arg(mode)
                        .output()
                        .unwrap();
                    let text = String::from_utf8_lossy(&theirs.stdout);
                    let line = text.lines().last().unwrap_or_default().to_owned();
                    let version = text.lines().next().unwrap_or_default();
                    if theirs.status.success() {
                        report(
                                &format!(
                                    "{variant} max_tokens {max_tokens} batch {batch:>2} {label} ({version})"
                                ),
                                &line,
                                None,
                            );
                    } else {
                        println!(
                            "{label} failed ({}): {}",
                            theirs.status,
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

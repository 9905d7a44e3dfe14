//! Generates for a file of conversations, alone or as one rank of a job
//! (see `mlx_engine::Placement`). Start it on every rank with the same
//! arguments:
//!
//! ```text
//! cargo build --release -p mlx-engine --bin mlx-generate
//! cargo xtask launch -n 2 -- target/release/mlx-generate --model DIR \
//!     --conversations conversations.json --placement pipeline --max-tokens 32
//! ```
//!
//! `conversations.json` is a JSON list of conversations, each a list of
//! `{"role": …, "content": …}`. `--system TEXT` gives a prefix message
//! (every conversation then starts with it; its cache is computed once).
//! Rank 0 prints one line `RESULT {json}` with the texts, the generation's
//! seconds and conversations per second, and the process's peak RSS (from
//! the OS) and MLX's peak (every rank prints its own with `--all-ranks`); `--logits` adds a SHA-256 of each
//! conversation's last-position logits (their bytes, computed over the
//! whole prompt), so that two placements can be compared bit for bit.
//!
//! Options: `--placement local|pipeline|data` (default local),
//! `--layers A..B,B..C,…` (pipeline ranges; default: split by bytes),
//! `--memory resident|mapped|streamed`, `--quantized keep|dequantize`,
//! `--batch-size N`, `--peer-timeout SECONDS`.

use std::ops::Range;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use mlx_engine::{
    EngineConfig, GenerateOptions, Group, GroupConfig, KvCache, MemoryMode, Message, MlxEngine,
    Placement, QuantizedWeights, SpecialTokens,
};
use sha2::{Digest, Sha256};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            println!("ERROR {message}");
            eprintln!("mlx-generate: {message}");
            ExitCode::FAILURE
        }
    }
}

struct Args {
    model: PathBuf,
    conversations: PathBuf,
    system: Option<String>,
    max_tokens: usize,
    placement: String,
    layers: Option<Vec<Range<usize>>>,
    memory: Option<MemoryMode>,
    quantized: Option<QuantizedWeights>,
    batch_size: usize,
    peer_timeout: Option<Duration>,
    logits: bool,
    all_ranks: bool,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        model: PathBuf::new(),
        conversations: PathBuf::new(),
        system: None,
        max_tokens: 1,
        placement: "local".into(),
        layers: None,
        memory: None,
        quantized: None,
        batch_size: 8,
        peer_timeout: None,
        logits: false,
        all_ranks: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(option) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{option} needs a value"));
        match option.as_str() {
            "--model" => args.model = value()?.into(),
            "--conversations" => args.conversations = value()?.into(),
            "--system" => args.system = Some(value()?),
            "--max-tokens" => args.max_tokens = value()?.parse().map_err(|_| "--max-tokens N")?,
            "--placement" => args.placement = value()?,
            "--layers" => {
                let ranges = value()?
                    .split(',')
                    .map(|r| {
                        let (a, b) = r.split_once("..").ok_or("--layers A..B,B..C")?;
                        Ok(a.parse().map_err(|_| "--layers A..B")?
                            ..b.parse().map_err(|_| "--layers A..B")?)
                    })
                    .collect::<Result<_, &str>>()?;
                args.layers = Some(ranges);
            }
            "--memory" => {
                args.memory = Some(match value()?.as_str() {
                    "resident" => MemoryMode::Resident,
                    "experts" => MemoryMode::ExpertsInFiles,
                    "mapped" => MemoryMode::MappedTables,
                    "streamed" => MemoryMode::Streamed,
                    other => {
                        return Err(format!(
                            "--memory {other}: resident, experts, mapped or streamed"
                        ))
                    }
                })
            }
            "--quantized" => {
                args.quantized = Some(match value()?.as_str() {
                    "keep" => QuantizedWeights::Keep,
                    "dequantize" => QuantizedWeights::DequantizeOnUse,
                    other => return Err(format!("--quantized {other}: keep or dequantize")),
                })
            }
            "--batch-size" => args.batch_size = value()?.parse().map_err(|_| "--batch-size N")?,
            "--peer-timeout" => {
                let s: f64 = value()?.parse().map_err(|_| "--peer-timeout SECONDS")?;
                args.peer_timeout = Some(Duration::from_secs_f64(s));
            }
            "--logits" => args.logits = true,
            "--all-ranks" => args.all_ranks = true,
            other => return Err(format!("unknown option {other}")),
        }
    }
    if args.model.as_os_str().is_empty() || args.conversations.as_os_str().is_empty() {
        return Err("--model DIR and --conversations FILE are needed".into());
    }
    Ok(args)
}

fn run() -> Result<(), String> {
    let args = parse()?;
    let text = std::fs::read_to_string(&args.conversations)
        .map_err(|e| format!("{}: {e}", args.conversations.display()))?;
    let mut conversations: Vec<Vec<Message>> =
        serde_json::from_str::<Vec<Vec<serde_json::Value>>>(&text)
            .map_err(|e| format!("{}: {e}", args.conversations.display()))?
            .into_iter()
            .map(|c| {
                c.iter()
                    .map(|m| {
                        Message::new(
                            m["role"].as_str().unwrap_or("user"),
                            m["content"].as_str().unwrap_or(""),
                        )
                    })
                    .collect()
            })
            .collect();
    let prefix: Vec<Message> = args
        .system
        .iter()
        .map(|s| Message::new("system", s.as_str()))
        .collect();
    for c in &mut conversations {
        c.splice(0..0, prefix.iter().cloned());
    }
    let group = Group::init(&GroupConfig::from_env().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let rank = group.rank();
    let placement = match args.placement.as_str() {
        "local" => Placement::Local,
        "pipeline" => Placement::Pipeline {
            group,
            layers: args.layers,
        },
        "data" => Placement::DataParallel { group },
        other => return Err(format!("--placement {other}: local, pipeline or data")),
    };
    let mut config = EngineConfig::new(&args.model)
        .prefix_messages(prefix)
        .batch_size(args.batch_size)
        .placement(placement);
    if let Some(m) = args.memory {
        config = config.memory(m);
    }
    if let Some(q) = args.quantized {
        config = config.quantized(q);
    }
    if let Some(t) = args.peer_timeout {
        config = config.peer_timeout(t);
    }
    let engine = MlxEngine::new(config).map_err(|e| e.to_string())?;
    engine.ensure_loaded().map_err(|e| e.to_string())?;
    let generation = engine
        .generate(
            conversations.clone(),
            GenerateOptions::new().max_tokens(args.max_tokens),
        )
        .map_err(|e| e.to_string())?;
    let mlx_peak = engine.mlx_peak_memory_bytes().wait().unwrap_or(0);
    let mut result = serde_json::json!({
        "rank": rank,
        "texts": generation.texts,
        "generated_tokens": generation.stats.generated_tokens,
        "seconds": generation.stats.seconds,
        "conversations_per_s": generation.stats.conversations_per_s(),
        "peak_rss_mb": engine.peak_memory_bytes().unwrap_or(0) as f64 / 1e6,
        "mlx_peak_mb": mlx_peak as f64 / 1e6,
    });
    if args.logits {
        // Every rank runs these forwards: a pipeline's stages compute them
        // together.
        let digests = engine
            .submit(move |worker| -> Result<Vec<String>, String> {
                conversations
                    .iter()
                    .map(|c| {
                        let tokens = worker
                            .tokenizer()
                            .chat_tokens(c, true, SpecialTokens::AsText)
                            .map_err(|e| e.to_string())?;
                        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
                        let input = mlx_rs::Array::from_slice(&ids, &[1, ids.len() as i32]);
                        let logits = worker
                            .model()
                            .forward_last(&input, &mut KvCache::new())
                            .map_err(|e| e.to_string())?
                            .as_dtype(mlx_rs::Dtype::Float32)
                            .map_err(|e| e.to_string())?;
                        logits.eval().map_err(|e| e.to_string())?;
                        let bytes: Vec<u8> = logits
                            .as_slice::<f32>()
                            .iter()
                            .flat_map(|v| v.to_le_bytes())
                            .collect();
                        Ok(format!("{:x}", Sha256::digest(&bytes)))
                    })
                    .collect()
            })
            .wait()
            .map_err(|e| e.to_string())??;
        result["logits_sha256"] = serde_json::json!(digests);
    }
    if rank == 0 || args.all_ranks {
        println!("RESULT {result}");
    }
    Ok(())
}

//! cc-sentiment's pipeline in Rust: the adapter the PyPI package
//! `cc-sentiment` ships (`adapters.safetensors.zst` + `adapter_config.json`)
//! is decoded and fused once into its Gemma 4 E2B base (cached in the
//! Hugging Face hub cache under the adapter's digest, the same entry name
//! the Python original uses), and an engine with the classifier's system
//! prompt as the shared prefix, batch size 2, one token and a logits
//! processor that allows only "1".."5" labels each text of a JSONL file.
//!
//! ```text
//! cargo run --release -p mlx-engine --example cc_sentiment -- \
//!     --adapter-dir ~/.cache/mlx-lowmem/cc-sentiment --input texts.jsonl
//! ```
//!
//! `cargo xtask fixtures` fetches the adapter and the system prompt into
//! `~/.cache/mlx-lowmem/cc-sentiment`. `--base` is a hub repo id (default:
//! the real base, `unsloth/gemma-4-E2B-it-UD-MLX-4bit`) or a local model
//! folder. Each input line is `{"text": "..."}`; each output line is
//! `{"index": N, "label": "1".."5"}`, and the throughput goes to stderr.
//! `--as-original` gives the Python original's labels (docs/mlx-engine.md,
//! "Same answers as the original").

use std::io::{BufRead, Write};
use std::path::PathBuf;

use adapter_codec::AdapterCodec;
use adapter_fuse::{Fuse, FuseOptions};
use anyhow::{bail, Context, Result};
use clap::Parser;
use mlx_engine::{
    EngineConfig, GenerateOptions, LogitsProcessor, Message, MlxEngine, PrefixCache,
    QuantizedWeights, Tokenizer,
};
use mlx_rs::error::Exception;
use mlx_rs::ops::select;
use mlx_rs::Array;

/// The base model cc-sentiment fuses its adapter into.
const BASE: &str = "unsloth/gemma-4-E2B-it-UD-MLX-4bit";

#[derive(Parser)]
#[command(about = "Classify texts 1-5 with cc-sentiment's adapter, fused into Gemma 4 E2B")]
struct Args {
    /// Folder with `adapters.safetensors.zst`, `adapter_config.json` and
    /// (unless `--system-prompt` is given) `system_prompt.txt`.
    #[arg(long)]
    adapter_dir: PathBuf,
    /// The classifier's system prompt.
    #[arg(long)]
    system_prompt: Option<PathBuf>,
    /// Hub repo id or local folder of the base model.
    #[arg(long, default_value = BASE)]
    base: String,
    /// JSONL input: one `{"text": ...}` per line.
    #[arg(long)]
    input: PathBuf,
    /// Hub cache root (default: where huggingface_hub would look).
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Conversations per batch (cc-sentiment uses 2).
    #[arg(long, default_value_t = 2)]
    batch_size: usize,
    /// Answer as the Python original does: its prefix cache (the prefix
    /// and the token generated after it) and mlx_lm's arithmetic (packed
    /// weights, the checkpoint's bfloat16; slow on the CPU backend).
    #[arg(long)]
    as_original: bool,
}

/// The user message cc-sentiment builds for one text.
fn user_content(text: &str) -> String {
    let body = text.trim();
    if body.starts_with("DEVELOPER:") || body.starts_with("AI:") {
        format!("CONVERSATION:\n{body}")
    } else {
        format!("CONVERSATION:\nDEVELOPER: {body}")
    }
}

/// Leaves only the label tokens' logits; every other token gets -1e9.
struct Labels {
    /// The last token of each of "1".."5".
    ids: Vec<u32>,
    /// `(vocab,)`, true at the label tokens; made at the first step.
    allowed: Option<Array>,
}

impl Labels {
    fn new(tokenizer: &Tokenizer) -> Labels {
        let ids = (1..=5)
            .filter_map(|n| tokenizer.encode(&n.to_string()).ok()?.last().copied())
            .collect();
        Labels { ids, allowed: None }
    }
}

impl LogitsProcessor for Labels {
    fn process(&mut self, logits: &Array) -> Result<Array, Exception> {
        let vocab = logits.dim(-1);
        if self.allowed.is_none() {
            let mut allowed = vec![false; vocab as usize];
            for &id in &self.ids {
                if let Some(slot) = allowed.get_mut(id as usize) {
                    *slot = true;
                }
            }
            self.allowed = Some(Array::from_slice(&allowed, &[vocab]));
        }
        let allowed = self.allowed.as_ref().expect("made above");
        select(allowed, logits, Array::from_f32(-1e9))
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // What an application running the engine on glibc should do.
    mlx_support::retain_freed_memory();
    let system_path = args
        .system_prompt
        .clone()
        .unwrap_or_else(|| args.adapter_dir.join("system_prompt.txt"));
    let system = std::fs::read_to_string(&system_path)
        .with_context(|| format!("reading the system prompt {}", system_path.display()))?;
    let mut texts = Vec::new();
    let input = std::fs::File::open(&args.input)
        .with_context(|| format!("opening {}", args.input.display()))?;
    for (n, line) in std::io::BufReader::new(input).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("{} line {}", args.input.display(), n + 1))?;
        let Some(text) = value.get("text").and_then(|t| t.as_str()) else {
            bail!(
                "{} line {}: no \"text\" string",
                args.input.display(),
                n + 1
            );
        };
        texts.push(text.to_owned());
    }

    let codec = AdapterCodec::new(
        args.adapter_dir.join("adapters.safetensors.zst"),
        args.adapter_dir.join("adapter_config.json"),
    );
    let mut options = FuseOptions::from_env();
    if let Some(cache) = &args.cache {
        options = options.with_cache_root(cache);
    }
    let fused = Fuse::new(&args.base, &codec, "cc-sentiment--fused")
        .options(&options)
        .run()
        .context("fusing the adapter")?;
    eprintln!("fused model: {}", fused.display());

    let system = Message::new("system", system);
    // OpenBLAS's cores shared out between the chunks the engine runs side
    // by side: nothing else runs MLX work in this program.
    let mut config = EngineConfig::new(&fused)
        .blas_threads(mlx_engine::BlasThreads::SharedByLanes)
        .prefix_messages(vec![system.clone()])
        .batch_size(args.batch_size)
        .logits_processor(Box::new(|tokenizer: &Tokenizer| {
            Box::new(Labels::new(tokenizer)) as Box<dyn LogitsProcessor>
        }));
    if args.as_original {
        config = config
            .prefix_cache(PrefixCache::WithGeneratedToken)
            .quantized(QuantizedWeights::Keep);
    }
    let engine = MlxEngine::new(config)?;
    engine.ensure_loaded()?;
    let conversations = texts
        .iter()
        .map(|t| vec![system.clone(), Message::new("user", user_content(t))])
        .collect();
    let generation = engine.generate(conversations, GenerateOptions::new().max_tokens(1))?;
    let mut out = std::io::stdout().lock();
    for (index, label) in generation.texts.iter().enumerate() {
        writeln!(
            out,
            "{}",
            serde_json::json!({"index": index, "label": label.trim()})
        )?;
    }
    eprintln!(
        "{} conversations in {:.2} s: {:.2} conversations/s",
        generation.stats.conversations,
        generation.stats.seconds,
        generation.stats.conversations_per_s()
    );
    Ok(())
}

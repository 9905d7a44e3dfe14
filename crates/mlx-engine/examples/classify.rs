//! Classify synthetic reviews with a shared system prompt, one token each,
//! with the weights held as `--memory` says, and print what it cost.
//!
//! ```sh
//! cargo xtask fixtures                                        # SmolLM2-135M-Instruct, once
//! cargo run --release -p mlx-engine --example classify        # that fixture's f32 folder
//! cargo run --release -p mlx-engine --example classify -- MODEL_DIR --memory streamed
//! ```
//!
//! `--memory auto` (the default) lets the engine choose from the model's
//! size and the memory the process may use (a cgroup limit included):
//! `cargo xtask memory-limit` runs this example under a memory limit
//! smaller than the model, in each mode.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use mlx_engine::{Checkpoint, EngineConfig, GenerateOptions, MemoryMode, Message, MlxEngine};

#[derive(Debug, Parser)]
struct Args {
    /// An mlx_lm-format folder (default: the SmolLM2 fixture's `f32`).
    model_dir: Option<PathBuf>,
    /// Where the weights live.
    #[arg(long, value_enum, default_value_t = Memory::Auto)]
    memory: Memory,
    /// Reviews to classify.
    #[arg(long, default_value_t = 32)]
    conversations: usize,
    /// Conversations per batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Memory {
    /// The engine's choice (`Checkpoint::default_memory`).
    Auto,
    Resident,
    Mapped,
    Streamed,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let model_dir = match args.model_dir {
        Some(dir) => dir,
        None => PathBuf::from(
            std::env::var_os("MLX_LOWMEM_SMOLLM2")
                .context("no MODEL_DIR given and no fixture: run `cargo xtask fixtures`")?,
        )
        .join("f32"),
    };
    // What an application running the engine on glibc should do.
    mlx_support::retain_freed_memory();
    let system = Message::new(
        "system",
        "You rate customer reviews from 1 (very bad) to 5 (very good). \
         Answer with the digit only.",
    );
    let mut config = EngineConfig::new(model_dir.clone())
        .prefix_messages(vec![system.clone()])
        .batch_size(args.batch)
        .worker_name("classify");
    let memory = match args.memory {
        Memory::Auto => {
            let chosen = Checkpoint::open(&model_dir)?.default_memory();
            println!("the engine's choice here: {chosen:?}");
            chosen
        }
        Memory::Resident => MemoryMode::Resident,
        Memory::Mapped => MemoryMode::MappedTables,
        Memory::Streamed => MemoryMode::Streamed,
    };
    // OpenBLAS's cores shared out between the chunks the engine runs side
    // by side: nothing else runs MLX work in this program.
    config = config
        .memory(memory)
        .blas_threads(mlx_engine::BlasThreads::SharedByLanes);
    let engine = MlxEngine::new(config)?;
    engine
        .ensure_loaded()
        .with_context(|| format!("loading {}", model_dir.display()))?;
    let reviews = [
        "The room was spotless and the staff went out of their way to help.",
        "Cold food, rude waiter, and we waited an hour for the bill.",
        "It was fine. Nothing special, nothing terrible.",
        "Broke after two days and support never answered my emails.",
    ];
    let conversations = (0..args.conversations)
        .map(|i| {
            vec![
                system.clone(),
                Message::new("user", reviews[i % reviews.len()]),
            ]
        })
        .collect();
    let generation = engine
        .generate_async(conversations, GenerateOptions::new().max_tokens(1))
        .wait()?;
    let labels: Vec<&str> = generation.texts.iter().map(|t| t.trim()).take(4).collect();
    let stats = generation.stats;
    println!(
        "memory {:?}: {} conversations in {:.2} s ({:.2} conv/s), first answers {labels:?}, peak RSS {} MB",
        args.memory,
        stats.conversations,
        stats.seconds,
        stats.conversations as f64 / stats.seconds,
        engine.peak_memory_bytes().unwrap_or(0) / 1_000_000
    );
    Ok(())
}

//! Answer a few questions in one batch with a shared system prompt.
//!
//! ```sh
//! cargo xtask fixtures                                   # SmolLM2-135M-Instruct, once
//! cargo run -p mlx-engine --example answer               # uses that fixture
//! cargo run -p mlx-engine --example answer -- MODEL_DIR  # any mlx_lm-format folder
//! ```
//!
//! The engine computes the system prompt's cache once on its worker thread,
//! prefills the three questions as one batch on copies of it, and decodes
//! greedily; the answers come back in the order asked.

use std::path::PathBuf;

use anyhow::{Context, Result};
use mlx_engine::{EngineConfig, GenerateOptions, Message, MlxEngine};

fn main() -> Result<()> {
    let model_dir = match std::env::args().nth(1) {
        Some(dir) => PathBuf::from(dir),
        None => {
            fixture().context("no MODEL_DIR given and no fixture: run `cargo xtask fixtures`")?
        }
    };
    let system = Message::new(
        "system",
        "You are a helpful assistant. Answer in one short sentence.",
    );
    let engine = MlxEngine::new(
        EngineConfig::new(model_dir.clone())
            .prefix_messages(vec![system.clone()])
            .batch_size(3)
            .worker_name("mlx-example"),
    )?;
    engine
        .ensure_loaded()
        .with_context(|| format!("loading {}", model_dir.display()))?;
    let questions = [
        "What is the capital of France?",
        "What colour is the sky on a clear day?",
        "How many legs does a spider have?",
    ];
    let conversations = questions
        .iter()
        .map(|q| vec![system.clone(), Message::new("user", *q)])
        .collect();
    let mlx_engine::Generation {
        texts: answers,
        stats,
        ..
    } = engine
        .generate_async(conversations, GenerateOptions::new().max_tokens(24))
        .wait()?;
    for (q, a) in questions.iter().zip(&answers) {
        println!("Q: {q}\nA: {}\n", a.trim());
    }
    println!(
        "{} conversations in {:.2} s: {:.1} prompt tokens/s, {:.1} generated tokens/s; peak RSS {} MB",
        stats.conversations,
        stats.seconds,
        stats.prompt_tokens_per_s(),
        stats.generated_tokens_per_s(),
        engine.peak_memory_bytes().unwrap_or(0) / 1_000_000,
    );
    engine.close();
    Ok(())
}

/// The f32 SmolLM2 that `cargo xtask fixtures` imports.
fn fixture() -> Option<PathBuf> {
    let root = match std::env::var_os("MLX_LOWMEM_SMOLLM2") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/mlx-lowmem/smollm2"),
    };
    let dir = root.join("f32");
    dir.join("config.json").is_file().then_some(dir)
}

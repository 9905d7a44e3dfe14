//! The end-to-end demo steps: ship an adapter, fuse it, classify with the
//! engine.

use std::path::{Path, PathBuf};
use std::time::Instant;

use adapter_codec::AdapterCodec;
use anyhow::{Context, Result};
use mlx_engine::{EngineConfig, GenerateOptions, Message, MlxEngine, Tokenizer};
use mlx_rs::Array;

/// A LoRA adapter made up for the demo (not trained): rank 4 on q and v of
/// every layer, with small random values so the fused model still answers.
pub fn make_demo_adapter(base: &Path, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(base.join("config.json"))?)?;
    let layers = config["num_hidden_layers"]
        .as_u64()
        .context("num_hidden_layers")? as i32;
    let hidden = config["hidden_size"].as_u64().context("hidden_size")? as i32;
    let heads = config["num_attention_heads"].as_u64().context("heads")? as i32;
    let kv = config["num_key_value_heads"]
        .as_u64()
        .unwrap_or(heads as u64) as i32;
    let head_dim = hidden / heads;
    let mut tensors: Vec<(String, Array)> = Vec::new();
    let mut seed = 2026;
    let mut normal = |shape: &[i32]| -> Result<Array> {
        seed += 1;
        Ok(mlx_rs::random::normal::<f32>(
            shape,
            None,
            0.02,
            &mlx_rs::random::key(seed)?,
        )?)
    };
    for layer in 0..layers {
        for (module, out) in [("q_proj", heads * head_dim), ("v_proj", kv * head_dim)] {
            let name = format!("model.layers.{layer}.self_attn.{module}");
            let a = normal(&[hidden, 4])?;
            let b = normal(&[4, out])?;
            tensors.push((format!("{name}.lora_a"), a));
            tensors.push((format!("{name}.lora_b"), b));
        }
    }
    let path = dir.join("adapters.safetensors");
    Array::save_safetensors(tensors.iter().map(|(k, v)| (k.as_str(), v)), None, &path)?;
    let adapter_config = serde_json::json!({
        "fine_tune_type": "lora", "num_layers": layers,
        "lora_parameters": {"rank": 4, "scale": 1.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]},
        "note": "made up by the mlx-lowmem demo; not a trained adapter"
    });
    std::fs::write(
        dir.join("adapter_config.json"),
        serde_json::to_vec_pretty(&adapter_config)?,
    )?;
    Ok(path)
}

/// Step 1: encode the adapter, report ratio and digest, decode and verify.
pub fn ship_adapter(src: &Path, dir: &Path) -> Result<AdapterCodec> {
    let codec = AdapterCodec::new(
        dir.join("adapters.safetensors.zst"),
        dir.join("adapter_config.json"),
    );
    let start = Instant::now();
    let stats = codec.encode(src)?;
    println!(
        "encoded {} tensors ({}): {} -> {} bytes, ratio {:.3}, digest {}, {:.2} s",
        stats.tensors,
        stats.dtype,
        stats.raw_bytes,
        stats.compressed_bytes,
        stats.ratio(),
        codec.digest()?,
        start.elapsed().as_secs_f64()
    );
    let restored = dir.join("restored.safetensors");
    codec.decode(&restored)?;
    anyhow::ensure!(
        std::fs::read(&restored)? == std::fs::read(src)?,
        "decoded adapter differs"
    );
    println!("decoded and verified byte for byte");
    Ok(codec)
}

/// Step 2: fuse into the hub cache, twice (the second is a hit).
pub fn fuse(base: &Path, codec: &AdapterCodec) -> Result<PathBuf> {
    let base = base.to_str().context("base path is not UTF-8")?;
    for attempt in ["first call", "second call"] {
        let start = Instant::now();
        let mut hit = false;
        let mut bars = adapter_fuse::ProgressBars::default();
        let path = adapter_fuse::Fuse::new(base, codec, "mlx-lowmem--demo")
            .progress(|e: adapter_fuse::FuseProgress| {
                hit |= e == adapter_fuse::FuseProgress::Hit;
                adapter_fuse::FuseReporter::report(&mut bars, e);
            })
            .run()?;
        println!(
            "{attempt}: {} in {:.2} s -> {}",
            if hit { "cache hit" } else { "fused" },
            start.elapsed().as_secs_f64(),
            path.display()
        );
        if attempt == "second call" {
            return Ok(path);
        }
    }
    unreachable!("the loop returns on the second call")
}

/// One labelled conversation of the dataset.
#[derive(Debug, serde::Deserialize)]
pub struct Example {
    pub text: String,
    pub label: u8,
}

/// Reads a JSONL dataset of `{"text", "label"}` lines.
pub fn read_dataset(path: &Path) -> Result<Vec<Example>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{}: line {}", path.display(), i + 1))
        })
        .collect()
}

/// What classification measured.
#[derive(Debug, serde::Serialize)]
pub struct Classification {
    pub examples: usize,
    pub accuracy: f64,
    /// `confusion[label - 1][predicted - 1]`; answers that are no label are not counted.
    pub confusion: [[usize; 5]; 5],
    pub conversations_per_s: f64,
    pub prompt_tokens_per_s: f64,
    pub peak_rss_bytes: Option<u64>,
    pub mlx_peak_bytes: usize,
}

/// The answer words for ratings 1 to 5. (SmolLM2-135M answers every review
/// with "1" when asked for a digit, in mlx_lm as here; words do better.)
const LABELS: [&str; 5] = ["terrible", "bad", "okay", "good", "excellent"];

const SYSTEM: &str = "Classify the review with one word: terrible, bad, okay, good, excellent.";

/// Step 3: classify every example with the engine, allowing only the first
/// token of each label word.
pub fn classify(
    model_dir: &Path,
    examples: &[Example],
    batch_size: usize,
    max_tokens: usize,
) -> Result<Classification> {
    let system = Message::new("system", SYSTEM);
    let engine = MlxEngine::new(
        EngineConfig::new(model_dir)
            .prefix_messages(vec![system.clone()])
            .batch_size(batch_size)
            .logits_processor(|tokenizer: &Tokenizer| {
                let allowed: Vec<i32> = LABELS
                    .iter()
                    .filter_map(|w| tokenizer.encode(w).ok()?.first().copied())
                    .map(|t| t as i32)
                    .collect();
                Box::new(move |logits: &Array| {
                    let vocab = logits.dim(-1);
                    let ids = mlx_rs::ops::arange::<_, i32>(None, vocab, None)?;
                    let mut keep = ids.eq(Array::from_int(allowed[0]))?;
                    for &t in &allowed[1..] {
                        keep = keep.logical_or(ids.eq(Array::from_int(t))?)?;
                    }
                    mlx_rs::ops::select(&keep, logits, Array::from_f32(f32::NEG_INFINITY))
                })
            })
            .worker_name("mlx-demo"),
    )?;
    engine.ensure_loaded()?;
    let conversations: Vec<Vec<Message>> = examples
        .iter()
        .map(|e| vec![system.clone(), Message::new("user", e.text.clone())])
        .collect();
    let bar = indicatif::ProgressBar::new(examples.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("classifying [{bar:30}] {pos}/{len}")
            .expect("template")
            .progress_chars("=> "),
    );
    let progress = bar.clone();
    let mlx_engine::Generation { texts, stats, .. } = engine
        .generate_async(
            conversations,
            GenerateOptions::new()
                .max_tokens(max_tokens)
                .on_progress(move |n| progress.inc(n as u64)),
        )
        .wait()?;
    bar.finish_and_clear();
    let mut confusion = [[0usize; 5]; 5];
    let mut correct = 0;
    for (example, text) in examples.iter().zip(&texts) {
        let answer = text.trim().to_lowercase();
        let pred = LABELS
            .iter()
            .position(|w| !answer.is_empty() && w.starts_with(answer.as_str()));
        if let Some(pred) = pred {
            confusion[example.label as usize - 1][pred] += 1;
            correct += usize::from(pred + 1 == example.label as usize);
        }
    }
    Ok(Classification {
        examples: examples.len(),
        accuracy: correct as f64 / examples.len().max(1) as f64,
        confusion,
        conversations_per_s: stats.conversations_per_s(),
        prompt_tokens_per_s: stats.prompt_tokens_per_s(),
        peak_rss_bytes: engine.peak_memory_bytes(),
        mlx_peak_bytes: engine.mlx_peak_memory_bytes().wait()?,
    })
}

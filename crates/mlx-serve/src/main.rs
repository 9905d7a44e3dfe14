//! `mlx-serve --model-dir DIR`: the OpenAI-compatible server (see the
//! crate's docs and docs/serving.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use mlx_engine::{EngineConfig, MemoryMode, MlxEngine, QuantizedWeights};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Memory {
    Resident,
    /// A mixture of experts' experts read from the files as routed.
    Experts,
    Mapped,
    Streamed,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Quantized {
    Keep,
    Dequantize,
}

/// An OpenAI-compatible server on one model: continuous batching, shared
/// prefixes computed once.
#[derive(Debug, Parser)]
#[command(name = "mlx-serve", version)]
struct Args {
    /// The model folder (mlx_lm format).
    #[arg(long)]
    model_dir: PathBuf,
    /// The id clients name in `model`; default: the folder's name.
    #[arg(long)]
    model_id: Option<String>,
    /// An mlx_lm adapter folder served unfused beside the base, as
    /// `NAME=DIR`; a request naming `MODEL_ID:NAME` decodes with it, in
    /// the same batch as requests of other adapters and of none.
    /// Repeatable.
    #[arg(long = "adapter", value_name = "NAME=DIR", value_parser = named_adapter)]
    adapters: Vec<(String, PathBuf)>,
    /// Lets clients load and unload adapters while the server runs
    /// (`POST /v1/adapters` with `{"name": …, "path": DIR}`, `DELETE
    /// /v1/adapters/NAME`); a load reads a folder of this machine.
    #[arg(long)]
    allow_adapter_loading: bool,
    /// Address to listen on (127.0.0.1 by default: nothing outside this
    /// machine reaches it).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port; 0 picks a free one (the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Where the weights live; default: chosen from the model's size and
    /// the memory limit.
    #[arg(long, value_enum)]
    memory: Option<Memory>,
    /// How quantized weights are held; default: the faster for the device.
    #[arg(long, value_enum)]
    quantized: Option<Quantized>,
    /// Rows decoded together at most.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Milliseconds a request that finds the server idle waits for others
    /// sent with it, so that they are prefilled in one step; 0: none.
    #[arg(long, default_value_t = mlx_engine::DEFAULT_ADMISSION_WINDOW.as_secs_f64() * 1e3)]
    admission_window_ms: f64,
    /// Requests that may wait for a slot; one more gets a 429.
    #[arg(long, default_value_t = mlx_engine::DEFAULT_MAX_QUEUE)]
    max_queue: usize,
    /// MiB of shared prefixes' caches kept for later requests.
    #[arg(long, default_value_t = 256)]
    prefix_store_mb: usize,
    /// A folder where computed shared prefixes are kept across restarts
    /// (created if missing); a later start with the same model reads them
    /// instead of computing them.
    #[arg(long)]
    prefix_cache_dir: Option<PathBuf>,
    /// MiB of stored prefixes the folder keeps at most (least recently
    /// used out first).
    #[arg(long, default_value_t = 4096)]
    prefix_cache_dir_mb: u64,
    /// `max_tokens` of a request that gives none.
    #[arg(long, default_value_t = 512)]
    default_max_tokens: usize,
    /// Seconds a request may take.
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// Seconds running requests get after SIGTERM or SIGINT.
    #[arg(long, default_value_t = 30.0)]
    shutdown_grace: f64,
}

/// `NAME=DIR`, the name without `:` (it follows one in a request's id).
fn named_adapter(arg: &str) -> Result<(String, PathBuf), String> {
    let (name, dir) = arg
        .split_once('=')
        .ok_or_else(|| format!("{arg:?} is not NAME=DIR"))?;
    if name.is_empty() || name.contains(':') {
        return Err(format!("adapter name {name:?}: not empty, no ':'"));
    }
    Ok((name.to_owned(), PathBuf::from(dir)))
}

/// The window of `--admission-window-ms`: finite, 0 to 1000 ms.
fn admission_window(ms: f64) -> anyhow::Result<std::time::Duration> {
    if !(0.0..=1000.0).contains(&ms) {
        anyhow::bail!("--admission-window-ms {ms}: give 0 to 1000");
    }
    Ok(std::time::Duration::from_secs_f64(ms / 1e3))
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "mlx_serve=info,mlx_engine=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mlx-serve: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let model_id = args.model_id.clone().unwrap_or_else(|| {
        args.model_dir
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned())
    });
    let mut config = EngineConfig::new(&args.model_dir)
        .batch_size(args.batch_size)
        .max_queue(args.max_queue)
        .prefix_store_bytes(args.prefix_store_mb << 20)
        .admission_window(admission_window(args.admission_window_ms)?)
        .worker_name("mlx-serve-engine");
    for (name, dir) in &args.adapters {
        config = config.named_adapter(name, dir);
    }
    if let Some(dir) = &args.prefix_cache_dir {
        config = config.prefix_cache_dir(dir, args.prefix_cache_dir_mb << 20);
    }
    if let Some(memory) = args.memory {
        config = config.memory(match memory {
            Memory::Resident => MemoryMode::Resident,
            Memory::Experts => MemoryMode::ExpertsInFiles,
            Memory::Mapped => MemoryMode::MappedTables,
            Memory::Streamed => MemoryMode::Streamed,
        });
    }
    if let Some(quantized) = args.quantized {
        config = config.quantized(match quantized {
            Quantized::Keep => QuantizedWeights::Keep,
            Quantized::Dequantize => QuantizedWeights::DequantizeOnUse,
        });
    }
    let engine = Arc::new(MlxEngine::new(config)?);
    engine
        .ensure_loaded()
        .with_context(|| format!("loading {}", args.model_dir.display()))?;
    let settings = mlx_serve::Settings::new(model_id.clone())
        .allow_adapter_loading(args.allow_adapter_loading)
        .default_max_tokens(args.default_max_tokens)
        .request_timeout(Duration::from_secs_f64(args.request_timeout))
        .shutdown_grace(Duration::from_secs_f64(args.shutdown_grace));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", args.host, args.port)
            .parse()
            .with_context(|| format!("--host {} --port {}", args.host, args.port))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let bound = listener.local_addr()?;
        // One line on stdout that scripts and tests wait for.
        println!("mlx-serve: serving {model_id} on http://{bound}/v1");
        mlx_serve::serve(listener, engine, settings, shutdown_signal()).await
    })
}

/// SIGTERM or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}

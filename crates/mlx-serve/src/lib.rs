//! An OpenAI-compatible HTTP server on [`mlx_engine`]: one model held once
//! in memory, requests decoded together as they arrive (continuous
//! batching, see [`mlx_engine::MlxEngine::complete`]), the prefixes they
//! share (a system prompt) computed once and kept.
//!
//! Routes: `POST /v1/chat/completions` (whole, or `stream: true` as
//! server-sent events), `GET /v1/models`, `GET /health`, `GET /metrics`
//! (Prometheus text); with [`Settings::allow_adapter_loading`], `POST
//! /v1/adapters` and `DELETE /v1/adapters/{name}` (adapters loaded and
//! unloaded while serving). docs/serving.md says what differs from
//! OpenAI's API.
//!
//! ```no_run
//! use std::sync::Arc;
//! use mlx_engine::{EngineConfig, MlxEngine};
//!
//! # async fn run() -> anyhow::Result<()> {
//! let engine = Arc::new(MlxEngine::new(EngineConfig::new("models/smollm2").batch_size(8))?);
//! engine.ensure_loaded()?;
//! let settings = mlx_serve::Settings::new("smollm2");
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! mlx_serve::serve(listener, engine, settings, std::future::pending()).await?;
//! # Ok(())
//! # }
//! ```

mod adapters;
mod chat;
mod error;
mod wire;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use mlx_engine::MlxEngine;

pub use error::ApiError;

/// How the server answers, besides the engine's own settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settings {
    /// The id clients name in `model` (and `/v1/models` lists).
    pub model_id: String,
    /// Whether clients may load and unload adapters
    /// (`POST /v1/adapters`, `DELETE /v1/adapters/{name}`): off by default,
    /// since a load reads a folder of the server's machine. The adapters
    /// the engine serves (`EngineConfig::named_adapter`, and those loaded
    /// later) are offered as `"{model_id}:{name}"` either way.
    pub adapter_loading: bool,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: usize,
    /// A request not done by then ends with a 504 (or an error event).
    pub request_timeout: Duration,
    /// After a shutdown signal, running requests get this long to finish
    /// before the rest are ended with an error.
    pub shutdown_grace: Duration,
}

impl Settings {
    /// The defaults: 512 tokens, 10 minutes per request, 30 s of grace.
    pub fn new(model_id: impl Into<String>) -> Settings {
        Settings {
            model_id: model_id.into(),
            adapter_loading: false,
            default_max_tokens: 512,
            request_timeout: Duration::from_secs(600),
            shutdown_grace: Duration::from_secs(30),
        }
    }

    /// Lets clients load and unload adapters (see
    /// [`adapter_loading`](Self::adapter_loading)).
    pub fn allow_adapter_loading(mut self, allow: bool) -> Settings {
        self.adapter_loading = allow;
        self
    }

    /// `max_tokens` when a request gives none.
    pub fn default_max_tokens(mut self, n: usize) -> Settings {
        self.default_max_tokens = n;
        self
    }

    /// How long a request may take.
    pub fn request_timeout(mut self, timeout: Duration) -> Settings {
        self.request_timeout = timeout;
        self
    }

    /// How long running requests get after a shutdown signal.
    pub fn shutdown_grace(mut self, grace: Duration) -> Settings {
        self.shutdown_grace = grace;
        self
    }
}

/// What every handler reads.
pub(crate) struct AppState {
    pub engine: Arc<MlxEngine>,
    pub model_id: String,
    /// The adapters offered, in the order they were loaded.
    adapters: RwLock<Vec<String>>,
    pub adapter_loading: bool,
    pub vocab_size: usize,
    pub default_max_tokens: usize,
    pub request_timeout: Duration,
    ids: AtomicU64,
}

impl AppState {
    /// The ids a request may name: the base model, then the base with
    /// each adapter.
    pub(crate) fn served_ids(&self) -> Vec<String> {
        let adapters = self.adapters.read().unwrap_or_else(PoisonError::into_inner);
        let with = adapters.iter().map(|a| format!("{}:{a}", self.model_id));
        std::iter::once(self.model_id.clone()).chain(with).collect()
    }

    /// The adapter a request's `model` names: `Ok(None)` for the base
    /// model, `Err(())` for an id this server does not serve.
    pub(crate) fn adapter_of(&self, model: &str) -> Result<Option<String>, ()> {
        if model == self.model_id {
            return Ok(None);
        }
        let name = model
            .strip_prefix(self.model_id.as_str())
            .and_then(|rest| rest.strip_prefix(':'))
            .ok_or(())?;
        let adapters = self.adapters.read().unwrap_or_else(PoisonError::into_inner);
        match adapters.iter().any(|a| a == name) {
            true => Ok(Some(name.to_owned())),
            false => Err(()),
        }
    }

    /// Offers the adapter `name` (loaded).
    pub(crate) fn add_adapter(&self, name: &str) {
        let mut adapters = self
            .adapters
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if !adapters.iter().any(|a| a == name) {
            adapters.push(name.to_owned());
        }
    }

    /// Offers the adapter `name` no more; whether it was offered.
    pub(crate) fn remove_adapter(&self, name: &str) -> bool {
        let mut adapters = self
            .adapters
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let before = adapters.len();
        adapters.retain(|a| a != name);
        adapters.len() != before
    }

    /// The model card of `id`.
    pub(crate) fn card(&self, id: String) -> wire::ModelCard {
        wire::ModelCard {
            id,
            object: "model",
            created: 0,
            owned_by: "mlx-lowmem",
        }
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed)
    }
}

/// The server's routes on `engine` (loaded: see
/// [`MlxEngine::ensure_loaded`]).
///
/// # Errors
/// The engine's load error.
pub fn router(engine: Arc<MlxEngine>, settings: &Settings) -> anyhow::Result<Router> {
    engine.ensure_loaded()?;
    let vocab_size = engine
        .submit(|worker| worker.model().config().vocab_size)
        .wait()?;
    let adapters = RwLock::new(engine.adapters()?);
    let state = Arc::new(AppState {
        engine,
        model_id: settings.model_id.clone(),
        adapters,
        adapter_loading: settings.adapter_loading,
        vocab_size,
        default_max_tokens: settings.default_max_tokens,
        request_timeout: settings.request_timeout,
        ids: AtomicU64::new(1),
    });
    Ok(Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/adapters", post(adapters::load))
        .route("/v1/adapters/{name}", delete(adapters::unload))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(state))
}

/// Serves on `listener` until `shutdown` resolves; then stops accepting,
/// gives running requests [`Settings::shutdown_grace`] to finish, and
/// closes the engine, which ends what is left with an error its client
/// sees (a 503, or an error event).
///
/// # Errors
/// The engine's load error, or the listener's.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: Arc<MlxEngine>,
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = {
        let engine = engine.clone();
        let settings = settings.clone();
        tokio::task::spawn_blocking(move || router(engine, &settings)).await??
    };
    let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        shutdown.await;
        tracing::info!("shutting down: no new requests, running ones finish");
        let _ = signalled_tx.send(());
    });
    let grace = settings.shutdown_grace;
    tokio::select! {
        served = server => served?,
        () = async {
            if signalled_rx.await.is_ok() {
                tokio::time::sleep(grace).await;
            } else {
                std::future::pending::<()>().await;
            }
        } => tracing::warn!(?grace, "requests still running after the grace period end with an error"),
    }
    // Closing joins the worker thread: not on the runtime's threads.
    tokio::task::spawn_blocking(move || engine.close()).await?;
    Ok(())
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such route; see /v1/chat/completions, /v1/models, /health, /metrics".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
        retry_after: None,
    }
}

async fn models(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    Json(wire::ModelList {
        object: "list",
        data: (state.served_ids().into_iter())
            .map(|id| state.card(id))
            .collect(),
    })
}

async fn health() -> impl IntoResponse {
    Json(serde_json::json!({"status": "ok"}))
}

/// Prometheus's text format.
async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let m = state.engine.serving_metrics();
    let per_second = if m.busy_seconds > 0.0 {
        m.generated_tokens as f64 / m.busy_seconds
    } else {
        0.0
    };
    let peak = state.engine.peak_memory_bytes().unwrap_or(0);
    let rows: [(&str, &str, &str, String); 14] = [
        (
            "mlx_serve_queue_depth",
            "gauge",
            "Requests waiting for a slot.",
            m.waiting.to_string(),
        ),
        (
            "mlx_serve_running_rows",
            "gauge",
            "Rows decoding.",
            m.running.to_string(),
        ),
        (
            "mlx_serve_requests_total",
            "counter",
            "Requests admitted.",
            m.requests.to_string(),
        ),
        (
            "mlx_serve_prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            m.prompt_tokens.to_string(),
        ),
        (
            "mlx_serve_cached_prompt_tokens_total",
            "counter",
            "Prompt tokens whose cache came from the prefix store.",
            m.cached_prompt_tokens.to_string(),
        ),
        (
            "mlx_serve_generated_tokens_total",
            "counter",
            "Tokens generated.",
            m.generated_tokens.to_string(),
        ),
        (
            "mlx_serve_generated_tokens_per_second",
            "gauge",
            "Tokens generated per second of the worker's busy time.",
            format!("{per_second:.3}"),
        ),
        (
            "mlx_serve_steps_total",
            "counter",
            "Engine steps: each prefills the requests admitted to it and decodes a token for every running row.",
            m.steps.to_string(),
        ),
        (
            "mlx_serve_prefix_cache_hits_total",
            "counter",
            "Requests that found their prefix cached.",
            m.prefix_hits.to_string(),
        ),
        (
            "mlx_serve_prefix_cache_misses_total",
            "counter",
            "Requests whose shareable prefix the store did not hold.",
            m.prefix_misses.to_string(),
        ),
        (
            "mlx_serve_prefix_cache_folder_reads_total",
            "counter",
            "Of the misses, prefixes read from the prefix cache folder instead of computed.",
            m.prefix_folder_reads.to_string(),
        ),
        (
            "mlx_serve_prefix_cache_entries",
            "gauge",
            "Prefixes held.",
            m.prefix_entries.to_string(),
        ),
        (
            "mlx_serve_prefix_cache_bytes",
            "gauge",
            "Bytes of the prefixes held.",
            m.prefix_bytes.to_string(),
        ),
        (
            "mlx_serve_peak_rss_bytes",
            "gauge",
            "The process's peak resident set size, from the OS.",
            peak.to_string(),
        ),
    ];
    let mut text = String::new();
    for (name, kind, help, value) in rows {
        text.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        ));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

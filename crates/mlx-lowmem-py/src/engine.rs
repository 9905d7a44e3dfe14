//! `Engine`: an [`mlx_engine::MlxEngine`] driven from Python. Every call
//! that waits for the worker releases the GIL, so that the worker can take
//! it to call the Python logits processor, progress callback or job.

use std::sync::{Arc, Mutex, OnceLock};

use mlx_engine::{
    EngineConfig, EngineError, GenerateOptions, LogitsProcessor, MemoryMode, MlxEngine,
    PrefixCache, QuantizedWeights,
};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors::{self, raise};
use crate::processor::{FactoryFailed, PythonProcessor};
use crate::tokenizer::{conversation, Tokenizer};

/// What the worker's Python callbacks leave for the calling thread.
#[derive(Default)]
struct Shared {
    /// The exception the logits processor factory raised at load.
    factory_raised: OnceLock<PyErr>,
    /// The exception the logits processor raised during the last call.
    processor_raised: Arc<Mutex<Option<PyErr>>>,
    /// What the factory returned.
    processor: OnceLock<Py<PyAny>>,
    /// The tokenizer handed to the factory (or asked for later).
    tokenizer: OnceLock<Py<Tokenizer>>,
}

/// Batched generation on a worker thread that owns MLX (see
/// `mlx_lowmem.MlxEngine` for the asyncio face).
#[pyclass(frozen, module = "mlx_lowmem._native")]
pub(crate) struct Engine {
    /// `None` only while being dropped.
    inner: Option<MlxEngine>,
    shared: Arc<Shared>,
}

fn parse_memory(memory: &str) -> PyResult<MemoryMode> {
    match memory {
        "resident" => Ok(MemoryMode::Resident),
        "experts_in_files" => Ok(MemoryMode::ExpertsInFiles),
        "mapped_tables" => Ok(MemoryMode::MappedTables),
        "streamed" => Ok(MemoryMode::Streamed),
        other => Err(raise(
            "ConfigError",
            format!(
                "memory='{other}': expected 'resident', 'experts_in_files', 'mapped_tables' \
                 or 'streamed'"
            ),
        )),
    }
}

fn parse_quantized(quantized: &str) -> PyResult<QuantizedWeights> {
    match quantized {
        "keep" => Ok(QuantizedWeights::Keep),
        "dequantize_on_use" => Ok(QuantizedWeights::DequantizeOnUse),
        other => Err(raise(
            "ConfigError",
            format!("quantized='{other}': expected 'keep' or 'dequantize_on_use'"),
        )),
    }
}

fn parse_prefix_cache(prefix_cache: &str) -> PyResult<PrefixCache> {
    match prefix_cache {
        "with_generated_token" => Ok(PrefixCache::WithGeneratedToken),
        "clean" => Ok(PrefixCache::Clean),
        other => Err(raise(
            "ConfigError",
            format!("prefix_cache='{other}': expected 'with_generated_token' or 'clean'"),
        )),
    }
}

#[pymethods]
impl Engine {
    /// Starts the worker, which loads the model from `model_dir` and
    /// computes the prefix's cache; returns at once.
    #[new]
    #[pyo3(signature = (
        model_dir, *, logits_processor_factory = None, prefix_messages = None, batch_size = 8,
        worker_name = "mlx".to_owned(), memory = None, quantized = None,
        prefix_cache = "with_generated_token".to_owned(), lanes = None, max_prompt_tokens = None,
        prefix_cache_dir = None, prefix_cache_max_bytes = 4 << 30, adapters = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        model_dir: std::path::PathBuf,
        logits_processor_factory: Option<Py<PyAny>>,
        prefix_messages: Option<&Bound<'_, PyAny>>,
        batch_size: usize,
        worker_name: String,
        memory: Option<String>,
        quantized: Option<String>,
        prefix_cache: String,
        lanes: Option<usize>,
        max_prompt_tokens: Option<usize>,
        prefix_cache_dir: Option<std::path::PathBuf>,
        prefix_cache_max_bytes: u64,
        adapters: Option<std::collections::BTreeMap<String, std::path::PathBuf>>,
    ) -> PyResult<Engine> {
        let shared = Arc::new(Shared::default());
        let prefix = match prefix_messages {
            Some(messages) => conversation(messages, 0)?,
            None => Vec::new(),
        };
        let mut config = EngineConfig::new(model_dir)
            .prefix_messages(prefix)
            .batch_size(batch_size)
            .worker_name(worker_name)
            .prefix_cache(parse_prefix_cache(&prefix_cache)?);
        if let Some(memory) = memory {
            config = config.memory(parse_memory(&memory)?);
        }
        if let Some(quantized) = quantized {
            config = config.quantized(parse_quantized(&quantized)?);
        }
        if let Some(lanes) = lanes {
            config = config.lanes(lanes);
        }
        if let Some(tokens) = max_prompt_tokens {
            config = config.max_prompt_tokens(tokens);
        }
        if let Some(dir) = prefix_cache_dir {
            config = config.prefix_cache_dir(dir, prefix_cache_max_bytes);
        }
        for (name, dir) in adapters.unwrap_or_default() {
            config = config.named_adapter(name, dir);
        }
        if let Some(factory) = logits_processor_factory {
            let shared = shared.clone();
            config = config
                .logits_processor(move |tokenizer| call_factory(&factory, tokenizer, &shared));
        }
        let inner = MlxEngine::new(config).map_err(|e| errors::engine(&e))?;
        Ok(Engine {
            inner: Some(inner),
            shared,
        })
    }

    /// Blocks (without the GIL) until the load has finished; raises its
    /// error, or what the logits processor factory raised, every time.
    fn wait_loaded(&self, py: Python<'_>) -> PyResult<()> {
        let loaded = py.detach(|| self.engine().ensure_loaded());
        if let Some(raised) = self.shared.factory_raised.get() {
            return Err(raised.clone_ref(py));
        }
        loaded.map_err(|e| self.error(py, &e))
    }

    /// Generates up to `max_tokens` tokens for each conversation (lists
    /// of `{"role", "content"}` dicts, each starting with the prefix
    /// messages); returns the texts in the given order. `on_progress(n)`
    /// is called on the worker thread after each batch. `adapter`: the
    /// name of one of the engine's adapters, which every conversation of
    /// the call decodes with.
    #[pyo3(signature = (message_lists, max_tokens = 1, on_progress = None, adapter = None))]
    fn generate(
        &self,
        py: Python<'_>,
        message_lists: &Bound<'_, PyAny>,
        max_tokens: usize,
        on_progress: Option<Py<PyAny>>,
        adapter: Option<String>,
    ) -> PyResult<Vec<String>> {
        let mut conversations = Vec::new();
        for (index, messages) in message_lists.try_iter()?.enumerate() {
            conversations.push(conversation(&messages?, index)?);
        }
        let mut options = GenerateOptions::new().max_tokens(max_tokens);
        if let Some(name) = adapter {
            options = options.adapter(name);
        }
        if let Some(callback) = on_progress {
            options = options.on_progress(move |done| {
                Python::attach(|py| {
                    if let Err(e) = callback.call1(py, (done,)) {
                        // A failing progress callback must not lose the
                        // answers: it is reported as Python reports
                        // exceptions nobody can catch.
                        e.write_unraisable(py, Some(callback.bind(py)));
                    }
                })
            });
        }
        let generated = py.detach(|| self.engine().generate(conversations, options));
        generated.map(|g| g.texts).map_err(|e| self.error(py, &e))
    }

    /// Runs `fn(*args)` on the worker thread (with the GIL taken there)
    /// between generations; returns its result or raises its exception.
    #[pyo3(signature = (function, args))]
    fn submit(
        &self,
        py: Python<'_>,
        function: Py<PyAny>,
        args: Py<PyTuple>,
    ) -> PyResult<Py<PyAny>> {
        let reply = self
            .engine()
            .submit(move |_| Python::attach(|py| function.call1(py, args.bind(py))));
        match py.detach(|| reply.wait()) {
            Ok(result) => result,
            Err(e) => Err(self.error(py, &e)),
        }
    }

    /// Serves the mlx_lm adapter folder `folder` as `name` from the next
    /// call on (see `MlxEngine::load_adapter`).
    fn load_adapter(
        &self,
        py: Python<'_>,
        name: String,
        folder: std::path::PathBuf,
    ) -> PyResult<()> {
        let reply = self.engine().load_adapter_async(name, folder);
        py.detach(|| reply.wait()).map_err(|e| self.error(py, &e))
    }

    /// Stops serving the adapter `name`.
    fn unload_adapter(&self, py: Python<'_>, name: String) -> PyResult<()> {
        let reply = self.engine().unload_adapter_async(name);
        py.detach(|| reply.wait()).map_err(|e| self.error(py, &e))
    }

    /// The names of the adapters served, in the order they were loaded.
    fn adapters(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        py.detach(|| self.engine().adapters())
            .map_err(|e| self.error(py, &e))
    }

    /// The shared prefix's token ids (after the load).
    fn prefix_tokens(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let reply = self
            .engine()
            .submit(|worker| worker.prefix_tokens().to_vec());
        py.detach(|| reply.wait()).map_err(|e| self.error(py, &e))
    }

    /// The model's tokenizer (after the load): the object the logits
    /// processor factory received.
    fn tokenizer(&self, py: Python<'_>) -> PyResult<Py<Tokenizer>> {
        if let Some(tokenizer) = self.shared.tokenizer.get() {
            return Ok(tokenizer.clone_ref(py));
        }
        let reply = self
            .engine()
            .submit(|worker| Arc::new(worker.tokenizer().clone()));
        let inner = py.detach(|| reply.wait()).map_err(|e| self.error(py, &e))?;
        let made = Py::new(py, Tokenizer { inner })?;
        Ok(self.shared.tokenizer.get_or_init(|| made).clone_ref(py))
    }

    /// What the logits processor factory returned (None before the load or
    /// without a factory).
    fn logits_processor(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.shared.processor.get().map(|p| p.clone_ref(py))
    }

    /// The process's peak resident set size in bytes, from the OS.
    fn peak_memory_bytes(&self) -> Option<u64> {
        self.engine().peak_memory_bytes()
    }

    /// MLX's own peak memory in bytes (its allocator's high-water mark).
    fn mlx_peak_memory_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        let reply = self.engine().mlx_peak_memory_bytes();
        py.detach(|| reply.wait()).map_err(|e| self.error(py, &e))
    }

    /// Lets queued work finish, then stops the worker; later calls raise
    /// `EngineClosedError`.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.engine().close())
    }
}

impl Engine {
    fn engine(&self) -> &MlxEngine {
        self.inner.as_ref().expect("only None while dropping")
    }

    /// The Python exception for `error`: the one the logits processor
    /// raised if that is what failed, else the error's class.
    fn error(&self, py: Python<'_>, error: &EngineError) -> PyErr {
        if let Some(raised) = self.shared.factory_raised.get() {
            return raised.clone_ref(py);
        }
        if let Some(raised) = self
            .shared
            .processor_raised
            .lock()
            .expect("not poisoned")
            .take()
        {
            return raised;
        }
        errors::engine(error)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing joins the worker, which may be waiting for the GIL (a
        // processor or job of its last command): wait without holding it.
        if let Some(inner) = self.inner.take() {
            Python::attach(|py| py.detach(move || drop(inner)));
        }
    }
}

/// Calls the Python factory with the loaded tokenizer, on the worker.
fn call_factory(
    factory: &Py<PyAny>,
    tokenizer: &mlx_engine::Tokenizer,
    shared: &Arc<Shared>,
) -> Box<dyn LogitsProcessor> {
    Python::attach(|py| {
        let made = Py::new(
            py,
            Tokenizer {
                inner: Arc::new(tokenizer.clone()),
            },
        )
        .and_then(|tokenizer| {
            let _ = shared.tokenizer.set(tokenizer.clone_ref(py));
            factory.call1(py, (tokenizer,))
        });
        match made {
            Ok(processor) => {
                let _ = shared.processor.set(processor.clone_ref(py));
                Box::new(PythonProcessor {
                    processor,
                    raised: shared.processor_raised.clone(),
                }) as Box<dyn LogitsProcessor>
            }
            Err(e) => {
                let message = e.to_string();
                let _ = shared.factory_raised.set(e);
                Box::new(FactoryFailed(message))
            }
        }
    })
}

//! Loading and unloading the adapters served per row while the engine
//! serves (see `weights/row_lora`): jobs on the worker, between steps.

use std::path::PathBuf;

use super::{MlxEngine, Reply};
use crate::error::EngineError;
use crate::runtime::adapters;

impl MlxEngine {
    /// Serves the mlx_lm adapter folder `dir` (`adapter_config.json`,
    /// `adapters.safetensors`) as `name`, unfused, beside the base and
    /// the adapters served already: from the next step on, requests
    /// ([`Completion::adapter`]) and calls ([`GenerateOptions::adapter`])
    /// may name it, and their rows decode in the same batch as rows of
    /// other adapters and of none. The base weights are not copied; the
    /// adapter's pairs are copied into memory. Runs between the serving
    /// steps of the requests running, which go on.
    ///
    /// # Errors
    /// [`EngineError::AdapterLoad`] naming the adapter and the first key
    /// that does not fit (a pair whose module is no linear layer of the
    /// model, shapes that differ from the layer's), a name served already,
    /// or an unreadable folder: the adapters served stay as they were.
    /// [`EngineError::InvalidRequest`] for an empty name or one with `:`
    /// (the server's `"{model}:{adapter}"`); [`EngineError::InvalidConfig`]
    /// with a distributed placement.
    ///
    /// ```no_run
    /// use mlx_engine::{Completion, EngineConfig, Message, MlxEngine};
    ///
    /// let engine = MlxEngine::new(EngineConfig::new("models/base"))?;
    /// engine.load_adapter("sentiment", "adapters/sentiment")?;
    /// let messages = vec![Message::new("user", "The lid leaks.")];
    /// let completion = Completion::new(messages).max_tokens(1).adapter("sentiment");
    /// println!("{}", engine.complete(completion)?.collect()?.text);
    /// engine.unload_adapter("sentiment")?;
    /// # Ok::<(), mlx_engine::EngineError>(())
    /// ```
    ///
    /// [`Completion::adapter`]: crate::Completion::adapter
    /// [`GenerateOptions::adapter`]: crate::GenerateOptions::adapter
    pub fn load_adapter(
        &self,
        name: impl Into<String>,
        dir: impl Into<PathBuf>,
    ) -> Result<(), EngineError> {
        self.load_adapter_async(name, dir).wait()
    }

    /// [`load_adapter`](Self::load_adapter) as a [`Reply`].
    pub fn load_adapter_async(
        &self,
        name: impl Into<String>,
        dir: impl Into<PathBuf>,
    ) -> Reply<()> {
        let (name, dir) = (name.into(), dir.into());
        self.send(move |worker| {
            let worker = worker.map_err(Clone::clone)?;
            adapters::load(&worker.model, name, dir, worker.adapter_digests)
        })
    }

    /// Stops serving the adapter `name`, and drops the prefix caches
    /// computed under it. An adapter that requests running or waiting use
    /// is not unloaded: [`EngineError::AdapterInUse`] says how many (unload
    /// it once they are done; new requests naming it are still taken
    /// until it is unloaded). [`EngineError::UnknownAdapter`] when no
    /// adapter is called so.
    pub fn unload_adapter(&self, name: impl Into<String>) -> Result<(), EngineError> {
        self.unload_adapter_async(name).wait()
    }

    /// [`unload_adapter`](Self::unload_adapter) as a [`Reply`].
    pub fn unload_adapter_async(&self, name: impl Into<String>) -> Reply<()> {
        let name = name.into();
        self.send(move |worker| {
            let worker = worker.map_err(Clone::clone)?;
            let Some(slot) = adapters::served_by(&worker.model)?.slot(&name) else {
                return Err(EngineError::UnknownAdapter(name));
            };
            let requests = worker.serving.using_adapter(&name, slot);
            if requests > 0 {
                return Err(EngineError::AdapterInUse { name, requests });
            }
            adapters::unload(&worker.model, &name)?;
            worker.serving.forget_adapter(slot);
            worker.state.forget_adapter(slot);
            Ok(())
        })
    }

    /// The names of the adapters served per row, in the order they were
    /// loaded (empty with a distributed placement).
    pub fn adapters(&self) -> Result<Vec<String>, EngineError> {
        self.submit(|worker| {
            worker
                .model
                .row_adapters()
                .map(|a| a.names())
                .unwrap_or_default()
        })
        .wait()
    }
}

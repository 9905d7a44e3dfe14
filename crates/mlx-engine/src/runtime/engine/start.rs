//! The worker's start: the model, tokenizer, shared prefix and serving
//! scheduler an [`EngineConfig`] asks for.

use std::sync::{Arc, OnceLock};

use super::Worker;
use crate::error::EngineError;
use crate::models::checkpoint::Checkpoint;
use crate::runtime::adapters;
use crate::runtime::generate::{GenSettings, GenState};
use crate::runtime::options::{EngineConfig, DEFAULT_MAX_PROMPT_TOKENS};
use crate::runtime::prefix_disk::{file_digests, PrefixDisk};
use crate::runtime::serving::grammar::Grammars;
use crate::runtime::serving::scheduler::{Scheduler, SchedulerSettings};
use crate::runtime::serving::SharedCounters;
use crate::tokenizer::Tokenizer;

/// Builds the worker on its own thread.
pub(super) fn load(
    config: EngineConfig,
    counters: SharedCounters,
    grammars: &OnceLock<Grammars>,
) -> Result<Worker, EngineError> {
    let _span = tracing::info_span!("load", model_dir = %config.model_dir.display()).entered();
    let err = |e: crate::Error| EngineError::Load(Arc::new(e));
    let device = mlx_support::best_device();
    mlx_support::use_device(device).map_err(|e| EngineError::InvalidConfig(e.to_string()))?;
    let checkpoint = Checkpoint::open(&config.model_dir).map_err(err)?;
    // What a prefix kept on disk is bound to: the model's files and the
    // adapters' (hashed before the loader takes them). Not with ranks:
    // each holds only its stage's layers.
    let digests = (config.prefix_cache_dir.is_some() && config.placement.group().is_none())
        .then(|| file_digests(&checkpoint, &config.adapters, &config.lora))
        .transpose()
        .map_err(err)?;
    let adapter_digests = digests.is_some();
    let row_adapters = adapters::per_row(
        &config.named_adapters,
        adapter_digests,
        config.placement.group().is_some(),
    )?;
    let lora = adapters::on_the_fly(&checkpoint, &config.adapters, config.lora).map_err(err)?;
    let mut loader = checkpoint.loader().lora(lora).placement(&config.placement);
    if let Some(adapters) = row_adapters {
        loader = loader.row_adapters(adapters);
    }
    if let Some(quantized) = config.quantized {
        loader = loader.quantized(quantized);
    }
    if let Some(memory) = config.memory {
        loader = loader.memory(memory);
    }
    if let Some(kernels) = config.kernels {
        loader = loader.kernels(kernels);
    }
    let model = loader.load().map_err(|e| match e {
        // A setting of the caller's, not a fault of the folder.
        crate::Error::AdaptersNeedStreamedLayers { .. } => {
            EngineError::InvalidConfig(e.to_string())
        }
        e => err(e),
    })?;
    let memory = model.memory();
    let tokenizer = Tokenizer::load(&config.model_dir).map_err(err)?;
    let processor = config.logits_processor_factory.map(|f| f(&tokenizer));
    let max_prompt_tokens = config.max_prompt_tokens.unwrap_or_else(|| {
        model
            .config()
            .max_position_embeddings
            .unwrap_or(DEFAULT_MAX_PROMPT_TOKENS)
    });
    let prefix_disk = (config.prefix_cache_dir.zip(digests))
        .map(|(folder, digests)| PrefixDisk::bound(folder, digests, model.arithmetic()));
    let settings = GenSettings {
        prefix_messages: config.prefix_messages,
        processor,
        batch_size: config.batch_size,
        // Ranks exchange in one order: one chunk at a time.
        blas_threads: config.blas_threads,
        lanes: match config.placement.group() {
            Some(_) => 1,
            None => config
                .lanes
                .unwrap_or_else(|| crate::runtime::lanes::default_lanes(device, memory)),
        },
        max_prompt_tokens,
        special_tokens: config.special_tokens,
        prefix_cache: config.prefix_cache,
        placement: config.placement.clone(),
        prefix_disk: prefix_disk.clone(),
    };
    let state = GenState::new(&model, &tokenizer, settings).map_err(err)?;
    let _ = grammars.set(Grammars::new(
        config.model_dir.join("tokenizer.json"),
        model.config().vocab_size,
        tokenizer.eos_ids().iter().copied().collect(),
    ));
    let serving = Scheduler::new(
        SchedulerSettings {
            batch_size: config.batch_size,
            max_prompt_tokens,
            special_tokens: config.special_tokens,
            prefix_store_bytes: config.prefix_store_bytes,
            admission_window: config.admission_window,
            prefix_disk,
        },
        counters,
        state.shareable_prefix(),
    );
    // What the load freed (the tokenizer file's parse, transient copies,
    // the prefix's forward) would otherwise stay resident between
    // requests; the first chunk faults in what it needs again, once.
    let released = mlx_support::release_free_memory();
    tracing::debug!(released, "free memory handed back after the load");
    #[expect(
        clippy::arc_with_non_send_sync,
        reason = "the worker's Arc crosses to the lanes only inside a ForLanes, which says why that is sound"
    )]
    let model = Arc::new(model);
    Ok(Worker {
        model,
        tokenizer,
        state,
        serving,
        adapter_digests,
    })
}

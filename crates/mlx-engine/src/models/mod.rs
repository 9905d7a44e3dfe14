//! A loaded decoder model: the architecture a folder's `config.json` names,
//! with its weights.

pub(crate) mod checkpoint;
pub(crate) mod config;
pub(crate) mod family;
pub(crate) mod gemma;
pub(crate) mod layers;
pub(crate) mod llama;
pub(crate) mod loader;
#[cfg(test)]
mod tests;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use crate::distributed::stage::Stage;
use crate::error::Result;
use crate::models::config::ModelConfig;
use crate::models::family::Decoder;
pub(crate) use crate::models::layers::Schedule;
use crate::nn::cache::KvCache;
pub use crate::weights::memory_mode::MemoryMode;
use crate::weights::row_lora::RowAdapters;
pub use crate::weights::QuantizedWeights;
use std::sync::Arc;

/// A loaded decoder model: llama, mistral, qwen2, qwen3, qwen3_moe,
/// mixtral, gpt_oss, Gemma 3 or Gemma 4 (text).
pub struct Model {
    config: ModelConfig,
    decoder: Box<dyn Decoder>,
    /// The layers this process holds (all, unless it is a pipeline stage).
    stage: Stage,
    memory: MemoryMode,
    /// What decides the model's numbers besides its files (see
    /// [`arithmetic`](Self::arithmetic)).
    arithmetic: String,
    pass_cost_tokens: usize,
    /// Adapters applied per row, unfused (`weights/row_lora/`).
    row_adapters: Option<Arc<RowAdapters>>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .field("memory", &self.memory)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// The model the loader built (`loader.rs`).
    pub(crate) fn assemble(
        config: ModelConfig,
        decoder: Box<dyn Decoder>,
        stage: Stage,
        memory: MemoryMode,
        quantized: QuantizedWeights,
        arithmetic: String,
    ) -> Model {
        // A pass over f32 weights streams 4 bytes per parameter (~10 GB/s
        // here) where a token's products do 2 FLOPs per parameter (~200
        // GFLOP/s): about 40 tokens' worth. Unpacking a packed parameter to
        // f32 before each product (~250 M/s) is worth about 400.
        let unpacks = quantized == QuantizedWeights::DequantizeOnUse
            && config.quantization != mlx_support::QuantizationConfig::none();
        // (Streamed layers are read once per chunk, whatever its groups:
        // see `last_hidden_each`.)
        let pass_cost_tokens = if unpacks { 400 } else { 40 };
        Model {
            config,
            decoder,
            stage,
            memory,
            arithmetic,
            pass_cost_tokens,
            row_adapters: None,
        }
    }

    /// This model serving `adapters` per row.
    pub(crate) fn with_row_adapters(mut self, adapters: Option<Arc<RowAdapters>>) -> Model {
        self.row_adapters = adapters;
        self
    }

    /// The adapters this model serves per row, if any.
    pub(crate) fn row_adapters(&self) -> Option<&RowAdapters> {
        self.row_adapters.as_deref()
    }

    /// Builds the forwards of `build` with row `i` under adapter slot
    /// `rows[i]` (none: the base model's bits). Rows of no adapter need no
    /// adapters loaded.
    pub(crate) fn with_adapters<T>(
        &self,
        rows: &[Option<usize>],
        build: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        match &self.row_adapters {
            Some(adapters) => adapters.with_rows(rows, build),
            None if rows.iter().all(Option::is_none) => build(),
            None => Err(no_adapters()),
        }
    }

    /// Builds the forwards of `build` with every row under adapter `slot`
    /// (none: the base model).
    pub(crate) fn with_adapter<T>(
        &self,
        slot: Option<usize>,
        build: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        match (slot, &self.row_adapters) {
            (None, _) => build(),
            (Some(slot), Some(adapters)) => adapters.with_slot(slot, build),
            (Some(_), None) => Err(no_adapters()),
        }
    }

    /// What decides this model's numbers besides its files: how packed
    /// weights are multiplied, which kernels, the device, whether this CPU
    /// has the project's kernels, MLX's version and the engine's. Two loads
    /// with the same files and the same arithmetic compute the same bits
    /// (the memory mode does not change them).
    pub(crate) fn arithmetic(&self) -> &str {
        &self.arithmetic
    }

    /// Where the model's weights live (as asked, or the load's default).
    pub fn memory(&self) -> MemoryMode {
        self.memory
    }

    /// What one forward's pass over the weights costs beside the products
    /// of its tokens, in tokens of products: a rough figure for the CPU
    /// backend (memory bandwidth and GEMM rate of the project's machine),
    /// with which batched prefill weighs padding rows to a common length
    /// against running them in separate forwards.
    pub(crate) fn pass_cost_tokens(&self) -> usize {
        self.pass_cost_tokens
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Logits `(B, L, vocab)` for `tokens` `(B, L)` (int32), continuing from
    /// `cache`, which is extended with these positions. New positions see
    /// the shared prefix (see [`KvCache::fork`]) and the rows' own earlier
    /// positions, never a row's left padding (see [`KvCache::fork_padded`]),
    /// and on sliding-window layers only the window's latest positions.
    pub fn forward(&self, tokens: &Array, cache: &mut KvCache) -> Result<Array> {
        let x = self.hidden(tokens, cache, false)?;
        self.head(&x)
    }

    /// As [`forward`](Self::forward), but the logits `(B, vocab)` of the
    /// last position only: what prefill needs. The output projection of
    /// every position would cost a `(B·L, vocab)` matrix (vocabularies are
    /// large: 49 152 for SmolLM2, 262 144 for Gemma) that is thrown away.
    ///
    /// Everything after the last keys and values are written runs on the
    /// last position alone: the rest of the last layer (llama family,
    /// Gemma 3) or, in Gemma 4, the rest of the last layer before the
    /// KV-shared ones and all of those (see `Gemma::hidden_each`; for E2B
    /// the second half of layer 14 and the 20 double-wide layers after it,
    /// so a prefill costs about a third of a full forward). The logits agree with `forward`'s last
    /// position to rounding, not bit for bit (fewer rows in the products).
    pub fn forward_last(&self, tokens: &Array, cache: &mut KvCache) -> Result<Array> {
        self.head(&self.last_hidden(tokens, cache)?)
    }

    /// The last position's hidden state `(B, hidden)`, before the final
    /// norm: [`forward_last`](Self::forward_last) without the head, whose
    /// product a caller can run once for the rows of several forwards.
    pub(crate) fn last_hidden(&self, tokens: &Array, cache: &mut KvCache) -> Result<Array> {
        let x = self.hidden(tokens, cache, true)?;
        Ok(x.index((.., -1, ..)))
    }

    fn hidden(&self, tokens: &Array, cache: &mut KvCache, last_only: bool) -> Result<Array> {
        let mut each = self.hidden_each(
            std::slice::from_ref(tokens),
            std::slice::from_mut(cache),
            last_only,
        )?;
        Ok(each.remove(0))
    }

    /// [`last_hidden`](Self::last_hidden) of independent forwards, one per
    /// cache (e.g. a chunk's prefill groups): the same states as calling it
    /// for each, but with [`MemoryMode::Streamed`] each layer is read once
    /// for all of them.
    pub(crate) fn last_hidden_each(
        &self,
        tokens: &[Array],
        caches: &mut [KvCache],
    ) -> Result<Vec<Array>> {
        Ok(self
            .hidden_each(tokens, caches, true)?
            .iter()
            .map(|x| x.index((.., -1, ..)))
            .collect())
    }

    /// How generation runs this model's forwards.
    pub(crate) fn schedule(&self) -> Schedule {
        self.decoder.schedule()
    }

    /// Each forward's last hidden states; with `last_only`, possibly of
    /// the last position alone.
    fn hidden_each(
        &self,
        tokens: &[Array],
        caches: &mut [KvCache],
        last_only: bool,
    ) -> Result<Vec<Array>> {
        self.decoder
            .hidden_each(&self.config, &self.stage, tokens, caches, last_only)
    }

    /// The logits `(…, vocab)` of hidden states `(…, hidden)`: the final
    /// norm and the output projection. One call for all of a chunk's rows
    /// costs one pass over the projection's weights (with the tables
    /// mapped, one read of the table), not one per prefill group.
    pub(crate) fn head(&self, x: &Array) -> Result<Array> {
        self.stage.logits(x, self.config.vocab_size, || {
            self.decoder.head(&self.config, x)
        })
    }
}

fn no_adapters() -> crate::Error {
    crate::Error::Adapter {
        name: "(any)".to_owned(),
        dir: std::path::PathBuf::new(),
        message: "this model was loaded without adapters".to_owned(),
    }
}

//! A loaded decoder model: the architecture a folder's `config.json` names,
//! with its weights.

pub(crate) mod config;
pub(crate) mod gemma;
pub(crate) mod llama;
#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::Arc;

use block_stream::BlockLoraSource;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use st_mmap::SafetensorsSet;

use crate::error::{Error, Result};
use crate::models::config::ModelConfig;
use crate::models::gemma::{Gemma, KeyPrefixes};
use crate::models::llama::Llama;
use crate::nn::cache::KvCache;
use crate::weights::Weights;

pub use crate::weights::memory_mode::MemoryMode;
pub use crate::weights::QuantizedWeights;

enum Decoder {
    Llama(Llama),
    Gemma(Gemma),
}

/// A loaded decoder model: llama, mistral, qwen2, qwen3, Gemma 3 or
/// Gemma 4 (text).
pub struct Model {
    config: ModelConfig,
    decoder: Decoder,
    pass_cost_tokens: usize,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Loads `dir` (mlx_lm format: `config.json` + safetensors) into
    /// memory ([`MemoryMode::Resident`]).
    pub fn load(dir: &Path, quantized: QuantizedWeights) -> Result<Model> {
        Model::load_with(dir, quantized, MemoryMode::Resident)
    }

    /// Loads `dir`, its weights held as `memory` says.
    pub fn load_with(dir: &Path, quantized: QuantizedWeights, memory: MemoryMode) -> Result<Model> {
        Model::load_with_lora(dir, quantized, memory, Vec::new())
    }

    /// Loads `dir` with `memory` [`MemoryMode::Streamed`], each layer
    /// adapted by `lora` as it is read (see `EngineConfig::lora`); with no
    /// sources, [`load_with`](Self::load_with). Sources for another mode
    /// are [`Error::Config`]: the adapter is fused into the layers only
    /// when they are streamed.
    pub fn load_with_lora(
        dir: &Path,
        quantized: QuantizedWeights,
        memory: MemoryMode,
        lora: Vec<BlockLoraSource>,
    ) -> Result<Model> {
        if !lora.is_empty() && memory != MemoryMode::Streamed {
            return Err(Error::Config {
                path: dir.to_path_buf(),
                message: format!("LoRA on the fly needs MemoryMode::Streamed, not {memory:?}"),
            });
        }
        let config = ModelConfig::load(dir)?;
        let set = Arc::new(SafetensorsSet::open_dir(dir)?);
        let lora = Arc::new(lora);
        let w = Weights {
            dir,
            set: &set,
            quant: &config.quantization,
            mode: quantized,
            memory,
            streamed: None,
            lora: &lora,
        };
        let layers_prefix = match &config.gemma {
            Some(spec) => format!("{}layers.", KeyPrefixes::find(spec, &w)?.text),
            None => "model.layers.".to_owned(),
        };
        // The config's layer count is checked against the layers the files
        // hold before anything is sized by it.
        let prefix = st_mmap::BlockPrefix::new(layers_prefix.as_str());
        let present = st_mmap::BlockIndex::build(&prefix, set.keys())?.len();
        if config.num_hidden_layers > present {
            return Err(Error::Config {
                path: dir.join("config.json"),
                message: format!(
                    "num_hidden_layers is {} but the weights hold {present} layers ({layers_prefix}N)",
                    config.num_hidden_layers
                ),
            });
        }
        let decoder = match &config.gemma {
            Some(spec) => Decoder::Gemma(Gemma::load(&config, spec, &w)?),
            None => Decoder::Llama(Llama::load(&config, &w)?),
        };
        // What the model holds is copied out of the files, and a table left
        // in them is read with positioned reads, so no page of the files
        // needs to stay mapped in. Each copied tensor's pages were released
        // as it was copied, but the kernel maps the page cache's large
        // folios whole, and the part of one that lies in a table left in
        // the files stayed resident for the model's life (SmolLM2 with its
        // table mapped: 7.5 MB).
        for key in set.keys() {
            set.release(key);
        }
        // A pass over f32 weights streams 4 bytes per parameter (~10 GB/s
        // here) where a token's products do 2 FLOPs per parameter (~200
        // GFLOP/s): about 40 tokens' worth. Unpacking a packed parameter to
        // f32 before each product (~250 M/s) is worth about 400.
        let unpacks = quantized == QuantizedWeights::DequantizeOnUse
            && config.quantization != mlx_support::QuantizationConfig::none();
        // (Streamed layers are read once per chunk, whatever its groups:
        // see `last_hidden_each`.)
        let pass_cost_tokens = if unpacks { 400 } else { 40 };
        Ok(Model {
            config,
            decoder,
            pass_cost_tokens,
        })
    }

    /// What one forward's pass over the weights costs beside the products
    /// of its tokens, in tokens of products: a rough figure for the CPU
    /// backend (memory bandwidth and GEMM rate of the project's machine),
    /// with which batched prefill weighs padding rows to a common length
    /// against running them in separate forwards.
    pub fn pass_cost_tokens(&self) -> usize {
        self.pass_cost_tokens
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Logits `(B, L, vocab)` for `tokens` `(B, L)` (int32), continuing from
    /// `cache`, which is extended with these positions. New positions see
    /// the shared prefix (see [`KvCache::fork`]) and the rows' own earlier
    /// positions, never a row's left padding (see [`KvCache::set_pads`]),
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

    /// Whether the layers are read from the files at each forward.
    pub(crate) fn streams_layers(&self) -> bool {
        match &self.decoder {
            Decoder::Gemma(g) => g.streams_layers(),
            Decoder::Llama(m) => m.streams_layers(),
        }
    }

    /// Each forward's last hidden states; with `last_only`, possibly of
    /// the last position alone.
    fn hidden_each(
        &self,
        tokens: &[Array],
        caches: &mut [KvCache],
        last_only: bool,
    ) -> Result<Vec<Array>> {
        match &self.decoder {
            Decoder::Gemma(g) => g.hidden_each(&self.config, tokens, caches, last_only),
            Decoder::Llama(m) => m.hidden_each(&self.config, tokens, caches, last_only),
        }
    }

    /// The logits `(…, vocab)` of hidden states `(…, hidden)`: the final
    /// norm and the output projection. One call for all of a chunk's rows
    /// costs one pass over the projection's weights (with the tables
    /// mapped, one read of the table), not one per prefill group.
    pub(crate) fn head(&self, x: &Array) -> Result<Array> {
        match &self.decoder {
            Decoder::Gemma(g) => g.head(&self.config, x),
            Decoder::Llama(m) => m.head(&self.config, x),
        }
    }
}

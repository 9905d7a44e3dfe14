//! A loaded decoder model: the architecture a folder's `config.json` names,
//! with its weights.

pub(crate) mod config;
pub(crate) mod family;
pub(crate) mod gemma;
pub(crate) mod llama;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use block_stream::BlockLoraSource;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use st_mmap::SafetensorsSet;

use crate::distributed::stage::Stage;
use crate::distributed::{self, split, Placement};
use crate::error::{Error, Result};
use crate::models::config::ModelConfig;
use crate::models::family::{Decoder, Family};
use crate::nn::cache::KvCache;
use crate::weights::kernels::{Kernels, Products};
pub(crate) use crate::weights::layers::Schedule;
use crate::weights::Weights;

pub use crate::weights::memory_mode::MemoryMode;

/// Every family the crate runs, by `model_type` (see [`family`]).
const FAMILIES: &[&Family] = &[&llama::FAMILY, &gemma::FAMILY];

/// The family that runs `model_type`.
fn family_of(model_type: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.model_types.contains(&model_type))
}

#[cfg(test)]
#[test]
fn every_supported_model_type_has_one_family() {
    for model_type in config::SUPPORTED {
        let n = FAMILIES
            .iter()
            .filter(|f| f.model_types.contains(model_type))
            .count();
        assert_eq!(n, 1, "{model_type}");
    }
    let listed: usize = FAMILIES.iter().map(|f| f.model_types.len()).sum();
    assert_eq!(listed, config::SUPPORTED.len());
}

impl ModelConfig {
    /// Reads and checks `dir/config.json`: the common fields, and the
    /// family's own settings as its `model_type`'s family reads them.
    pub fn load(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let bad = |message: String| Error::Config {
            path: path.clone(),
            message,
        };
        let raw: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let model_type = raw
            .get("model_type")
            .and_then(|t| t.as_str())
            .ok_or_else(|| bad("missing field `model_type`".into()))?;
        let family = family_of(model_type).ok_or_else(|| Error::UnsupportedArchitecture {
            model_type: model_type.to_owned(),
            supported: config::SUPPORTED,
        })?;
        let fields = (family.fields)(&raw).map_err(bad)?;
        let mut config = ModelConfig::from_fields(&fields).map_err(bad)?;
        config.settings = (family.settings)(&raw, &fields, &config).map_err(bad)?;
        Ok(config)
    }
}
pub use crate::weights::QuantizedWeights;

/// A loaded decoder model: llama, mistral, qwen2, qwen3, qwen3_moe,
/// mixtral, Gemma 3 or Gemma 4 (text).
pub struct Model {
    config: ModelConfig,
    decoder: Box<dyn Decoder>,
    /// The layers this process holds (all, unless it is a pipeline stage).
    stage: Stage,
    pass_cost_tokens: usize,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// How to load a model folder: [`Model::loader`], then the settings, then
/// [`load`](Self::load).
///
/// ```no_run
/// use mlx_engine::{MemoryMode, Model, QuantizedWeights};
///
/// let model = Model::loader("models/fused")
///     .quantized(QuantizedWeights::DequantizeOnUse)
///     .memory(MemoryMode::MappedTables)
///     .load()?;
/// # Ok::<(), mlx_engine::Error>(())
/// ```
#[derive(Debug)]
#[must_use = "a loader does nothing until `load` is called"]
pub struct ModelLoader {
    dir: PathBuf,
    quantized: Option<QuantizedWeights>,
    memory: MemoryMode,
    lora: Vec<BlockLoraSource>,
    placement: Placement,
    kernels: Option<Kernels>,
}

impl ModelLoader {
    /// How to hold quantized weights (default: the faster for the device
    /// MLX uses, [`QuantizedWeights::for_device`]).
    pub fn quantized(mut self, quantized: QuantizedWeights) -> ModelLoader {
        self.quantized = Some(quantized);
        self
    }

    /// Where the weights live (default [`MemoryMode::Resident`]).
    pub fn memory(mut self, memory: MemoryMode) -> ModelLoader {
        self.memory = memory;
        self
    }

    /// Adapters fused into each layer as it is read, with
    /// [`MemoryMode::Streamed`] (see `EngineConfig::lora`); with another
    /// mode, [`load`](Self::load) is [`Error::Config`]: the adapter is
    /// fused into the layers only when they are streamed.
    pub fn lora(mut self, lora: Vec<BlockLoraSource>) -> ModelLoader {
        self.lora = lora;
        self
    }

    /// Loads as one rank of `placement`: a pipeline stage loads only its
    /// layers (see [`Placement`]). Every rank of the group must load; each
    /// checks with the others that they loaded the same model. Default
    /// [`Placement::Local`].
    pub fn placement(mut self, placement: &Placement) -> ModelLoader {
        self.placement = placement.clone();
        self
    }

    /// Which kernels multiply dense weights (default: [`Kernels::from_env`],
    /// [`Kernels::Native`] unless `MLX_LOWMEM_KERNELS` says otherwise).
    pub fn kernels(mut self, kernels: Kernels) -> ModelLoader {
        self.kernels = Some(kernels);
        self
    }

    /// Loads the model.
    ///
    /// # Errors
    /// What the folder lacks or holds wrong, naming the file and key
    /// ([`Error::MissingWeight`], [`Error::WeightShape`], [`Error::Config`],
    /// [`Error::UnsupportedArchitecture`], …); with a distributed placement,
    /// [`Error::Distributed`] when the ranks disagree.
    pub fn load(self) -> Result<Model> {
        let quantized = self
            .quantized
            .unwrap_or_else(|| QuantizedWeights::for_device(mlx_support::current_device()));
        let kernels = match self.kernels {
            Some(kernels) => kernels,
            None => Kernels::from_env()?,
        };
        Model::load_placed(
            &self.dir,
            Settings {
                quantized,
                kernels,
                memory: self.memory,
            },
            self.lora,
            &self.placement,
        )
    }
}

/// How a loader holds and multiplies the weights.
struct Settings {
    quantized: QuantizedWeights,
    kernels: Kernels,
    memory: MemoryMode,
}

impl Model {
    /// A loader for `dir` (mlx_lm format: `config.json` + safetensors),
    /// with the defaults: resident weights, quantized ones held the faster
    /// way for the device, no adapter, this process alone.
    pub fn loader(dir: impl Into<PathBuf>) -> ModelLoader {
        ModelLoader {
            dir: dir.into(),
            quantized: None,
            memory: MemoryMode::Resident,
            lora: Vec::new(),
            placement: Placement::Local,
            kernels: None,
        }
    }

    fn load_placed(
        dir: &Path,
        settings: Settings,
        lora: Vec<BlockLoraSource>,
        placement: &Placement,
    ) -> Result<Model> {
        let Settings {
            quantized,
            kernels,
            memory,
        } = settings;
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
            products: Products::at_load(kernels),
            memory,
            streamed: None,
            lora: &lora,
        };
        let family =
            family_of(&config.model_type).ok_or_else(|| Error::UnsupportedArchitecture {
                model_type: config.model_type.clone(),
                supported: config::SUPPORTED,
            })?;
        // The config's layer count is checked against the layers the files
        // hold before anything is sized by it.
        let prefix = (family.layers_prefix)(&config, &w)?.children();
        let present = st_mmap::BlockIndex::build(&prefix, set.keys())?.len();
        if config.num_hidden_layers > present {
            return Err(Error::Config {
                path: dir.join("config.json"),
                message: format!(
                    "num_hidden_layers is {} but the weights hold {present} layers ({}N)",
                    config.num_hidden_layers,
                    prefix.as_str()
                ),
            });
        }
        let stage = match placement {
            Placement::Pipeline { group, layers } if !group.is_single() => {
                let n = config.num_hidden_layers;
                let can_cut = |i: usize| (family.can_cut_before)(&config, i);
                let refused = |message: String| Error::Distributed {
                    rank: group.rank(),
                    message: format!("pipeline layers: {message}"),
                };
                let ranges = match layers {
                    Some(ranges) => {
                        split::checked(ranges, n, group.size(), can_cut).map_err(refused)?;
                        ranges.clone()
                    }
                    None => {
                        let tables_mapped = memory != MemoryMode::Resident;
                        let resident = ResidentBytes::of(&set, &prefix, n, tables_mapped);
                        split::by_bytes_where(
                            &resident.layers,
                            resident.first,
                            resident.last,
                            group.size(),
                            can_cut,
                        )
                        .map_err(refused)?
                    }
                };
                Stage::part(group.clone(), ranges[group.rank()].clone(), n)
            }
            _ => Stage::whole(config.num_hidden_layers),
        };
        let decoder = (family.load)(&config, &w, &stage)?;
        if let Some(group) = placement.group() {
            let layers = stage.is_split().then(|| stage.layers());
            distributed::agree(group, dir, &set, layers)?;
        }
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
            stage,
            pass_cost_tokens,
        })
    }

    /// The key prefix of `dir`'s decoder layers (`model.layers.`, or where
    /// a Gemma checkpoint keeps them), as its family names them.
    pub(crate) fn layers_prefix(dir: &Path) -> Result<String> {
        let config = ModelConfig::load(dir)?;
        let set = Arc::new(SafetensorsSet::open_dir(dir)?);
        let family =
            family_of(&config.model_type).ok_or_else(|| Error::UnsupportedArchitecture {
                model_type: config.model_type.clone(),
                supported: config::SUPPORTED,
            })?;
        let lora = Arc::new(Vec::new());
        let w = Weights {
            dir,
            set: &set,
            quant: &config.quantization,
            mode: QuantizedWeights::Keep,
            products: Products::at_load(Kernels::Portable),
            memory: MemoryMode::Streamed,
            streamed: None,
            lora: &lora,
        };
        Ok((family.layers_prefix)(&config, &w)?
            .children()
            .as_str()
            .to_owned())
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

/// What a pipeline stage holds in memory, by part: the bytes that decide
/// an even split.
struct ResidentBytes {
    layers: Vec<u64>,
    /// The embedding table, on the first stage (none when tables are left
    /// in their files).
    first: u64,
    /// The final norm and an untied output head, on the last stage.
    last: u64,
}

impl ResidentBytes {
    fn of(
        set: &SafetensorsSet,
        prefix: &st_mmap::BlockPrefix,
        layers: usize,
        tables_mapped: bool,
    ) -> Self {
        let mut bytes = ResidentBytes {
            layers: vec![0; layers],
            first: 0,
            last: 0,
        };
        for key in set.keys() {
            let size = set.tensor(key).map_or(0, |t| t.data.len() as u64);
            match prefix.parse(key) {
                Ok(Some((i, _))) if i < layers => bytes.layers[i] += size,
                Ok(Some(_)) | Err(_) => {}
                // Gemma 4's per-layer table is on every stage: it does not
                // move the cut.
                Ok(None) if key.contains("embed_tokens_per_layer") => {}
                Ok(None) if key.contains("embed_tokens") => {
                    if !tables_mapped {
                        bytes.first += size;
                    }
                }
                Ok(None) => bytes.last += size,
            }
        }
        bytes
    }
}

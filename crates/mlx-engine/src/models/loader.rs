//! Loading a model: a [`ModelLoader`]'s settings and their defaults, each
//! decided here once (where the weights live, how packed weights are held,
//! which kernels multiply them, the rule that adapters need streamed
//! layers), then the decoder built from a [`Checkpoint`].

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

use block_stream::BlockLoraSource;

use crate::distributed::stage::Stage;
use crate::distributed::{self, split, Placement};
use crate::error::{Error, Result};
use crate::models::checkpoint::Checkpoint;
use crate::models::Model;
use crate::weights::kernels::{Kernels, Products};
use crate::weights::memory_mode::MemoryMode;
use crate::weights::plan::Plan;
use crate::weights::row_lora::RowAdapters;
use crate::weights::{QuantizedWeights, WeightSource};

/// How to load a model folder: [`Model::loader`] (or
/// [`Checkpoint::loader`]), then the settings, then [`load`](Self::load).
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
    source: Source,
    quantized: Option<QuantizedWeights>,
    memory: Option<MemoryMode>,
    lora: Vec<BlockLoraSource>,
    row_adapters: Option<Arc<RowAdapters>>,
    placement: Placement,
    kernels: Option<Kernels>,
}

/// What a loader loads: a folder it opens at [`ModelLoader::load`], or a
/// checkpoint already open.
#[derive(Debug)]
enum Source {
    Dir(PathBuf),
    Opened(Box<Checkpoint>),
}

impl Model {
    /// A loader for `dir` (mlx_lm format: `config.json` + safetensors),
    /// with the defaults: weights where [`Checkpoint::default_memory`]
    /// puts them on this machine, quantized ones held the faster way for
    /// the device, no adapter, this process alone.
    pub fn loader(dir: impl Into<PathBuf>) -> ModelLoader {
        ModelLoader::of(Source::Dir(dir.into()))
    }
}

impl Checkpoint {
    /// A loader of this checkpoint, with [`Model::loader`]'s defaults: the
    /// folder is not opened again.
    pub fn loader(self) -> ModelLoader {
        ModelLoader::of(Source::Opened(Box::new(self)))
    }
}

impl ModelLoader {
    fn of(source: Source) -> ModelLoader {
        ModelLoader {
            source,
            quantized: None,
            memory: None,
            lora: Vec::new(),
            row_adapters: None,
            placement: Placement::Local,
            kernels: None,
        }
    }

    /// How to hold quantized weights (default: the faster for the device
    /// MLX uses, [`QuantizedWeights::for_device`]).
    pub fn quantized(mut self, quantized: QuantizedWeights) -> ModelLoader {
        self.quantized = Some(quantized);
        self
    }

    /// Where the weights live (default: [`Checkpoint::default_memory`],
    /// or [`MemoryMode::Streamed`] with adapters).
    pub fn memory(mut self, memory: MemoryMode) -> ModelLoader {
        self.memory = Some(memory);
        self
    }

    /// Adapters fused into each layer as it is read, which needs
    /// [`MemoryMode::Streamed`] (see `EngineConfig::lora`): with another
    /// mode, [`load`](Self::load) is [`Error::AdaptersNeedStreamedLayers`].
    pub fn lora(mut self, lora: Vec<BlockLoraSource>) -> ModelLoader {
        self.lora = lora;
        self
    }

    /// Adapters kept unfused beside the weights and applied per row, in
    /// any memory mode (see `weights/row_lora/`).
    pub(crate) fn row_adapters(mut self, adapters: Arc<RowAdapters>) -> ModelLoader {
        self.row_adapters = Some(adapters);
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
    /// [`Error::UnsupportedArchitecture`], …); settings that cannot go
    /// together ([`Error::AdaptersNeedStreamedLayers`], [`Error::Setting`]);
    /// with a distributed placement, [`Error::Distributed`] when the ranks
    /// disagree.
    pub fn load(self) -> Result<Model> {
        let checkpoint = match self.source {
            Source::Dir(dir) => Checkpoint::open(dir)?,
            Source::Opened(checkpoint) => *checkpoint,
        };
        let settings = Settings {
            quantized: self
                .quantized
                .unwrap_or_else(|| QuantizedWeights::for_device(mlx_support::current_device())),
            kernels: match self.kernels {
                Some(kernels) => kernels,
                None => Kernels::from_env()?,
            },
            memory: memory_for(&checkpoint, self.memory, !self.lora.is_empty())?,
        };
        load(
            checkpoint,
            &settings,
            self.lora,
            self.row_adapters,
            &self.placement,
        )
    }
}

/// Where the weights live: as asked, else the machine's default for the
/// checkpoint. Adapters are fused into layers as the streamer reads them,
/// so they need the layers streamed: their default, and the one mode they
/// take.
fn memory_for(
    checkpoint: &Checkpoint,
    asked: Option<MemoryMode>,
    adapters: bool,
) -> Result<MemoryMode> {
    match (asked, adapters) {
        (Some(memory), false) => Ok(memory),
        (None, false) => Ok(checkpoint.default_memory()),
        (None | Some(MemoryMode::Streamed), true) => Ok(MemoryMode::Streamed),
        (Some(memory), true) => Err(Error::AdaptersNeedStreamedLayers { memory }),
    }
}

/// How a loader holds and multiplies the weights, decided.
struct Settings {
    quantized: QuantizedWeights,
    kernels: Kernels,
    memory: MemoryMode,
}

/// The decoder of `checkpoint` (the layers `placement` gives this rank).
fn load(
    checkpoint: Checkpoint,
    settings: &Settings,
    lora: Vec<BlockLoraSource>,
    row_adapters: Option<Arc<RowAdapters>>,
    placement: &Placement,
) -> Result<Model> {
    let stage = stage_of(&checkpoint, settings.memory, placement)?;
    let family = checkpoint.family();
    let config = checkpoint.config();
    let plan = Plan {
        quantized: settings.quantized,
        memory: settings.memory,
        products: Products::at_load(settings.kernels)?,
    };
    tracing::info!(?plan, "how the weights are held");
    let source = WeightSource {
        dir: checkpoint.dir().to_path_buf(),
        set: checkpoint.set().clone(),
        quant: config.quantization.clone(),
        plan,
        lora: Arc::new(lora),
        row_adapters: row_adapters.clone(),
    };
    let decoder = (family.load)(config, &source.weights(), &stage)?;
    if let Some(adapters) = &row_adapters {
        adapters.model_built(matrices(&checkpoint))?;
    }
    if let Some(group) = placement.group() {
        let layers = stage.is_split().then(|| stage.layers());
        distributed::agree(group, checkpoint.dir(), checkpoint.set(), layers)?;
    }
    // What the model holds is copied out of the files, and a table left
    // in them is read with positioned reads, so no page of the files
    // needs to stay mapped in. Each copied tensor's pages were released
    // as it was copied, but the kernel maps the page cache's large
    // folios whole, and the part of one that lies in a table left in
    // the files stayed resident for the model's life (SmolLM2 with its
    // table mapped: 7.5 MB).
    for key in checkpoint.set().keys() {
        checkpoint.set().release(key);
    }
    let (_, config, _, _) = checkpoint.into_parts();
    Ok(Model::assemble(
        config,
        decoder,
        stage,
        settings.memory,
        settings.quantized,
        arithmetic(settings),
    )
    .with_row_adapters(row_adapters))
}

/// The modules of every matrix of `checkpoint`'s decoder layers, which a
/// per-row adapter may adapt though they are built later (streamed) or
/// never (see `RowAdapters::model_built`). Outside the layers, what is a
/// linear layer was built at load: a pair for another matrix there (the
/// embedding table, which a tied head reads) would never be applied.
fn matrices(checkpoint: &Checkpoint) -> BTreeSet<String> {
    let set = checkpoint.set();
    let layers = checkpoint.block_prefix();
    set.keys()
        .filter(|key| key.starts_with(layers.as_str()))
        .filter(|key| set.tensor(key).is_some_and(|t| t.shape.len() == 2))
        .filter_map(|key| key.strip_suffix(".weight").map(str::to_owned))
        .collect()
}

/// What decides the loaded model's numbers besides its files (see
/// `Model::arithmetic`).
fn arithmetic(settings: &Settings) -> String {
    format!(
        // The kernels' instruction sets give the same sums (cpu-kernels'
        // tests hold each to one scalar loop): whether they run is what
        // changes the numbers.
        "{:?}, {:?} kernels (CPU kernels run: {}), {:?}, MLX {}, mlx-engine {}",
        settings.quantized,
        settings.kernels,
        cpu_kernels::supported(),
        mlx_support::current_device(),
        mlx_support::mlx_version(),
        env!("CARGO_PKG_VERSION"),
    )
}

/// The layers this rank holds: all of them, or its pipeline stage's, as
/// given or split evenly by the bytes each stage holds in memory.
fn stage_of(checkpoint: &Checkpoint, memory: MemoryMode, placement: &Placement) -> Result<Stage> {
    let n = checkpoint.config().num_hidden_layers;
    let Placement::Pipeline { group, layers } = placement else {
        return Ok(Stage::whole(n));
    };
    if group.is_single() {
        return Ok(Stage::whole(n));
    }
    let family = checkpoint.family();
    let can_cut = |i: usize| (family.can_cut_before)(checkpoint.config(), i);
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
            let tables_mapped = memory.maps_tables();
            let resident = checkpoint.resident_bytes(n, tables_mapped);
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
    Ok(Stage::part(group.clone(), ranges[group.rank()].clone(), n))
}

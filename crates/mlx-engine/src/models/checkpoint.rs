//! A model folder opened once: its `config.json` read through its family,
//! its safetensors set, and what each tensor is part of, as the family
//! says. The memory default, an adapter's block prefix, the pipeline split
//! and the load all read one [`Checkpoint`] instead of opening the folder
//! again, and none of them knows a family's tensor names.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use st_mmap::{BlockPrefix, SafetensorsSet};

use crate::error::{Error, Result};
use crate::models::config::{ModelConfig, SUPPORTED};
use crate::models::family::{Family, Part};
use crate::models::{gemma, llama};
use crate::weights::memory_mode::MemoryMode;
use crate::weights::KeyPath;

/// Every family the crate runs, by `model_type` (see [`Family`]).
const FAMILIES: &[&Family] = &[&llama::FAMILY, &gemma::FAMILY];

/// The family that runs `model_type`.
pub(crate) fn family_of(model_type: &str) -> Result<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.model_types.contains(&model_type))
        .ok_or_else(|| Error::UnsupportedArchitecture {
            model_type: model_type.to_owned(),
            supported: SUPPORTED,
        })
}

impl ModelConfig {
    /// Reads and checks `dir/config.json`: the common fields, and the
    /// family's own settings as its `model_type`'s family reads them.
    pub fn load(dir: &Path) -> Result<ModelConfig> {
        Ok(ModelConfig::read(dir)?.0)
    }

    /// [`load`](Self::load), with the family that read it.
    pub(crate) fn read(dir: &Path) -> Result<(ModelConfig, &'static Family)> {
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
        let family = family_of(model_type)?;
        let fields = (family.fields)(&raw).map_err(bad)?;
        let mut config = ModelConfig::from_fields(&fields).map_err(bad)?;
        config.settings = (family.settings)(&raw, &fields, &config).map_err(bad)?;
        Ok((config, family))
    }
}
/// A model folder (mlx_lm's format: `config.json` and safetensors), opened
/// once and read by everything that decides how to load it.
///
/// ```no_run
/// use mlx_engine::Checkpoint;
///
/// let checkpoint = Checkpoint::open("models/fused")?;
/// // Where the weights would live on this machine, then the load.
/// let memory = checkpoint.default_memory();
/// let model = checkpoint.loader().memory(memory).load()?;
/// # Ok::<(), mlx_engine::Error>(())
/// ```
pub struct Checkpoint {
    dir: PathBuf,
    config: ModelConfig,
    set: Arc<SafetensorsSet>,
    family: &'static Family,
    /// Where the decoder layers are (`model.layers`): layer `i` under its
    /// child `i`.
    layers: KeyPath,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("model_type", &self.config.model_type)
            .field("layer_prefix", &self.layers.as_str())
            .finish_non_exhaustive()
    }
}

/// What a pipeline stage holds in memory, by part: the bytes that decide
/// an even split.
pub(crate) struct ResidentBytes {
    pub layers: Vec<u64>,
    /// The token table, on the first stage (none when tables are left in
    /// their files).
    pub first: u64,
    /// The final norm and an untied output head, on the last stage.
    pub last: u64,
}

impl Checkpoint {
    /// Opens `dir`: reads and checks `config.json` through its family,
    /// opens the safetensors set, and checks that the files hold the
    /// layers the config counts.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Config`] for `config.json`,
    /// [`Error::UnsupportedArchitecture`] for its `model_type`, the set's
    /// errors, and [`Error::Config`] when the files hold fewer layers than
    /// `num_hidden_layers`.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Checkpoint> {
        let dir = dir.into();
        let (config, family) = ModelConfig::read(&dir)?;
        let set = Arc::new(SafetensorsSet::open_dir(&dir)?);
        let layers = (family.layers_prefix)(&config, &set, &dir)?;
        let checkpoint = Checkpoint {
            dir,
            config,
            set,
            family,
            layers,
        };
        checkpoint.check_layer_count()?;
        Ok(checkpoint)
    }

    /// The config's layer count, checked against the layers the files hold
    /// before anything is sized by it.
    fn check_layer_count(&self) -> Result<()> {
        let prefix = self.block_prefix();
        let present = st_mmap::BlockIndex::build(&prefix, self.set.keys())?.len();
        if self.config.num_hidden_layers > present {
            return Err(Error::Config {
                path: self.dir.join("config.json"),
                message: format!(
                    "num_hidden_layers is {} but the weights hold {present} layers ({}N)",
                    self.config.num_hidden_layers,
                    prefix.as_str()
                ),
            });
        }
        Ok(())
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Where the weights live by default on this machine
    /// ([`MemoryMode::for_parts`] with the weight files' bytes, the bytes
    /// of their tables and of their experts, and
    /// [`mlx_support::memory_limit`]).
    pub fn default_memory(&self) -> MemoryMode {
        let weights = self
            .set
            .files()
            .iter()
            .map(|f| f.bytes().len() as u64)
            .sum();
        let (mut tables, mut experts) = (0, 0);
        for (part, bytes) in self.tensor_parts() {
            match part {
                Part::Table | Part::SharedTable => tables += bytes,
                Part::Experts(_) => experts += bytes,
                _ => {}
            }
        }
        MemoryMode::for_parts(weights, tables, experts, mlx_support::memory_limit())
    }

    /// The block prefix of the decoder layers (`model.layers.`), which
    /// adapters and the layer streamer key blocks by.
    pub(crate) fn block_prefix(&self) -> BlockPrefix {
        self.layers.children()
    }

    pub(crate) fn set(&self) -> &Arc<SafetensorsSet> {
        &self.set
    }

    pub(crate) fn family(&self) -> &'static Family {
        self.family
    }

    /// Every tensor's part and bytes.
    fn tensor_parts(&self) -> impl Iterator<Item = (Part, u64)> + '_ {
        let prefix = self.block_prefix();
        self.set.keys().map(move |key| {
            let bytes = self.set.tensor(key).map_or(0, |t| t.data.len() as u64);
            ((self.family.part_of)(&prefix, key), bytes)
        })
    }

    /// What each part of a pipeline holds in memory, for the first
    /// `layers` layers; `tables_mapped`: the tables are left in the files.
    pub(crate) fn resident_bytes(&self, layers: usize, tables_mapped: bool) -> ResidentBytes {
        let mut bytes = ResidentBytes {
            layers: vec![0; layers],
            first: 0,
            last: 0,
        };
        for (part, size) in self.tensor_parts() {
            match part {
                Part::Layer(i) | Part::Experts(i) if i < layers => bytes.layers[i] += size,
                Part::Layer(_) | Part::Experts(_) => {}
                // On every stage: it does not move the cut.
                Part::SharedTable => {}
                Part::Table if !tables_mapped => bytes.first += size,
                Part::Table => {}
                Part::Rest => bytes.last += size,
            }
        }
        bytes
    }

    /// The folder, the config, the set and the family, for the load.
    pub(crate) fn into_parts(self) -> (PathBuf, ModelConfig, Arc<SafetensorsSet>, &'static Family) {
        (self.dir, self.config, self.set, self.family)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_model_type_has_one_family() {
        for model_type in SUPPORTED {
            let n = FAMILIES
                .iter()
                .filter(|f| f.model_types.contains(model_type))
                .count();
            assert_eq!(n, 1, "{model_type}");
        }
        let listed: usize = FAMILIES.iter().map(|f| f.model_types.len()).sum();
        assert_eq!(listed, SUPPORTED.len());
        assert!(matches!(
            family_of("bert"),
            Err(Error::UnsupportedArchitecture { .. })
        ));
    }

    /// Each family names its parts: the tables, the experts, the layers,
    /// the rest.
    #[test]
    fn families_name_their_tables_experts_and_layers() {
        let layers = KeyPath::new("model.layers").children();
        let llama = |key| (llama::FAMILY.part_of)(&layers, key);
        assert_eq!(llama("model.embed_tokens.weight"), Part::Table);
        assert_eq!(llama("model.embed_tokens.scales"), Part::Table);
        let experts = "model.layers.3.mlp.switch_mlp.down_proj.weight";
        assert_eq!(llama(experts), Part::Experts(3));
        let mixtral = "model.layers.0.block_sparse_moe.switch_mlp.gate_proj.scales";
        assert_eq!(llama(mixtral), Part::Experts(0));
        assert_eq!(llama("model.layers.0.mlp.up_proj.weight"), Part::Layer(0));
        assert_eq!(llama("model.layers.0.mlp.gate.weight"), Part::Layer(0));
        assert_eq!(llama("lm_head.weight"), Part::Rest);
        assert_eq!(llama("model.norm.weight"), Part::Rest);
        let text = KeyPath::new("language_model.model.layers").children();
        let gemma = |key| (gemma::FAMILY.part_of)(&text, key);
        assert_eq!(
            gemma("language_model.model.embed_tokens.biases"),
            Part::Table
        );
        let per_layer = "language_model.model.embed_tokens_per_layer.weight";
        assert_eq!(gemma(per_layer), Part::SharedTable);
        let projection = "language_model.model.per_layer_model_projection.weight";
        assert_eq!(gemma(projection), Part::Rest);
        assert_eq!(
            gemma("language_model.model.embed_tokens_norm.weight"),
            Part::Rest
        );
        let attention = "language_model.model.layers.2.self_attn.q_proj.weight";
        assert_eq!(gemma(attention), Part::Layer(2));
        assert_eq!(gemma("vision_tower.blocks.0.weight"), Part::Rest);
    }

    /// A folder opened once: its config, its layers' prefix, and the bytes
    /// of its parts from the headers, which the memory default and the
    /// pipeline split weigh; a config counting more layers than the files
    /// hold is refused at the open.
    #[test]
    fn a_checkpoint_weighs_its_parts_from_the_headers() {
        let dir = tempfile::tempdir().unwrap();
        ::test_support::tiny_llama::TinyLlama::new("llama").write(dir.path());
        let checkpoint = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(checkpoint.config().num_hidden_layers, 2);
        assert_eq!(checkpoint.block_prefix().as_str(), "model.layers.");
        let table: u64 = checkpoint
            .tensor_parts()
            .filter(|(part, _)| *part == Part::Table)
            .map(|(_, bytes)| bytes)
            .sum();
        assert_eq!(table, 48 * 64 * 4, "the tiny vocabulary of 48 × 64 in f32");
        let resident = checkpoint.resident_bytes(2, false);
        assert_eq!(resident.first, table);
        assert_eq!(resident.last, 64 * 4, "the final norm");
        assert!(resident.layers.iter().all(|&bytes| bytes > 0));
        let mapped = checkpoint.resident_bytes(2, true);
        assert_eq!((mapped.first, &mapped.layers), (0, &resident.layers));

        let path = dir.path().join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config["num_hidden_layers"] = 3.into();
        std::fs::write(&path, config.to_string()).unwrap();
        let err = Checkpoint::open(dir.path()).unwrap_err();
        assert!(
            matches!(&err, Error::Config { path, message } if path.ends_with("config.json")
                && message.contains("hold 2 layers")),
            "{err}"
        );
    }
}

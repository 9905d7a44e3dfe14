//! What the rest of the crate knows about a model family: a [`Decoder`]
//! (its forward and its head) and a [`Family`] (its `model_type`s, its part
//! of `config.json`, its parts, its loading), listed once in
//! `models::checkpoint::FAMILIES`.
//! [`Model`](crate::Model) and generation go through these and never name a
//! family; adding one is a folder under `models/` with its decoder and
//! tests, and one entry in that list.

use std::path::Path;

use mlx_rs::Array;
use st_mmap::{BlockPrefix, SafetensorsSet};

use crate::distributed::stage::Stage;
use crate::error::Result;
use crate::models::config::{FamilySettings, ModelConfig};
use crate::models::layers::Schedule;
use crate::nn::cache::KvCache;
use crate::weights::{KeyPath, Weights};

/// What a tensor of a checkpoint is part of, as its family names its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The token table (also a tied head): on the first pipeline stage;
    /// left in the files when tables are mapped.
    Table,
    /// A table every layer reads (Gemma 4's per-layer inputs): on every
    /// stage; left in the files when tables are mapped.
    SharedTable,
    /// Decoder layer `i`'s weights.
    Layer(usize),
    /// Layer `i`'s stacked experts: left in the files when tables are
    /// mapped.
    Experts(usize),
    /// The rest (the final norm, an untied head, what a multimodal
    /// checkpoint holds beside its text decoder): the last stage.
    Rest,
}

/// The module name of a tensor key (`model.embed_tokens.weight` →
/// `embed_tokens`), for families naming their parts.
pub(crate) fn module_name(key: &str) -> &str {
    let module = key.rsplit_once('.').map_or(key, |(module, _)| module);
    module.rsplit('.').next().unwrap_or(module)
}

/// A loaded decoder (or the layers of it one pipeline stage holds).
pub(crate) trait Decoder {
    /// The last layer's outputs `(B, L, hidden)` — `(B, 1, hidden)` with
    /// `last_only` — before the final norm, of the independent forwards of
    /// `tokens` over `caches` (one cache each, extended). On a pipeline
    /// stage, the stage's layers, their input received and their output
    /// sent through `stage`.
    fn hidden_each(
        &self,
        config: &ModelConfig,
        stage: &Stage,
        tokens: &[Array],
        caches: &mut [KvCache],
        last_only: bool,
    ) -> Result<Vec<Array>>;

    /// The logits of hidden states `(…, hidden)`: final norm and head.
    fn head(&self, config: &ModelConfig, x: &Array) -> Result<Array>;

    /// How generation runs this decoder's forwards (its layers decide).
    fn schedule(&self) -> Schedule;
}

/// A model family: the `model_type`s it reads, its part of `config.json`,
/// and how to load it.
pub(crate) struct Family {
    /// `config.json`'s `model_type`s this family runs.
    pub model_types: &'static [&'static str],
    /// The fields the common [`ModelConfig`] is read from (a multimodal
    /// checkpoint nests its text decoder's), completed with the family's
    /// defaults.
    pub fields: fn(&serde_json::Value) -> std::result::Result<serde_json::Value, String>,
    /// The family's own settings, from those fields and the common config
    /// (kept in [`ModelConfig`] for the family alone to read back).
    /// (Arguments: the whole `config.json`, the fields, the common config.)
    pub settings: fn(
        &serde_json::Value,
        &serde_json::Value,
        &ModelConfig,
    ) -> std::result::Result<Option<FamilySettings>, String>,
    /// Where the decoder layers' weights are (`model.layers`): layer `i`'s
    /// are under its child `i`. (Arguments: the config, the folder's
    /// tensors, the folder, for errors.)
    pub layers_prefix: fn(&ModelConfig, &SafetensorsSet, &Path) -> Result<KeyPath>,
    /// What the tensor `key` is part of, the layers being under `layers`:
    /// the family's names for its tables, experts and layers, so that
    /// nothing outside the family reads them.
    pub part_of: fn(layers: &BlockPrefix, key: &str) -> Part,
    /// Whether a pipeline may cut before layer `i` (no layer at or after
    /// `i` reads a layer before it within a forward).
    pub can_cut_before: fn(&ModelConfig, usize) -> bool,
    /// Loads the decoder, or the layers `stage` holds.
    pub load: fn(&ModelConfig, &Weights<'_>, &Stage) -> Result<Box<dyn Decoder>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_names_are_the_last_part_before_the_parameter() {
        assert_eq!(module_name("model.embed_tokens.weight"), "embed_tokens");
        assert_eq!(
            module_name("language_model.model.embed_tokens_per_layer.scales"),
            "embed_tokens_per_layer"
        );
        assert_eq!(module_name("lm_head.weight"), "lm_head");
        assert_eq!(module_name("weight"), "weight");
    }
}

//! What the rest of the crate knows about a model family: a [`Decoder`]
//! (its forward and its head) and a [`Family`] (its `model_type`s, its part
//! of `config.json`, its loading), listed once in `models::FAMILIES`.
//! [`Model`](crate::Model) and generation go through these and never name a
//! family; adding one is a folder under `models/` with its decoder and
//! tests, and one entry in that list.

use mlx_rs::Array;

use crate::distributed::stage::Stage;
use crate::error::Result;
use crate::models::config::{FamilySettings, ModelConfig};
use crate::nn::cache::KvCache;
use crate::weights::layers::Schedule;
use crate::weights::{KeyPath, Weights};

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
    /// are under its child `i`.
    pub layers_prefix: fn(&ModelConfig, &Weights<'_>) -> Result<KeyPath>,
    /// Whether a pipeline may cut before layer `i` (no layer at or after
    /// `i` reads a layer before it within a forward).
    pub can_cut_before: fn(&ModelConfig, usize) -> bool,
    /// Loads the decoder, or the layers `stage` holds.
    pub load: fn(&ModelConfig, &Weights<'_>, &Stage) -> Result<Box<dyn Decoder>>,
}

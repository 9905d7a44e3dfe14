//! `config.json` of an mlx_lm-format model, for the decoder families we run.

use std::any::Any;
use std::sync::Arc;

use serde::Deserialize;

use mlx_support::QuantizationConfig;

/// The `model_type`s this crate implements. `gemma3` and `gemma4` are
/// multimodal checkpoints: their text decoder runs, their vision and audio
/// towers are skipped.
pub const SUPPORTED: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "gemma3_text",
    "gemma3",
    "gemma4_text",
    "gemma4",
];

/// The fields of `config.json` the decoder needs.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelConfig {
    /// Architecture name, one of [`SUPPORTED`].
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    /// Defaults to `num_attention_heads` (no grouped-query attention).
    pub num_key_value_heads: Option<usize>,
    /// Defaults to `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Affine quantization of the layers, with mlx_lm's per-module
    /// overrides (mixed bits, modules left unquantized).
    #[serde(default, deserialize_with = "quantization_config")]
    pub quantization: QuantizationConfig,
    /// The context length the model was trained for, when the config says.
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    /// The family's own settings, if it has any (see
    /// [`Family::settings`](crate::models::family::Family)).
    #[serde(skip)]
    pub(crate) settings: Option<FamilySettings>,
}

fn default_rope_theta() -> f32 {
    10000.0
}

/// `config.json`'s `quantization` entry, read by the workspace's one
/// quantization-config type.
fn quantization_config<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<QuantizationConfig, D::Error> {
    let value = serde_json::Value::deserialize(deserializer)?;
    if value.is_null() {
        return Ok(QuantizationConfig::none());
    }
    QuantizationConfig::from_entry(&value).map_err(serde::de::Error::custom)
}

impl ModelConfig {
    /// The common config from `fields` (a family's
    /// [`Family::fields`](crate::models::family::Family)), checked.
    pub(crate) fn from_fields(
        fields: &serde_json::Value,
    ) -> std::result::Result<ModelConfig, String> {
        let config: ModelConfig =
            serde_json::from_value(fields.clone()).map_err(|e| e.to_string())?;
        config.check()?;
        Ok(config)
    }

    /// The family's own settings, of type `T`.
    pub(crate) fn settings<T: std::any::Any>(&self) -> Option<&T> {
        self.settings.as_ref()?.get()
    }

    /// Sizes that cannot work, before anything is allocated from them.
    /// (Whether they fit the weights is checked as each weight loads.)
    fn check(&self) -> std::result::Result<(), String> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.kv_heads()),
            ("vocab_size", self.vocab_size),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be at least 1"));
        }
        // Dimensions become MLX's i32 shapes.
        let limit = i32::MAX as usize;
        if let Some((name, v)) = positive.iter().find(|(_, v)| *v > limit) {
            return Err(format!("{name} = {v} is larger than any tensor can be"));
        }
        if self.head_dim == Some(0) {
            return Err("head_dim must be at least 1".into());
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err("num_attention_heads must divide hidden_size (or give head_dim)".into());
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return Err(format!(
                "num_key_value_heads {} must divide num_attention_heads {}",
                self.kv_heads(),
                self.num_attention_heads
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rope_theta.is_finite() && self.rope_theta > 0.0)
        {
            return Err("rms_norm_eps and rope_theta must be finite (rope_theta positive)".into());
        }
        Ok(())
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Size of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }
}

/// A family's own settings (Gemma's layer types, windows, per-layer
/// inputs, ...), held in [`ModelConfig`] without the common config naming
/// their type; the family reads them back with [`ModelConfig::settings`].
#[derive(Clone)]
pub(crate) struct FamilySettings(Arc<dyn Any + Send + Sync>);

impl FamilySettings {
    pub(crate) fn new<T: Any + Send + Sync>(settings: T) -> FamilySettings {
        FamilySettings(Arc::new(settings))
    }

    pub(crate) fn get<T: Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }
}

impl std::fmt::Debug for FamilySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FamilySettings(..)")
    }
}

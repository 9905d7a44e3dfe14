//! `config.json` of an mlx_lm-format model, for the decoder families we run.

use std::path::Path;

use serde::Deserialize;

use mlx_support::QuantizationConfig;

use crate::error::{Error, Result};

/// The `model_type`s this crate implements. `gemma3` and `gemma4` are
/// multimodal checkpoints: their text decoder runs, their vision and audio
/// towers are skipped.
pub const SUPPORTED: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
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
    /// Gemma's architecture fields (layer types, windows, per-layer
    /// embeddings, …); `None` for the llama family.
    #[serde(skip)]
    pub(crate) gemma: Option<crate::models::gemma::config::GemmaSpec>,
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
    /// Reads and checks `dir/config.json`.
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
        if !SUPPORTED.contains(&model_type) {
            return Err(Error::UnsupportedArchitecture {
                model_type: model_type.to_owned(),
                supported: SUPPORTED,
            });
        }
        // Gemma's text fields, flattened and completed with mlx_lm's
        // defaults; other families read as they are.
        let text_fields = crate::models::gemma::config::text_fields(&raw).map_err(bad)?;
        let fields = text_fields.as_ref().unwrap_or(&raw);
        let mut config: ModelConfig =
            serde_json::from_value(fields.clone()).map_err(|e| bad(e.to_string()))?;
        config.check().map_err(bad)?;
        if text_fields.is_some() {
            let multimodal = matches!(model_type, "gemma3" | "gemma4");
            let spec =
                crate::models::gemma::config::GemmaSpec::resolve(fields, &config, multimodal)
                    .map_err(bad)?;
            config.gemma = Some(spec);
        }
        Ok(config)
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

    /// Whether q/k/v projections carry biases (qwen2).
    pub fn attention_bias(&self) -> bool {
        self.model_type == "qwen2"
    }

    /// Whether queries and keys are RMS-normalised per head (qwen3).
    pub fn qk_norm(&self) -> bool {
        self.model_type == "qwen3"
    }
}

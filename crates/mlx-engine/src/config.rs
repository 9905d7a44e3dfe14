//! `config.json` of an mlx_lm-format model, for the decoder families we run.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// The `model_type`s this crate implements.
pub const SUPPORTED: &[&str] = &["llama", "mistral", "qwen2", "qwen3"];

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
    /// Affine quantization of the linear layers, when present.
    pub quantization: Option<Quantization>,
}

fn default_rope_theta() -> f32 {
    10000.0
}

/// MLX affine quantization parameters.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
pub struct Quantization {
    pub group_size: i32,
    pub bits: i32,
}

impl ModelConfig {
    /// Reads and checks `dir/config.json`.
    pub fn load(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let config: ModelConfig = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: path.clone(),
            message: e.to_string(),
        })?;
        if !SUPPORTED.contains(&config.model_type.as_str()) {
            return Err(Error::UnsupportedArchitecture {
                model_type: config.model_type,
                supported: SUPPORTED,
            });
        }
        let heads_fit = config.head_dim.is_some()
            || config
                .hidden_size
                .is_multiple_of(config.num_attention_heads.max(1));
        if config.num_attention_heads == 0 || !heads_fit {
            return Err(Error::Config {
                path,
                message: "num_attention_heads must divide hidden_size (or give head_dim)".into(),
            });
        }
        Ok(config)
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

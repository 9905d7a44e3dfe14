//! gpt_oss as a member of the llama family, as mlx_lm 0.32.2's
//! `gpt_oss.py` computes it: sliding and full attention layers alternating
//! (`layer_types`), a learned sink per head in every layer's attention,
//! YaRN-scaled rotary positions, biases on every projection, and a router
//! with a bias choosing among experts that have biases too, behind a
//! clamped SwiGLU.

use mlx_rs::ops::{maximum, minimum, sigmoid};
use mlx_rs::{Array, Dtype};

use crate::error::{Error, Result};
use crate::models::config::ModelConfig;
use crate::nn::rope_scaling::RopeScaling;
use crate::weights::{KeyPath, Weights};

use super::moe::{LocalExpertsFields, MoeSettings, MoeStyle};
use super::windows::Windows;
use super::LlamaSettings;

/// gpt_oss's fields of `config.json` beyond the common ones (mlx_lm's
/// `ModelArgs`).
#[derive(Debug, serde::Deserialize)]
struct Fields {
    #[serde(flatten)]
    experts: LocalExpertsFields,
    sliding_window: usize,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
}

/// The family's settings for a gpt_oss `config.json`.
pub(super) fn settings(
    raw: &serde_json::Value,
    config: &ModelConfig,
) -> std::result::Result<LlamaSettings, String> {
    let fields: Fields = serde_json::from_value(raw.clone()).map_err(|e| e.to_string())?;
    let layers = config.num_hidden_layers;
    // mlx_lm's default: sliding then full, pair by pair (it would leave an
    // odd last layer out of the forward; that is refused here instead).
    let types = match fields.layer_types {
        Some(types) => types,
        None if layers.is_multiple_of(2) => ["sliding_attention", "full_attention"]
            .iter()
            .cycle()
            .take(layers)
            .map(|t| (*t).to_owned())
            .collect(),
        None => {
            return Err(format!(
                "{layers} layers and no layer_types: give layer_types"
            ))
        }
    };
    let windows = Windows::of_layer_types(&types, Some(fields.sliding_window), layers)?;
    let rope_scaling = RopeScaling::from_config(
        fields.rope_scaling.as_ref(),
        config.head_dim(),
        f64::from(config.rope_theta),
    )?;
    let moe = MoeSettings::every_layer(fields.experts, MoeStyle::GptOss);
    moe.check()?;
    Ok(LlamaSettings {
        qk_norm: false,
        moe: Some(moe),
        windows,
        sinks: true,
        rope_scaling,
    })
}

/// The experts' biases under `experts` (`gate_proj.bias`, …), or a typed
/// error naming the way out when the files hold Hugging Face's original
/// layout (gate and up interleaved in one `gate_up_proj`, MXFP4 blocks
/// beside it), which mlx_lm's `sanitize` rewrites when converting.
pub(super) fn expert_biases(
    w: &Weights<'_>,
    experts: &KeyPath,
    moe: &MoeSettings,
    hidden: usize,
) -> Result<[Array; 3]> {
    let original = ["gate_up_proj", "gate_up_proj_blocks"]
        .iter()
        .map(|name| experts.join(name))
        .find(|key| w.has(key));
    if let Some(original) = original {
        return Err(Error::MissingWeight {
            dir: w.dir.to_path_buf(),
            key: format!(
                "{} (the files hold the original checkpoint's `{original}`: convert the \
                 model with mlx_lm.convert, which splits it)",
                experts.join("gate_proj").join("weight")
            ),
        });
    }
    let (e, inter) = (moe.num_experts, moe.moe_intermediate_size);
    let bias = |name: &str, out: usize| w.array(&experts.join(name).join("bias"), &[e, out]);
    Ok([
        bias("gate_proj", inter)?,
        bias("up_proj", inter)?,
        bias("down_proj", hidden)?,
    ])
}

/// gpt_oss's gated activation of its experts: the gate clamped above at
/// 7 and the linear part within ±7, `gate · σ(1.702 · gate) · (up + 1)`,
/// each step in the inputs' dtype as mlx_lm's `swiglu` computes it.
pub(super) fn clamped_swiglu(gate: &Array, up: &Array) -> Result<Array> {
    let scalar = |v: f32, dtype: Dtype| Array::from_f32(v).as_dtype(dtype);
    let limit = scalar(7.0, gate.dtype())?;
    let gate = minimum(gate, &limit)?;
    let up = minimum(
        maximum(up, scalar(-7.0, up.dtype())?)?,
        scalar(7.0, up.dtype())?,
    )?;
    let glu = gate.multiply(sigmoid(gate.multiply(scalar(1.702, gate.dtype())?)?)?)?;
    Ok(glu.multiply(up.add(scalar(1.0, up.dtype())?)?)?)
}

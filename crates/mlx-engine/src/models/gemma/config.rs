//! Gemma 3 and Gemma 4 configs as mlx_lm 0.32.2 reads them
//! (`gemma3_text.py`, `gemma3.py`, `gemma4_text.py`, `gemma4.py`): the
//! multimodal wrappers' `text_config`, mlx_lm's defaults for fields a config
//! leaves out, and what each layer is (sliding or full attention, head
//! size, rotary embedding, whose keys and values it reads).

use serde_json::{json, Map, Value};

use crate::models::config::ModelConfig;

/// Which Gemma.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Version {
    Three,
    Four,
}

/// The rotary embedding of one layer type.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RopeSpec {
    /// The base of the frequencies, or `None` when `freqs` gives them.
    pub base: Option<f32>,
    /// Positions are multiplied by it (linear scaling: `1 / factor`).
    pub scale: f32,
    /// Gemma 4's "proportional" RoPE: one period per pair, infinite (no
    /// rotation) for the pairs past the rotated part.
    pub freqs: Option<Vec<f32>>,
}

/// One decoder layer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LayerSpec {
    /// Sliding-window attention (else full attention).
    pub sliding: bool,
    pub head_dim: usize,
    /// The layer whose keys and values this one attends to: itself, or for
    /// a Gemma 4 KV-shared layer the last earlier layer of the same type
    /// that computes its own.
    pub kv_source: usize,
    pub intermediate: usize,
    pub rope: RopeSpec,
    /// Key/value heads of this layer's projections.
    pub kv_heads: usize,
    /// Gemma 4's `attention_k_eq_v` on a full layer: no value projection,
    /// the values are the keys' projection (before the keys' norm and
    /// rotation).
    pub values_are_keys: bool,
}

impl LayerSpec {
    /// Whether the layer computes (and caches) keys and values itself.
    pub fn owns_kv(&self, index: usize) -> bool {
        self.kv_source == index
    }
}

/// What the Gemma decoder needs beyond the common fields.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GemmaSpec {
    pub version: Version,
    /// Text weights under `language_model.` (a `gemma3`/`gemma4` checkpoint).
    pub multimodal: bool,
    pub layers: Vec<LayerSpec>,
    /// Keys a sliding layer's query may see: the `window` latest positions,
    /// its own included.
    pub window: usize,
    pub attention_scale: f32,
    /// `tanh(logits / c) · c` on the output.
    pub softcap: Option<f32>,
    /// Gemma 4's per-layer input embeddings: width per layer (0: none) and
    /// the table's vocabulary.
    pub per_layer_dim: usize,
    pub per_layer_vocab: usize,
    /// Gemma 4's mixture-of-experts block beside each layer's MLP (the
    /// 26B-A4B model's `enable_moe_block`).
    pub moe: Option<GemmaMoe>,
}

/// Gemma 4's routed experts, in every layer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GemmaMoe {
    pub experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
}

impl GemmaSpec {
    /// Whether a later layer attends to layer `index`'s keys and values.
    pub fn is_kv_source(&self, index: usize) -> bool {
        self.layers
            .iter()
            .enumerate()
            .any(|(i, layer)| i != index && layer.kv_source == index)
    }
}

const GEMMA3_TEXT: &str = "gemma3_text";
const GEMMA4_TEXT: &str = "gemma4_text";

/// mlx_lm's `ModelArgs` defaults, for the fields that do not size the
/// model: those (hidden size, layer count, MLP width) must be given.
fn defaults(version: Version) -> Value {
    match version {
        Version::Three => json!({
            "num_attention_heads": 4, "head_dim": 256, "rms_norm_eps": 1.0e-6,
            "vocab_size": 262144, "num_key_value_heads": 1, "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256.0,
            "sliding_window": 512, "sliding_window_pattern": 6,
            "max_position_embeddings": 32768,
        }),
        Version::Four => json!({
            "num_attention_heads": 8, "head_dim": 256, "global_head_dim": 512,
            "rms_norm_eps": 1.0e-6, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
            "num_key_value_heads": 1, "num_kv_shared_layers": 20,
            "hidden_size_per_layer_input": 256, "rope_traditional": false,
            "sliding_window": 512, "sliding_window_pattern": 5,
            "max_position_embeddings": 131072, "attention_k_eq_v": false,
            "final_logit_softcapping": 30.0, "use_double_wide_mlp": true,
            "enable_moe_block": false, "tie_word_embeddings": true,
        }),
    }
}

/// For a Gemma config, its text decoder's fields: a multimodal wrapper's
/// `text_config` (with the wrapper's vocabulary size, head-count defaults
/// and quantization), completed with mlx_lm's defaults, `model_type` the
/// text one. `None` for other families.
pub(crate) fn text_fields(raw: &Value) -> Result<Option<Value>, String> {
    let model_type = raw.get("model_type").and_then(Value::as_str).unwrap_or("");
    let (version, text) = match model_type {
        GEMMA3_TEXT => (Version::Three, raw.clone()),
        GEMMA4_TEXT => (Version::Four, raw.clone()),
        "gemma3" | "gemma4" => {
            let version = if model_type == "gemma3" {
                Version::Three
            } else {
                Version::Four
            };
            let mut text = match raw.get("text_config") {
                Some(Value::Object(t)) => t.clone(),
                Some(_) => return Err("`text_config` must be an object".into()),
                None => return Err(format!("a {model_type} config needs a `text_config`")),
            };
            // The wrapper's `vocab_size` (its own default when absent)
            // replaces the text config's, as in mlx_lm.
            let vocab = raw.get("vocab_size").cloned().unwrap_or(match version {
                Version::Three => json!(262208),
                Version::Four => json!(262144),
            });
            text.insert("vocab_size".into(), vocab);
            let kv_default = if version == Version::Three { 4 } else { 1 };
            text.entry("num_attention_heads").or_insert(json!(8));
            text.entry("num_key_value_heads")
                .or_insert(json!(kv_default));
            if let Some(q) = raw.get("quantization") {
                text.insert("quantization".into(), q.clone());
            }
            (version, Value::Object(text))
        }
        _ => return Ok(None),
    };
    let Value::Object(given) = text else {
        return Err("the config must be an object".into());
    };
    let Value::Object(mut fields) = defaults(version) else {
        unreachable!("defaults are objects")
    };
    fields.extend(given);
    fields.insert(
        "model_type".into(),
        json!(if version == Version::Three {
            GEMMA3_TEXT
        } else {
            GEMMA4_TEXT
        }),
    );
    Ok(Some(Value::Object(fields)))
}

fn get_f32(fields: &Map<String, Value>, key: &str) -> Result<Option<f32>, String> {
    match fields.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|v| Some(v as f32))
            .ok_or_else(|| format!("`{key}` must be a number")),
    }
}

fn get_usize(fields: &Map<String, Value>, key: &str) -> Result<Option<usize>, String> {
    match fields.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .filter(|&v| v <= i32::MAX as usize)
            .map(Some)
            .ok_or_else(|| format!("`{key}` must be a size")),
    }
}

fn flag(fields: &Map<String, Value>, key: &str) -> bool {
    fields.get(key).and_then(Value::as_bool).unwrap_or(false)
}

impl GemmaSpec {
    /// Resolves the layers of the Gemma config whose text fields are
    /// `fields` (from [`text_fields`]) and common part `config`;
    /// `multimodal`: the weights sit under `language_model.`.
    pub(crate) fn resolve(
        fields: &Value,
        config: &ModelConfig,
        multimodal: bool,
    ) -> Result<GemmaSpec, String> {
        let fields = fields.as_object().ok_or("the config must be an object")?;
        let version = if config.model_type == GEMMA3_TEXT {
            Version::Three
        } else {
            Version::Four
        };
        let n = config.num_hidden_layers;
        let window = get_usize(fields, "sliding_window")?.unwrap_or(0);
        if window == 0 {
            return Err("sliding_window must be at least 1".into());
        }
        let pattern = get_usize(fields, "sliding_window_pattern")?.unwrap_or(1);
        if pattern == 0 {
            return Err("sliding_window_pattern must be at least 1".into());
        }
        let head_dim = config.head_dim();
        let spec = match version {
            Version::Three => {
                let local = RopeSpec {
                    base: Some(get_f32(fields, "rope_local_base_freq")?.unwrap_or(10_000.0)),
                    scale: 1.0,
                    freqs: None,
                };
                let global = RopeSpec {
                    base: Some(config.rope_theta),
                    scale: linear_scale(fields.get("rope_scaling"))?,
                    freqs: None,
                };
                let layers = (0..n)
                    .map(|i| {
                        // mlx_lm's rule (it ignores `layer_types` here).
                        let sliding = (i + 1) % pattern != 0;
                        LayerSpec {
                            sliding,
                            head_dim,
                            kv_source: i,
                            intermediate: config.intermediate_size,
                            kv_heads: config.kv_heads(),
                            values_are_keys: false,
                            rope: if sliding {
                                local.clone()
                            } else {
                                global.clone()
                            },
                        }
                    })
                    .collect();
                let scalar = get_f32(fields, "query_pre_attn_scalar")?.unwrap_or(256.0);
                if !(scalar.is_finite() && scalar > 0.0) {
                    return Err("query_pre_attn_scalar must be positive".into());
                }
                GemmaSpec {
                    version,
                    multimodal: false,
                    layers,
                    window,
                    attention_scale: scalar.powf(-0.5),
                    softcap: None,
                    per_layer_dim: 0,
                    per_layer_vocab: 0,
                    moe: None,
                }
            }
            Version::Four => Self::resolve_four(fields, config, window, pattern)?,
        };
        Ok(GemmaSpec { multimodal, ..spec })
    }

    fn resolve_four(
        fields: &Map<String, Value>,
        config: &ModelConfig,
        window: usize,
        pattern: usize,
    ) -> Result<GemmaSpec, String> {
        let n = config.num_hidden_layers;
        let moe = moe_of(fields)?;
        let values_are_keys = flag(fields, "attention_k_eq_v");
        // mlx_lm: full layers of a k-eq-v model have their own head count.
        let global_kv_heads = match get_usize(fields, "num_global_key_value_heads")? {
            Some(heads) if values_are_keys => heads,
            _ => config.kv_heads(),
        };
        if global_kv_heads == 0 || !config.num_attention_heads.is_multiple_of(global_kv_heads) {
            return Err(format!(
                "num_global_key_value_heads {global_kv_heads} must divide num_attention_heads {}",
                config.num_attention_heads
            ));
        }
        let sliding: Vec<bool> = match fields.get("layer_types") {
            None | Some(Value::Null) => (0..n).map(|i| (i + 1) % pattern != 0).collect(),
            Some(Value::Array(types)) => {
                if types.len() < n {
                    return Err(format!(
                        "layer_types has {} entries for {n} layers",
                        types.len()
                    ));
                }
                types[..n]
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => Ok(true),
                        Some("full_attention") => Ok(false),
                        _ => Err(format!("unknown layer type {t}")),
                    })
                    .collect::<Result<_, _>>()?
            }
            Some(_) => return Err("`layer_types` must be a list".into()),
        };
        let shared = get_usize(fields, "num_kv_shared_layers")?.unwrap_or(0);
        if shared >= n && shared > 0 {
            return Err(format!(
                "num_kv_shared_layers {shared} leaves no layer of the {n} to compute keys and values"
            ));
        }
        let first_shared = n - shared;
        let global_head_dim = get_usize(fields, "global_head_dim")?
            .filter(|&d| d > 0)
            .unwrap_or(config.head_dim());
        let double_wide = flag(fields, "use_double_wide_mlp");
        let rope_parameters = match fields.get("rope_parameters") {
            None | Some(Value::Null) => json!({
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
                "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10_000.0, "rope_type": "default"},
            }),
            Some(v) => v.clone(),
        };
        let rope_of = |key: &str, dims: usize| -> Result<RopeSpec, String> {
            let empty = Map::new();
            let params = rope_parameters
                .get(key)
                .and_then(Value::as_object)
                .unwrap_or(&empty);
            rope_spec(params, dims)
        };
        let mut last_of_type: [Option<usize>; 2] = [None, None];
        let mut layers = Vec::with_capacity(n);
        for (i, &is_sliding) in sliding.iter().enumerate() {
            let head_dim = if is_sliding {
                config.head_dim()
            } else {
                global_head_dim
            };
            let kind = usize::from(is_sliding);
            let kv_source = if i < first_shared {
                last_of_type[kind] = Some(i);
                i
            } else {
                last_of_type[kind].ok_or_else(|| {
                    format!("KV-shared layer {i} has no earlier layer of its attention type to share with")
                })?
            };
            let wide = double_wide && i >= first_shared && first_shared > 0;
            layers.push(LayerSpec {
                sliding: is_sliding,
                head_dim,
                kv_source,
                intermediate: config.intermediate_size * if wide { 2 } else { 1 },
                kv_heads: if is_sliding {
                    config.kv_heads()
                } else {
                    global_kv_heads
                },
                values_are_keys: values_are_keys && !is_sliding,
                rope: rope_of(
                    if is_sliding {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    },
                    head_dim,
                )?,
            });
        }
        let per_layer_dim = get_usize(fields, "hidden_size_per_layer_input")?.unwrap_or(0);
        let per_layer_vocab =
            get_usize(fields, "vocab_size_per_layer_input")?.unwrap_or(config.vocab_size);
        let softcap = get_f32(fields, "final_logit_softcapping")?;
        if softcap.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
            return Err("final_logit_softcapping must be positive".into());
        }
        Ok(GemmaSpec {
            version: Version::Four,
            multimodal: false,
            layers,
            window,
            attention_scale: 1.0,
            softcap,
            per_layer_dim,
            per_layer_vocab,
            moe,
        })
    }
}

/// The MoE block's fields, when `enable_moe_block` is set.
fn moe_of(fields: &Map<String, Value>) -> Result<Option<GemmaMoe>, String> {
    if !flag(fields, "enable_moe_block") {
        return Ok(None);
    }
    let need = |key: &str| -> Result<usize, String> {
        get_usize(fields, key)?
            .filter(|&v| v > 0)
            .ok_or_else(|| format!("`enable_moe_block` needs `{key}` of at least 1"))
    };
    let moe = GemmaMoe {
        experts: need("num_experts")?,
        top_k: need("top_k_experts")?,
        intermediate: need("moe_intermediate_size")?,
    };
    if moe.top_k > moe.experts {
        return Err(format!(
            "top_k_experts {} must be at most num_experts {}",
            moe.top_k, moe.experts
        ));
    }
    Ok(Some(moe))
}

/// mlx_lm's `initialize_rope` for the types Gemma 4 configs use.
fn rope_spec(params: &Map<String, Value>, dims: usize) -> Result<RopeSpec, String> {
    let kind = params
        .get("type")
        .or_else(|| params.get("rope_type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let base = get_f32(params, "rope_theta")?.unwrap_or(10_000.0);
    let factor = get_f32(params, "factor")?.unwrap_or(1.0);
    match kind {
        "default" => Ok(RopeSpec {
            base: Some(base),
            scale: 1.0,
            freqs: None,
        }),
        "linear" => Ok(RopeSpec {
            base: Some(base),
            scale: 1.0 / factor,
            freqs: None,
        }),
        "proportional" => {
            let partial = get_f32(params, "partial_rotary_factor")?.unwrap_or(1.0);
            let rotated = (dims as f32 * partial) as usize;
            if rotated > dims {
                return Err("partial_rotary_factor must be at most 1".into());
            }
            // Periods `factor · base^(2i / dims)` for the rotated pairs,
            // computed in f32 as mlx_lm does; the rest never rotate.
            let mut freqs: Vec<f32> = (0..rotated)
                .step_by(2)
                .map(|i| factor * base.powf(i as f32 / dims as f32))
                .collect();
            freqs.resize(dims / 2, f32::INFINITY);
            Ok(RopeSpec {
                base: None,
                scale: 1.0,
                freqs: Some(freqs),
            })
        }
        other => Err(format!("rope type {other:?} is not supported for Gemma 4")),
    }
}

/// Gemma 3's `rope_scaling` for its global layers: none, or linear.
fn linear_scale(scaling: Option<&Value>) -> Result<f32, String> {
    let Some(Value::Object(params)) = scaling else {
        return match scaling {
            None | Some(Value::Null) => Ok(1.0),
            Some(_) => Err("`rope_scaling` must be an object".into()),
        };
    };
    match rope_spec(params, 0)? {
        RopeSpec {
            freqs: None, scale, ..
        } => Ok(scale),
        _ => Err("Gemma 3's rope_scaling must be linear or default".into()),
    }
}

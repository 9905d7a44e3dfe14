//! The decoder (llama, mistral, qwen2, qwen3) written with mlx-rs.

use std::path::Path;

use mlx_rs::fast;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{dequantize, quantized_matmul};
use mlx_rs::{Array, Dtype};
use mlx_support::array_from_bytes;
use st_mmap::SafetensorsSet;

use crate::attention::attention;
use crate::cache::{padded_causal_mask, KvCache};
use mlx_support::{Quantization, QuantizationConfig};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::fused::silu_mul;

/// How to hold quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantizedWeights {
    /// Keep them packed and use MLX's quantized matmul (the fast path on
    /// Apple GPUs).
    Keep,
    /// Keep them packed and dequantize each matrix to f32 just before its
    /// product (the CPU default): memory stays that of the packed weights,
    /// while the product runs on BLAS. MLX's CPU quantized matmul has no
    /// BLAS path and is far slower.
    DequantizeOnUse,
    /// Dequantize to f32 at load: the fastest on the CPU backend, at the
    /// memory of an f32 model.
    DequantizeF32,
}

impl QuantizedWeights {
    /// The choice for the device MLX will use.
    pub fn for_device(device: mlx_support::ComputeDevice) -> QuantizedWeights {
        match device {
            mlx_support::ComputeDevice::Gpu => QuantizedWeights::Keep,
            mlx_support::ComputeDevice::Cpu => QuantizedWeights::DequantizeOnUse,
        }
    }
}

struct Weights<'a> {
    set: &'a SafetensorsSet,
    quant: &'a QuantizationConfig,
    mode: QuantizedWeights,
}

impl Weights<'_> {
    fn array(&self, key: &str) -> Result<Array> {
        let view = self.set.tensor(key).ok_or_else(|| Error::MissingWeight {
            key: key.to_owned(),
        })?;
        let array = array_from_bytes(key, view.dtype, view.shape, view.data)?;
        // The array is a copy: the mapped pages read to make it would
        // otherwise stay resident until the whole model is loaded, doubling
        // the peak memory of loading.
        self.set.release(key);
        Ok(array)
    }

    fn optional(&self, key: &str) -> Result<Option<Array>> {
        if self.set.tensor(key).is_some() {
            self.array(key).map(Some)
        } else {
            Ok(None)
        }
    }

    /// `{prefix}.weight` (+ `.bias`), quantized when `.scales` exists.
    fn linear(&self, prefix: &str) -> Result<Linear> {
        let weight = self.array(&format!("{prefix}.weight"))?;
        let bias = self.optional(&format!("{prefix}.bias"))?;
        let Some(scales) = self.optional(&format!("{prefix}.scales"))? else {
            return Ok(Linear {
                weight: transposed(&weight)?,
                bias,
                packed: None,
            });
        };
        // The module's own entry (mixed-precision checkpoints), else the
        // default.
        let q = self.quant.of(prefix).ok_or_else(|| Error::MissingWeight {
            key: format!("{prefix}: quantized weights but config.json's `quantization` does not cover this module"),
        })?;
        let packed = Packed {
            scales,
            biases: self.array(&format!("{prefix}.biases"))?,
            q,
            dequantize_on_use: self.mode == QuantizedWeights::DequantizeOnUse,
        };
        Ok(match self.mode {
            QuantizedWeights::DequantizeF32 => Linear {
                weight: transposed(&packed.dense_f32(&weight)?)?,
                bias,
                packed: None,
            },
            QuantizedWeights::Keep | QuantizedWeights::DequantizeOnUse => Linear {
                weight,
                bias,
                packed: Some(packed),
            },
        })
    }

    /// An embedding table as a dense matrix, transposed: `(hidden, vocab)`
    /// (quantized tables are dequantized).
    fn embedding_t(&self, prefix: &str) -> Result<Array> {
        let table = self.linear(prefix)?;
        match &table.packed {
            Some(packed) => transposed(&packed.dense(&table.weight)?),
            None => Ok(table.weight),
        }
    }
}

/// `wᵀ`, evaluated as a contiguous matrix so the original can be dropped.
///
/// Dense weights are held as `(in, out)`: with the product `x · W` on rows
/// of few tokens (decoding), OpenBLAS repacks that layout somewhat faster
/// than the checkpoint's `(out, in)` read transposed (a micro-benchmark on
/// the project's machine; no difference at hundreds of rows). Done once at
/// load, a matrix at a time, so loading holds one extra matrix at most.
fn transposed(w: &Array) -> Result<Array> {
    let t = w.t().contiguous()?;
    t.eval()?;
    Ok(t)
}

/// What unpacks a quantized weight matrix.
struct Packed {
    scales: Array,
    biases: Array,
    q: Quantization,
    /// Dequantize before each product instead of MLX's quantized matmul.
    dequantize_on_use: bool,
}

impl Packed {
    /// The dense matrix, in the scales' dtype.
    fn dense(&self, weight: &Array) -> Result<Array> {
        let (gs, bits) = (self.q.group_size, self.q.bits);
        Ok(dequantize(weight, &self.scales, &self.biases, gs, bits)?)
    }

    /// The dense matrix in f32, which MLX's CPU backend multiplies with BLAS.
    fn dense_f32(&self, weight: &Array) -> Result<Array> {
        Ok(self.dense(weight)?.as_dtype(Dtype::Float32)?)
    }
}

/// A linear layer, `x @ Wᵀ + b`, dense or quantized.
struct Linear {
    /// Dense: `Wᵀ`, `(in, out)`. Packed: as stored, `(out, in / pack)`.
    weight: Array,
    bias: Option<Array>,
    packed: Option<Packed>,
}

impl Linear {
    fn forward(&self, x: &Array) -> Result<Array> {
        let y = match &self.packed {
            Some(p) if p.dequantize_on_use => x.matmul(p.dense_f32(&self.weight)?.t())?,
            Some(p) => {
                let (gs, bits) = (p.q.group_size, p.q.bits);
                quantized_matmul(x, &self.weight, &p.scales, &p.biases, true, gs, bits)?
            }
            None => x.matmul(&self.weight)?,
        };
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
}

struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Array>,
    k_norm: Option<Array>,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: Array,
    post_norm: Array,
}

/// A loaded decoder model.
pub struct Model {
    config: ModelConfig,
    /// The embedding table transposed, `(hidden, vocab)`: the tied output
    /// projection's dense layout (see [`transposed`]).
    embed_t: Array,
    layers: Vec<Layer>,
    norm: Array,
    lm_head: Option<Linear>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Loads `dir` (mlx_lm format: `config.json` + safetensors).
    pub fn load(dir: &Path, quantized: QuantizedWeights) -> Result<Model> {
        let config = ModelConfig::load(dir)?;
        let set = SafetensorsSet::open_dir(dir)?;
        let w = Weights {
            set: &set,
            quant: &config.quantization,
            mode: quantized,
        };
        let embed_t = w.embedding_t("model.embed_tokens")?;
        let expected = [config.vocab_size as i32, config.hidden_size as i32];
        if embed_t.shape() != [expected[1], expected[0]] {
            return Err(Error::WeightShape {
                key: "model.embed_tokens.weight".into(),
                expected: expected.to_vec(),
                actual: embed_t.shape().iter().rev().copied().collect(),
            });
        }
        // The config's layer count is checked against the layers the files
        // hold before anything is sized by it.
        let layer_prefix = st_mmap::BlockPrefix::new("model.layers.");
        let present = st_mmap::BlockIndex::build(&layer_prefix, set.keys())?.len();
        if config.num_hidden_layers > present {
            return Err(Error::Config {
                path: dir.join("config.json"),
                message: format!(
                    "num_hidden_layers is {} but the weights hold {present} layers (model.layers.N)",
                    config.num_hidden_layers
                ),
            });
        }
        let mut layers = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                q: w.linear(&format!("{p}.self_attn.q_proj"))?,
                k: w.linear(&format!("{p}.self_attn.k_proj"))?,
                v: w.linear(&format!("{p}.self_attn.v_proj"))?,
                o: w.linear(&format!("{p}.self_attn.o_proj"))?,
                q_norm: if config.qk_norm() {
                    Some(w.array(&format!("{p}.self_attn.q_norm.weight"))?)
                } else {
                    None
                },
                k_norm: if config.qk_norm() {
                    Some(w.array(&format!("{p}.self_attn.k_norm.weight"))?)
                } else {
                    None
                },
                gate: w.linear(&format!("{p}.mlp.gate_proj"))?,
                up: w.linear(&format!("{p}.mlp.up_proj"))?,
                down: w.linear(&format!("{p}.mlp.down_proj"))?,
                input_norm: w.array(&format!("{p}.input_layernorm.weight"))?,
                post_norm: w.array(&format!("{p}.post_attention_layernorm.weight"))?,
            });
        }
        let norm = w.array("model.norm.weight")?;
        let lm_head = if config.tie_word_embeddings && set.tensor("lm_head.weight").is_none() {
            None
        } else {
            Some(w.linear("lm_head")?)
        };
        Ok(Model {
            config,
            embed_t,
            layers,
            norm,
            lm_head,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Logits `(B, L, vocab)` for `tokens` `(B, L)` (int32), continuing from
    /// `cache`, which is extended with these positions. `mask` `(B, 1, L,
    /// cache.own_len() + L)` (true = may attend) overrides the default
    /// causal mask over the positions the rows own, e.g. to hide left
    /// padding; a shared prefix (see [`KvCache::fork`]) is always visible.
    pub fn forward(
        &self,
        tokens: &Array,
        cache: &mut KvCache,
        mask: Option<&Array>,
    ) -> Result<Array> {
        let x = self.hidden(tokens, cache, mask)?;
        self.head(&x)
    }

    /// As [`forward`](Self::forward), but the logits `(B, vocab)` of the
    /// last position only: what prefill needs. The output projection of
    /// every position would cost a `(B·L, vocab)` matrix (vocabularies are
    /// large: 49 152 for SmolLM2) that is thrown away.
    pub fn forward_last(
        &self,
        tokens: &Array,
        cache: &mut KvCache,
        mask: Option<&Array>,
    ) -> Result<Array> {
        let x = self.hidden(tokens, cache, mask)?;
        self.head(&x.index((.., -1, ..)))
    }

    /// The final norm and the output projection (or the tied embedding).
    fn head(&self, x: &Array) -> Result<Array> {
        let x = fast::rms_norm(x, Some(&self.norm), self.config.rms_norm_eps)?;
        Ok(match &self.lm_head {
            Some(head) => head.forward(&x)?,
            None => x.matmul(&self.embed_t)?,
        })
    }

    /// The last decoder layer's output `(B, L, hidden)`, before the final
    /// norm; extends `cache`.
    fn hidden(&self, tokens: &Array, cache: &mut KvCache, mask: Option<&Array>) -> Result<Array> {
        let c = &self.config;
        let (b, l) = (tokens.dim(0), tokens.dim(1));
        let (heads, kv_heads, hd) = (
            c.num_attention_heads as i32,
            c.kv_heads() as i32,
            c.head_dim() as i32,
        );
        let own_cached = cache.own_len();
        // Without a mask, new positions see the owned ones causally; a
        // single new position sees them all.
        let causal;
        let mask = match mask {
            Some(m) => Some(m),
            None if l > 1 => {
                causal = padded_causal_mask(&[0], own_cached as usize, l as usize);
                Some(&causal)
            }
            None => None,
        };
        // Rotary positions: the cached length, less each row's padding.
        let position = cache.len();
        let offsets = cache.pads().iter().any(|&p| p != 0).then(|| {
            let offsets: Vec<i32> = cache.pads().iter().map(|p| position - p).collect();
            Array::from_slice(&offsets, &[offsets.len() as i32])
        });
        let mut x = self
            .embed_t
            .take_axis(tokens, 1)?
            .transpose_axes(&[1, 2, 0])?;
        let scale = (hd as f32).powf(-0.5);
        for (i, layer) in self.layers.iter().enumerate() {
            let h = fast::rms_norm(&x, Some(&layer.input_norm), c.rms_norm_eps)?;
            let split = |a: Array, n: i32| -> Result<Array> {
                Ok(a.reshape(&[b, l, n, hd])?.transpose_axes(&[0, 2, 1, 3])?)
            };
            let mut q = split(layer.q.forward(&h)?, heads)?;
            let mut k = split(layer.k.forward(&h)?, kv_heads)?;
            let v = split(layer.v.forward(&h)?, kv_heads)?;
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                q = fast::rms_norm(&q, Some(qn), c.rms_norm_eps)?;
                k = fast::rms_norm(&k, Some(kn), c.rms_norm_eps)?;
            }
            let rope = |x: &Array| -> Result<Array> {
                Ok(match &offsets {
                    Some(offsets) => fast::rope_dynamic(
                        x,
                        hd,
                        c.rope_traditional,
                        c.rope_theta,
                        1.0,
                        offsets,
                        None,
                    )?,
                    None => {
                        fast::rope(x, hd, c.rope_traditional, c.rope_theta, 1.0, position, None)?
                    }
                })
            };
            let (q, k) = (rope(&q)?, rope(&k)?);
            let (k, v) = cache.append(i, k, v)?;
            let attended = attention(&q, cache.shared(i), (&k, &v), mask, scale)?;
            let attended = attended
                .transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[b, l, heads * hd])?;
            let x1 = x.add(layer.o.forward(&attended)?)?;
            let h = fast::rms_norm(&x1, Some(&layer.post_norm), c.rms_norm_eps)?;
            let gated = silu_mul(&layer.gate.forward(&h)?, &layer.up.forward(&h)?)?;
            x = x1.add(layer.down.forward(&gated)?)?;
        }
        cache.advance(l);
        Ok(x)
    }
}

//! The Gemma 3 and Gemma 4 text decoders, with the arithmetic of mlx_lm
//! 0.32.2's `gemma3_text.py` and `gemma4_text.py`.
//!
//! What both share: four norms per layer, q/k norms, a GeGLU MLP with
//! tanh-approximated GELU, a scaled embedding, sliding-window layers
//! between full-attention ones, a tied output head. Gemma 3 adds one to
//! every norm weight and scales attention by `query_pre_attn_scalar^-½`.
//! Gemma 4 adds per-layer input embeddings, layers that reuse an earlier
//! layer's keys and values, a weightless value norm, attention scale 1,
//! larger heads and "proportional" RoPE on full layers, a learned scalar on
//! each layer's output and a tanh softcap on the logits.

pub(crate) mod config;

use mlx_rs::fast;
use mlx_rs::ops::{clip, power, tanh};
use mlx_rs::{Array, Dtype};

use crate::error::{Error, Result};
use crate::models::config::ModelConfig;
use crate::models::gemma::config::{GemmaSpec, Version};
use crate::nn::attention::attention;
use crate::nn::cache::{at_position, KvCache, LayerMask};
use crate::nn::fused::gelu_tanh_mul;
use crate::nn::mlp::gated_mlp;
use crate::nn::rope::Positions;
use crate::nn::row_groups::{in_row_groups, rows_within};
use crate::weights::layers::{Forward, Layers};
use crate::weights::{Embedding, GatheredRows, Linear, Weights};

/// The f32 bytes of one group of rows' queries, from which a layer's
/// attention runs to its output projection a group of rows at a time.
/// A prefill's queries, their normed and rotated copies, the attended
/// values and their transposed copy are each rows × positions × heads ×
/// head size: for a global layer of E2B's shapes (8 heads of 512) and 32
/// rows of ~100 tokens, ~50 MB apiece, several alive at once, most of
/// the streamed layers' working set. Grouped, the projections' packed
/// weights are unpacked once per group; a decode step's few positions are
/// one group.
const QUERY_BYTES: usize = 8 << 20;

/// Where a checkpoint keeps the text decoder's weights.
pub(crate) struct KeyPrefixes {
    /// `model.`, `language_model.model.` or `model.language_model.`.
    pub text: String,
    /// The untied output head, `lm_head` or `language_model.lm_head`.
    pub head: String,
}

impl KeyPrefixes {
    /// The prefixes the files use: a multimodal checkpoint's text weights
    /// sit under `language_model.model.` (mlx_lm) or
    /// `model.language_model.` (Hugging Face).
    pub(crate) fn find(spec: &GemmaSpec, w: &Weights<'_>) -> Result<KeyPrefixes> {
        if !spec.multimodal {
            return Ok(KeyPrefixes {
                text: "model.".into(),
                head: "lm_head".into(),
            });
        }
        let has_embedding = |p: &str| {
            w.has(&format!("{p}embed_tokens.weight")) || w.has(&format!("{p}embed_tokens.scales"))
        };
        let text = ["language_model.model.", "model.language_model."]
            .into_iter()
            .find(|p| has_embedding(p))
            .ok_or_else(|| Error::MissingWeight {
                dir: w.dir.to_path_buf(),
                key: "language_model.model.embed_tokens.weight (the text decoder's weights)".into(),
            })?;
        Ok(KeyPrefixes {
            text: text.into(),
            head: "language_model.lm_head".into(),
        })
    }
}

struct Attention {
    q: Linear,
    /// Keys and values: only in layers that compute their own.
    kv: Option<(Linear, Linear, Array)>,
    o: Linear,
    q_norm: Array,
}

/// Gemma 4's per-layer input: gate, projection back to the hidden size,
/// and its norm.
struct PerLayerInput {
    gate: Linear,
    projection: Linear,
    norm: Array,
}

struct Layer {
    attention: Attention,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: Array,
    post_attention_norm: Array,
    pre_feedforward_norm: Array,
    post_feedforward_norm: Array,
    per_layer_input: Option<PerLayerInput>,
    scalar: Option<Array>,
    /// Gemma 4's proportional RoPE periods.
    freqs: Option<Array>,
}

/// What building one layer needs besides its weights.
struct LayerContext<'a> {
    config: &'a ModelConfig,
    spec: &'a GemmaSpec,
    /// The text decoder's key prefix (see [`KeyPrefixes`]).
    text: &'a str,
    with_per_layer_input: bool,
}

impl Layer {
    fn load(cx: &LayerContext<'_>, w: &Weights<'_>, i: usize) -> Result<Layer> {
        let (config, spec) = (cx.config, cx.spec);
        let hidden = config.hidden_size;
        let (heads, kv_heads) = (config.num_attention_heads, config.kv_heads());
        let four = spec.version == Version::Four;
        let norm = |key: &str, len: usize| norm(w, spec.version, key, len);
        let layer = &spec.layers[i];
        let lp = format!("{}layers.{i}", cx.text);
        let hd = layer.head_dim;
        let kv = if layer.owns_kv(i) {
            Some((
                w.linear(&format!("{lp}.self_attn.k_proj"), hidden, kv_heads * hd)?,
                w.linear(&format!("{lp}.self_attn.v_proj"), hidden, kv_heads * hd)?,
                norm(&format!("{lp}.self_attn.k_norm.weight"), hd)?,
            ))
        } else {
            // A KV-shared layer: checkpoints from mlx_lm 0.31.3 still
            // carry unused k/v weights here, which are never read.
            None
        };
        let inter = layer.intermediate;
        let ple = spec.per_layer_dim;
        let per_layer_input = if cx.with_per_layer_input {
            Some(PerLayerInput {
                gate: w.linear(&format!("{lp}.per_layer_input_gate"), hidden, ple)?,
                projection: w.linear(&format!("{lp}.per_layer_projection"), ple, hidden)?,
                norm: norm(&format!("{lp}.post_per_layer_input_norm.weight"), hidden)?,
            })
        } else {
            None
        };
        Ok(Layer {
            attention: Attention {
                q: w.linear(&format!("{lp}.self_attn.q_proj"), hidden, heads * hd)?,
                kv,
                o: w.linear(&format!("{lp}.self_attn.o_proj"), heads * hd, hidden)?,
                q_norm: norm(&format!("{lp}.self_attn.q_norm.weight"), hd)?,
            },
            gate: w.linear(&format!("{lp}.mlp.gate_proj"), hidden, inter)?,
            up: w.linear(&format!("{lp}.mlp.up_proj"), hidden, inter)?,
            down: w.linear(&format!("{lp}.mlp.down_proj"), inter, hidden)?,
            input_norm: norm(&format!("{lp}.input_layernorm.weight"), hidden)?,
            post_attention_norm: norm(&format!("{lp}.post_attention_layernorm.weight"), hidden)?,
            pre_feedforward_norm: norm(&format!("{lp}.pre_feedforward_layernorm.weight"), hidden)?,
            post_feedforward_norm: norm(
                &format!("{lp}.post_feedforward_layernorm.weight"),
                hidden,
            )?,
            per_layer_input,
            scalar: if four {
                Some(w.array(&format!("{lp}.layer_scalar"), &[1])?)
            } else {
                None
            },
            freqs: layer
                .rope
                .freqs
                .as_ref()
                .map(|f| Array::from_slice(f, &[f.len() as i32])),
        })
    }
}

/// A norm's weight; Gemma 3 scales by (1 + w), and adding the one at load
/// gives the same values mlx_lm computes at each call. The sum is
/// evaluated now, on the thread that loads: lanes read the model's arrays
/// from other threads and cannot compute one (see `lanes`).
fn norm(w: &Weights<'_>, version: Version, key: &str, len: usize) -> Result<Array> {
    let weight = w.vector(key, len)?;
    Ok(match version {
        Version::Four => weight,
        Version::Three => {
            let plus_one = weight.add(Array::from_f32(1.0).as_dtype(weight.dtype())?)?;
            plus_one.eval()?;
            plus_one
        }
    })
}

/// Gemma 4's per-layer embeddings: a table gathered per token and a
/// projection of the embedding, both `(B, L, layers · width)`.
struct PerLayerInputs {
    table: Embedding,
    projection: Linear,
    norm: Array,
}

/// A loaded Gemma 3 or Gemma 4 text decoder.
pub(crate) struct Gemma {
    spec: GemmaSpec,
    embed: Embedding,
    per_layer: Option<PerLayerInputs>,
    layers: Layers<Layer>,
    norm: Array,
    lm_head: Option<Linear>,
}

impl Gemma {
    pub(crate) fn load(config: &ModelConfig, spec: &GemmaSpec, w: &Weights<'_>) -> Result<Gemma> {
        let prefixes = KeyPrefixes::find(spec, w)?;
        let p = &prefixes.text;
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        let n = config.num_hidden_layers;
        let four = spec.version == Version::Four;
        let norm = |key: &str, len: usize| norm(w, spec.version, key, len);
        let untied = w.has(&format!("{}.weight", prefixes.head));
        let tied = match spec.version {
            // mlx_lm ties Gemma 3's head whenever the files have none.
            Version::Three => !untied,
            Version::Four => config.tie_word_embeddings,
        };
        let embed = w.embedding(&format!("{p}embed_tokens"), vocab, hidden, tied)?;
        let ple = spec.per_layer_dim;
        let per_layer = if four && ple > 0 {
            Some(PerLayerInputs {
                table: w.embedding(
                    &format!("{p}embed_tokens_per_layer"),
                    spec.per_layer_vocab,
                    n * ple,
                    false,
                )?,
                projection: w.linear(&format!("{p}per_layer_model_projection"), hidden, n * ple)?,
                norm: norm(&format!("{p}per_layer_projection_norm.weight"), ple)?,
            })
        } else {
            None
        };
        let (layer_config, layer_spec, text) = (config.clone(), spec.clone(), p.clone());
        let with_per_layer_input = per_layer.is_some();
        let layers = Layers::load(w, &format!("{p}layers."), n, move |w, i| {
            let context = LayerContext {
                config: &layer_config,
                spec: &layer_spec,
                text: &text,
                with_per_layer_input,
            };
            Layer::load(&context, w, i)
        })?;
        let final_norm = norm(&format!("{p}norm.weight"), hidden)?;
        let lm_head = if tied {
            None
        } else {
            Some(w.linear(&prefixes.head, hidden, vocab)?)
        };
        Ok(Gemma {
            spec: spec.clone(),
            embed,
            per_layer,
            layers,
            norm: final_norm,
            lm_head,
        })
    }

    /// The final norm, the output head and Gemma 4's softcap.
    /// Whether the layers are read from the files at each forward.
    pub(crate) fn streams_layers(&self) -> bool {
        self.layers.streamed()
    }

    pub(crate) fn head(&self, config: &ModelConfig, x: &Array) -> Result<Array> {
        let spec = &self.spec;
        let x = fast::rms_norm(x, Some(&self.norm), config.rms_norm_eps)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&x)?,
            None => self.embed.as_linear(&x)?,
        };
        Ok(match spec.softcap {
            Some(cap) => {
                let cap = scalar(cap as f64, logits.dtype())?;
                tanh(&logits.divide(&cap)?)?.multiply(&cap)?
            }
            None => logits,
        })
    }

    /// The last layer's outputs `(B, L, hidden)` before the final norm, of
    /// each of the independent forwards of `tokens` over `caches` (one
    /// cache each, extended); layer by layer (see [`Layers::forward_each`]).
    ///
    /// With `last_only`, only the last position's output is wanted (`(B, 1,
    /// hidden)` comes back): once the last layer that writes keys and
    /// values has written them, the other positions' hidden states can no
    /// longer reach anything, so the rest of that layer and every later one
    /// run on the last position alone. For Gemma 4 E2B that is the second
    /// half of layer 14 and the 20 KV-shared layers after it (the
    /// double-wide ones); for Gemma 3, the second half of the last layer.
    /// The cache gets every position's keys and values all the same.
    pub(crate) fn hidden_each(
        &self,
        c: &ModelConfig,
        tokens: &[Array],
        caches: &mut [KvCache],
        last_only: bool,
    ) -> Result<Vec<Array>> {
        let layers = &self.spec.layers;
        let narrow_after = (0..layers.len())
            .rfind(|&i| layers[i].owns_kv(i))
            .filter(|_| last_only);
        self.layers.forward_each(
            tokens,
            caches,
            |tokens, cache| self.begin(c, tokens, cache, narrow_after),
            |i, layer, pass| layer.forward(c, &self.spec, self.per_layer.as_ref(), i, pass),
        )
    }

    /// A forward of `tokens` over `cache`, before its first layer.
    fn begin<'c>(
        &self,
        c: &ModelConfig,
        tokens: &Array,
        cache: &'c mut KvCache,
        narrow_after: Option<usize>,
    ) -> Result<Pass<'c>> {
        let spec = &self.spec;
        let (b, l) = (tokens.dim(0), tokens.dim(1));
        let embedded = self.embed.lookup(tokens)?;
        let dtype = embedded.dtype();
        let hidden_scale = match spec.version {
            // mlx_lm rounds Gemma 3's scale to bfloat16 first.
            Version::Three => Array::from_f32((c.hidden_size as f64).sqrt() as f32)
                .as_dtype(Dtype::Bfloat16)?
                .as_dtype(dtype)?,
            Version::Four => scalar((c.hidden_size as f64).sqrt(), dtype)?,
        };
        let h = embedded.multiply(&hidden_scale)?;
        let per_layer = match &self.per_layer {
            Some(ple) => Some(PerLayerSource {
                rows: ple.table.gather(tokens)?,
                embedded: h.clone(),
            }),
            None => None,
        };
        // One mask per attention type, from the first layer of that type
        // with a cache of its own (all such layers keep the same slots).
        let window = spec.window as i32;
        let mask_of = |sliding: bool| -> LayerMask {
            let owner = spec
                .layers
                .iter()
                .enumerate()
                .find(|(i, s)| s.sliding == sliding && s.owns_kv(*i))
                .map_or(0, |(i, _)| i);
            cache.mask(owner, l, sliding.then_some(window))
        };
        let has = |sliding: bool| spec.layers.iter().any(|s| s.sliding == sliding);
        let sliding_mask = has(true).then(|| mask_of(true));
        let full_mask = has(false).then(|| mask_of(false));
        Ok(Pass {
            h,
            per_layer,
            sliding_mask,
            full_mask,
            positions: Positions::of(cache),
            kvs: vec![None; spec.layers.len()],
            b,
            l,
            new: l,
            narrow_after,
            cache,
        })
    }
}

/// What Gemma 4's per-layer inputs are computed from, for one forward:
/// the per-layer table's rows for its tokens, as the table holds them, and
/// the scaled token embedding.
struct PerLayerSource {
    rows: GatheredRows,
    embedded: Array,
}

impl PerLayerInputs {
    /// Layer `i`'s per-layer input `(B, L, width)`: its columns of the
    /// table's rows scaled by `√width`, plus the normalised projection of
    /// the scaled embedding onto its outputs, the sum scaled by `2^-½`.
    ///
    /// A layer at a time: all layers' inputs at once are 35 × 256 wide for
    /// E2B, ~32 MB for a prefill of 8 rows of 113 tokens, and computing them
    /// held several such arrays at once (the prefill's highest point).
    /// Each element's arithmetic is the same either way.
    fn of_layer(
        &self,
        c: &ModelConfig,
        spec: &GemmaSpec,
        i: usize,
        source: &PerLayerSource,
    ) -> Result<Array> {
        let width = spec.per_layer_dim;
        let columns = i * width..(i + 1) * width;
        let rows = source.rows.columns(columns.clone())?;
        let rows = rows.multiply(scalar((width as f64).sqrt(), rows.dtype())?)?;
        let projected = self.projection.forward_outputs(&source.embedded, columns)?;
        let projected = projected.multiply(scalar(
            (c.hidden_size as f64).powf(-0.5),
            projected.dtype(),
        )?)?;
        let projected = fast::rms_norm(&projected, Some(&self.norm), c.rms_norm_eps)?;
        let sum = projected.add(&rows)?;
        Ok(sum.multiply(scalar(0.5f64.sqrt(), sum.dtype())?)?)
    }
}

/// One forward in progress: the hidden state after the layers so far, and
/// what every layer of it reads.
struct Pass<'c> {
    h: Array,
    per_layer: Option<PerLayerSource>,
    sliding_mask: Option<LayerMask>,
    full_mask: Option<LayerMask>,
    positions: Positions,
    /// Each layer's keys and values, for the layers that share them.
    kvs: Vec<Option<(Array, Array)>>,
    b: i32,
    /// Positions the layers run on: `new`, or 1 after [`keep_last`](Self::keep_last).
    l: i32,
    /// Positions appended to the cache.
    new: i32,
    /// The layer after whose keys and values only the last position is
    /// kept (see `Gemma::hidden_each`).
    narrow_after: Option<usize>,
    cache: &'c mut KvCache,
}

impl Pass<'_> {
    /// Drops every position but the last from what the rest of the forward
    /// reads: the hidden state, the per-layer inputs, the queries' masks
    /// and rotary positions. Only once no later step writes keys or values.
    fn keep_last(&mut self) -> Result<()> {
        let last = self.l - 1;
        self.h = at_position(&self.h, 1, last)?;
        if let Some(source) = &mut self.per_layer {
            source.rows = source.rows.at_position(last)?;
            source.embedded = at_position(&source.embedded, 1, last)?;
        }
        for mask in [&mut self.sliding_mask, &mut self.full_mask]
            .into_iter()
            .flatten()
        {
            *mask = mask.of_last(self.l)?;
        }
        self.positions = self.positions.advanced(last)?;
        self.l = 1;
        Ok(())
    }
}

impl Forward for Pass<'_> {
    fn finish(self) -> Result<Array> {
        self.cache.advance(self.new)?;
        Ok(self.h)
    }
}

impl Layer {
    /// Layer `i` over `p`; returns what it computed from the weights (the
    /// new hidden state, and the keys and values of a layer that owns
    /// them).
    fn forward(
        &self,
        c: &ModelConfig,
        spec: &GemmaSpec,
        ple: Option<&PerLayerInputs>,
        i: usize,
        p: &mut Pass<'_>,
    ) -> Result<Vec<Array>> {
        let s = &spec.layers[i];
        let (b, l) = (p.b, p.l);
        let heads = c.num_attention_heads as i32;
        let kv_heads = c.kv_heads() as i32;
        let hd = s.head_dim as i32;
        let window = spec.window as i32;
        let x = fast::rms_norm(&p.h, Some(&self.input_norm), c.rms_norm_eps)?;
        let rope = |x: &Array, positions: &Positions| -> Result<Array> {
            positions.rope(
                x,
                hd,
                c.rope_traditional,
                s.rope.base,
                s.rope.scale,
                self.freqs.as_ref(),
            )
        };
        let a = &self.attention;
        let mut outputs = Vec::with_capacity(3);
        let (keys, values) = match &a.kv {
            Some((k_proj, v_proj, k_norm)) => {
                // Normed before the heads move ahead of the positions (the
                // norm is over each head's features either way).
                let k = fast::rms_norm(
                    &k_proj.forward(&x)?.reshape(&[b, l, kv_heads, hd])?,
                    Some(k_norm),
                    c.rms_norm_eps,
                )?;
                let k = rope(&k.transpose_axes(&[0, 2, 1, 3])?, &p.positions)?;
                let mut v = v_proj.forward(&x)?.reshape(&[b, l, kv_heads, hd])?;
                if spec.version == Version::Four {
                    v = fast::rms_norm(&v, None, c.rms_norm_eps)?;
                }
                let v = v.transpose_axes(&[0, 2, 1, 3])?;
                let window = s.sliding.then_some(window);
                let kv = p.cache.append(i, k, v, window)?;
                // Kept for the forward only where a later layer reads it.
                if spec.is_kv_source(i) {
                    p.kvs[i] = Some(kv.clone());
                }
                outputs.extend([kv.0.clone(), kv.1.clone()]);
                kv
            }
            None => p.kvs[s.kv_source].clone().ok_or_else(|| {
                Error::Cache(format!(
                    "layer {i} reads the keys of layer {} before they exist",
                    s.kv_source
                ))
            })?,
        };
        // The last keys and values are written: from here on only the last
        // position's queries matter (see `Gemma::hidden_each`).
        let x = if p.narrow_after == Some(i) {
            let x = at_position(&x, 1, p.l - 1)?;
            p.keep_last()?;
            x
        } else {
            x
        };
        let l = p.l;
        let mask = if s.sliding {
            &p.sliding_mask
        } else {
            &p.full_mask
        };
        let mask = mask.as_ref().expect("made for every type present");
        let shared = p.cache.shared(s.kv_source);
        // The queries' side, from their projection to the output's, a
        // group of rows at a time (see `QUERY_BYTES`).
        let per_row = 4 * (l * heads * hd) as usize;
        let step = rows_within(QUERY_BYTES, per_row, b as usize);
        let out = in_row_groups(b as usize, step, |g| {
            let rows = g.len();
            let q = fast::rms_norm(
                &a.q.forward(&g.of(&x))?.reshape(&[rows, l, heads, hd])?,
                Some(&a.q_norm),
                c.rms_norm_eps,
            )?;
            let q = rope(&q.transpose_axes(&[0, 2, 1, 3])?, &p.positions.of_rows(g))?;
            let attended = attention(
                &q,
                shared,
                (&g.of(&keys), &g.of(&values)),
                &mask.of_rows(g),
                spec.attention_scale,
            )?;
            let attended =
                attended
                    .transpose_axes(&[0, 2, 1, 3])?
                    .reshape(&[rows, l, heads * hd])?;
            Ok(fast::rms_norm(
                &a.o.forward(&attended)?,
                Some(&self.post_attention_norm),
                c.rms_norm_eps,
            )?)
        })?;
        let mut h = residual_add(spec.version, &p.h, &out)?;
        let x = fast::rms_norm(&h, Some(&self.pre_feedforward_norm), c.rms_norm_eps)?;
        let out = fast::rms_norm(
            &gated_mlp(&x, &self.gate, &self.up, &self.down, gelu_mul)?,
            Some(&self.post_feedforward_norm),
            c.rms_norm_eps,
        )?;
        h = residual_add(spec.version, &h, &out)?;
        if let (Some(pli), Some(ple), Some(source)) = (&self.per_layer_input, ple, &p.per_layer) {
            let gate = gelu_mul(&pli.gate.forward(&h)?, &ple.of_layer(c, spec, i, source)?)?;
            let out = fast::rms_norm(
                &pli.projection.forward(&gate)?,
                Some(&pli.norm),
                c.rms_norm_eps,
            )?;
            h = h.add(&out)?;
        }
        if let Some(scalar) = &self.scalar {
            h = h.multiply(scalar)?;
        }
        p.h = h;
        outputs.push(p.h.clone());
        Ok(outputs)
    }
}

/// A Python float as mlx_lm's arithmetic sees it: rounded to the array's
/// dtype.
fn scalar(v: f64, dtype: Dtype) -> Result<Array> {
    Ok(Array::from_f32(v as f32).as_dtype(dtype)?)
}

/// `gelu_tanh(gate) · up`: compiled for f32 (see
/// [`crate::nn::fused::gelu_tanh_mul`]), MLX's own operations otherwise.
fn gelu_mul(gate: &Array, up: &Array) -> Result<Array> {
    if gate.dtype() == Dtype::Float32 && up.dtype() == Dtype::Float32 {
        return Ok(gelu_tanh_mul(gate, up)?);
    }
    Ok(gelu_tanh(gate)?.multiply(up)?)
}

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, MLX's `gelu_approx`,
/// operation for operation: in bfloat16 each step rounds, so the cube is
/// MLX's `power` (one rounding), not two products.
fn gelu_tanh(x: &Array) -> Result<Array> {
    let dtype = x.dtype();
    let c = |v: f64| scalar(v, dtype);
    let cubed = power(x, c(3.0)?)?;
    let inner = x
        .add(c(0.044715)?.multiply(cubed)?)?
        .multiply(c((2.0 / std::f64::consts::PI).sqrt())?)?;
    Ok(c(0.5)?.multiply(x)?.multiply(c(1.0)?.add(tanh(&inner)?)?)?)
}

/// `x + y`; Gemma 3 in float16 sums in f32 and clips to float16's range,
/// as mlx_lm does (its activations overflow float16).
fn residual_add(version: Version, x: &Array, y: &Array) -> Result<Array> {
    if version == Version::Four || x.dtype() != Dtype::Float16 {
        return Ok(x.add(y)?);
    }
    let bound = 65504.0f32;
    let sum = x
        .as_dtype(Dtype::Float32)?
        .add(y.as_dtype(Dtype::Float32)?)?;
    Ok(clip(&sum, (-bound, bound))?.as_dtype(Dtype::Float16)?)
}

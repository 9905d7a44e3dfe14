//! One Gemma decoder layer: its weights, and its forward over a pass.

use mlx_rs::fast;
use mlx_rs::Array;

use crate::error::{Error, Result};
use crate::models::config::ModelConfig;
use crate::models::gemma::config::{GemmaSpec, Version};
use crate::models::gemma::moe::MoeBlock;
use crate::models::gemma::ops::{gelu_mul, norm, residual_add};
use crate::models::gemma::per_layer::{PerLayerInputs, PerLayerSource};
use crate::models::layers::Forward;
use crate::nn::attention::attention;
use crate::nn::cache::{KvCache, LayerMask};
use crate::nn::mlp::gated_mlp;
use crate::nn::rope::Positions;
use crate::nn::row_groups::in_row_groups;
use crate::ops::{at_position, rows_within};
use crate::weights::{KeyPath, Linear, Weights};

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

struct Attention {
    q: Linear,
    /// Keys, values (none where the values are the keys' projection) and
    /// the keys' norm: only in layers that compute their own.
    kv: Option<(Linear, Option<Linear>, Array)>,
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

pub(super) struct Layer {
    attention: Attention,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: Array,
    post_attention_norm: Array,
    pre_feedforward_norm: Array,
    post_feedforward_norm: Array,
    per_layer_input: Option<PerLayerInput>,
    /// Gemma 4's routed experts beside the MLP (26B-A4B).
    moe: Option<MoeBlock>,
    scalar: Option<Array>,
    /// Gemma 4's proportional RoPE periods.
    freqs: Option<Array>,
}

/// What building one layer needs besides its weights.
pub(super) struct LayerContext<'a> {
    pub(super) config: &'a ModelConfig,
    pub(super) spec: &'a GemmaSpec,
    /// Where the text decoder's layers are (see `KeyPrefixes`).
    pub(super) layers: &'a KeyPath,
    pub(super) with_per_layer_input: bool,
}

impl Layer {
    /// Whether its forward copies routed experts out of the files.
    pub(super) fn copies_experts(&self) -> bool {
        self.moe.as_ref().is_some_and(MoeBlock::copies_experts)
    }

    pub(super) fn load(cx: &LayerContext<'_>, w: &Weights<'_>, i: usize) -> Result<Layer> {
        let (config, spec) = (cx.config, cx.spec);
        let hidden = config.hidden_size;
        let four = spec.version == Version::Four;
        let norm = |key: &KeyPath, len: usize| norm(w, spec.version, key, len);
        let layer = &spec.layers[i];
        let (heads, kv_heads) = (config.num_attention_heads, layer.kv_heads);
        let lp = cx.layers.join(i);
        let (attn, mlp) = (lp.join("self_attn"), lp.join("mlp"));
        let hd = layer.head_dim;
        let kv = if layer.owns_kv(i) {
            let keys = w.linear(&attn.join("k_proj"), hidden, kv_heads * hd)?;
            let values = match layer.values_are_keys {
                true => None,
                false => Some(w.linear(&attn.join("v_proj"), hidden, kv_heads * hd)?),
            };
            Some((keys, values, norm(&attn.join("k_norm").join("weight"), hd)?))
        } else {
            // A KV-shared layer: checkpoints from mlx_lm 0.31.3 still
            // carry unused k/v weights here, which are never read.
            None
        };
        let inter = layer.intermediate;
        let ple = spec.per_layer_dim;
        let per_layer_input = if cx.with_per_layer_input {
            Some(PerLayerInput {
                gate: w.linear(&lp.join("per_layer_input_gate"), hidden, ple)?,
                projection: w.linear(&lp.join("per_layer_projection"), ple, hidden)?,
                norm: norm(&lp.join("post_per_layer_input_norm").join("weight"), hidden)?,
            })
        } else {
            None
        };
        Ok(Layer {
            attention: Attention {
                q: w.linear(&attn.join("q_proj"), hidden, heads * hd)?,
                kv,
                o: w.linear(&attn.join("o_proj"), heads * hd, hidden)?,
                q_norm: norm(&attn.join("q_norm").join("weight"), hd)?,
            },
            gate: w.linear(&mlp.join("gate_proj"), hidden, inter)?,
            up: w.linear(&mlp.join("up_proj"), hidden, inter)?,
            down: w.linear(&mlp.join("down_proj"), inter, hidden)?,
            input_norm: norm(&lp.join("input_layernorm").join("weight"), hidden)?,
            post_attention_norm: norm(&lp.join("post_attention_layernorm").join("weight"), hidden)?,
            pre_feedforward_norm: norm(
                &lp.join("pre_feedforward_layernorm").join("weight"),
                hidden,
            )?,
            post_feedforward_norm: norm(
                &lp.join("post_feedforward_layernorm").join("weight"),
                hidden,
            )?,
            per_layer_input,
            moe: match &spec.moe {
                Some(moe) => Some(MoeBlock::load(w, &lp, hidden, moe, spec.version)?),
                None => None,
            },
            scalar: if four {
                Some(w.array(&lp.join("layer_scalar"), &[1])?)
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

/// One forward in progress: the hidden state after the layers so far, and
/// what every layer of it reads.
pub(super) struct Pass<'c> {
    pub(super) h: Array,
    pub(super) per_layer: Option<PerLayerSource>,
    pub(super) sliding_mask: Option<LayerMask>,
    pub(super) full_mask: Option<LayerMask>,
    pub(super) positions: Positions,
    /// Each layer's keys and values, for the layers that share them.
    pub(super) kvs: Vec<Option<(Array, Array)>>,
    pub(super) b: i32,
    /// Positions the layers run on: `new`, or 1 after [`keep_last`](Self::keep_last).
    pub(super) l: i32,
    /// Positions appended to the cache.
    pub(super) new: i32,
    /// The layer after whose keys and values only the last position is
    /// kept (see `Gemma::hidden_each`).
    pub(super) narrow_after: Option<usize>,
    pub(super) cache: &'c mut KvCache,
}

impl Pass<'_> {
    /// Drops every position but the last from what the rest of the forward
    /// reads: the hidden state, the per-layer inputs, the queries' masks
    /// and rotary positions. Only once no later step writes keys or values.
    pub(super) fn keep_last(&mut self) -> Result<()> {
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
    pub(super) fn forward(
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
        let kv_heads = s.kv_heads as i32;
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
                let projected = k_proj.forward(&x)?.reshape(&[b, l, kv_heads, hd])?;
                let mut v = match v_proj {
                    Some(v_proj) => v_proj.forward(&x)?.reshape(&[b, l, kv_heads, hd])?,
                    None => projected.clone(),
                };
                let k = fast::rms_norm(&projected, Some(k_norm), c.rms_norm_eps)?;
                let k = rope(&k.transpose_axes(&[0, 2, 1, 3])?, &p.positions)?;
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
                None,
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
        let mut out = gated_mlp(&x, &self.gate, &self.up, &self.down, gelu_mul)?;
        if let Some(moe) = &self.moe {
            out = moe.beside_the_mlp(&h, &out, c.rms_norm_eps)?;
        }
        let out = fast::rms_norm(&out, Some(&self.post_feedforward_norm), c.rms_norm_eps)?;
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

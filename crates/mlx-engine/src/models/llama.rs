//! The llama-family decoder (llama, mistral, qwen2, qwen3) written with
//! mlx-rs.

use mlx_rs::fast;
use mlx_rs::Array;

use crate::error::Result;
use crate::models::config::ModelConfig;
use crate::nn::attention::attention;
use crate::nn::cache::{at_position, KvCache, LayerMask};
use crate::nn::fused::silu_mul;
use crate::nn::mlp::gated_mlp;
use crate::nn::rope::Positions;
use crate::weights::layers::{Forward, Layers};
use crate::weights::{Embedding, Linear, Weights};

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

impl Layer {
    fn load(config: &ModelConfig, w: &Weights<'_>, i: usize) -> Result<Layer> {
        let hidden = config.hidden_size;
        let (heads, kv_heads, hd) = (
            config.num_attention_heads,
            config.kv_heads(),
            config.head_dim(),
        );
        let inter = config.intermediate_size;
        let p = format!("model.layers.{i}");
        let qk_norm = |name: &str| -> Result<Option<Array>> {
            if config.qk_norm() {
                Ok(Some(w.vector(&format!("{p}.self_attn.{name}.weight"), hd)?))
            } else {
                Ok(None)
            }
        };
        Ok(Layer {
            q: w.linear(&format!("{p}.self_attn.q_proj"), hidden, heads * hd)?,
            k: w.linear(&format!("{p}.self_attn.k_proj"), hidden, kv_heads * hd)?,
            v: w.linear(&format!("{p}.self_attn.v_proj"), hidden, kv_heads * hd)?,
            o: w.linear(&format!("{p}.self_attn.o_proj"), heads * hd, hidden)?,
            q_norm: qk_norm("q_norm")?,
            k_norm: qk_norm("k_norm")?,
            gate: w.linear(&format!("{p}.mlp.gate_proj"), hidden, inter)?,
            up: w.linear(&format!("{p}.mlp.up_proj"), hidden, inter)?,
            down: w.linear(&format!("{p}.mlp.down_proj"), inter, hidden)?,
            input_norm: w.vector(&format!("{p}.input_layernorm.weight"), hidden)?,
            post_norm: w.vector(&format!("{p}.post_attention_layernorm.weight"), hidden)?,
        })
    }
}

/// A loaded llama-family decoder.
pub(crate) struct Llama {
    embed: Embedding,
    layers: Layers<Layer>,
    norm: Array,
    lm_head: Option<Linear>,
}

impl Llama {
    pub(crate) fn load(config: &ModelConfig, w: &Weights<'_>) -> Result<Llama> {
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        let tied = config.tie_word_embeddings && !w.has("lm_head.weight");
        let embed = w.embedding("model.embed_tokens", vocab, hidden, true)?;
        let layer_config = config.clone();
        let layers = Layers::load(w, "model.layers.", config.num_hidden_layers, move |w, i| {
            Layer::load(&layer_config, w, i)
        })?;
        let norm = w.vector("model.norm.weight", hidden)?;
        let lm_head = if tied {
            None
        } else {
            Some(w.linear("lm_head", hidden, vocab)?)
        };
        Ok(Llama {
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// The final norm and the output projection (or the tied embedding).
    /// Whether the layers are read from the files at each forward.
    pub(crate) fn streams_layers(&self) -> bool {
        self.layers.streamed()
    }

    pub(crate) fn head(&self, config: &ModelConfig, x: &Array) -> Result<Array> {
        let x = fast::rms_norm(x, Some(&self.norm), config.rms_norm_eps)?;
        match &self.lm_head {
            Some(head) => head.forward(&x),
            None => self.embed.as_linear(&x),
        }
    }

    /// The last decoder layer's outputs `(B, L, hidden)`, before the final
    /// norm, of each of the independent forwards of `tokens` over `caches`
    /// (one cache each, extended); layer by layer (see
    /// [`Layers::forward_each`]).
    ///
    /// With `last_only`, only the last position's output is wanted (`(B, 1,
    /// hidden)` comes back): the last layer writes every position's keys
    /// and values, then runs its queries, attention and MLP on the last
    /// position alone (nothing reads the others' outputs).
    pub(crate) fn hidden_each<'c>(
        &self,
        c: &ModelConfig,
        tokens: &[Array],
        caches: &'c mut [KvCache],
        last_only: bool,
    ) -> Result<Vec<Array>> {
        let narrow_at = c.num_hidden_layers.checked_sub(1).filter(|_| last_only);
        let begin = |tokens: &Array, cache: &'c mut KvCache| {
            let l = tokens.dim(1);
            Ok(Pass {
                x: self.embed.lookup(tokens)?,
                mask: cache.mask(0, l, None),
                positions: Positions::of(cache),
                b: tokens.dim(0),
                l,
                new: l,
                narrow_at,
                cache,
            })
        };
        self.layers
            .forward_each(tokens, caches, begin, |i, layer, pass| {
                layer.forward(c, i, pass)
            })
    }
}

/// One forward in progress: the hidden state after the layers so far.
struct Pass<'c> {
    x: Array,
    mask: LayerMask,
    positions: Positions,
    b: i32,
    /// Positions the queries run on: `new`, or 1 once narrowed.
    l: i32,
    /// Positions appended to the cache.
    new: i32,
    /// The layer whose queries run on the last position alone.
    narrow_at: Option<usize>,
    cache: &'c mut KvCache,
}

impl Forward for Pass<'_> {
    fn finish(self) -> Result<Array> {
        self.cache.advance(self.new)?;
        Ok(self.x)
    }
}

impl Layer {
    /// Layer `i` over `p`; returns what it computed from the weights (the
    /// new hidden state and this layer's keys and values).
    fn forward(&self, c: &ModelConfig, i: usize, p: &mut Pass<'_>) -> Result<Vec<Array>> {
        let (b, l) = (p.b, p.l);
        let (heads, kv_heads, hd) = (
            c.num_attention_heads as i32,
            c.kv_heads() as i32,
            c.head_dim() as i32,
        );
        let scale = (hd as f32).powf(-0.5);
        let h = fast::rms_norm(&p.x, Some(&self.input_norm), c.rms_norm_eps)?;
        let split = |a: Array, n: i32| -> Result<Array> {
            Ok(a.reshape(&[b, l, n, hd])?.transpose_axes(&[0, 2, 1, 3])?)
        };
        let mut k = split(self.k.forward(&h)?, kv_heads)?;
        let v = split(self.v.forward(&h)?, kv_heads)?;
        if let Some(kn) = &self.k_norm {
            k = fast::rms_norm(&k, Some(kn), c.rms_norm_eps)?;
        }
        let rope = |x: &Array, positions: &Positions| {
            positions.rope(x, hd, c.rope_traditional, Some(c.rope_theta), 1.0, None)
        };
        let k = rope(&k, &p.positions)?;
        let (k, v) = p.cache.append(i, k, v, None)?;
        // Every position's keys and values are written: in the last layer
        // of a prefill only the last position's queries matter from here.
        let h = if p.narrow_at == Some(i) {
            let last = p.l - 1;
            p.x = at_position(&p.x, 1, last)?;
            p.mask = p.mask.of_last(p.l)?;
            p.positions = p.positions.advanced(last)?;
            p.l = 1;
            at_position(&h, 1, last)?
        } else {
            h
        };
        let l = p.l;
        let mut q = self
            .q
            .forward(&h)?
            .reshape(&[b, l, heads, hd])?
            .transpose_axes(&[0, 2, 1, 3])?;
        if let Some(qn) = &self.q_norm {
            q = fast::rms_norm(&q, Some(qn), c.rms_norm_eps)?;
        }
        let q = rope(&q, &p.positions)?;
        let attended = attention(&q, p.cache.shared(i), (&k, &v), &p.mask, scale)?;
        let attended = attended
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[b, l, heads * hd])?;
        let x1 = p.x.add(self.o.forward(&attended)?)?;
        let h = fast::rms_norm(&x1, Some(&self.post_norm), c.rms_norm_eps)?;
        let act = |g: &Array, u: &Array| Ok(silu_mul(g, u)?);
        p.x = x1.add(gated_mlp(&h, &self.gate, &self.up, &self.down, act)?)?;
        Ok(vec![p.x.clone(), k, v])
    }
}

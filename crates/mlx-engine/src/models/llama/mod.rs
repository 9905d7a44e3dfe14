//! The llama-family decoder (llama, mistral, qwen2, qwen3, and the
//! mixtures of experts qwen3_moe, mixtral and gpt_oss, whose sparse layers
//! route each position to a few experts) written with mlx-rs.

mod gpt_oss;
mod moe;
mod windows;

use mlx_rs::fast;
use mlx_rs::Array;

use crate::distributed::stage::Stage;
use crate::error::{Error, Result};
use crate::models::config::{FamilySettings, ModelConfig};
use crate::models::family::{module_name, Decoder, Family, Part};
use crate::models::layers::{Forward, Layers, Schedule};
use crate::nn::attention::attention;
use crate::nn::cache::{KvCache, LayerMask};
use crate::nn::experts::Experts;
use crate::nn::fused::silu_mul;
use crate::nn::mlp::gated_mlp;
use crate::nn::rope::Positions;
use crate::nn::rope_scaling::{RopeScaling, Rotation};

use crate::ops::at_position;
use crate::weights::{Embedding, KeyPath, Linear, Weights};
use moe::{load_experts, MoeSettings, MoeStyle};
use windows::Windows;

/// Where the llama family's text decoder keeps its weights.
const MODEL: &str = "model";

/// `model.layers`: layer `i`'s weights are under its child `i`.
fn layers_path() -> KeyPath {
    KeyPath::new(MODEL).join("layers")
}

struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Array>,
    k_norm: Option<Array>,
    /// A learned score per head that every query's softmax counts
    /// (gpt_oss).
    sinks: Option<Array>,
    /// The attention window of a sliding layer (gpt_oss).
    window: Option<i32>,
    mlp: Mlp,
    input_norm: Array,
    post_norm: Array,
}

/// A layer's feed-forward block.
enum Mlp {
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// The sparse layers of qwen3_moe and mixtral (boxed: three stacks of several arrays
    /// each, against the dense block's three layers).
    Experts(Box<Experts>),
}

/// What the llama family's members differ in.
#[derive(Debug, Clone)]
struct LlamaSettings {
    /// Queries and keys RMS-normalised per head (qwen3, qwen3_moe).
    qk_norm: bool,
    /// The mixtures of experts' (qwen3_moe, mixtral, gpt_oss).
    moe: Option<MoeSettings>,
    /// Layers attending within a window (gpt_oss's sliding layers).
    windows: Option<windows::Windows>,
    /// Each layer's attention has a sink per head (gpt_oss).
    sinks: bool,
    /// How positions are scaled (`rope_scaling`: llama, mistral, qwen2,
    /// qwen3, gpt_oss).
    rope_scaling: Option<RopeScaling>,
}

impl Layer {
    /// Whether its forward copies routed experts out of the files.
    fn copies_experts(&self) -> bool {
        matches!(&self.mlp, Mlp::Experts(e) if e.copies_from_files())
    }

    fn load(config: &ModelConfig, w: &Weights<'_>, i: usize) -> Result<Layer> {
        let hidden = config.hidden_size;
        let (heads, kv_heads, hd) = (
            config.num_attention_heads,
            config.kv_heads(),
            config.head_dim(),
        );
        let inter = config.intermediate_size;
        let p = layers_path().join(i);
        let (attn, mlp) = (p.join("self_attn"), p.join("mlp"));
        let settings = config.settings::<LlamaSettings>();
        let qk_norm = |name: &str| -> Result<Option<Array>> {
            if settings.is_some_and(|s| s.qk_norm) {
                Ok(Some(w.vector(&attn.join(name).join("weight"), hd)?))
            } else {
                Ok(None)
            }
        };
        Ok(Layer {
            q: w.linear(&attn.join("q_proj"), hidden, heads * hd)?,
            k: w.linear(&attn.join("k_proj"), hidden, kv_heads * hd)?,
            v: w.linear(&attn.join("v_proj"), hidden, kv_heads * hd)?,
            o: w.linear(&attn.join("o_proj"), heads * hd, hidden)?,
            q_norm: qk_norm("q_norm")?,
            k_norm: qk_norm("k_norm")?,
            sinks: if settings.is_some_and(|s| s.sinks) {
                Some(w.vector(&attn.join("sinks"), heads)?)
            } else {
                None
            },
            window: settings
                .and_then(|s| s.windows.as_ref())
                .and_then(|windows| windows.of(i)),
            mlp: match settings.and_then(|s| s.moe.as_ref()) {
                Some(moe) if moe.sparse(i) => {
                    let block = p.join(moe.block());
                    Mlp::Experts(Box::new(load_experts(w, &block, hidden, moe)?))
                }
                _ => Mlp::Dense {
                    gate: w.linear(&mlp.join("gate_proj"), hidden, inter)?,
                    up: w.linear(&mlp.join("up_proj"), hidden, inter)?,
                    down: w.linear(&mlp.join("down_proj"), inter, hidden)?,
                },
            },
            input_norm: w.vector(&p.join("input_layernorm").join("weight"), hidden)?,
            post_norm: w.vector(&p.join("post_attention_layernorm").join("weight"), hidden)?,
        })
    }
}

/// The llama family: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral,
/// gpt_oss.
pub(crate) const FAMILY: Family = Family {
    model_types: &[
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "mixtral",
        "gpt_oss",
    ],
    fields: |raw| {
        let mut fields = raw.clone();
        // mlx_lm's default for mixtral, where ours is llama's.
        if raw["model_type"] == "mixtral" && raw.get("rope_theta").is_none() {
            fields["rope_theta"] = serde_json::json!(1e6);
        }
        // transformers 5 nests qwen3's `rope_theta` in `rope_parameters`,
        // where mlx_lm reads it; without either it refuses the config.
        if raw["model_type"] == "qwen3" && raw.get("rope_theta").is_none() {
            match raw.pointer("/rope_parameters/rope_theta") {
                Some(theta) => fields["rope_theta"] = theta.clone(),
                None => return Err("rope_theta is missing from the model config".into()),
            }
        }
        Ok(fields)
    },
    settings: |raw, _, config| {
        let model_type = config.model_type.as_str();
        if model_type == "gpt_oss" {
            return Ok(Some(FamilySettings::new(gpt_oss::settings(raw, config)?)));
        }
        let parsed = match model_type {
            "qwen3_moe" => serde_json::from_value(raw.clone()).map(Some),
            "mixtral" => serde_json::from_value(raw.clone())
                .map(|f| Some(MoeSettings::every_layer(f, MoeStyle::Mixtral))),
            _ => Ok(None),
        };
        let moe: Option<MoeSettings> = parsed.map_err(|e| e.to_string())?;
        if let Some(moe) = &moe {
            moe.check()?;
        }
        // mlx_lm's llama (mistral's too), qwen2 and qwen3 scale their
        // positions as `rope_scaling` says (qwen3: or `rope_parameters`);
        // its qwen3_moe and mixtral ignore it.
        let scaling = match model_type {
            "llama" | "mistral" | "qwen2" => raw.get("rope_scaling"),
            "qwen3" => raw
                .get("rope_scaling")
                .filter(|s| !s.is_null())
                .or_else(|| raw.get("rope_parameters")),
            _ => None,
        };
        let rope_scaling =
            RopeScaling::from_config(scaling, config.head_dim(), f64::from(config.rope_theta))?;
        // mlx_lm's llama (mistral's too) slides the layers `layer_types`
        // names (without it, every layer is full: mistral's bare
        // `sliding_window` is ignored, as there).
        let windows = match (model_type, raw.get("layer_types")) {
            ("llama" | "mistral", Some(types)) if !types.is_null() => {
                let types: Vec<String> =
                    serde_json::from_value(types.clone()).map_err(|e| e.to_string())?;
                let window = raw
                    .get("sliding_window")
                    .and_then(serde_json::Value::as_u64)
                    .map(|w| w as usize);
                Windows::of_layer_types(&types, window, config.num_hidden_layers)?
            }
            _ => None,
        };
        Ok(Some(FamilySettings::new(LlamaSettings {
            // qwen3's per-head norms of queries and keys (q/k/v biases,
            // qwen2's, are found by their weights).
            qk_norm: matches!(model_type, "qwen3" | "qwen3_moe"),
            moe,
            windows,
            sinks: false,
            rope_scaling,
        })))
    },
    layers_prefix: |_, _, _| Ok(layers_path()),
    part_of: |layers, key| match layers.parse(key) {
        // `mlp.switch_mlp` (qwen3_moe), `block_sparse_moe.switch_mlp`
        // (mixtral) or `mlp.experts` (gpt_oss): the stacked experts; not
        // gpt_oss's experts' biases, a vector per expert.
        Ok(Some((i, param)))
            if param.contains("switch_mlp.")
                || (param.contains("mlp.experts.") && !param.ends_with(".bias")) =>
        {
            Part::Experts(i)
        }
        Ok(Some((i, _))) => Part::Layer(i),
        _ if module_name(key) == "embed_tokens" => Part::Table,
        _ => Part::Rest,
    },
    can_cut_before: |_, _| true,
    load: |config, w, stage| Ok(Box::new(Llama::load(config, w, stage)?)),
};

/// A loaded llama-family decoder, or the part of it one pipeline stage
/// holds.
pub(crate) struct Llama {
    /// On the first stage, and on the last when the head is tied to it.
    embed: Option<Embedding>,
    layers: Layers<Layer>,
    /// The final norm and output projection: on the last stage.
    head: Option<Head>,
    /// Its forwards copy their chosen experts out of the files.
    experts_copied: bool,
    /// How positions rotate (the config's `rope_scaling`).
    rotation: Rotation,
}

struct Head {
    norm: Array,
    /// `None`: tied to the embedding.
    lm_head: Option<Linear>,
}

impl Llama {
    pub(crate) fn load(config: &ModelConfig, w: &Weights<'_>, stage: &Stage) -> Result<Llama> {
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        let (model, lm_head) = (KeyPath::new(MODEL), KeyPath::new("lm_head"));
        let tied = config.tie_word_embeddings && !w.has(&lm_head.join("weight"));
        let embed = if stage.is_first() || (stage.is_last() && tied) {
            Some(w.embedding(&model.join("embed_tokens"), vocab, hidden, true)?)
        } else {
            None
        };
        let head = if stage.is_last() {
            Some(Head {
                norm: w.vector(&model.join("norm").join("weight"), hidden)?,
                lm_head: if tied {
                    None
                } else {
                    Some(w.linear(&lm_head, hidden, vocab)?)
                },
            })
        } else {
            None
        };
        // After the head: laying a matrix out holds one extra copy of it
        // for a moment, so the largest ones go while the least is resident
        // (a 302 MB head laid out last raised a pipeline stage's peak by
        // 302 MB).
        let layer_config = config.clone();
        let layers = Layers::load(w, &layers_path(), stage.layers(), move |w, i| {
            Layer::load(&layer_config, w, i)
        })?;
        let settings = config.settings::<LlamaSettings>();
        let moe = settings.is_some_and(|s| s.moe.is_some());
        let rotation = RopeScaling::rotation(
            settings.and_then(|s| s.rope_scaling.as_ref()),
            config.head_dim(),
            config.rope_theta,
        )?;
        if let Rotation::Periods { freqs, .. } = &rotation {
            // Lanes read the model's arrays from other threads.
            crate::evaluation::evaluate(crate::evaluation::Why::Load, [freqs])?;
        }
        let experts_copied = moe && layers.any_held(Layer::copies_experts);
        Ok(Llama {
            embed,
            layers,
            head,
            experts_copied,
            rotation,
        })
    }

    /// The embedding table; absent only on a middle pipeline stage, which
    /// never embeds.
    fn embed(&self) -> Result<&Embedding> {
        self.embed.as_ref().ok_or(Error::NotOnThisStage {
            what: "the embedding",
        })
    }
}

impl Decoder for Llama {
    fn schedule(&self) -> Schedule {
        match self.layers.schedule() {
            Schedule::Independent if self.experts_copied => Schedule::WholeChunks,
            schedule => schedule,
        }
    }

    /// The final norm and the output projection (or the tied embedding).
    fn head(&self, config: &ModelConfig, x: &Array) -> Result<Array> {
        let head = self.head.as_ref().ok_or(Error::NotOnThisStage {
            what: "the output head",
        })?;
        let x = fast::rms_norm(x, Some(&head.norm), config.rms_norm_eps)?;
        match &head.lm_head {
            Some(lm_head) => lm_head.forward(&x),
            None => self.embed()?.as_linear(&x),
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
    fn hidden_each(
        &self,
        c: &ModelConfig,
        stage: &Stage,
        tokens: &[Array],
        caches: &mut [KvCache],
        last_only: bool,
    ) -> Result<Vec<Array>> {
        self.forwards(c, stage, tokens, caches, last_only)
    }
}

impl Llama {
    /// [`Decoder::hidden_each`], with the caches' lifetime named for the
    /// forwards in progress.
    fn forwards<'c>(
        &self,
        c: &ModelConfig,
        stage: &Stage,
        tokens: &[Array],
        caches: &'c mut [KvCache],
        last_only: bool,
    ) -> Result<Vec<Array>> {
        let narrow_at = c.num_hidden_layers.checked_sub(1).filter(|_| last_only);
        let windows = c
            .settings::<LlamaSettings>()
            .and_then(|s| s.windows.as_ref());
        // One mask per kind of layer, from the first held layer of the
        // kind (all of them keep the same slots).
        let first_held = |sliding: bool| {
            stage
                .layers()
                .find(|&i| windows.and_then(|w| w.of(i)).is_some() == sliding)
        };
        let (full, sliding) = (first_held(false), first_held(true));
        let begin = |tokens: &Array, cache: &'c mut KvCache| {
            let l = tokens.dim(1);
            Ok(Pass {
                x: stage.input(tokens, c.hidden_size, || self.embed()?.lookup(tokens))?,
                mask: cache.mask(full.unwrap_or(0), l, None),
                window_mask: match (windows, sliding) {
                    (Some(w), Some(i)) => Some(cache.mask(i, l, Some(w.size))),
                    _ => None,
                },
                rotation: self.rotation.clone(),
                positions: Positions::of(cache),
                b: tokens.dim(0),
                l,
                new: l,
                narrow_at,
                cache,
            })
        };
        let outputs = self
            .layers
            .forward_each(tokens, caches, begin, |i, layer, pass| {
                layer.forward(c, i, pass)
            })?;
        for x in &outputs {
            stage.output(x)?;
        }
        Ok(outputs)
    }
}

/// One forward in progress: the hidden state after the layers so far.
struct Pass<'c> {
    x: Array,
    /// The full layers' mask.
    mask: LayerMask,
    /// The sliding layers' mask, where there are some.
    window_mask: Option<LayerMask>,
    /// How positions rotate.
    rotation: Rotation,
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
        let rotation = p.rotation.clone();
        let rope = |x: &Array, positions: &Positions| match &rotation {
            Rotation::Periods {
                freqs,
                feature_scale,
            } => {
                let x = if *feature_scale == 1.0 {
                    x.clone()
                } else {
                    x.multiply(Array::from_f32(*feature_scale).as_dtype(x.dtype())?)?
                };
                positions.rope(&x, hd, c.rope_traditional, None, 1.0, Some(freqs))
            }
            Rotation::Base { base, scale } => {
                positions.rope(x, hd, c.rope_traditional, Some(*base), *scale, None)
            }
        };
        let k = rope(&k, &p.positions)?;
        let (k, v) = p.cache.append(i, k, v, self.window)?;
        // Every position's keys and values are written: in the last layer
        // of a prefill only the last position's queries matter from here.
        let h = if p.narrow_at == Some(i) {
            let last = p.l - 1;
            p.x = at_position(&p.x, 1, last)?;
            p.mask = p.mask.of_last(p.l)?;
            p.window_mask = p.window_mask.as_ref().map(|m| m.of_last(p.l)).transpose()?;
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
        let mask = match (&p.window_mask, self.window) {
            (Some(window_mask), Some(_)) => window_mask,
            _ => &p.mask,
        };
        let attended = attention(
            &q,
            p.cache.shared(i),
            (&k, &v),
            mask,
            scale,
            self.sinks.as_ref(),
        )?;
        let attended = attended
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[b, l, heads * hd])?;
        let x1 = p.x.add(self.o.forward(&attended)?)?;
        let h = fast::rms_norm(&x1, Some(&self.post_norm), c.rms_norm_eps)?;
        let act = |g: &Array, u: &Array| Ok(silu_mul(g, u)?);
        let out = match &self.mlp {
            Mlp::Dense { gate, up, down } => gated_mlp(&h, gate, up, down, act)?,
            Mlp::Experts(experts) => experts.forward(&h)?,
        };
        p.x = x1.add(out)?;
        Ok(vec![p.x.clone(), k, v])
    }
}

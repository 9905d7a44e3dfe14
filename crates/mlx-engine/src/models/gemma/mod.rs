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
//! each layer's output and a tanh softcap on the logits; the 26B-A4B model
//! adds routed experts beside each MLP (`moe.rs`) and full layers whose
//! values are their keys' projection.

pub(crate) mod config;
mod layer;
mod moe;
mod ops;
mod per_layer;

use std::path::Path;

use mlx_rs::fast;
use mlx_rs::ops::tanh;
use mlx_rs::{Array, Dtype};
use st_mmap::SafetensorsSet;

use crate::distributed::stage::Stage;
use crate::error::{Error, Result};
use crate::models::config::{FamilySettings, ModelConfig};
use crate::models::family::{module_name, Decoder, Family, Part};
use crate::models::gemma::config::{text_fields, GemmaSpec, Version};
use crate::models::gemma::layer::{Layer, LayerContext, Pass};
use crate::models::gemma::ops::{norm, scalar};
use crate::models::gemma::per_layer::{PerLayerInputs, PerLayerSource};
use crate::models::layers::{Layers, Schedule};
use crate::nn::cache::{KvCache, LayerMask};
use crate::nn::rope::Positions;
use crate::weights::{Embedding, KeyPath, Linear, Weights};

/// Where a checkpoint keeps the text decoder's weights.
pub(crate) struct KeyPrefixes {
    /// `model`, `language_model.model` or `model.language_model`.
    pub text: KeyPath,
    /// The untied output head, `lm_head` or `language_model.lm_head`.
    pub head: KeyPath,
}

impl KeyPrefixes {
    /// The prefixes the files use: a multimodal checkpoint's text weights
    /// sit under `language_model.model.` (mlx_lm) or
    /// `model.language_model.` (Hugging Face).
    pub(crate) fn find(spec: &GemmaSpec, set: &SafetensorsSet, dir: &Path) -> Result<KeyPrefixes> {
        if !spec.multimodal {
            return Ok(KeyPrefixes {
                text: KeyPath::new("model"),
                head: KeyPath::new("lm_head"),
            });
        }
        let has_embedding = |p: &KeyPath| {
            let table = p.join("embed_tokens");
            let has = |k: &KeyPath| set.tensor(k.as_str()).is_some();
            has(&table.join("weight")) || has(&table.join("scales"))
        };
        let text = ["language_model.model", "model.language_model"]
            .map(KeyPath::new)
            .into_iter()
            .find(has_embedding)
            .ok_or_else(|| Error::MissingWeight {
                dir: dir.to_path_buf(),
                key: "language_model.model.embed_tokens.weight (the text decoder's weights)".into(),
            })?;
        Ok(KeyPrefixes {
            text,
            head: KeyPath::new("language_model.lm_head"),
        })
    }
}

/// Gemma 3 and Gemma 4 (their text decoders; the multimodal checkpoints'
/// towers are skipped).
pub(crate) const FAMILY: Family = Family {
    model_types: &["gemma3_text", "gemma3", "gemma4_text", "gemma4"],
    fields: |raw| text_fields(raw)?.ok_or_else(|| "not a Gemma config".to_owned()),
    settings: |raw, fields, config| {
        // The multimodal checkpoints keep the text decoder's weights under
        // `language_model.`.
        let multimodal = matches!(
            raw.get("model_type").and_then(serde_json::Value::as_str),
            Some("gemma3" | "gemma4")
        );
        Ok(Some(FamilySettings::new(GemmaSpec::resolve(
            fields, config, multimodal,
        )?)))
    },
    layers_prefix: |config, set, dir| {
        Ok(KeyPrefixes::find(spec_of(config)?, set, dir)?
            .text
            .join("layers"))
    },
    part_of: |layers, key| match layers.parse(key) {
        // Gemma 4's routed experts (26B-A4B).
        Ok(Some((i, param))) if param.contains("experts.switch_glu.") => Part::Experts(i),
        Ok(Some((i, _))) => Part::Layer(i),
        _ => match module_name(key) {
            "embed_tokens" => Part::Table,
            "embed_tokens_per_layer" => Part::SharedTable,
            _ => Part::Rest,
        },
    },
    // Gemma 4's KV-shared layers read their source layer's keys and values
    // within the same forward.
    can_cut_before: |config, i| {
        config
            .settings::<GemmaSpec>()
            .is_none_or(|spec| spec.layers[i..].iter().all(|l| l.kv_source >= i))
    },
    load: |config, w, stage| Ok(Box::new(Gemma::load(config, spec_of(config)?, w, stage)?)),
};

/// Gemma's own fields of a config (resolved when `config.json` was read).
fn spec_of(config: &ModelConfig) -> Result<&GemmaSpec> {
    config.settings::<GemmaSpec>().ok_or_else(|| Error::Config {
        path: "config.json".into(),
        message: format!("model_type {:?} without Gemma's fields", config.model_type),
    })
}

/// A loaded Gemma 3 or Gemma 4 text decoder, or the part of it one
/// pipeline stage holds.
pub(crate) struct Gemma {
    spec: GemmaSpec,
    /// On the first stage, and on the last when the head is tied to it.
    embed: Option<Embedding>,
    /// On every stage: each layer reads its per-layer input.
    per_layer: Option<PerLayerInputs>,
    layers: Layers<Layer>,
    /// The final norm and the untied head: on the last stage.
    norm: Option<Array>,
    lm_head: Option<Linear>,
    /// Layers this stage holds.
    held: std::ops::Range<usize>,
    /// Its forwards copy their chosen experts out of the files.
    experts_copied: bool,
}

impl Gemma {
    pub(crate) fn load(
        config: &ModelConfig,
        spec: &GemmaSpec,
        w: &Weights<'_>,
        stage: &Stage,
    ) -> Result<Gemma> {
        let prefixes = KeyPrefixes::find(spec, w.set, w.dir)?;
        let p = &prefixes.text;
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        let n = config.num_hidden_layers;
        let four = spec.version == Version::Four;
        let norm = |key: &KeyPath, len: usize| norm(w, spec.version, key, len);
        let untied = w.has(&prefixes.head.join("weight"));
        let tied = match spec.version {
            // mlx_lm ties Gemma 3's head whenever the files have none.
            Version::Three => !untied,
            Version::Four => config.tie_word_embeddings,
        };
        let embed = if stage.is_first() || (stage.is_last() && tied) {
            Some(w.embedding(&p.join("embed_tokens"), vocab, hidden, tied)?)
        } else {
            None
        };
        let ple = spec.per_layer_dim;
        let per_layer = if four && ple > 0 {
            Some(PerLayerInputs {
                table: w.embedding(
                    &p.join("embed_tokens_per_layer"),
                    spec.per_layer_vocab,
                    n * ple,
                    false,
                )?,
                projection: w.linear(&p.join("per_layer_model_projection"), hidden, n * ple)?,
                norm: norm(&p.join("per_layer_projection_norm").join("weight"), ple)?,
            })
        } else {
            None
        };
        let layers_path = p.join("layers");
        let (layer_config, layer_spec) = (config.clone(), spec.clone());
        let in_layers = layers_path.clone();
        let with_per_layer_input = per_layer.is_some();
        let layers = Layers::load(w, &layers_path, stage.layers(), move |w, i| {
            let context = LayerContext {
                config: &layer_config,
                spec: &layer_spec,
                layers: &in_layers,
                with_per_layer_input,
            };
            Layer::load(&context, w, i)
        })?;
        let final_norm = match stage.is_last() {
            true => Some(norm(&p.join("norm").join("weight"), hidden)?),
            false => None,
        };
        let lm_head = if tied || !stage.is_last() {
            None
        } else {
            Some(w.linear(&prefixes.head, hidden, vocab)?)
        };
        let experts_copied = layers.any_held(Layer::copies_experts);
        Ok(Gemma {
            spec: spec.clone(),
            embed,
            per_layer,
            layers,
            norm: final_norm,
            lm_head,
            held: stage.layers(),
            experts_copied,
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

impl Decoder for Gemma {
    fn schedule(&self) -> Schedule {
        match self.layers.schedule() {
            // As for llama's experts: each routed expert copied once per
            // forward for the whole batch.
            Schedule::Independent if self.experts_copied => Schedule::WholeChunks,
            schedule => schedule,
        }
    }

    /// The final norm, the output head and Gemma 4's softcap.
    fn head(&self, config: &ModelConfig, x: &Array) -> Result<Array> {
        let spec = &self.spec;
        let final_norm = self.norm.as_ref().ok_or(Error::NotOnThisStage {
            what: "the output head",
        })?;
        let x = fast::rms_norm(x, Some(final_norm), config.rms_norm_eps)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&x)?,
            None => self.embed()?.as_linear(&x)?,
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
    fn hidden_each(
        &self,
        c: &ModelConfig,
        stage: &Stage,
        tokens: &[Array],
        caches: &mut [KvCache],
        last_only: bool,
    ) -> Result<Vec<Array>> {
        let layers = &self.spec.layers;
        let narrow_after = (0..layers.len())
            .rfind(|&i| layers[i].owns_kv(i))
            .filter(|_| last_only);
        // What the next stage needs besides each forward's output: the
        // scaled embedding its per-layer inputs read.
        let carried = std::cell::RefCell::new(Vec::new());
        let outputs = self.layers.forward_each(
            tokens,
            caches,
            |tokens, cache| {
                let pass = self.begin(c, stage, tokens, cache, narrow_after)?;
                if let Some(source) = &pass.per_layer {
                    carried.borrow_mut().push(source.embedded.clone());
                }
                Ok(pass)
            },
            |i, layer, pass| layer.forward(c, &self.spec, self.per_layer.as_ref(), i, pass),
        )?;
        let carried = carried.into_inner();
        for (k, x) in outputs.iter().enumerate() {
            let mut out = vec![x.clone()];
            out.extend(carried.get(k).cloned());
            stage.outputs(&out)?;
        }
        Ok(outputs)
    }
}

impl Gemma {
    /// A forward of `tokens` over `cache`, before its first layer.
    fn begin<'c>(
        &self,
        c: &ModelConfig,
        stage: &Stage,
        tokens: &Array,
        cache: &'c mut KvCache,
        narrow_after: Option<usize>,
    ) -> Result<Pass<'c>> {
        let spec = &self.spec;
        let (b, l) = (tokens.dim(0), tokens.dim(1));
        let carried = usize::from(self.per_layer.is_some());
        let mut received = stage.inputs(tokens, c.hidden_size, 1 + carried, || {
            let embedded = self.embed()?.lookup(tokens)?;
            let dtype = embedded.dtype();
            let hidden_scale = match spec.version {
                // mlx_lm rounds Gemma 3's scale to bfloat16 first.
                Version::Three => Array::from_f32((c.hidden_size as f64).sqrt() as f32)
                    .as_dtype(Dtype::Bfloat16)?
                    .as_dtype(dtype)?,
                Version::Four => scalar((c.hidden_size as f64).sqrt(), dtype)?,
            };
            let h = embedded.multiply(&hidden_scale)?;
            Ok(vec![h.clone(), h])
        })?;
        let h = received.remove(0);
        let per_layer = match &self.per_layer {
            Some(ple) => Some(PerLayerSource {
                rows: ple.table.gather(tokens)?,
                embedded: received.remove(0),
            }),
            None => None,
        };
        // One mask per attention type, from the first layer of that type
        // with a cache of its own (all such layers keep the same slots).
        let window = spec.window as i32;
        // Of the layers this stage holds.
        let held = || {
            spec.layers
                .iter()
                .enumerate()
                .skip(self.held.start)
                .take(self.held.len())
        };
        let mask_of = |sliding: bool| -> LayerMask {
            let owner = held()
                .find(|(i, s)| s.sliding == sliding && s.owns_kv(*i))
                .map_or(0, |(i, _)| i);
            cache.mask(owner, l, sliding.then_some(window))
        };
        let has = |sliding: bool| held().any(|(_, s)| s.sliding == sliding);
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

//! How a model scales its rotary positions (`config.json`'s
//! `rope_scaling`), as mlx_lm 0.32.2's `initialize_rope` reads it: none,
//! linear, Llama 3's or YaRN's. The per-pair periods are computed with
//! MLX's f32 operations as mlx_lm computes them, its scalars in f64 as
//! Python does, so that positions rotate by the same bits.

use mlx_rs::ops::{arange, clip, select};
use mlx_rs::Array;

use crate::error::Result;

/// Reads a field of a `rope_scaling` entry: its number, or the default
/// given, or an error naming it.
type FieldReader<'a> = dyn Fn(&str, Option<f64>) -> std::result::Result<f64, String> + 'a;

/// A model's rotary scaling (`rope_scaling`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RopeScaling {
    /// Positions divided by `factor` (`linear`).
    Linear { factor: f64 },
    /// Llama 3's periods (`llama3`).
    Llama3(Llama3),
    /// YaRN's (`yarn`, and mlx_lm's aliases of it).
    Yarn(Yarn),
}

/// Llama 3's rotary periods, as mlx_lm's `Llama3RoPE` computes them: long
/// wavelengths stretched by `factor`, short ones kept, those between
/// blended.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Llama3 {
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original_max_position_embeddings: f64,
}

/// How rotary positions are computed, once a model is loaded.
#[derive(Clone)]
pub(crate) enum Rotation {
    /// `base` and a position `scale` (`fast::rope`'s own periods).
    Base { base: f32, scale: f32 },
    /// Explicit per-pair periods, the rotated features multiplied by
    /// `feature_scale` first (YaRN's `mscale`, else 1).
    Periods { freqs: Array, feature_scale: f32 },
}

impl RopeScaling {
    /// From `config.json`'s `rope_scaling` (or what stands for it): `None`
    /// for none or `default`; an error naming the type for the types
    /// mlx_lm has and this engine does not (`dynamic`, `longrope`, …).
    pub(crate) fn from_config(
        scaling: Option<&serde_json::Value>,
        dims: usize,
        base: f64,
    ) -> std::result::Result<Option<RopeScaling>, String> {
        let Some(scaling) = scaling.filter(|s| !s.is_null()) else {
            return Ok(None);
        };
        let kind = scaling
            .get("type")
            .or_else(|| scaling.get("rope_type"))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        let number = |name: &str, default: Option<f64>| -> std::result::Result<f64, String> {
            match scaling.get(name).and_then(serde_json::Value::as_f64) {
                Some(v) if v.is_finite() => Ok(v),
                Some(v) => Err(format!("rope_scaling.{name} = {v} is not finite")),
                None => {
                    default.ok_or_else(|| format!("rope_scaling of type {kind} needs `{name}`"))
                }
            }
        };
        let positive = |name: &str, v: f64| {
            if v > 0.0 {
                Ok(v)
            } else {
                Err(format!("rope_scaling.{name} must be positive"))
            }
        };
        Ok(match kind {
            "default" => None,
            "linear" => Some(RopeScaling::Linear {
                factor: positive("factor", number("factor", None)?)?,
            }),
            "llama3" => {
                let (low, high) = (
                    number("low_freq_factor", Some(1.0))?,
                    number("high_freq_factor", Some(4.0))?,
                );
                if low == high {
                    return Err(
                        "rope_scaling's low_freq_factor and high_freq_factor are equal".into(),
                    );
                }
                Some(RopeScaling::Llama3(Llama3 {
                    factor: positive("factor", number("factor", None)?)?,
                    low_freq_factor: positive("low_freq_factor", low)?,
                    high_freq_factor: positive("high_freq_factor", high)?,
                    original_max_position_embeddings: positive(
                        "original_max_position_embeddings",
                        number("original_max_position_embeddings", Some(8192.0))?,
                    )?,
                }))
            }
            "yarn" | "deepseek_yarn" | "telechat3-yarn" => {
                Some(RopeScaling::Yarn(Yarn::from_entry(&number, dims, base)?))
            }
            other => {
                return Err(format!(
                    "rope_scaling of type {other:?} is not supported (default, linear, llama3 \
                     and yarn are)"
                ))
            }
        })
    }

    /// How positions rotate for `dims` features over `base`, computed now
    /// (on the thread that loads).
    pub(crate) fn rotation(
        scaling: Option<&RopeScaling>,
        dims: usize,
        base: f32,
    ) -> Result<Rotation> {
        Ok(match scaling {
            None => Rotation::Base { base, scale: 1.0 },
            Some(RopeScaling::Linear { factor }) => Rotation::Base {
                base,
                scale: (1.0 / factor) as f32,
            },
            Some(RopeScaling::Yarn(yarn)) => Rotation::Periods {
                freqs: yarn.freqs()?,
                feature_scale: yarn.feature_scale() as f32,
            },
            Some(RopeScaling::Llama3(llama3)) => Rotation::Periods {
                freqs: llama3.freqs(dims, f64::from(base))?,
                feature_scale: 1.0,
            },
        })
    }
}

impl Llama3 {
    /// The periods `(dims / 2,)` of `dims` features over `base`.
    fn freqs(&self, dims: usize, base: f64) -> Result<Array> {
        let Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } = *self;
        let scalar = |v: f64| Array::from_f32(v as f32);
        let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
        // `mx.arange(0, dims, 2)` is int32, divided by an int: f32.
        let pairs = arange::<_, i32>(0, dims as i32, 2)?.divide(Array::from_int(dims as i32))?;
        let freqs = scalar(base).power(&pairs)?;
        let wavelens = scalar(2.0 * std::f64::consts::PI).multiply(&freqs)?;
        let freqs = select(
            &wavelens.gt(scalar(low_wavelen))?,
            freqs.multiply(scalar(factor))?,
            &freqs,
        )?;
        let medium = wavelens
            .gt(scalar(high_wavelen))?
            .logical_and(&wavelens.lt(scalar(low_wavelen))?)?;
        let smooth = scalar(old)
            .divide(&wavelens)?
            .subtract(scalar(low_freq_factor))?
            .divide(scalar(high_freq_factor - low_freq_factor))?;
        let smooth_freqs = freqs.divide(
            scalar(1.0)
                .subtract(&smooth)?
                .divide(scalar(factor))?
                .add(&smooth)?,
        )?;
        Ok(select(&medium, &smooth_freqs, &freqs)?)
    }
}

/// YaRN's rotary positions (`rope_scaling` of type `yarn`), as mlx_lm
/// 0.32.2's `YarnRoPE` computes them: per-pair periods blended between the
/// base's and the base's times `factor` across a ramp of pairs, and the
/// rotated features scaled first. Scalars in f64 as Python computes them,
/// arrays in f32 with MLX's operations, as mlx_lm's are.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Yarn {
    pub dims: usize,
    pub base: f64,
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

impl Yarn {
    /// From a `rope_scaling` entry of a YaRN type (`number` reads its
    /// fields, with mlx_lm's defaults).
    fn from_entry(
        number: &FieldReader<'_>,
        dims: usize,
        base: f64,
    ) -> std::result::Result<Yarn, String> {
        let yarn = Yarn {
            dims,
            base,
            factor: number("factor", None)?,
            original_max_position_embeddings: number(
                "original_max_position_embeddings",
                Some(4096.0),
            )?,
            beta_fast: number("beta_fast", Some(32.0))?,
            beta_slow: number("beta_slow", Some(1.0))?,
            mscale: number("mscale", Some(1.0))?,
            mscale_all_dim: number("mscale_all_dim", Some(0.0))?,
        };
        let positive = [yarn.factor, yarn.beta_fast, yarn.beta_slow, yarn.base];
        if positive.iter().any(|&v| v <= 0.0) || dims < 2 {
            return Err(
                "rope_scaling of type yarn needs positive factor, beta_fast and beta_slow".into(),
            );
        }
        Ok(yarn)
    }

    /// The factor the rotated features are multiplied by before rotation.
    pub(crate) fn feature_scale(&self) -> f64 {
        let of = |m: f64| {
            if self.factor <= 1.0 {
                1.0
            } else {
                0.1 * m * self.factor.ln() + 1.0
            }
        };
        of(self.mscale) / of(self.mscale_all_dim)
    }

    /// The per-pair periods `(dims / 2,)` for [`Positions::rope`]'s
    /// `freqs`.
    pub(crate) fn freqs(&self) -> Result<Array> {
        let dims = self.dims as f64;
        // The pair whose rotations over the original context are
        // `rotations` turns.
        let correction = |rotations: f64| {
            let turns =
                self.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI);
            (dims * turns.ln()) / (2.0 * self.base.ln())
        };
        let low = correction(self.beta_fast).floor().max(0.0);
        let mut high = correction(self.beta_slow).ceil().min(dims - 1.0);
        if low == high {
            high += 0.001;
        }
        let scalar = |v: f64| Array::from_f32(v as f32);
        let arange = |stop: usize, step: usize| arange::<_, f32>(0, stop as i32, step as i32);
        let extra = scalar(self.base).power(arange(self.dims, 2)?.divide(scalar(dims))?)?;
        let inter = scalar(self.factor).multiply(&extra)?;
        let ramp = clip(
            arange(self.dims / 2, 1)?
                .subtract(scalar(low))?
                .divide(scalar(high - low))?,
            (0.0f32, 1.0f32),
        )?;
        let mask = scalar(1.0).subtract(&ramp)?;
        let blended = inter
            .multiply(&mask)?
            .add(extra.multiply(scalar(1.0).subtract(&mask)?)?)?;
        Ok(inter.multiply(&extra)?.divide(&blended)?)
    }
}

//! Rotary positions of the tokens being appended to a cache.

use mlx_rs::fast;
use mlx_rs::ops::{arange, clip};
use mlx_rs::Array;

use crate::error::Result;
use crate::nn::cache::KvCache;
use crate::nn::row_groups::RowGroup;

/// Where each row's new tokens sit: the cached length, less each row's
/// left padding (so padding does not shift positions).
pub(crate) enum Positions {
    /// Every row at the same offset.
    Same(i32),
    /// One offset per row.
    PerRow(Array),
}

impl Positions {
    pub(crate) fn of(cache: &KvCache) -> Positions {
        let position = cache.len();
        if cache.pads().iter().all(|&p| p == 0) {
            return Positions::Same(position);
        }
        let offsets: Vec<i32> = cache.pads().iter().map(|p| position - p).collect();
        Positions::PerRow(Array::from_slice(&offsets, &[offsets.len() as i32]))
    }

    /// The positions `by` places further on (the last of `by + 1` new
    /// tokens, once a forward keeps only that one).
    pub(crate) fn advanced(&self, by: i32) -> Result<Positions> {
        Ok(match self {
            Positions::Same(offset) => Positions::Same(offset + by),
            Positions::PerRow(offsets) => Positions::PerRow(offsets.add(Array::from_int(by))?),
        })
    }

    /// The positions of `group`'s rows.
    pub(crate) fn of_rows(&self, group: &RowGroup) -> Positions {
        match self {
            Positions::Same(offset) => Positions::Same(*offset),
            Positions::PerRow(offsets) => Positions::PerRow(group.of(offsets)),
        }
    }

    /// RoPE over the first `dims` features of `x` `(B, heads, L, D)`, with
    /// `base` or explicit per-pair periods `freqs`.
    pub(crate) fn rope(
        &self,
        x: &Array,
        dims: i32,
        traditional: bool,
        base: Option<f32>,
        scale: f32,
        freqs: Option<&Array>,
    ) -> Result<Array> {
        Ok(match self {
            Positions::Same(offset) => {
                fast::rope(x, dims, traditional, base, scale, *offset, freqs)?
            }
            Positions::PerRow(offsets) => {
                fast::rope_dynamic(x, dims, traditional, base, scale, offsets, freqs)?
            }
        })
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
    /// From `config.json`'s `rope_scaling`: `None` when absent or of
    /// another type (which the caller rejects or ignores as its family
    /// does), an error for a YaRN entry without its factor.
    pub(crate) fn from_scaling(
        scaling: Option<&serde_json::Value>,
        dims: usize,
        base: f64,
    ) -> std::result::Result<Option<Yarn>, String> {
        let Some(scaling) = scaling.filter(|s| !s.is_null()) else {
            return Ok(None);
        };
        let kind = scaling
            .get("rope_type")
            .or_else(|| scaling.get("type"))
            .and_then(|t| t.as_str());
        if kind != Some("yarn") {
            return Ok(None);
        }
        let number = |name: &str, default: Option<f64>| -> std::result::Result<f64, String> {
            match scaling.get(name).and_then(serde_json::Value::as_f64) {
                Some(v) if v.is_finite() => Ok(v),
                Some(v) => Err(format!("rope_scaling.{name} = {v} is not finite")),
                None => default.ok_or_else(|| format!("rope_scaling of type yarn needs `{name}`")),
            }
        };
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
        Ok(Some(yarn))
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

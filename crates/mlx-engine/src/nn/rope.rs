//! Rotary positions of the tokens being appended to a cache.

use mlx_rs::fast;
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

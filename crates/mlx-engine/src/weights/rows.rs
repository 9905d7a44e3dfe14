//! A table's rows gathered for some tokens, as the table holds them.

use std::ops::Range;

use mlx_rs::ops::dequantize;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use mlx_support::Quantization;

use crate::error::Result;
use crate::weights::unpack::{dequantize_f32, packed_span};

/// A table's rows for some tokens, `(B, L, …)`, as the table holds them
/// (see `Table::gather`). Gemma 4 reads its per-layer table a layer's
/// columns at a time: the whole rows unpacked are 35 layers wide.
pub(crate) enum GatheredRows {
    Dense(Array),
    /// `f32_rows`: unpacked to f32 ([`dequantize_f32`]), else to the scales'
    /// dtype, as the table's own lookup does.
    Packed {
        weight: Array,
        scales: Array,
        biases: Array,
        q: Quantization,
        f32_rows: bool,
    },
}

impl GatheredRows {
    /// `columns` of every row, `(B, L, columns.len())`: the values a lookup
    /// gives there.
    pub(crate) fn columns(&self, columns: Range<usize>) -> Result<Array> {
        let range = |r: Range<usize>| r.start as i32..r.end as i32;
        Ok(match self {
            GatheredRows::Dense(a) => a.index((.., .., range(columns))),
            GatheredRows::Packed {
                weight,
                scales,
                biases,
                q,
                f32_rows,
            } => {
                // A layer's columns of Gemma 4's table need not be whole
                // groups: the covering groups are unpacked.
                let (words, groups, first) = packed_span(*q, columns.clone());
                let w = weight.index((.., .., words));
                let (s, b) = (
                    scales.index((.., .., groups.clone())),
                    biases.index((.., .., groups)),
                );
                let dense = if *f32_rows {
                    dequantize_f32(&w, &s, &b, *q)?
                } else {
                    dequantize(&w, &s, &b, q.group_size, q.bits)?
                };
                if dense.dim(-1) as usize == columns.len() {
                    dense
                } else {
                    dense.index((.., .., range(columns.start - first..columns.end - first)))
                }
            }
        })
    }

    /// The rows of position `at` of axis 1 alone, the axis kept.
    pub(crate) fn at_position(&self, at: i32) -> Result<GatheredRows> {
        let keep = |a: &Array| crate::ops::at_position(a, 1, at);
        Ok(match self {
            GatheredRows::Dense(a) => GatheredRows::Dense(keep(a)?),
            GatheredRows::Packed {
                weight,
                scales,
                biases,
                q,
                f32_rows,
            } => GatheredRows::Packed {
                weight: keep(weight)?,
                scales: keep(scales)?,
                biases: keep(biases)?,
                q: *q,
                f32_rows: *f32_rows,
            },
        })
    }
}

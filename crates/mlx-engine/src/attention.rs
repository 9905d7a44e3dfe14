//! Grouped-query attention over a shared prefix and the rows' own positions.
//!
//! MLX's fused attention has no CPU kernel: on the CPU it falls back to
//! matrix products that repeat each key/value head for its query heads and
//! read every row's copy of a prompt cache. Here the query heads that share
//! a key/value head are stacked into one matrix (fewer, larger products),
//! and the shared prefix is read once for the whole batch.

use mlx_rs::ops::{maximum, select};
use mlx_rs::Array;

use crate::cache::LayerMask;
use crate::error::Result;
use crate::fused::exp_shifted;

/// `softmax(q·kᵀ·scale, masked) · v` for queries `q` `(B, heads, L, D)`.
///
/// `shared` keys/values are `(kv_heads, P, D)`, read by every row; `own`
/// are `(B, kv_heads, T, D)`. `mask.own` `(B or 1, 1, L, T)` and
/// `mask.shared` `(B, L, P)` (true = may attend) hide what a query may not
/// see. Returns `(B, heads, L, D)`.
pub(crate) fn attention(
    q: &Array,
    shared: Option<(&Array, &Array)>,
    own: (&Array, &Array),
    mask: &LayerMask,
    scale: f32,
) -> Result<Array> {
    let (b, heads, l, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let kv_heads = own.0.dim(1);
    let group = heads / kv_heads;
    // Query heads `h` of one group use key/value head `h / group`: as rows
    // of one matrix, `(B, kv_heads, group·L, D)`.
    let q = q
        .multiply(Array::from_f32(scale))?
        .reshape(&[b, kv_heads, group * l, d])?;
    let mut own_scores = q.matmul(own.0.swap_axes(-1, -2)?)?;
    if let Some(mask) = &mask.own {
        let t = own.0.dim(2);
        let grouped = own_scores.reshape(&[b, kv_heads, group, l, t])?;
        let mask = mask.expand_dims(1)?;
        own_scores = select(&mask, &grouped, Array::from_f32(f32::MIN))?.reshape(&[
            b,
            kv_heads,
            group * l,
            t,
        ])?;
    }
    // Softmax with the normalisation after the products: `Σ eˢ·v / Σ eˢ`
    // divides `D` values per query instead of every score, and the prefix
    // and own parts need no concatenation.
    let max_of = |s: &Array| s.max_axis(-1, true);
    let Some((shared_keys, shared_values)) = shared else {
        let e = exp_shifted(&own_scores, &max_of(&own_scores)?)?;
        let sum = e.sum_axis(-1, true)?;
        return Ok(e.matmul(own.1)?.divide(sum)?.reshape(&[b, heads, l, d])?);
    };
    // Every row's queries against the prefix at once: `(kv_heads, B·group·L, D)`.
    let across = |a: &Array, width: i32| -> Result<Array> {
        Ok(a.transpose_axes(&[1, 0, 2, 3])?
            .reshape(&[kv_heads, b * group * l, width])?)
    };
    let back = |a: Array, width: i32| -> Result<Array> {
        Ok(a.reshape(&[kv_heads, b, group * l, width])?
            .transpose_axes(&[1, 0, 2, 3])?)
    };
    // The prefix's scores stay in the across-rows layout: exponentials,
    // sums and the product with the values read them contiguously, and only
    // per-query columns (maximum, sum) and the `D`-wide result change layout.
    let mut shared_scores = across(&q, d)?.matmul(shared_keys.swap_axes(-1, -2)?)?;
    if let Some(mask) = &mask.shared {
        // `(B, L, P)` against the scores' `(kv_heads, B, group, L, P)`.
        let p = shared_keys.dim(1);
        let grouped = shared_scores.reshape(&[kv_heads, b, group, l, p])?;
        let mask = mask.expand_dims(1)?;
        shared_scores = select(&mask, &grouped, Array::from_f32(f32::MIN))?.reshape(&[
            kv_heads,
            b * group * l,
            p,
        ])?;
    }
    let max = maximum(back(max_of(&shared_scores)?, 1)?, max_of(&own_scores)?)?;
    let e_shared = exp_shifted(&shared_scores, &across(&max, 1)?)?;
    let e_own = exp_shifted(&own_scores, &max)?;
    let sum = back(e_shared.sum_axis(-1, true)?, 1)?.add(e_own.sum_axis(-1, true)?)?;
    let from_shared = back(e_shared.matmul(shared_values)?, d)?;
    let from_own = e_own.matmul(own.1)?;
    Ok(from_shared
        .add(from_own)?
        .divide(sum)?
        .reshape(&[b, heads, l, d])?)
}

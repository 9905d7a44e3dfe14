//! Grouped-query attention over a shared prefix and the rows' own positions.
//!
//! MLX's fused attention has no CPU kernel: on the CPU it falls back to
//! matrix products that repeat each key/value head for its query heads and
//! read every row's copy of a prompt cache. Here the query heads that share
//! a key/value head are stacked into one matrix (fewer, larger products),
//! and the shared prefix is read once for the whole batch.

use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::ops::{broadcast_to, concatenate, maximum, ones, select};
use mlx_rs::{Array, Dtype};

use crate::error::Result;
use crate::nn::cache::LayerMask;
use crate::nn::fused::exp_shifted;
use crate::nn::row_groups::in_row_groups;
use crate::ops::rows_within;

/// The f32 bytes of one group of rows' scores (see [`attention`]).
const SCORES_BYTES: usize = 8 << 20;

/// `softmax(q·kᵀ·scale, masked) · v` for queries `q` `(B, heads, L, D)`.
///
/// `shared` keys/values are `(kv_heads, P, D)`, read by every row; `own`
/// are `(B, kv_heads, T, D)`. `mask.own` `(B or 1, 1, L, T)` and
/// `mask.shared` `(B, L, P)` (true = may attend) hide what a query may not
/// see. `sinks` `(heads,)` (gpt_oss) are one more score per head that
/// every query's softmax counts and no value answers: a learned share of
/// attention that goes nowhere. Returns `(B, heads, L, D)`.
///
/// Rows are attended a group at a time, each group's scores under
/// [`SCORES_BYTES`] and evaluated before the next group's exist: a prefill
/// of many long rows otherwise holds its scores several times over (the
/// exponential's parts are separate kernels), ~100 MiB per layer for 8
/// rows of ~110 tokens after E2B's 700-token prefix. Rows are independent,
/// so the groups' results are the rows' own.
pub(crate) fn attention(
    q: &Array,
    shared: Option<(&Array, &Array)>,
    own: (&Array, &Array),
    mask: &LayerMask,
    scale: f32,
    sinks: Option<&Array>,
) -> Result<Array> {
    if q.dtype() != Dtype::Float32 {
        return mlx_attention(q, shared, own, mask, scale, sinks);
    }
    let (b, heads, l) = (q.dim(0) as usize, q.dim(1) as usize, q.dim(2) as usize);
    let keys = own.0.dim(2) as usize + shared.map_or(0, |(k, _)| k.dim(1) as usize);
    let per_row = 4 * heads * l * keys;
    in_groups_of(
        q,
        shared,
        own,
        mask,
        scale,
        sinks,
        rows_within(SCORES_BYTES, per_row, b),
    )
}

/// [`attention`] in the activations' own reduced precision (bfloat16 or
/// float16): MLX's attention, called as mlx_lm calls it, on the prefix's
/// keys and the rows' own side by side. The products above would promote
/// such activations to f32 (their scale and masking constants are f32):
/// more exact, but not what mlx_lm computes, and on Apple GPUs MLX's fused
/// kernel is the fast path for these types anyway. The prefix is copied
/// per row here, as each of mlx_lm's rows holds its own copy.
fn mlx_attention(
    q: &Array,
    shared: Option<(&Array, &Array)>,
    own: (&Array, &Array),
    mask: &LayerMask,
    scale: f32,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (b, l) = (q.dim(0), q.dim(2));
    let t = own.0.dim(2);
    let Some((shared_keys, shared_values)) = shared else {
        let mask = mask.own.as_ref().map(ScaledDotProductAttentionMask::Array);
        return Ok(scaled_dot_product_attention(
            q, own.0, own.1, scale, mask, sinks,
        )?);
    };
    let p = shared_keys.dim(1);
    let per_row = |prefix: &Array, rows: &Array| -> Result<Array> {
        let shape = [b, prefix.dim(0), p, prefix.dim(2)];
        let prefix = broadcast_to(prefix.expand_dims(0)?, &shape)?;
        Ok(concatenate(&[prefix, rows.clone()], 2)?)
    };
    let keys = per_row(shared_keys, own.0)?;
    let values = per_row(shared_values, own.1)?;
    let combined = match (&mask.shared, &mask.own) {
        (None, None) => None,
        (shared_mask, own_mask) => {
            let shared_mask = match shared_mask {
                Some(m) => m.expand_dims(1)?,
                None => ones::<bool>(&[b, 1, l, p])?,
            };
            let own_mask = match own_mask {
                Some(m) => broadcast_to(m, &[b, 1, l, t])?,
                None => ones::<bool>(&[b, 1, l, t])?,
            };
            Some(concatenate(&[shared_mask, own_mask], 3)?)
        }
    };
    let mask = combined.as_ref().map(ScaledDotProductAttentionMask::Array);
    Ok(scaled_dot_product_attention(
        q, &keys, &values, scale, mask, sinks,
    )?)
}

/// [`attention`] `rows` rows at a time.
fn in_groups_of(
    q: &Array,
    shared: Option<(&Array, &Array)>,
    own: (&Array, &Array),
    mask: &LayerMask,
    scale: f32,
    sinks: Option<&Array>,
    rows: usize,
) -> Result<Array> {
    in_row_groups(q.dim(0) as usize, rows, |g| {
        rows_attention(
            &g.of(q),
            shared,
            (&g.of(own.0), &g.of(own.1)),
            &mask.of_rows(g),
            scale,
            sinks,
        )
    })
}

/// [`attention`] for all of `q`'s rows at once.
fn rows_attention(
    q: &Array,
    shared: Option<(&Array, &Array)>,
    own: (&Array, &Array),
    mask: &LayerMask,
    scale: f32,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (b, heads, l, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let kv_heads = own.0.dim(1);
    let group = heads / kv_heads;
    // Each query's sink, in the grouped queries' layout `(1, kv_heads,
    // group·L, 1)`.
    let sinks = match sinks {
        Some(s) => {
            let s = s.as_dtype(Dtype::Float32)?.reshape(&[kv_heads, group, 1])?;
            let s = broadcast_to(&s, &[kv_heads, group, l])?;
            Some(s.reshape(&[1, kv_heads, group * l, 1])?)
        }
        None => None,
    };
    // The softmax's largest score, the sink counted; and its sum, the
    // sink's exponential added.
    let with_sink = |max: Array| -> Result<Array> {
        Ok(match &sinks {
            Some(s) => maximum(&max, s)?,
            None => max,
        })
    };
    let sink_added = |sum: Array, max: &Array| -> Result<Array> {
        Ok(match &sinks {
            Some(s) => sum.add(s.subtract(max)?.exp()?)?,
            None => sum,
        })
    };
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
        let max = with_sink(max_of(&own_scores)?)?;
        let e = exp_shifted(&own_scores, &max)?;
        let sum = sink_added(e.sum_axis(-1, true)?, &max)?;
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
    let max = with_sink(maximum(
        back(max_of(&shared_scores)?, 1)?,
        max_of(&own_scores)?,
    )?)?;
    let e_shared = exp_shifted(&shared_scores, &across(&max, 1)?)?;
    let e_own = exp_shifted(&own_scores, &max)?;
    let sum = sink_added(
        back(e_shared.sum_axis(-1, true)?, 1)?.add(e_own.sum_axis(-1, true)?)?,
        &max,
    )?;
    let from_shared = back(e_shared.matmul(shared_values)?, d)?;
    let from_own = e_own.matmul(own.1)?;
    Ok(from_shared
        .add(from_own)?
        .divide(sum)?
        .reshape(&[b, heads, l, d])?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::max_abs_diff;
    use mlx_rs::random;

    /// Rows attended a group at a time give what all rows at once give,
    /// with row-wise masks of both kinds and a mask shared by every row.
    #[test]
    fn row_groups_equal_all_rows_at_once() {
        let key = |seed| random::key(seed).unwrap();
        let normal =
            |shape: &[i32], seed| random::normal::<f32>(shape, None, None, &key(seed)).unwrap();
        let p_true = Array::from_f32(0.7);
        let coin = |shape: &[i32], seed| random::bernoulli(&p_true, shape, &key(seed)).unwrap();
        let (b, heads, kv_heads, l, d, p, t) = (5, 4, 2, 3, 8, 7, 4);
        let q = normal(&[b, heads, l, d], 1);
        let shared = (normal(&[kv_heads, p, d], 2), normal(&[kv_heads, p, d], 3));
        let own = (
            normal(&[b, kv_heads, t, d], 4),
            normal(&[b, kv_heads, t, d], 5),
        );
        for own_rows in [b, 1] {
            let mask = LayerMask {
                own: Some(coin(&[own_rows, 1, l, t], 6)),
                shared: Some(coin(&[b, l, p], 7)),
            };
            let shared = Some((&shared.0, &shared.1));
            let own = (&own.0, &own.1);
            let whole = rows_attention(&q, shared, own, &mask, 0.3, None).unwrap();
            for rows in [1, 2, 3] {
                let grouped = in_groups_of(&q, shared, own, &mask, 0.3, None, rows).unwrap();
                assert_eq!(grouped.shape(), whole.shape());
                assert!(
                    max_abs_diff(&grouped, &whole) <= 1e-6,
                    "{rows} rows at a time, own mask of {own_rows} rows"
                );
            }
        }
    }

    /// With sinks, the grouped products give MLX's own attention (which
    /// counts each head's sink as one more score), with and without a
    /// shared prefix and masks.
    #[test]
    fn sinks_count_as_mlx_counts_them() {
        let normal = |shape: &[i32], seed| {
            random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap()
        };
        let (b, heads, kv_heads, l, d, p, t) = (3, 4, 2, 3, 8, 5, 4);
        let q = normal(&[b, heads, l, d], 21);
        let shared = (normal(&[kv_heads, p, d], 22), normal(&[kv_heads, p, d], 23));
        let own = (
            normal(&[b, kv_heads, t, d], 24),
            normal(&[b, kv_heads, t, d], 25),
        );
        let sinks = normal(&[heads], 26).multiply(Array::from_f32(3.0)).unwrap();
        let visible: Vec<bool> = (0..b * l * t).map(|i| i % 3 != 1).collect();
        let masks = [
            LayerMask::default(),
            LayerMask {
                own: Some(Array::from_slice(&visible, &[b, 1, l, t])),
                shared: None,
            },
        ];
        for mask in &masks {
            for shared in [None, Some((&shared.0, &shared.1))] {
                let own = (&own.0, &own.1);
                let ours = rows_attention(&q, shared, own, mask, 0.4, Some(&sinks)).unwrap();
                let mlx = mlx_attention(&q, shared, own, mask, 0.4, Some(&sinks)).unwrap();
                let without = rows_attention(&q, shared, own, mask, 0.4, None).unwrap();
                assert!(max_abs_diff(&ours, &mlx) <= 1e-5, "{:?}", shared.is_some());
                assert!(max_abs_diff(&ours, &without) > 1e-2, "the sinks count");
            }
        }
    }
}

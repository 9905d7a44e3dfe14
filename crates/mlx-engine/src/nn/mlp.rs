//! The gated feed-forward block every decoder here has:
//! `down(act(gate(x), up(x)))`, with `act` SiLU or tanh-GELU times `up`.
//!
//! Why its own home: with packed weights unpacked before each product
//! (`QuantizedWeights::DequantizeOnUse`), the block runs a slice of the
//! intermediate width at a time. Each slice's gate and up columns, its
//! activation and its share of the down projection (the matching columns
//! of the down matrix, a product over part of the inner dimension) are
//! computed and added to the output before the next slice is unpacked.
//! So a forward holds one slice's activations, not the whole intermediate
//! width's several times over (gate, up, their joined parts, the
//! activation): for a prefill of 8 rows of ~110 tokens through E2B's
//! layers that was ~240 MiB above the weights, most of the engine's peak.
//! The products and the unpacking are the same work either way.

use mlx_rs::Array;

use crate::error::Result;
use crate::evaluation::{evaluate, Why};
use crate::weights::slices::slice_rows;
use crate::weights::Linear;

/// The f32 bytes of one slice's activations at most, e.g. its gate
/// columns for every row: a slice is evaluated as one graph, which holds
/// several arrays of that size at once (gate, up, the activation's parts).
const ACTIVATION_BYTES: usize = 4 << 20;

/// `down(act(gate(x), up(x)))`.
pub(crate) fn gated_mlp(
    x: &Array,
    gate: &Linear,
    up: &Linear,
    down: &Linear,
    act: impl Fn(&Array, &Array) -> Result<Array>,
) -> Result<Array> {
    // Weights taken whole by their products (dense, packed for MLX's
    // quantized products, with a bias, or unpacked in different ways):
    // the whole block at once.
    let whole = || down.forward(&act(&gate.forward(x)?, &up.forward(x)?)?);
    let groups = [gate, up, down].map(|l| l.slice_group());
    let [Some(q), Some(u), Some(d)] = groups else {
        return whole();
    };
    if q != u || q != d {
        return whole();
    }
    // As wide as one unpacked 16 MiB slice of a row-major matrix (see
    // `slice_rows`), and narrower where the rows' activations of a slice
    // would pass `ACTIVATION_BYTES`; in whole quantization groups.
    let group = q.group_size as usize;
    let dim = x.dim(-1) as usize;
    let rows = x.size() / dim.max(1);
    let columns = slice_rows(dim).min(ACTIVATION_BYTES / (4 * rows).max(1));
    let width = (columns / group).max(1) * group;
    in_slices(x, [gate, up, down], &act, width)
}

/// [`gated_mlp`] a `width` of intermediate columns at a time, each slice's
/// share of the output evaluated before the next slice exists.
fn in_slices(
    x: &Array,
    [gate, up, down]: [&Linear; 3],
    act: &impl Fn(&Array, &Array) -> Result<Array>,
    width: usize,
) -> Result<Array> {
    let inner = gate.outputs();
    let slice = |start: usize| -> Result<Array> {
        let columns = start..(start + width).min(inner);
        let activated = act(
            &gate.forward_outputs(x, columns.clone())?,
            &up.forward_outputs(x, columns.clone())?,
        )?;
        down.forward_columns(&activated, columns)
    };
    let mut out = slice(0)?;
    evaluate(Why::Piece, [&out])?;
    for start in (width..inner).step_by(width) {
        out = out.add(&slice(start)?)?;
        evaluate(Why::Piece, [&out])?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::quantize;
    use mlx_rs::random;
    use mlx_support::Quantization;

    use crate::nn::fused::silu_mul;
    use crate::test_support::max_abs_diff;

    fn packed(rows: i32, cols: i32, seed: u64) -> Linear {
        let key = random::key(seed).unwrap();
        let w = random::normal::<f32>(&[rows, cols], None, None, &key).unwrap();
        let (weight, scales, biases) = quantize(&w, 32, 4).unwrap();
        crate::weights::linear::packed_on_use(weight, scales, biases, Quantization::affine(32, 4))
    }

    /// Sliced or whole, the block gives the same values: only the down
    /// projection's sum over the intermediate width is split, so they
    /// agree to rounding. Slices that do not divide the width included.
    #[test]
    fn sliced_block_equals_the_whole_one() {
        let (hidden, inner) = (64, 224);
        let (gate, up, down) = (
            packed(inner, hidden, 1),
            packed(inner, hidden, 2),
            packed(hidden, inner, 3),
        );
        let key = random::key(4).unwrap();
        let x = random::normal::<f32>(&[2, 5, hidden], None, None, &key).unwrap();
        let act = |g: &Array, u: &Array| Ok(silu_mul(g, u)?);
        let whole = down
            .forward(&act(&gate.forward(&x).unwrap(), &up.forward(&x).unwrap()).unwrap())
            .unwrap();
        for width in [32, 64, 96, 224, 256] {
            let sliced = in_slices(&x, [&gate, &up, &down], &act, width).unwrap();
            assert_eq!(sliced.shape(), whole.shape());
            let diff = max_abs_diff(&sliced, &whole);
            let scale = whole.abs().unwrap().max(None).unwrap().item_exact::<f32>();
            assert!(
                diff <= 1e-5 * scale,
                "width {width}: {diff} against values up to {scale}"
            );
        }
        // The default width covers this small block in one slice: the
        // same operations as the whole block, bit for bit.
        let default = gated_mlp(&x, &gate, &up, &down, act).unwrap();
        let bits = |a: &Array| {
            a.as_slice::<f32>()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        let whole_bits = bits(&whole);
        assert!(bits(&default) == whole_bits);
    }
}

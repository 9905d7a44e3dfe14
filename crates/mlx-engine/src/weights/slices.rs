//! Products with a matrix that is unpacked (or read from a file) a slice
//! of rows at a time, so that one slice exists at once, not the whole
//! matrix.

use mlx_rs::ops::concatenate;
use mlx_rs::Array;

use crate::error::Result;
use crate::evaluation::{evaluate, Why};
use crate::ops::rows_within;

/// The f32 bytes of the slice of rows in which a packed matrix is
/// unpacked for a product.
const SLICE_BYTES: usize = 16 << 20;

/// Rows of a `dim`-wide matrix per slice (see [`SLICE_BYTES`]).
pub(crate) fn slice_rows(dim: usize) -> usize {
    rows_in(SLICE_BYTES, dim)
}

/// The f32 bytes of the slice of rows in which a tied output head, resident
/// or left in the files, is multiplied. A head left in the files reads,
/// unpacks and multiplies a slice at a time, and this is what it adds to
/// the resident path's memory: SmolLM2 f32 at batch 8 peaked 4–10 MiB
/// lower with 8 MiB than with 16 MiB (same speed). The resident head is
/// multiplied in the same slices because with its rows as they are
/// (`x · rowsᵀ`) OpenBLAS's products of column slices are not the whole
/// product's columns bit for bit, and the two must agree.
const HEAD_SLICE_BYTES: usize = 8 << 20;

/// Rows of a tied head's `dim`-wide table per slice (see
/// [`HEAD_SLICE_BYTES`]).
pub(crate) fn head_slice_rows(dim: usize) -> usize {
    rows_in(HEAD_SLICE_BYTES, dim)
}

/// Rows of a `dim`-wide f32 matrix that fit in `bytes`, at least one.
fn rows_in(bytes: usize, dim: usize) -> usize {
    rows_within(bytes, 4 * dim.max(1), usize::MAX)
}

/// `x · Wᵀ` for a matrix `W` of `rows` rows that is unpacked (or read)
/// `step` rows at a time: `part(range)` is the product with those rows,
/// `(…, range.len())`; each is evaluated before the next slice exists, and
/// the parts are joined.
///
/// Why slices: memory, since one slice (16 MiB for a packed matrix, see
/// [`slice_rows`]) is unpacked at a time, not a
/// whole matrix (Gemma's tied head is 1.5 GiB in f32; E2B's double-wide MLP
/// matrices 150 MB); and time, since glibc serves blocks under 32 MiB
/// from heap memory it keeps, but larger ones from fresh pages that the
/// kernel zeroes every time: at E2B's sizes that was most of a forward's
/// system time. The parts are not always the whole product's columns bit
/// for bit: with `W` multiplied as `x · Wᵀ` from its rows, OpenBLAS gave
/// other bits for column slices of a dense table. Two paths that must agree
/// (a tied head resident and left in the files) therefore use the same
/// `step` ([`head_slice_rows`]).
pub(crate) fn in_row_slices(
    rows: usize,
    step: usize,
    mut part: impl FnMut(std::ops::Range<usize>) -> Result<Array>,
) -> Result<Array> {
    let step = step.max(1);
    let mut parts = Vec::with_capacity(rows.div_ceil(step));
    let mut start = 0;
    while start < rows {
        let end = (start + step).min(rows);
        let p = part(start..end)?;
        evaluate(Why::Piece, [&p])?;
        parts.push(p);
        start = end;
    }
    if parts.len() == 1 {
        return Ok(parts.swap_remove(0));
    }
    Ok(concatenate(&parts, -1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_hold_16_mib_of_f32_rows_and_at_least_one_row() {
        assert_eq!(slice_rows(1536), 2730);
        assert_eq!(slice_rows(576), 7281);
        assert_eq!(slice_rows(8 << 20), 1);
        assert_eq!(slice_rows(0), 4 << 20);
    }
}

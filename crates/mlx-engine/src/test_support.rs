//! Helpers for the crate's unit tests.

use mlx_rs::Array;

/// The largest `|a − b|` over all elements.
pub(crate) fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let diff = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap();
    diff.item_exact::<f32>()
}

//! A batch's rows worked on a group at a time.
//!
//! Why: in a prefill, some steps make arrays of rows × positions × width
//! that are large next to what the step keeps (a Gemma 4 global layer's
//! queries are 8 heads of 512 features; their attention scores grow with
//! the prompt), and MLX evaluates a lazy graph whole, with several such
//! arrays alive at once. Built and evaluated a group of rows at a time,
//! only one group's exist. The rows of a batch are independent in these
//! steps, so a group's result is its rows' part of the whole.
//!
//! One group covering every row is the step as it was, unsliced and
//! unevaluated, so a small batch runs exactly the same operations.

use std::ops::Range;

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use crate::error::Result;
use crate::evaluation::{evaluate, Why};

/// Some consecutive rows (axis 0) of a batch.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RowGroup {
    range: Range<i32>,
    /// Every row of the batch: arrays are taken as they are.
    whole: bool,
}

impl RowGroup {
    /// How many rows.
    pub(crate) fn len(&self) -> i32 {
        self.range.len() as i32
    }

    /// `a`'s rows of this group; `a` itself when the group is every row.
    pub(crate) fn of(&self, a: &Array) -> Array {
        if self.whole {
            a.clone()
        } else {
            a.index(self.range.clone())
        }
    }

    /// [`of`](Self::of), except that an array of one row, which applies to
    /// every row (a broadcast mask), is taken as it is.
    pub(crate) fn of_broadcast(&self, a: &Array) -> Array {
        if a.dim(0) == 1 {
            a.clone()
        } else {
            self.of(a)
        }
    }
}

/// `part(group)` for `rows` rows, `step` at a time, joined along axis 0.
/// With more than one group, each part is evaluated before the next is
/// built; with one, `part` of every row comes back as it is (lazy).
pub(crate) fn in_row_groups(
    rows: usize,
    step: usize,
    mut part: impl FnMut(&RowGroup) -> Result<Array>,
) -> Result<Array> {
    let step = step.max(1);
    if step >= rows {
        return part(&RowGroup {
            range: 0..rows as i32,
            whole: true,
        });
    }
    let mut parts = Vec::with_capacity(rows.div_ceil(step));
    for start in (0..rows).step_by(step) {
        let group = RowGroup {
            range: start as i32..(start + step).min(rows) as i32,
            whole: false,
        };
        let p = part(&group)?;
        evaluate(Why::Piece, [&p])?;
        parts.push(p);
    }
    Ok(concatenate(&parts, 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_cover_the_rows_in_order_and_one_group_is_the_whole() {
        let a = Array::from_iter(0..10i32, &[5, 2]);
        let mut seen = Vec::new();
        let joined = in_row_groups(5, 2, |g| {
            seen.push((g.range.clone(), g.whole, g.len()));
            Ok(g.of(&a).multiply(Array::from_int(3))?)
        })
        .unwrap();
        assert_eq!(
            seen,
            vec![(0..2, false, 2), (2..4, false, 2), (4..5, false, 1)]
        );
        let tripled: Vec<i32> = (0..10).map(|v| v * 3).collect();
        assert_eq!(joined.as_slice::<i32>(), tripled.as_slice());

        let mut groups = Vec::new();
        in_row_groups(5, 5, |g| {
            groups.push(g.clone());
            Ok(g.of(&a))
        })
        .unwrap();
        assert_eq!(
            groups,
            vec![RowGroup {
                range: 0..5,
                whole: true
            }]
        );
    }

    #[test]
    fn a_one_row_array_applies_to_every_group() {
        let group = RowGroup {
            range: 1..3,
            whole: false,
        };
        let one = Array::from_iter(0..4i32, &[1, 4]);
        assert_eq!(group.of_broadcast(&one).shape(), &[1, 4]);
        let many = Array::from_iter(0..16i32, &[4, 4]);
        let rows = group.of_broadcast(&many);
        assert_eq!(rows.as_slice::<i32>(), &(4..12).collect::<Vec<_>>()[..]);
    }
}

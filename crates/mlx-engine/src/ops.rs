//! The few array helpers every folder of the engine uses, at the bottom of
//! its order (docs/ARCHITECTURE.md): a position kept along an axis, rows
//! per group within a byte budget, and MLX-compiled functions kept per
//! thread. They import nothing of the engine but its errors.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;

use crate::error::Result;

/// `a`'s position `at` along `axis`, the axis kept (of length 1): what a
/// forward keeps once only its last position is read (see
/// `Model::forward_last`).
pub(crate) fn at_position(a: &Array, axis: i32, at: i32) -> Result<Array> {
    Ok(a.take_axis(Array::from_slice(&[at], &[1]), axis)?)
}

/// Rows per group so that a group's `per_row` bytes stay within `budget`:
/// at least one row, at most `rows`.
pub(crate) fn rows_within(budget: usize, per_row: usize, rows: usize) -> usize {
    (budget / per_row.max(1)).clamp(1, rows.max(1))
}

/// A function MLX compiled, as a thread keeps it.
pub(crate) type Compiled = Box<dyn for<'a> FnMut(&'a [Array]) -> Result<Vec<Array>, Exception>>;
/// A thread's compiled function (a `thread_local!` of [`compiled`]).
pub(crate) type CompiledKey = std::thread::LocalKey<RefCell<Compiled>>;

/// `f` compiled for any shapes (traced once).
pub(crate) fn compiled(f: fn(&[Array]) -> Result<Vec<Array>, Exception>) -> RefCell<Compiled> {
    RefCell::new(Box::new(compile(f, true)))
}

/// Calls this thread's compiled `f` on `args`, expecting `N` results.
pub(crate) fn call<const N: usize>(
    f: &'static CompiledKey,
    args: &[Array],
) -> Result<[Array; N], Exception> {
    let out = f.with(|f| (f.borrow_mut())(args))?;
    out.try_into()
        .map_err(|_| Exception::custom("a compiled kernel returned the wrong number of arrays"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_within_a_budget_are_at_least_one_and_at_most_all() {
        assert_eq!(rows_within(8 << 20, 1 << 20, 32), 8);
        assert_eq!(rows_within(8 << 20, 9 << 20, 32), 1);
        assert_eq!(rows_within(8 << 20, 1, 32), 32);
        assert_eq!(rows_within(8 << 20, 0, 0), 1);
    }
}

//! How a product is cut into tiles and shared out over threads.

use crate::pool::Workers;

/// Outputs per panel: two AVX-512 registers of f32.
pub const PANEL: usize = 32;

/// Rows a kernel sums at once: two registers of sums each, sixteen in all.
pub const TILE_ROWS: usize = 8;

/// One tile of a product in panels: `rows` (at most [`TILE_ROWS`]) rows
/// from `row` on, times panel `panel`, whose `PANEL` sums per row go to
/// `y`, rows `stride` floats apart.
pub(crate) struct Tile {
    pub panel: usize,
    pub row: usize,
    pub rows: usize,
    /// Row `row`'s first sum of the panel's columns.
    pub y: *mut f32,
    pub stride: usize,
}

/// Calls `kernel` on every tile of `y` `(rows, count · PANEL)`, the panels
/// shared out over `workers`. Each tile's `PANEL` columns of its rows are
/// its own: no other call writes them, so a kernel may write all of them
/// through [`Tile::y`] (and nothing else). A panel's tiles come one after
/// another, in the rows' order, on one thread: a kernel may prepare a
/// panel at its first tile (`row == 0`) and use it for the rest.
///
/// The caller has checked that `y` is `rows × count · PANEL` floats.
pub(crate) fn each_tile(
    rows: usize,
    count: usize,
    y: &mut [f32],
    workers: Workers<'_>,
    kernel: impl Fn(Tile) + Sync,
) {
    debug_assert_eq!(y.len(), rows * count * PANEL);
    if rows == 0 || count == 0 || y.len() != rows * count * PANEL {
        return;
    }
    let out = Columns {
        y: y.as_mut_ptr(),
        row_len: count * PANEL,
    };
    let run = |panels: std::ops::Range<usize>| {
        for panel in panels {
            for row in (0..rows).step_by(TILE_ROWS) {
                kernel(Tile {
                    panel,
                    row,
                    rows: (rows - row).min(TILE_ROWS),
                    // SAFETY: `row < rows` and `panel < count`, so this
                    // is inside `y` (its length was checked above).
                    y: unsafe { out.at(row * out.row_len + panel * PANEL) },
                    stride: out.row_len,
                });
            }
        }
    };
    // Whole panels per task, a few tasks per thread: enough to even the
    // work out without splitting a small product to dust.
    let per_task = count.div_ceil(workers.threads() * 4).max(1);
    workers.each(count.div_ceil(per_task), |task| {
        run(task * per_task..((task + 1) * per_task).min(count));
    });
}

/// Where a product's sums go: `y`, rows of `row_len`.
struct Columns {
    y: *mut f32,
    row_len: usize,
}

impl Columns {
    /// The sum at `offset` in `y`.
    ///
    /// # Safety
    /// `offset` is inside `y`.
    unsafe fn at(&self, offset: usize) -> *mut f32 {
        // SAFETY: inside `y` (the caller).
        unsafe { self.y.add(offset) }
    }
}

// SAFETY: the pointer is only offset here and handed to kernels, each tile
// to one call with its own columns (see `each_tile`), while `each_tile`
// holds `y` mutably borrowed.
unsafe impl Sync for Columns {}

//! Products with dense f32 weights on the CPU, made for a decode step's
//! few rows.
//!
//! A decode step multiplies every weight by one row per conversation (8 at
//! batch 8). BLAS packs each weight matrix before multiplying it, which for
//! so few rows costs as much as the product: SmolLM2's 210 matrices took
//! 59–64 ms on OpenBLAS's two threads where reading them once takes about
//! 20 (docs/benchmarks.md, "Dense weights in panels"). So on the CPU a
//! dense f32 weight is held *in panels*: `(out / PANEL, in, PANEL)`, each
//! panel the weight's next `PANEL` outputs for every input, contiguous.
//! The kernel reads each panel front to back, eight rows at a time with
//! their `PANEL` sums in registers; the rows after the first eight find
//! the panel in the cache. Every product of such a weight runs here: BLAS
//! cannot read panels, and the `(in, out)` copy it would need cost a
//! prefill more than the kernel's arithmetic.
//!
//! Each output is summed in the inputs' order with fused multiply-adds,
//! whatever the rows around it or the threads: a row's result is the same
//! bits alone or in a batch. It is not BLAS's order, so it differs from a
//! product BLAS makes by rounding.
//!
//! The kernel is written for AVX-512 (x86-64); elsewhere (and on the GPU)
//! weights keep the `(in, out)` layout and every product goes to MLX.

use mlx_rs::Array;
use rayon::prelude::*;

use crate::error::Result;

/// Outputs per panel: two AVX-512 registers of f32.
pub(crate) const PANEL: usize = 32;

/// Whether this CPU runs the kernel.
pub(crate) fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the kernel can hold a weight `(outputs, inputs)` of `dtype`
/// on this CPU (the device and the choice of kernels are the load's:
/// `kernels::Products`).
pub(crate) fn holds_in_panels(outputs: usize, dtype: mlx_rs::Dtype) -> bool {
    dtype == mlx_rs::Dtype::Float32 && outputs > 0 && outputs.is_multiple_of(PANEL) && supported()
}

/// `w` `(out, in)` in panels `(out / PANEL, in, PANEL)`, lazily.
pub(crate) fn to_panels(w: &Array) -> Result<Array> {
    let (outputs, inputs) = (w.dim(0), w.dim(1));
    Ok(w.reshape(&[outputs / PANEL as i32, PANEL as i32, inputs])?
        .transpose_axes(&[0, 2, 1])?
        .contiguous()?)
}

/// The `(in, out)` matrix of `panels`, lazily: a copy, for BLAS.
pub(crate) fn transposed(panels: &Array) -> Result<Array> {
    let (count, inputs) = (panels.dim(0), panels.dim(1));
    Ok(panels
        .transpose_axes(&[1, 0, 2])?
        .reshape(&[inputs, count * PANEL as i32])?)
}

/// `x · W` for `x` `(…, in)` and `W` held as `panels`: `(…, out)`, in
/// f32 (as MLX promotes a narrower `x` against an f32 weight).
pub(crate) fn product(x: &Array, panels: &Array) -> Result<Array> {
    let inputs = panels.dim(1) as usize;
    let outputs = panels.dim(0) as usize * PANEL;
    let fallback = || Ok(x.matmul(transposed(panels)?)?);
    on_host(x, inputs, outputs, fallback, |xs, rows, sums, threads| {
        multiply(xs, rows, inputs, host_f32(panels)?, sums, threads);
        Ok(())
    })
}

/// A product `(…, in)` → `(…, out)` of `x` computed on the host by
/// `kernel(x, rows, sums, threads)`, which writes the f32 sums `(rows,
/// out)` straight into the result's buffer. `fallback` (MLX's product)
/// answers instead where the kernel cannot: no rows, a width that does not
/// fit (MLX's error names the shapes), or no AVX-512.
pub(crate) fn on_host(
    x: &Array,
    inputs: usize,
    outputs: usize,
    fallback: impl FnOnce() -> Result<Array>,
    kernel: impl FnOnce(&[f32], usize, &mut [f32], usize) -> Result<()>,
) -> Result<Array> {
    let fits = x.ndim() > 0 && x.shape()[x.ndim() - 1] as usize == inputs;
    let rows = x.size().checked_div(inputs).unwrap_or(0);
    if !fits || rows == 0 || !supported() {
        return fallback();
    }
    let x = if x.dtype() == mlx_rs::Dtype::Float32 {
        x.clone()
    } else {
        x.as_dtype(mlx_rs::Dtype::Float32)?
    };
    let flat = x.reshape(&[rows as i32, inputs as i32])?.contiguous()?;
    let xs = host_f32(&flat)?;
    let threads = mlx_support::blas_threads().unwrap_or(1).max(1);
    let y = host_written("few_rows::product", &[rows, outputs], |sums| {
        kernel(xs, rows, sums, threads)
    })?;
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = outputs as i32;
    }
    Ok(y.reshape(&shape)?)
}

/// A new f32 array of `shape` whose values `fill` writes on the host,
/// straight into MLX's buffer (`what` names it in errors).
pub(crate) fn host_written(
    what: &str,
    shape: &[usize],
    fill: impl FnOnce(&mut [f32]) -> Result<()>,
) -> Result<Array> {
    mlx_support::array_written::<crate::error::Error>(what, st_mmap::Dtype::F32, shape, |bytes| {
        // SAFETY: any bit pattern is an f32; `align_to_mut` only yields
        // the part of the buffer that is aligned for one.
        let (head, values, tail) = unsafe { bytes.align_to_mut::<f32>() };
        if !head.is_empty() || !tail.is_empty() {
            return Err(host_error("MLX's buffer is not aligned for f32"));
        }
        fill(values)
    })
}

/// The evaluated, row-contiguous f32 data of `a`.
pub(crate) fn host_f32(a: &Array) -> Result<&[f32]> {
    a.try_as_slice::<f32>()
        .map_err(|e| host_error(&format!("reading an f32 array on the host: {e}")))
}

pub(crate) fn host_error(what: &str) -> crate::error::Error {
    crate::error::Error::Mlx(mlx_rs::error::Exception::custom(what))
}

/// `y` `(rows, outputs)` = `x` `(rows, inputs)` times the weight held as
/// `panels` `(outputs / PANEL, inputs, PANEL)`, the panels shared out over
/// `threads` (each thread writes its panels' columns of every row).
///
/// # Panics
/// When the slices' lengths do not fit `rows` and `inputs`, or the CPU
/// lacks the kernel's instructions ([`supported`]).
pub(crate) fn multiply(
    x: &[f32],
    rows: usize,
    inputs: usize,
    panels: &[f32],
    y: &mut [f32],
    threads: usize,
) {
    let panel_len = inputs * PANEL;
    let count = if rows == 0 {
        0
    } else {
        y.len() / (rows * PANEL)
    };
    assert!(
        x.len() == rows * inputs
            && y.len() == count * rows * PANEL
            && panels.len() == count * panel_len
            && supported(),
        "few_rows::multiply: lengths do not fit, or no AVX-512"
    );
    each_tile(rows, count, y, threads, |tile| {
        let x = &x[tile.row * inputs..(tile.row + tile.rows) * inputs];
        let panel = &panels[tile.panel * panel_len..][..panel_len];
        // SAFETY: `multiply` checked that the CPU has AVX-512F; `x` is
        // `tile.rows` rows of `inputs`, `panel` is `inputs × PANEL`, and the
        // tile's sums are its own (`each_tile`).
        unsafe { panel_tile(x, inputs, panel, &tile) };
    });
}

/// `tile`'s sums: its `x` `(tile.rows, inputs)` times `panel` `(inputs,
/// PANEL)`, each output summed in the inputs' order with fused
/// multiply-adds, written through `tile.y`.
///
/// # Safety
/// The CPU has AVX-512F ([`supported`]); `x.len() == tile.rows · inputs`,
/// `panel.len() == inputs · PANEL`, `tile.rows <= TILE_ROWS`, and the tile's
/// sums are writable and its own (as [`each_tile`] hands them out).
pub(crate) unsafe fn panel_tile(x: &[f32], inputs: usize, panel: &[f32], tile: &Tile) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as the caller promises.
    unsafe {
        match tile.rows {
            1 => avx512::tile::<1>(x, inputs, panel, tile.y, tile.stride),
            2 => avx512::tile::<2>(x, inputs, panel, tile.y, tile.stride),
            3 => avx512::tile::<3>(x, inputs, panel, tile.y, tile.stride),
            4 => avx512::tile::<4>(x, inputs, panel, tile.y, tile.stride),
            5 => avx512::tile::<5>(x, inputs, panel, tile.y, tile.stride),
            6 => avx512::tile::<6>(x, inputs, panel, tile.y, tile.stride),
            7 => avx512::tile::<7>(x, inputs, panel, tile.y, tile.stride),
            _ => avx512::tile::<8>(x, inputs, panel, tile.y, tile.stride),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x, inputs, panel, tile);
        unreachable!("the panel kernels check supported()");
    }
}

/// Rows a kernel sums at once: two registers of sums each, sixteen in all.
pub(crate) const TILE_ROWS: usize = 8;

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
/// shared out over `threads`. Each tile's `PANEL` columns of its rows are
/// its own: no other call writes them, so a kernel may write all of them
/// through [`Tile::y`] (and nothing else). A panel's tiles come one after
/// another, in the rows' order, on one thread: a kernel may prepare a
/// panel at its first tile (`row == 0`) and use it for the rest.
///
/// # Panics
/// When `y` is not `rows × count · PANEL` floats.
pub(crate) fn each_tile(
    rows: usize,
    count: usize,
    y: &mut [f32],
    threads: usize,
    kernel: impl Fn(Tile) + Sync,
) {
    assert_eq!(y.len(), rows * count * PANEL, "each_tile: y does not fit");
    if rows == 0 || count == 0 {
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
    if threads <= 1 {
        run(0..count);
    } else {
        // Whole panels per task, a few tasks per thread: enough to even
        // the work out without splitting a small product to dust.
        let per_task = count.div_ceil(threads * 4).max(1);
        (0..count.div_ceil(per_task))
            .into_par_iter()
            .for_each(|task| run(task * per_task..((task + 1) * per_task).min(count)));
    }
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

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps,
    };

    use super::PANEL;

    /// The `(R, PANEL)` sums of `x` `(R, inputs)` · `panel` `(inputs,
    /// PANEL)`, written at `y`, rows `stride` apart: the panel read once,
    /// front to back, into 2·R registers of sums.
    ///
    /// # Safety
    /// The CPU has AVX-512F, `x.len() == R * inputs`, `panel.len() ==
    /// inputs * PANEL`, and `PANEL` floats at `y + r * stride` for each
    /// `r < R` are writable and not written by anyone else meanwhile.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile<const R: usize>(
        x: &[f32],
        inputs: usize,
        panel: &[f32],
        y: *mut f32,
        stride: usize,
    ) {
        debug_assert!(x.len() == R * inputs && panel.len() == inputs * PANEL);
        let mut low = [_mm512_setzero_ps(); R];
        let mut high = [_mm512_setzero_ps(); R];
        for k in 0..inputs {
            // SAFETY: row k of the panel is `panel[k * PANEL..][..PANEL]`,
            // inside it (the caller's lengths); unaligned loads.
            let (w_low, w_high) = unsafe {
                let at = panel.as_ptr().add(k * PANEL);
                (_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(16)))
            };
            for r in 0..R {
                // SAFETY: r < R and k < inputs, inside `x`.
                let b = _mm512_set1_ps(unsafe { *x.get_unchecked(r * inputs + k) });
                low[r] = _mm512_fmadd_ps(b, w_low, low[r]);
                high[r] = _mm512_fmadd_ps(b, w_high, high[r]);
            }
        }
        for r in 0..R {
            // SAFETY: row r's `PANEL` sums at `y + r * stride` (the caller).
            unsafe {
                let at = y.add(r * stride);
                _mm512_storeu_ps(at, low[r]);
                _mm512_storeu_ps(at.add(16), high[r]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use mlx_rs::random;

    use super::*;
    use crate::test_support::max_abs_diff;

    /// Through MLX: one tile of rows and more (the kernel where the CPU
    /// has it), and a narrower input, give `x · Wᵀ` in `x`'s shape; a width
    /// that does not fit is MLX's error.
    #[test]
    fn products_in_panels_equal_the_plain_product() {
        let key = random::key(7).unwrap();
        let w = random::normal::<f32>(&[96, 40], None, None, &key).unwrap();
        let panels = to_panels(&w).unwrap();
        assert_eq!(panels.shape(), &[3, 40, PANEL as i32]);
        for shape in [[1, 3, 40], [2, 4, 40], [3, 5, 40]] {
            let key = random::key(shape[1] as u64).unwrap();
            let x = random::normal::<f32>(&shape, None, None, &key).unwrap();
            let got = product(&x, &panels).unwrap();
            let want = x.matmul(w.t()).unwrap();
            assert_eq!(got.shape(), want.shape());
            let diff = max_abs_diff(&got, &want);
            assert!(diff < 1e-4, "{shape:?}: {diff}");
        }
        let narrow = random::normal::<f32>(&[2, 40], None, None, &key)
            .unwrap()
            .as_dtype(mlx_rs::Dtype::Bfloat16)
            .unwrap();
        let got = product(&narrow, &panels).unwrap();
        assert_eq!(got.dtype(), mlx_rs::Dtype::Float32);
        let want = narrow.matmul(w.t()).unwrap();
        assert!(max_abs_diff(&got, &want) < 1e-4);
        let wrong = mlx_rs::ops::ones::<f32>(&[2, 41]).unwrap();
        let refused = product(&wrong, &panels).and_then(|y| Ok(y.eval()?));
        assert!(refused.is_err(), "a width that does not fit is MLX's error");
    }

    /// A deterministic spread of values, some negative.
    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0) - 1.0)
            .collect()
    }

    /// Each output against an f64 sum, every row count up to two tiles,
    /// inputs not a multiple of anything, one and two threads the same bits,
    /// and a row alone the same bits as in a batch.
    #[test]
    fn kernel_sums_match_a_double_precision_product() {
        if !supported() {
            eprintln!("SKIPPED: this CPU has no AVX-512F; products go to BLAS");
            return;
        }
        let (inputs, count) = (77, 3);
        let panels = values(count * inputs * PANEL, 1);
        for rows in 1..=17 {
            let x = values(rows * inputs, rows);
            let mut one = vec![0f32; rows * count * PANEL];
            let mut two = vec![0f32; rows * count * PANEL];
            multiply(&x, rows, inputs, &panels, &mut one, 1);
            multiply(&x, rows, inputs, &panels, &mut two, 2);
            assert_eq!(one, two, "{rows} rows: threads changed the sums");
            for p in 0..count {
                for r in 0..rows {
                    for c in 0..PANEL {
                        let exact: f64 = (0..inputs)
                            .map(|k| {
                                f64::from(x[r * inputs + k])
                                    * f64::from(panels[(p * inputs + k) * PANEL + c])
                            })
                            .sum();
                        let got = one[r * count * PANEL + p * PANEL + c];
                        assert!(
                            (f64::from(got) - exact).abs() < 1e-4,
                            "{rows} rows, panel {p}, row {r}, column {c}: {got} against {exact}"
                        );
                    }
                }
            }
            let last = rows - 1;
            let mut alone = vec![0f32; count * PANEL];
            multiply(&x[last * inputs..], 1, inputs, &panels, &mut alone, 1);
            assert_eq!(
                alone[..],
                one[last * count * PANEL..],
                "{rows} rows: the last row alone differs"
            );
        }
    }
}

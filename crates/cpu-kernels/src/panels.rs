//! Products with dense f32 weights held in panels.
//!
//! A dense weight `(outputs, inputs)` is held as `(outputs / PANEL,
//! inputs, PANEL)`: each panel the weight's next [`PANEL`] outputs for
//! every input, contiguous. The kernel reads each panel front to back,
//! eight rows at a time with their `PANEL` sums in registers; the rows
//! after the first eight find the panel in the cache.

use crate::error::{expect, Error, Result};
use crate::isa::Isa;
use crate::pool::Workers;
use crate::tiles::{each_tile, Tile, PANEL, TILE_ROWS};

/// `y` `(rows, outputs)` = `x` `(rows, inputs)` times the weight held as
/// `panels` `(outputs / PANEL, inputs, PANEL)`, the panels shared out over
/// `workers` (each thread writes its panels' columns of every row).
///
/// # Errors
/// [`Error::Unsupported`] on a CPU the kernels do not run on ([`Isa`]);
/// [`Error::Shape`] when the slices' lengths do not fit `rows` and
/// `inputs`.
pub fn multiply(
    x: &[f32],
    rows: usize,
    inputs: usize,
    panels: &[f32],
    y: &mut [f32],
    workers: Workers<'_>,
) -> Result<()> {
    let isa = Isa::best().ok_or(Error::Unsupported)?;
    multiply_on(isa, x, rows, inputs, panels, y, workers)
}

/// [`multiply`] on `isa`, which the caller has found available.
pub(crate) fn multiply_on(
    isa: Isa,
    x: &[f32],
    rows: usize,
    inputs: usize,
    panels: &[f32],
    y: &mut [f32],
    workers: Workers<'_>,
) -> Result<()> {
    if !isa.available() {
        return Err(Error::Unsupported);
    }
    let panel_len = inputs * PANEL;
    expect("x: rows × inputs", rows * inputs, x.len())?;
    let count = y.len().checked_div(rows * PANEL).unwrap_or(0);
    expect(
        "y: rows × a multiple of PANEL",
        count * rows * PANEL,
        y.len(),
    )?;
    expect("panels: outputs × inputs", count * panel_len, panels.len())?;
    each_tile(rows, count, y, workers, |tile| {
        let x = &x[tile.row * inputs..(tile.row + tile.rows) * inputs];
        let panel = &panels[tile.panel * panel_len..][..panel_len];
        // SAFETY: checked above that the CPU runs `isa`; `x` is
        // `tile.rows` rows of `inputs`, `panel` is `inputs × PANEL`, and the
        // tile's sums are its own (`each_tile`).
        unsafe { panel_tile(isa, x, inputs, panel, &tile) };
    });
    Ok(())
}

/// `tile`'s sums: its `x` `(tile.rows, inputs)` times `panel` `(inputs,
/// PANEL)`, each output summed in the inputs' order with fused
/// multiply-adds, written through `tile.y`.
///
/// # Safety
/// The CPU runs `isa`; `x.len() == tile.rows · inputs`, `panel.len() ==
/// inputs · PANEL`, `tile.rows <= TILE_ROWS`, and the tile's sums are
/// writable and their own (as [`each_tile`] hands them out).
pub(crate) unsafe fn panel_tile(isa: Isa, x: &[f32], inputs: usize, panel: &[f32], tile: &Tile) {
    debug_assert!(tile.rows <= TILE_ROWS);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as the caller promises.
    unsafe {
        let (y, stride) = (tile.y, tile.stride);
        match (isa, tile.rows) {
            (Isa::Avx512F, 1) => avx512::tile::<1>(x, inputs, panel, y, stride),
            (Isa::Avx512F, 2) => avx512::tile::<2>(x, inputs, panel, y, stride),
            (Isa::Avx512F, 3) => avx512::tile::<3>(x, inputs, panel, y, stride),
            (Isa::Avx512F, 4) => avx512::tile::<4>(x, inputs, panel, y, stride),
            (Isa::Avx512F, 5) => avx512::tile::<5>(x, inputs, panel, y, stride),
            (Isa::Avx512F, 6) => avx512::tile::<6>(x, inputs, panel, y, stride),
            (Isa::Avx512F, 7) => avx512::tile::<7>(x, inputs, panel, y, stride),
            (Isa::Avx512F, _) => avx512::tile::<8>(x, inputs, panel, y, stride),
            (Isa::Avx2Fma, rows) => avx2::rows(x, rows, inputs, panel, y, stride),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // Unreachable: no instruction set is available here, and callers
        // return `Unsupported` first.
        let _ = (isa, x, inputs, panel, tile);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

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
    use proptest::prelude::*;

    use super::*;
    use crate::Pool;

    /// A deterministic spread of values, some negative.
    pub(crate) fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0) - 1.0)
            .collect()
    }

    /// The scalar loop the kernel's sums equal bit for bit: each output
    /// summed in the inputs' order with fused multiply-adds.
    fn scalar(x: &[f32], rows: usize, inputs: usize, panels: &[f32]) -> Vec<f32> {
        let count = panels.len() / (inputs * PANEL);
        let mut y = vec![0f32; rows * count * PANEL];
        for r in 0..rows {
            for p in 0..count {
                for c in 0..PANEL {
                    let mut acc = 0f32;
                    for k in 0..inputs {
                        acc = x[r * inputs + k].mul_add(panels[(p * inputs + k) * PANEL + c], acc);
                    }
                    y[r * count * PANEL + p * PANEL + c] = acc;
                }
            }
        }
        y
    }

    /// Every row count up to two tiles and a bit, inputs not a multiple of
    /// anything: the scalar loop's bits, on one thread or three, and a row
    /// alone the same bits as in a batch.
    #[test]
    fn sums_equal_the_scalar_loop_bit_for_bit() {
        for isa in crate::isa::each_available() {
            sums_on(isa);
        }
    }

    fn sums_on(isa: Isa) {
        let pool = Pool::new(3).unwrap();
        let (inputs, count) = (77, 3);
        let panels = values(count * inputs * PANEL, 1);
        for rows in 1..=17 {
            let x = values(rows * inputs, rows);
            let mut one = vec![0f32; rows * count * PANEL];
            let mut three = vec![0f32; rows * count * PANEL];
            multiply_on(isa, &x, rows, inputs, &panels, &mut one, pool.workers(1)).unwrap();
            multiply_on(isa, &x, rows, inputs, &panels, &mut three, pool.workers(3)).unwrap();
            assert_eq!(one, scalar(&x, rows, inputs, &panels), "{isa}, {rows} rows");
            assert_eq!(one, three, "{isa}, {rows} rows: threads changed the sums");
            let last = rows - 1;
            let mut alone = vec![0f32; count * PANEL];
            multiply_on(
                isa,
                &x[last * inputs..],
                1,
                inputs,
                &panels,
                &mut alone,
                Workers::inline(),
            )
            .unwrap();
            assert_eq!(
                alone[..],
                one[last * count * PANEL..],
                "{isa}, {rows} rows: last row alone"
            );
        }
    }

    /// Slices that do not fit are typed errors, and leave `y` alone.
    #[test]
    fn lengths_that_do_not_fit_are_refused() {
        if !crate::supported() {
            let mut y = vec![0f32; PANEL];
            let got = multiply(&[1.0], 1, 1, &[0.0; PANEL], &mut y, Workers::inline());
            assert!(matches!(got, Err(Error::Unsupported)));
            return;
        }
        let panels = values(4 * PANEL, 2);
        let mut y = vec![7f32; 2 * PANEL];
        let short_x = multiply(&[1.0; 7], 2, 4, &panels, &mut y, Workers::inline());
        assert!(matches!(short_x, Err(Error::Shape { what, .. }) if what.starts_with("x")));
        let mut odd = vec![7f32; 2 * PANEL + 1];
        let odd_y = multiply(&[1.0; 8], 2, 4, &panels, &mut odd, Workers::inline());
        assert!(matches!(odd_y, Err(Error::Shape { what, .. }) if what.starts_with("y")));
        let short_w = multiply(&[1.0; 8], 2, 4, &panels[1..], &mut y, Workers::inline());
        assert!(matches!(short_w, Err(Error::Shape { what, .. }) if what.starts_with("panels")));
        assert!(y.iter().all(|&v| v == 7.0), "nothing written");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Any shape: the scalar loop's bits when the slices fit, a typed
        /// error when one is a float too long; never a panic.
        #[test]
        fn any_shape_gives_the_scalar_bits_or_an_error(
            rows in 1usize..20, inputs in 1usize..40, count in 0usize..4,
            extra_x in 0usize..2, extra_y in 0usize..2, threads in 1usize..4,
        ) {
            let pool = Pool::new(threads).unwrap();
            let x = values(rows * inputs + extra_x, 3);
            let panels = values(count * inputs * PANEL, 4);
            let mut y = vec![0f32; rows * count * PANEL + extra_y];
            let got = multiply(&x, rows, inputs, &panels, &mut y, pool.workers(threads));
            if !crate::supported() {
                let refused = matches!(got, Err(Error::Unsupported));
                prop_assert!(refused);
            } else if extra_x + extra_y > 0 {
                let refused = matches!(got, Err(Error::Shape { .. }));
                prop_assert!(refused);
            } else {
                prop_assert!(got.is_ok());
                prop_assert_eq!(y, scalar(&x, rows, inputs, &panels));
            }
        }
    }
}

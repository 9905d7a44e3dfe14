//! The dense panel kernel's AVX2 code: a panel's 32 outputs in four
//! registers per row, two rows at a time (their eight registers of sums,
//! the panel's four and a row's value fill most of the sixteen).

use std::arch::x86_64::{
    __m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_storeu_ps,
};

use super::PANEL;

/// Registers of eight floats in a panel's row.
const PARTS: usize = PANEL / 8;

/// The `(rows, PANEL)` sums of `x` `(rows, inputs)` · `panel` `(inputs,
/// PANEL)`, written at `y`, rows `stride` apart: two rows at a time, each
/// pair reading the panel front to back.
///
/// # Safety
/// The CPU has AVX2 and FMA, `x.len() == rows * inputs`, `panel.len() ==
/// inputs * PANEL`, and `PANEL` floats at `y + r * stride` for each `r <
/// rows` are writable and not written by anyone else meanwhile.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows(
    x: &[f32],
    rows: usize,
    inputs: usize,
    panel: &[f32],
    y: *mut f32,
    stride: usize,
) {
    debug_assert!(x.len() == rows * inputs && panel.len() == inputs * PANEL);
    let mut r = 0;
    // SAFETY: rows `r..r + 2` (or `r`) of `x` and of the sums, inside
    // what the caller gave.
    unsafe {
        while r + 2 <= rows {
            tile::<2>(
                &x[r * inputs..(r + 2) * inputs],
                inputs,
                panel,
                y.add(r * stride),
                stride,
            );
            r += 2;
        }
        if r < rows {
            tile::<1>(
                &x[r * inputs..(r + 1) * inputs],
                inputs,
                panel,
                y.add(r * stride),
                stride,
            );
        }
    }
}

/// [`rows`] for `R` (1 or 2) rows at once.
///
/// # Safety
/// As [`rows`]'s, with `rows == R`.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize>(
    x: &[f32],
    inputs: usize,
    panel: &[f32],
    y: *mut f32,
    stride: usize,
) {
    debug_assert!(x.len() == R * inputs && panel.len() == inputs * PANEL);
    let mut sums = [[_mm256_setzero_ps(); PARTS]; R];
    for k in 0..inputs {
        // Row k of the panel is `panel[k * PANEL..][..PANEL]`, inside it
        // (the caller's lengths); unaligned loads.
        let mut w: [__m256; PARTS] = [_mm256_setzero_ps(); PARTS];
        for (p, w) in w.iter_mut().enumerate() {
            // SAFETY: as above.
            *w = unsafe { _mm256_loadu_ps(panel.as_ptr().add(k * PANEL + 8 * p)) };
        }
        for (r, row) in sums.iter_mut().enumerate() {
            // SAFETY: r < R and k < inputs, inside `x`.
            let b = _mm256_set1_ps(unsafe { *x.get_unchecked(r * inputs + k) });
            for (sum, w) in row.iter_mut().zip(&w) {
                *sum = _mm256_fmadd_ps(b, *w, *sum);
            }
        }
    }
    for (r, row) in sums.iter().enumerate() {
        for (p, sum) in row.iter().enumerate() {
            // SAFETY: row r's `PANEL` sums at `y + r * stride` (the caller).
            unsafe { _mm256_storeu_ps(y.add(r * stride + 8 * p), *sum) };
        }
    }
}

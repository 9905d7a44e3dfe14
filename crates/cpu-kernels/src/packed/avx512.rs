//! The packed kernel's AVX-512 code: a panel's words unpacked in registers
//! and multiplied.

use std::arch::x86_64::{
    __m512, _mm512_add_ps, _mm512_and_si512, _mm512_cvtepi32_ps, _mm512_fmadd_ps,
    _mm512_i32gather_epi32, _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mul_ps, _mm512_set1_epi32,
    _mm512_set1_ps, _mm512_setzero_ps, _mm512_srli_epi32, _mm512_storeu_ps,
};

use super::{Part, PANEL};
use crate::tiles::Tile;

/// The panel's `(inputs, PANEL)` values unpacked, as [`tile`] unpacks
/// them, into `out`.
///
/// # Safety
/// The CPU has AVX-512F; the panel's outputs are inside the matrix (`PackedMatrix::part`);
/// `out.len() == m.inputs * PANEL`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn unpack(m: &Part<'_, '_>, panel: usize, out: &mut [f32]) {
    debug_assert!(out.len() == m.inputs * PANEL);
    // SAFETY: as the caller promises; each input's 32 values go to its
    // own row of `out`.
    unsafe {
        each_input(m, panel, |k, v_low, v_high| {
            let at = out.as_mut_ptr().add(k * PANEL);
            _mm512_storeu_ps(at, v_low);
            _mm512_storeu_ps(at.add(16), v_high);
        });
    }
}

/// The `(R, PANEL)` sums of `x` `(R, m.inputs)` times `tile.panel`'s
/// 32 outputs of `m`, written at `tile.y`, rows `tile.stride` apart.
///
/// # Safety
/// The CPU has AVX-512F; the panel's outputs are inside the matrix (`PackedMatrix::part`);
/// `x.len() == R * m.inputs`; `PANEL` floats at `tile.y + r *
/// tile.stride` for each `r < R` are writable and not written by anyone
/// else meanwhile.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile<const R: usize>(m: &Part<'_, '_>, x: &[f32], tile: &Tile) {
    let inputs = m.inputs;
    debug_assert!(x.len() == R * inputs);
    let mut low = [_mm512_setzero_ps(); R];
    let mut high = [_mm512_setzero_ps(); R];
    // SAFETY: as the caller promises; `k < inputs`, inside `x`'s rows.
    unsafe {
        each_input(m, tile.panel, |k, v_low, v_high| {
            for r in 0..R {
                let b = _mm512_set1_ps(*x.get_unchecked(r * inputs + k));
                low[r] = _mm512_fmadd_ps(b, v_low, low[r]);
                high[r] = _mm512_fmadd_ps(b, v_high, high[r]);
            }
        });
    }
    for r in 0..R {
        // SAFETY: row r's `PANEL` sums at `tile.y + r * tile.stride`
        // (the caller).
        unsafe {
            let at = tile.y.add(r * tile.stride);
            _mm512_storeu_ps(at, low[r]);
            _mm512_storeu_ps(at.add(16), high[r]);
        }
    }
}

/// Calls `f(k, low, high)` for each input `k` of the panel in order,
/// with its 32 outputs' values unpacked (`scale · q + bias`, outputs
/// 0–15 in `low`, 16–31 in `high`).
///
/// # Safety
/// The CPU has AVX-512F; the panel's outputs are inside the matrix (`PackedMatrix::part`).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn each_input(m: &Part<'_, '_>, panel: usize, mut f: impl FnMut(usize, __m512, __m512)) {
    let first_row = m.first_output + panel * PANEL;
    // Word offsets of the panel's 32 rows from its first row's.
    let offsets: [i32; PANEL] = std::array::from_fn(|j| (j * m.m.row_words) as i32);
    // SAFETY: 16 i32 each, inside `offsets`.
    let (low_rows, high_rows) = unsafe {
        (
            _mm512_loadu_si512(offsets.as_ptr().cast()),
            _mm512_loadu_si512(offsets.as_ptr().add(16).cast()),
        )
    };
    let mask = _mm512_set1_epi32(15);
    let words_per_group = m.m.group_size / 8;
    for g in 0..m.inputs / m.m.group_size {
        let scales: [f32; PANEL] = m.group_values(m.m.scales, panel * PANEL, g);
        let biases: [f32; PANEL] = m.group_values(m.m.biases, panel * PANEL, g);
        // SAFETY: 16 f32 each, inside the arrays just made.
        let (s_low, s_high, b_low, b_high) = unsafe {
            (
                _mm512_loadu_ps(scales.as_ptr()),
                _mm512_loadu_ps(scales.as_ptr().add(16)),
                _mm512_loadu_ps(biases.as_ptr()),
                _mm512_loadu_ps(biases.as_ptr().add(16)),
            )
        };
        for w in 0..words_per_group {
            let column = g * m.m.group_size + w * 8;
            let word = first_row * m.m.row_words + (m.first_column + column) / 8;
            // SAFETY: the panel's rows from `first_row` and this word
            // are inside the words (`PackedMatrix::part`), and the offsets reach only
            // those rows.
            let (mut w_low, mut w_high) = unsafe {
                // Unaligned: the gathers need no alignment.
                let base = m.m.words.as_ptr().add(4 * word).cast::<i32>();
                (
                    _mm512_i32gather_epi32::<4>(low_rows, base),
                    _mm512_i32gather_epi32::<4>(high_rows, base),
                )
            };
            for e in 0..8 {
                let q_low = _mm512_cvtepi32_ps(_mm512_and_si512(w_low, mask));
                let q_high = _mm512_cvtepi32_ps(_mm512_and_si512(w_high, mask));
                w_low = _mm512_srli_epi32::<4>(w_low);
                w_high = _mm512_srli_epi32::<4>(w_high);
                let v_low = _mm512_add_ps(_mm512_mul_ps(q_low, s_low), b_low);
                let v_high = _mm512_add_ps(_mm512_mul_ps(q_high, s_high), b_high);
                f(column + e, v_low, v_high);
            }
        }
    }
}

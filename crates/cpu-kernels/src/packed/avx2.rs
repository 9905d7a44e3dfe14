//! The packed kernel's AVX2 code: half a panel (16 outputs, two registers)
//! at a time, its words unpacked in registers and multiplied by up to
//! three rows; the values and sums are those of the AVX-512 code.

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_and_si256, _mm256_cvtepi32_ps, _mm256_fmadd_ps,
    _mm256_i32gather_epi32, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_mul_ps, _mm256_set1_epi32,
    _mm256_set1_ps, _mm256_setzero_ps, _mm256_srli_epi32, _mm256_storeu_ps, _mm_prefetch,
    _MM_HINT_T0,
};

use super::{Part, PANEL};
use crate::tiles::Tile;

/// Outputs a pass handles: two registers of eight.
const HALF: usize = PANEL / 2;

/// How many groups ahead of the one multiplied the rows' words are asked
/// for.
const PREFETCH_GROUPS: usize = 4;

/// The panel's `(inputs, PANEL)` values unpacked, as [`tile`] unpacks
/// them, into `out`.
///
/// # Safety
/// The CPU has AVX2 and FMA; the panel's outputs are inside the matrix
/// (`PackedMatrix::part`); `out.len() == m.inputs * PANEL`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn unpack(m: &Part<'_, '_>, panel: usize, out: &mut [f32]) {
    debug_assert!(out.len() == m.inputs * PANEL);
    for half in 0..2 {
        // SAFETY: as the caller promises; each input's 16 values of this
        // half go to its own row of `out`.
        unsafe {
            each_input(m, panel, half, |k, low, high| {
                let at = out.as_mut_ptr().add(k * PANEL + half * HALF);
                _mm256_storeu_ps(at, low);
                _mm256_storeu_ps(at.add(8), high);
            });
        }
    }
}

/// The `(R, PANEL)` sums of `x` `(R, m.inputs)` times `tile.panel`'s 32
/// outputs of `m`, written at `tile.y`, rows `tile.stride` apart; `R` is
/// at most 3.
///
/// # Safety
/// The CPU has AVX2 and FMA; the panel's outputs are inside the matrix
/// (`PackedMatrix::part`); `x.len() == R * m.inputs`; `PANEL` floats at
/// `tile.y + r * tile.stride` for each `r < R` are writable and not
/// written by anyone else meanwhile.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile<const R: usize>(m: &Part<'_, '_>, x: &[f32], tile: &Tile) {
    let inputs = m.inputs;
    debug_assert!(R <= 3 && x.len() == R * inputs);
    for half in 0..2 {
        let mut low = [_mm256_setzero_ps(); R];
        let mut high = [_mm256_setzero_ps(); R];
        // SAFETY: as the caller promises; `k < inputs`, inside `x`'s rows.
        unsafe {
            each_input(m, tile.panel, half, |k, v_low, v_high| {
                for r in 0..R {
                    let b = _mm256_set1_ps(*x.get_unchecked(r * inputs + k));
                    low[r] = _mm256_fmadd_ps(b, v_low, low[r]);
                    high[r] = _mm256_fmadd_ps(b, v_high, high[r]);
                }
            });
        }
        for r in 0..R {
            // SAFETY: row r's `PANEL` sums at `tile.y + r * tile.stride`
            // (the caller); this half's 16 of them.
            unsafe {
                let at = tile.y.add(r * tile.stride + half * HALF);
                _mm256_storeu_ps(at, low[r]);
                _mm256_storeu_ps(at.add(8), high[r]);
            }
        }
    }
}

/// Calls `f(k, low, high)` for each input `k` of the panel in order, with
/// half `half`'s 16 outputs' values unpacked (`scale · q + bias`: outputs
/// `16·half` to `16·half + 7` in `low`, the next eight in `high`).
///
/// # Safety
/// The CPU has AVX2 and FMA; the panel's outputs are inside the matrix
/// (`PackedMatrix::part`); `half` is 0 or 1.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn each_input(
    m: &Part<'_, '_>,
    panel: usize,
    half: usize,
    mut f: impl FnMut(usize, __m256, __m256),
) {
    let first_row = m.first_output + panel * PANEL + half * HALF;
    // Word offsets of the half's 16 rows from its first row's.
    let offsets: [i32; HALF] = std::array::from_fn(|j| (j * m.m.row_words) as i32);
    // SAFETY: 8 i32 each, inside `offsets`.
    let (low_rows, high_rows) = unsafe {
        (
            _mm256_loadu_si256(offsets.as_ptr().cast()),
            _mm256_loadu_si256(offsets.as_ptr().add(8).cast()),
        )
    };
    let mask = _mm256_set1_epi32(15);
    let words_per_group = m.m.group_size / 8;
    let words = m.m.words.as_ptr();
    for g in 0..m.inputs / m.m.group_size {
        // The gathers read 16 rows a row's length apart, a stride the
        // hardware's prefetchers follow poorly: each gather waited for its
        // lines. Ask for each row's words a few groups ahead (a hint: the
        // values are the same; `wrapping_add`, as the last groups' asks
        // point past the words, where a prefetch does not fault).
        let ahead = (m.first_column + (g + PREFETCH_GROUPS) * m.m.group_size) / 8;
        for j in 0..HALF {
            let at = 4 * ((first_row + j) * m.m.row_words + ahead);
            _mm_prefetch::<_MM_HINT_T0>(words.wrapping_add(at).cast());
        }
        let first = panel * PANEL + half * HALF;
        let scales: [f32; HALF] = m.group_values(m.m.scales, first, g);
        let biases: [f32; HALF] = m.group_values(m.m.biases, first, g);
        // SAFETY: 8 f32 each, inside the 16 of the arrays just made.
        let (s_low, s_high, b_low, b_high) = unsafe {
            let (s, b) = (scales.as_ptr(), biases.as_ptr());
            (
                _mm256_loadu_ps(s),
                _mm256_loadu_ps(s.add(8)),
                _mm256_loadu_ps(b),
                _mm256_loadu_ps(b.add(8)),
            )
        };
        for w in 0..words_per_group {
            let column = g * m.m.group_size + w * 8;
            let word = first_row * m.m.row_words + (m.first_column + column) / 8;
            // SAFETY: the half's rows from `first_row` and this word are
            // inside the words (`PackedMatrix::part`), and the offsets
            // reach only those rows.
            let (mut w_low, mut w_high) = unsafe {
                // Unaligned: the gathers need no alignment.
                let base = m.m.words.as_ptr().add(4 * word).cast::<i32>();
                (
                    _mm256_i32gather_epi32::<4>(base, low_rows),
                    _mm256_i32gather_epi32::<4>(base, high_rows),
                )
            };
            for e in 0..8 {
                let q_low = _mm256_cvtepi32_ps(_mm256_and_si256(w_low, mask));
                let q_high = _mm256_cvtepi32_ps(_mm256_and_si256(w_high, mask));
                w_low = _mm256_srli_epi32::<4>(w_low);
                w_high = _mm256_srli_epi32::<4>(w_high);
                // A product, then a sum (no fused multiply-add): the values
                // MLX's unpacking and the AVX-512 code give.
                let v_low = _mm256_add_ps(_mm256_mul_ps(q_low, s_low), b_low);
                let v_high = _mm256_add_ps(_mm256_mul_ps(q_high, s_high), b_high);
                f(column + e, v_low, v_high);
            }
        }
    }
}

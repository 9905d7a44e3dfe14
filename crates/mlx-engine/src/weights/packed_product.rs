//! Products with 4-bit packed weights on the CPU, read as MLX packs them,
//! made for a decode step's few rows.
//!
//! Under `QuantizedWeights::DequantizeOnUse` a packed matrix used to be
//! unpacked to f32 before each product and then multiplied by BLAS: a
//! decode step wrote and read eight times the packed bytes, and BLAS
//! packed each unpacked matrix again for its few rows. Here the kernel
//! reads the packed words themselves (MLX's layout: `(out, in / 8)` u32,
//! value `e` of a word at bits `4e`), 32 outputs at a time: for each word,
//! one gather of 16 outputs' words per register, whose eight values are
//! unpacked in registers as `scale · q + bias` (a product, then a sum: the
//! same f32 values MLX's unpacking gives) and multiplied by up to eight
//! rows at once, each output summed in the inputs' order with fused
//! multiply-adds. For more than eight rows each 32 outputs' values are
//! unpacked once into a small buffer in [`few_rows`]' panel layout and the
//! dense panel kernel multiplies every eight rows by it: the same values
//! and the same sums, so a row's result does not depend on its batch. No
//! dense matrix is written and nothing is laid out at load: resident,
//! mapped and streamed weights all run here, with the same bits. The
//! result differs from unpack-then-BLAS only by the order of the sums, as
//! [`few_rows`]' differs from BLAS.
//!
//! Runs for 4 bits, with f32, bfloat16 or float16 scales, on 32 outputs
//! at a time and whole quantization groups, for up to [`MAX_ROWS`] rows,
//! where the CPU has AVX-512F and the load chose the native kernels
//! (`kernels::Products`); everything else is unpacked and multiplied by
//! MLX.

use std::ops::Range;

use half::{bf16, f16};
use mlx_rs::{Array, Dtype};
use mlx_support::Quantization;

use crate::error::Result;
use crate::weights::few_rows::{self, host_f32, Tile, PANEL, TILE_ROWS};

/// Rows the kernel takes at most: a decode step up to batch 32. Past one
/// tile of eight rows it unpacks each panel once into a buffer that the
/// dense panel kernel multiplies (the same values and sums), which on
/// SmolLM2 (2-core Xeon, OpenBLAS SkylakeX kernels) made 32-token
/// generation at batch 32 faster than unpack-then-BLAS (3.65 vs 3.16
/// conv/s) while prefills of hundreds of rows ran 5–15% slower through it
/// (docs/benchmarks.md); so prefills unpack and go to BLAS.
pub(crate) const MAX_ROWS: usize = 32;

/// Whether the kernel multiplies weights quantized as `q` on this CPU.
pub(crate) fn runs(q: Quantization) -> bool {
    q.bits == 4 && few_rows::supported()
}

/// `x · W[outputs, columns]ᵀ` for MLX's packed `weight` `(out, in / 8)`
/// with its `(out, in / group)` `scales` and `biases`, when the kernel can
/// take it: `x` `(…, columns.len())` of at most [`MAX_ROWS`] rows, the outputs a multiple of 32 and the
/// columns whole groups, the arrays row-contiguous, the scales f32,
/// bfloat16 or float16. `None` otherwise: the caller unpacks.
pub(crate) fn product(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    q: Quantization,
    outputs: Range<usize>,
    columns: Range<usize>,
) -> Result<Option<Array>> {
    let gs = q.group_size as usize;
    let rows = x.size() / columns.len().max(1);
    let takes = rows <= MAX_ROWS
        && outputs.len().is_multiple_of(PANEL)
        && !outputs.is_empty()
        && columns.start.is_multiple_of(gs)
        && columns.len().is_multiple_of(gs)
        && !columns.is_empty()
        && x.ndim() > 0
        && x.shape()[x.ndim() - 1] as usize == columns.len();
    if !takes {
        return Ok(None);
    }
    let Some(mut matrix) = Matrix::of(weight, scales, biases, q) else {
        return Ok(None);
    };
    matrix.first_output = outputs.start;
    matrix.first_column = columns.start;
    matrix.inputs = columns.len();
    if !matrix.fits(outputs.end) {
        return Ok(None);
    }
    // `on_host` falls back for a width that does not fit or no AVX-512,
    // ruled out above, or for no rows: an empty product.
    let empty = || {
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = outputs.len() as i32;
        }
        Ok(mlx_rs::ops::zeros::<f32>(&shape)?)
    };
    let y = few_rows::on_host(
        x,
        columns.len(),
        outputs.len(),
        empty,
        |xs, rows, sums, threads| {
            multiply(&matrix, xs, rows, sums, threads);
            Ok(())
        },
    )?;
    Ok(Some(y))
}

/// A matrix's scales or biases on the host.
#[derive(Clone, Copy)]
enum Scales<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl Scales<'_> {
    fn of(a: &Array) -> Option<Scales<'_>> {
        match a.dtype() {
            Dtype::Float32 => host_f32(a).ok().map(Scales::F32),
            Dtype::Bfloat16 => a.try_as_slice::<bf16>().ok().map(Scales::Bf16),
            Dtype::Float16 => a.try_as_slice::<f16>().ok().map(Scales::F16),
            _ => None,
        }
    }

    fn len(&self) -> usize {
        match self {
            Scales::F32(s) => s.len(),
            Scales::Bf16(s) => s.len(),
            Scales::F16(s) => s.len(),
        }
    }

    /// Element `i` in f32 (exact from either half width).
    fn at(&self, i: usize) -> f32 {
        match self {
            Scales::F32(s) => s[i],
            Scales::Bf16(s) => s[i].to_f32(),
            Scales::F16(s) => s[i].to_f32(),
        }
    }
}

/// A packed matrix's part that a product reads: outputs from
/// `first_output` on (32 per panel), `inputs` columns from `first_column`.
pub(super) struct Matrix<'a> {
    words: &'a [u32],
    row_words: usize,
    scales: Scales<'a>,
    biases: Scales<'a>,
    row_groups: usize,
    group_size: usize,
    pub(super) first_output: usize,
    pub(super) first_column: usize,
    pub(super) inputs: usize,
}

impl<'a> Matrix<'a> {
    /// The whole of MLX's packed `weight` `(out, in / 8)` with its `(out,
    /// in / group)` `scales` and `biases`, when the kernel reads it: 4 bits
    /// on this CPU, the arrays row-contiguous, the scales f32, bfloat16 or
    /// float16. `None` otherwise.
    pub(super) fn of(
        weight: &'a Array,
        scales: &'a Array,
        biases: &'a Array,
        q: Quantization,
    ) -> Option<Matrix<'a>> {
        let takes = runs(q)
            && scales.dtype() == biases.dtype()
            && matches!(
                scales.dtype(),
                Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16
            )
            && weight.dtype() == Dtype::Uint32
            && weight.ndim() == 2
            && scales.ndim() == 2
            && weight.dim(0) > 0;
        if !takes {
            return None;
        }
        let words = weight.try_as_slice::<u32>().ok()?;
        let (scales, biases) = (Scales::of(scales)?, Scales::of(biases)?);
        let row_words = weight.dim(1) as usize;
        Some(Matrix {
            words,
            row_words,
            scales,
            biases,
            row_groups: biases.len() / weight.dim(0) as usize,
            group_size: q.group_size as usize,
            first_output: 0,
            first_column: 0,
            inputs: row_words * 8,
        })
    }

    /// Outputs (rows of the matrix) the arrays hold.
    pub(super) fn outputs(&self) -> usize {
        self.words.len() / self.row_words.max(1)
    }
}

impl Matrix<'_> {
    /// Whether outputs up to `end` and the columns are inside the arrays.
    pub(super) fn fits(&self, end: usize) -> bool {
        let rows = self.outputs();
        let groups_end = (self.first_column + self.inputs) / self.group_size;
        end <= rows
            && (self.first_column + self.inputs) / 8 <= self.row_words
            && self.scales.len() == rows * self.row_groups
            && self.biases.len() == self.scales.len()
            && groups_end <= self.row_groups
            // Gathers index words with i32 offsets from a panel's first row.
            && PANEL * self.row_words < i32::MAX as usize
    }

    /// The 32 scales (or biases) of `panel`'s outputs for group `g` of the
    /// product's columns.
    fn panel_values(&self, values: Scales<'_>, panel: usize, g: usize) -> [f32; PANEL] {
        let group = self.first_column / self.group_size + g;
        let first = self.first_output + panel * PANEL;
        std::array::from_fn(|j| values.at((first + j) * self.row_groups + group))
    }
}

/// `y` `(rows, outputs)` = `x · Wᵀ` for `x` `(rows, m.inputs)`, the panels
/// shared out over `threads`.
pub(super) fn multiply(m: &Matrix<'_>, x: &[f32], rows: usize, y: &mut [f32], threads: usize) {
    let count = y.len() / (rows * PANEL).max(1);
    assert!(
        x.len() == rows * m.inputs
            && m.fits(m.first_output + count * PANEL)
            && few_rows::supported(),
        "packed_product::multiply: lengths do not fit, or no AVX-512"
    );
    if rows <= TILE_ROWS {
        // One tile of rows: each word unpacked in registers as it is used.
        few_rows::each_tile(rows, count, y, threads, |tile: Tile| {
            // SAFETY: `multiply` checked AVX-512F and that the panel's
            // outputs and columns are inside the arrays (`fits`); `x` is
            // `tile.rows` rows of `m.inputs`; the tile's sums are its own
            // (`each_tile`).
            unsafe { packed_tile(m, x, &tile) };
        });
        return;
    }
    // More rows: each panel unpacked once, to the same values, into a
    // buffer in `few_rows`' panel layout, which the dense kernel then
    // multiplies by every tile of rows (the same sums in the same order).
    few_rows::each_tile(rows, count, y, threads, |tile: Tile| {
        UNPACKED.with_borrow_mut(|panel| {
            if tile.row == 0 {
                panel.resize(m.inputs * PANEL, 0.0);
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512F and the panel inside the arrays (checked
                // by `multiply`); `panel` holds `inputs × PANEL` floats.
                unsafe {
                    avx512::unpack(m, tile.panel, panel);
                }
            }
            let x = &x[tile.row * m.inputs..(tile.row + tile.rows) * m.inputs];
            // SAFETY: AVX-512F (checked); `x` is `tile.rows` rows, `panel`
            // this tile's panel, unpacked at its first tile (`each_tile`
            // hands a panel's tiles out in order on one thread); the
            // tile's sums are its own.
            unsafe { few_rows::panel_tile(x, m.inputs, panel, &tile) };
        });
    });
}

thread_local! {
    /// The panel being multiplied on this thread, unpacked.
    static UNPACKED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`avx512::tile`] for `tile.rows` rows.
///
/// # Safety
/// As [`avx512::tile`]'s.
unsafe fn packed_tile(m: &Matrix<'_>, x: &[f32], tile: &Tile) {
    let x = &x[tile.row * m.inputs..(tile.row + tile.rows) * m.inputs];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as the caller promises.
    unsafe {
        match tile.rows {
            1 => avx512::tile::<1>(m, x, tile),
            2 => avx512::tile::<2>(m, x, tile),
            3 => avx512::tile::<3>(m, x, tile),
            4 => avx512::tile::<4>(m, x, tile),
            5 => avx512::tile::<5>(m, x, tile),
            6 => avx512::tile::<6>(m, x, tile),
            7 => avx512::tile::<7>(m, x, tile),
            _ => avx512::tile::<8>(m, x, tile),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = x;
        unreachable!("packed_product::multiply checks supported()");
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, _mm512_add_ps, _mm512_and_si512, _mm512_cvtepi32_ps, _mm512_fmadd_ps,
        _mm512_i32gather_epi32, _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mul_ps,
        _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps, _mm512_srli_epi32, _mm512_storeu_ps,
    };

    use super::{Matrix, PANEL};
    use crate::weights::few_rows::Tile;

    /// The panel's `(inputs, PANEL)` values unpacked, as [`tile`] unpacks
    /// them, into `out`.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `m.fits` holds for the panel's outputs;
    /// `out.len() == m.inputs * PANEL`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn unpack(m: &Matrix<'_>, panel: usize, out: &mut [f32]) {
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
    /// The CPU has AVX-512F; `m.fits` holds for the panel's outputs;
    /// `x.len() == R * m.inputs`; `PANEL` floats at `tile.y + r *
    /// tile.stride` for each `r < R` are writable and not written by anyone
    /// else meanwhile.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile<const R: usize>(m: &Matrix<'_>, x: &[f32], tile: &Tile) {
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
    /// The CPU has AVX-512F; `m.fits` holds for the panel's outputs.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn each_input(m: &Matrix<'_>, panel: usize, mut f: impl FnMut(usize, __m512, __m512)) {
        let first_row = m.first_output + panel * PANEL;
        // Word offsets of the panel's 32 rows from its first row's.
        let offsets: [i32; PANEL] = std::array::from_fn(|j| (j * m.row_words) as i32);
        // SAFETY: 16 i32 each, inside `offsets`.
        let (low_rows, high_rows) = unsafe {
            (
                _mm512_loadu_si512(offsets.as_ptr().cast()),
                _mm512_loadu_si512(offsets.as_ptr().add(16).cast()),
            )
        };
        let mask = _mm512_set1_epi32(15);
        let words_per_group = m.group_size / 8;
        for g in 0..m.inputs / m.group_size {
            let scales = m.panel_values(m.scales, panel, g);
            let biases = m.panel_values(m.biases, panel, g);
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
                let column = g * m.group_size + w * 8;
                let word = first_row * m.row_words + (m.first_column + column) / 8;
                // SAFETY: the panel's rows from `first_row` and this word
                // are inside `m.words` (`fits`), and the offsets reach only
                // those rows.
                let (mut w_low, mut w_high) = unsafe {
                    let base = m.words.as_ptr().add(word).cast::<i32>();
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
}

#[cfg(test)]
mod tests {
    use mlx_rs::ops::indexing::IndexOp;
    use mlx_rs::random;

    use super::*;
    use crate::test_support::max_abs_diff;
    use crate::weights::unpack::dequantize_f32;

    fn quantized(
        outputs: i32,
        inputs: i32,
        gs: i32,
        seed: u64,
    ) -> (Array, Array, Array, Quantization) {
        let key = random::key(seed).unwrap();
        let w = random::normal::<f32>(&[outputs, inputs], None, None, &key).unwrap();
        let (weight, scales, biases) = mlx_rs::ops::quantize(&w, gs, 4).unwrap();
        let q = Quantization {
            group_size: gs,
            bits: 4,
        };
        (weight, scales, biases, q)
    }

    /// Each output against an f64 sum over MLX's own unpacked weights, for
    /// row counts around the tiles; one and two threads the same bits; a
    /// row alone the same bits as in a batch; a part of the outputs and
    /// of the columns; half-width scales.
    #[test]
    fn kernel_sums_match_a_double_precision_product_of_the_unpacked_weights() {
        if !few_rows::supported() {
            eprintln!("SKIPPED: this CPU has no AVX-512F; packed products go to MLX");
            return;
        }
        let (outputs, inputs) = (96usize, 192usize);
        let (weight, scales, biases, q) = quantized(outputs as i32, inputs as i32, 32, 3);
        let (s16, b16) = (
            scales.as_dtype(Dtype::Bfloat16).unwrap(),
            biases.as_dtype(Dtype::Bfloat16).unwrap(),
        );
        let (h16, c16) = (
            scales.as_dtype(Dtype::Float16).unwrap(),
            biases.as_dtype(Dtype::Float16).unwrap(),
        );
        for (scales, biases) in [(&scales, &biases), (&s16, &b16), (&h16, &c16)] {
            let dense = dequantize_f32(&weight, scales, biases, q).unwrap();
            let dense = dense.as_slice::<f32>().to_vec();
            for (outs, cols) in [(0..96, 0..192), (32..96, 64..160)] {
                let width = cols.len();
                for rows in [1usize, 2, 7, 8, 9, MAX_ROWS] {
                    let key = random::key(rows as u64).unwrap();
                    let x = random::normal::<f32>(&[rows as i32, width as i32], None, None, &key)
                        .unwrap();
                    let got = product(&x, &weight, scales, biases, q, outs.clone(), cols.clone())
                        .unwrap()
                        .expect("the kernel takes it");
                    let got = got.as_slice::<f32>().to_vec();
                    let xs = x.as_slice::<f32>();
                    for r in 0..rows {
                        for (c, o) in outs.clone().enumerate() {
                            let exact: f64 = (0..width)
                                .map(|k| {
                                    f64::from(xs[r * width + k])
                                        * f64::from(dense[o * inputs + cols.start + k])
                                })
                                .sum();
                            let v = got[r * outs.len() + c];
                            assert!(
                                (f64::from(v) - exact).abs() < 1e-3,
                                "{rows} rows, row {r}, output {o}: {v} against {exact}"
                            );
                        }
                    }
                    let m = Matrix {
                        words: weight.as_slice::<u32>(),
                        row_words: inputs / 8,
                        scales: Scales::of(scales).unwrap(),
                        biases: Scales::of(biases).unwrap(),
                        row_groups: inputs / 32,
                        group_size: 32,
                        first_output: outs.start,
                        first_column: cols.start,
                        inputs: width,
                    };
                    let mut two = vec![0f32; rows * outs.len()];
                    multiply(&m, xs, rows, &mut two, 2);
                    assert_eq!(two, got, "{rows} rows: threads changed the sums");
                    let mut alone = vec![0f32; outs.len()];
                    multiply(&m, &xs[(rows - 1) * width..], 1, &mut alone, 1);
                    assert_eq!(
                        alone[..],
                        got[(rows - 1) * outs.len()..],
                        "a row alone differs"
                    );
                }
            }
        }
    }

    /// Through MLX arrays: `x` of any leading shape or narrower dtype, and
    /// what the kernel does not take (3 bits, 48 outputs, a part of a
    /// group, a width that does not fit) left to the caller.
    #[test]
    fn products_equal_unpack_then_multiply_or_are_left_to_the_caller() {
        let (weight, scales, biases, q) = quantized(64, 128, 64, 5);
        let dense = dequantize_f32(&weight, &scales, &biases, q).unwrap();
        let key = random::key(9).unwrap();
        let x = random::normal::<f32>(&[2, 3, 128], None, None, &key).unwrap();
        let want = x.matmul(dense.t()).unwrap();
        let got = product(&x, &weight, &scales, &biases, q, 0..64, 0..128).unwrap();
        if !few_rows::supported() {
            assert!(got.is_none());
            return;
        }
        let got = got.unwrap();
        assert_eq!(got.shape(), want.shape());
        assert!(max_abs_diff(&got, &want) < 1e-4);
        let narrow = x.as_dtype(Dtype::Bfloat16).unwrap();
        let got = product(&narrow, &weight, &scales, &biases, q, 0..64, 0..128)
            .unwrap()
            .unwrap();
        assert_eq!(got.dtype(), Dtype::Float32);
        let left = |x: &Array, q: Quantization, outs: Range<usize>, cols: Range<usize>| {
            product(x, &weight, &scales, &biases, q, outs, cols)
                .unwrap()
                .is_none()
        };
        let three = Quantization { bits: 3, ..q };
        assert!(left(&x, three, 0..64, 0..128));
        assert!(left(&x, q, 0..48, 0..128));
        assert!(left(&x.index((.., .., 0..32)), q, 0..64, 0..32));
        assert!(left(&x, q, 0..64, 0..64));
        assert!(left(&x, q, 32..96, 0..128), "outputs past the matrix");
        let many = mlx_rs::ops::ones::<f32>(&[MAX_ROWS as i32 + 1, 128]).unwrap();
        assert!(
            left(&many, q, 0..64, 0..128),
            "more rows than a decode step's"
        );
    }
}

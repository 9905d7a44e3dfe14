//! Products with 4-bit packed weights on the CPU, read as MLX packs them,
//! made for a decode step's few rows.
//!
//! Under `QuantizedWeights::DequantizeOnUse` a packed matrix used to be
//! unpacked to f32 before each product and then multiplied by BLAS: a
//! decode step wrote and read eight times the packed bytes, and BLAS
//! packed each unpacked matrix again for its few rows. The kernel
//! (`cpu_kernels::packed`, MLX-free) reads the packed words themselves and
//! unpacks them in registers to the same f32 values MLX's unpacking gives;
//! a row's result does not depend on its batch, and differs from
//! unpack-then-BLAS only by the order of the sums. No dense matrix is
//! written and nothing is laid out at load: resident, mapped and streamed
//! weights all run there, with the same bits. This module decides which
//! products go to it and hands it MLX arrays' data.
//!
//! Runs for 4 bits, with f32, bfloat16 or float16 scales, on 32 outputs
//! at a time and whole quantization groups, for up to [`MAX_ROWS`] rows,
//! where the CPU has AVX-512F or AVX2 with FMA (x86-64) and the load chose
//! the native kernels
//! (`kernels::Products`); everything else is unpacked and multiplied by
//! MLX.

use std::ops::Range;

use cpu_kernels::packed::{PackedMatrix, Scales};
use half::{bf16, f16};
use mlx_rs::{Array, Dtype};
use mlx_support::Quantization;

use crate::error::Result;
use crate::evaluation::{host_slice, Why};
use crate::weights::few_rows::{self, PANEL};
use crate::weights::kernels::{multiplies_packed, HostKernels};

/// Rows the kernel takes at most: a decode step up to batch 32. Past one
/// tile of eight rows it unpacks each panel once into a buffer that the
/// dense panel kernel multiplies (the same values and sums), which on
/// SmolLM2 (2-core Xeon, OpenBLAS SkylakeX kernels) made 32-token
/// generation at batch 32 faster than unpack-then-BLAS (3.65 vs 3.16
/// conv/s) while prefills of hundreds of rows ran 5–15% slower through it
/// (docs/benchmarks.md); so prefills unpack and go to BLAS.
pub(crate) const MAX_ROWS: usize = 32;

/// `x · W[outputs, columns]ᵀ` for MLX's packed `weight` `(out, in / 8)`
/// with its `(out, in / group)` `scales` and `biases`, when the kernel can
/// take it: `x` `(…, columns.len())` of at most [`MAX_ROWS`] rows, the
/// outputs a multiple of 32 inside the matrix and the columns whole groups,
/// the scales f32, bfloat16 or float16. `None` otherwise: the caller
/// unpacks.
#[expect(
    clippy::too_many_arguments,
    reason = "one product's operands and its parts"
)]
pub(crate) fn product(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    q: Quantization,
    outputs: Range<usize>,
    columns: Range<usize>,
    kernels: &HostKernels,
) -> Result<Option<Array>> {
    let gs = q.group_size as usize;
    let rows = x.size() / columns.len().max(1);
    let takes = multiplies_packed(q)
        && rows <= MAX_ROWS
        && outputs.len().is_multiple_of(PANEL)
        && !outputs.is_empty()
        && outputs.end <= weight.dim(0) as usize
        && columns.start.is_multiple_of(gs)
        && columns.len().is_multiple_of(gs)
        && !columns.is_empty()
        && x.ndim() > 0
        && x.shape()[x.ndim() - 1] as usize == columns.len()
        && readable(weight, scales, biases);
    if !takes {
        return Ok(None);
    }
    let host = match HostMatrix::read(weight, scales, biases) {
        Ok(host) => host,
        // Not row-contiguous (a view of another array): unpacked instead.
        Err(crate::Error::HostRead { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let Ok(matrix) = host.matrix(q) else {
        return Ok(None);
    };
    if columns.end > matrix.inputs() {
        return Ok(None);
    }
    // `on_host` falls back for no rows: an empty product.
    let width = outputs.len();
    let empty = || {
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = width as i32;
        }
        Ok(mlx_rs::ops::zeros::<f32>(&shape)?)
    };
    let y = few_rows::on_host(x, columns.len(), width, empty, |xs, rows, sums| {
        let workers = kernels.workers();
        Ok(cpu_kernels::packed::multiply(
            &matrix, outputs, columns, xs, rows, sums, workers,
        )?)
    })?;
    Ok(Some(y))
}

/// Whether the kernel reads these arrays: MLX's packed words, two
/// dimensions, the scales and biases of one float dtype it unpacks with.
pub(crate) fn readable(weight: &Array, scales: &Array, biases: &Array) -> bool {
    weight.dtype() == Dtype::Uint32
        && weight.ndim() == 2
        && scales.ndim() == 2
        && weight.dim(0) > 0
        && scales.dtype() == biases.dtype()
        && matches!(
            scales.dtype(),
            Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16
        )
}

/// A packed matrix's arrays, computed and read on the host.
pub(crate) struct HostMatrix<'a> {
    words: &'a [u32],
    row_words: usize,
    scales: Scales<'a>,
    biases: Scales<'a>,
}

impl<'a> HostMatrix<'a> {
    /// The arrays of a matrix that is [`readable`], read.
    pub(crate) fn read(
        weight: &'a Array,
        scales: &'a Array,
        biases: &'a Array,
    ) -> Result<HostMatrix<'a>> {
        Ok(HostMatrix {
            words: host_slice::<u32>(Why::Kernel, "a packed weight's words", weight)?,
            row_words: weight.dim(1) as usize,
            scales: host_scales(scales)?,
            biases: host_scales(biases)?,
        })
    }

    /// The kernel's view, or its error when the arrays do not fit each
    /// other or `q`.
    pub(crate) fn matrix(&self, q: Quantization) -> cpu_kernels::Result<PackedMatrix<'a>> {
        let group = q.group_size as usize;
        PackedMatrix::new(self.words, self.row_words, self.scales, self.biases, group)
    }
}

/// Scales or biases on the host, in their own dtype.
fn host_scales(a: &Array) -> Result<Scales<'_>> {
    let what = "a packed weight's scales";
    Ok(match a.dtype() {
        Dtype::Bfloat16 => Scales::Bf16(host_slice::<bf16>(Why::Kernel, what, a)?),
        Dtype::Float16 => Scales::F16(host_slice::<f16>(Why::Kernel, what, a)?),
        _ => Scales::F32(host_slice::<f32>(Why::Kernel, what, a)?),
    })
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
        let q = Quantization::affine(gs, 4);
        (weight, scales, biases, q)
    }

    /// Each output against an f64 sum over MLX's own unpacked weights (the
    /// kernel unpacks to MLX's values), for row counts around the tiles, a
    /// part of the outputs and of the columns, half-width scales.
    #[test]
    fn kernel_sums_match_a_double_precision_product_of_the_unpacked_weights() {
        if !cpu_kernels::supported() {
            eprintln!("SKIPPED: this CPU has neither AVX-512F nor AVX2 with FMA; packed products go to MLX");
            return;
        }
        let k = HostKernels::for_tests(2);
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
                    let got = product(
                        &x,
                        &weight,
                        scales,
                        biases,
                        q,
                        outs.clone(),
                        cols.clone(),
                        &k,
                    )
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
        if !cpu_kernels::supported() {
            eprintln!("SKIPPED: this CPU has neither AVX-512F nor AVX2 with FMA; packed products go to MLX");
            return;
        }
        let k = HostKernels::for_tests(2);
        let got = product(&x, &weight, &scales, &biases, q, 0..64, 0..128, &k).unwrap();
        let got = got.unwrap();
        assert_eq!(got.shape(), want.shape());
        assert!(max_abs_diff(&got, &want) < 1e-4);
        let narrow = x.as_dtype(Dtype::Bfloat16).unwrap();
        let got = product(&narrow, &weight, &scales, &biases, q, 0..64, 0..128, &k)
            .unwrap()
            .unwrap();
        assert_eq!(got.dtype(), Dtype::Float32);
        let left = |x: &Array, q: Quantization, outs: Range<usize>, cols: Range<usize>| {
            product(x, &weight, &scales, &biases, q, outs, cols, &k)
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

//! A quantized weight matrix's unpacking: its scales, biases and
//! quantization, and its products unpacked to f32 a slice of rows at a
//! time or multiplied packed by MLX.

use std::ops::Range;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{dequantize, quantized_matmul};
use mlx_rs::Array;
use mlx_support::Quantization;

use crate::error::Result;
use crate::weights::kernels::HostKernels;
use crate::weights::packed_product;
use crate::weights::slices::{in_row_slices, slice_rows};
use crate::weights::unpack::dequantize_f32;

/// What unpacks a quantized weight matrix.
pub(crate) struct Packed {
    pub scales: Array,
    pub biases: Array,
    pub q: Quantization,
    /// Dequantize before each product instead of MLX's quantized matmul.
    pub dequantize_on_use: bool,
    /// With `dequantize_on_use`: the kernels that multiply it by
    /// [`packed_product`] (reading the packed words) where they take the
    /// product, unpacking only where they do not.
    pub on_host: Option<HostKernels>,
}

impl Packed {
    /// The dense matrix of the packed `weight` (or of some of its rows,
    /// given the matching rows of the scales and biases), in the scales'
    /// dtype.
    pub fn dense_rows(&self, weight: &Array, scales: &Array, biases: &Array) -> Result<Array> {
        let (gs, bits) = (self.q.group_size, self.q.bits);
        Ok(dequantize(weight, scales, biases, gs, bits)?)
    }

    /// The dense matrix in f32, which MLX's CPU backend multiplies with BLAS.
    pub fn dense_f32(&self, weight: &Array) -> Result<Array> {
        Ok(dequantize_f32(weight, &self.scales, &self.biases, self.q)?)
    }

    /// `x · W[rows]ᵀ` for the packed `weight`: the outputs `rows` alone,
    /// those rows unpacked to f32.
    pub(crate) fn product_with_rows(
        &self,
        x: &Array,
        weight: &Array,
        rows: Range<usize>,
    ) -> Result<Array> {
        if let Some(y) = self.on_kernel(x, weight, rows.clone(), 0..x.dim(-1) as usize)? {
            return Ok(y);
        }
        let r = rows.start as i32..rows.end as i32;
        let dense = dequantize_f32(
            &weight.index(r.clone()),
            &self.scales.index(r.clone()),
            &self.biases.index(r),
            self.q,
        )?;
        Ok(x.matmul(dense.t())?)
    }

    /// `x · Wᵀ` for the packed `weight`, unpacked to f32 and multiplied a
    /// slice of rows at a time (see [`in_row_slices`]).
    pub(crate) fn product_in_slices(&self, x: &Array, weight: &Array) -> Result<Array> {
        let (rows, dim) = (weight.dim(0) as usize, x.dim(-1) as usize);
        // On the kernel no dense slice is made: the whole product at once.
        if let Some(y) = self.on_kernel(x, weight, 0..rows, 0..dim)? {
            return Ok(y);
        }
        in_row_slices(rows, slice_rows(dim), |r| {
            self.product_with_rows(x, weight, r)
        })
    }

    /// `x · W[outputs, columns]ᵀ` by [`packed_product`]'s kernel, when this
    /// weight is multiplied there ([`on_host`](Self::on_host)) and the
    /// kernel takes the product; `None`: unpack.
    pub(crate) fn on_kernel(
        &self,
        x: &Array,
        weight: &Array,
        outputs: Range<usize>,
        columns: Range<usize>,
    ) -> Result<Option<Array>> {
        let Some(kernels) = &self.on_host else {
            return Ok(None);
        };
        packed_product::product(
            x,
            weight,
            &self.scales,
            &self.biases,
            self.q,
            outputs,
            columns,
            kernels,
        )
    }

    pub fn quantized_matmul(&self, x: &Array, weight: &Array) -> Result<Array> {
        let (gs, bits) = (self.q.group_size, self.q.bits);
        Ok(quantized_matmul(
            x,
            weight,
            &self.scales,
            &self.biases,
            true,
            gs,
            bits,
        )?)
    }
}

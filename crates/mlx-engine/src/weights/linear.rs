//! A linear layer, `x · Wᵀ + b`, behind one narrow trait: one
//! implementation per way a weight is held, chosen once at load by the
//! [`Plan`](crate::weights::plan::Plan), so that no product matches on a
//! form again and the layers (`nn`) never ask which form they hold.
//!
//! - [`Transposed`]: dense, `Wᵀ` `(in, out)`, multiplied by MLX (BLAS on the
//!   CPU).
//! - [`InPanels`]: dense, in panels `(out / 32, in, 32)` for the project's
//!   kernel (`cpu-kernels`).
//! - [`QuantizedProduct`]: packed, multiplied packed by MLX's quantized
//!   product (`QuantizedWeights::Keep`).
//! - [`UnpackedOnUse`]: packed, each product's matrix unpacked to f32 (a
//!   slice of rows at a time) or read packed by the project's kernel where
//!   it takes the product (`QuantizedWeights::DequantizeOnUse`).

use std::ops::Range;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::quantized_matmul;
use mlx_rs::Array;
use mlx_support::Quantization;

use crate::error::Result;
use crate::weights::few_rows;
use crate::weights::kernels::HostKernels;
use crate::weights::packed::Packed;
use crate::weights::unpack::{dequantize_f32, packed_span};

/// A linear layer as the model holds it.
pub(crate) type Linear = Box<dyn LinearProduct>;

/// The products of a linear layer `x · Wᵀ + b`, `x` `(…, in)`.
pub(crate) trait LinearProduct {
    /// Every output: `(…, out)`.
    fn forward(&self, x: &Array) -> Result<Array>;

    /// The outputs `outputs` alone, from those rows of the weight (and of
    /// the bias).
    fn forward_outputs(&self, x: &Array, outputs: Range<usize>) -> Result<Array>;

    /// The part of `x · Wᵀ` summed over the inputs `columns`, for `x` as
    /// wide as `columns`, without the bias: a product split over its inner
    /// dimension adds these parts up.
    fn forward_columns(&self, x: &Array, columns: Range<usize>) -> Result<Array>;

    /// The output width.
    fn outputs(&self) -> usize;

    /// The quantization whose groups a product may be cut on, for a layer
    /// whose weight is unpacked for each product and has no bias: the
    /// gated MLP (`nn/mlp.rs`) then runs a slice of its width at a time.
    /// `None`: take products whole.
    fn slice_group(&self) -> Option<Quantization> {
        None
    }
}

/// The bias's `outputs`, added to `y`, if there is one.
fn with_bias(y: Array, bias: Option<&Array>, outputs: Option<Range<usize>>) -> Result<Array> {
    Ok(match (bias, outputs) {
        (Some(b), Some(r)) => y.add(b.index(r.start as i32..r.end as i32))?,
        (Some(b), None) => y.add(b)?,
        (None, _) => y,
    })
}

fn index(r: &Range<usize>) -> Range<i32> {
    r.start as i32..r.end as i32
}

/// Dense, `Wᵀ` `(in, out)`, multiplied by MLX.
pub(crate) struct Transposed {
    pub weight_t: Array,
    pub bias: Option<Array>,
}

impl LinearProduct for Transposed {
    fn forward(&self, x: &Array) -> Result<Array> {
        // MLX's `nn.Linear` adds its bias inside the product (`addmm`):
        // one rounding, where a product then a sum rounds twice in
        // bfloat16.
        Ok(match &self.bias {
            Some(b) => mlx_rs::ops::addmm(b, x, &self.weight_t, None, None)?,
            None => x.matmul(&self.weight_t)?,
        })
    }

    fn forward_outputs(&self, x: &Array, outputs: Range<usize>) -> Result<Array> {
        let y = x.matmul(self.weight_t.index((.., index(&outputs))))?;
        with_bias(y, self.bias.as_ref(), Some(outputs))
    }

    fn forward_columns(&self, x: &Array, columns: Range<usize>) -> Result<Array> {
        Ok(x.matmul(self.weight_t.index(index(&columns)))?)
    }

    fn outputs(&self) -> usize {
        self.weight_t.dim(1) as usize
    }
}

/// Dense, in panels `(out / 32, in, 32)`, multiplied by the project's
/// kernel on `kernels`.
pub(crate) struct InPanels {
    pub panels: Array,
    pub bias: Option<Array>,
    pub kernels: HostKernels,
}

impl LinearProduct for InPanels {
    fn forward(&self, x: &Array) -> Result<Array> {
        let y = few_rows::product(x, &self.panels, &self.kernels)?;
        with_bias(y, self.bias.as_ref(), None)
    }

    /// From the panels that hold the outputs when they start and end on a
    /// panel's edge, else the whole product's columns.
    fn forward_outputs(&self, x: &Array, outputs: Range<usize>) -> Result<Array> {
        let panel = few_rows::PANEL;
        let y = if outputs.start.is_multiple_of(panel) && outputs.end.is_multiple_of(panel) {
            let panels = self
                .panels
                .index((outputs.start / panel) as i32..(outputs.end / panel) as i32);
            few_rows::product(x, &panels, &self.kernels)?
        } else {
            let all = few_rows::transposed(&self.panels)?;
            x.matmul(all.index((.., index(&outputs))))?
        };
        with_bias(y, self.bias.as_ref(), Some(outputs))
    }

    fn forward_columns(&self, x: &Array, columns: Range<usize>) -> Result<Array> {
        let rows = self.panels.index((.., index(&columns)));
        Ok(x.matmul(few_rows::transposed(&rows)?)?)
    }

    fn outputs(&self) -> usize {
        self.panels.dim(0) as usize * few_rows::PANEL
    }
}

/// Packed `(out, in / pack)`, multiplied packed by MLX's quantized product.
pub(crate) struct QuantizedProduct {
    pub weight: Array,
    pub packed: Packed,
    pub bias: Option<Array>,
}

impl LinearProduct for QuantizedProduct {
    fn forward(&self, x: &Array) -> Result<Array> {
        let y = self.packed.quantized_matmul(x, &self.weight)?;
        with_bias(y, self.bias.as_ref(), None)
    }

    fn forward_outputs(&self, x: &Array, outputs: Range<usize>) -> Result<Array> {
        let (p, r) = (&self.packed, index(&outputs));
        let y = quantized_matmul(
            x,
            self.weight.index(r.clone()),
            p.scales.index(r.clone()),
            &p.biases.index(r),
            true,
            p.q.group_size,
            p.q.bits,
        )?;
        with_bias(y, self.bias.as_ref(), Some(outputs))
    }

    fn forward_columns(&self, x: &Array, columns: Range<usize>) -> Result<Array> {
        let p = &self.packed;
        let (words, groups, _) = packed_span(p.q, columns);
        Ok(quantized_matmul(
            x,
            self.weight.index((.., words)).contiguous()?,
            p.scales.index((.., groups.clone())).contiguous()?,
            &p.biases.index((.., groups)).contiguous()?,
            true,
            p.q.group_size,
            p.q.bits,
        )?)
    }

    fn outputs(&self) -> usize {
        self.weight.dim(0) as usize
    }
}

/// Packed `(out, in / pack)`, unpacked to f32 for each product (a slice of
/// rows at a time), or read packed by the project's kernel where the
/// packing's `on_host` kernels take the product.
pub(crate) struct UnpackedOnUse {
    pub weight: Array,
    pub packed: Packed,
    pub bias: Option<Array>,
}

impl LinearProduct for UnpackedOnUse {
    fn forward(&self, x: &Array) -> Result<Array> {
        let y = self.packed.product_in_slices(x, &self.weight)?;
        with_bias(y, self.bias.as_ref(), None)
    }

    fn forward_outputs(&self, x: &Array, outputs: Range<usize>) -> Result<Array> {
        let y = self
            .packed
            .product_with_rows(x, &self.weight, outputs.clone())?;
        with_bias(y, self.bias.as_ref(), Some(outputs))
    }

    /// Whole quantization groups of columns (what [`slice_group`] promises
    /// the MLP).
    ///
    /// [`slice_group`]: LinearProduct::slice_group
    fn forward_columns(&self, x: &Array, columns: Range<usize>) -> Result<Array> {
        let p = &self.packed;
        if let Some(y) = p.on_kernel(x, &self.weight, 0..self.outputs(), columns.clone())? {
            return Ok(y);
        }
        let (words, groups, _) = packed_span(p.q, columns);
        // Contiguous copies of the packed columns (an eighth of the f32
        // slice at 4 bits): the unpacking reads its words as bytes.
        let dense = dequantize_f32(
            &self.weight.index((.., words)).contiguous()?,
            &p.scales.index((.., groups.clone())).contiguous()?,
            &p.biases.index((.., groups)).contiguous()?,
            p.q,
        )?;
        Ok(x.matmul(dense.t())?)
    }

    fn outputs(&self) -> usize {
        self.weight.dim(0) as usize
    }

    fn slice_group(&self) -> Option<Quantization> {
        self.bias.is_none().then_some(self.packed.q)
    }
}

/// The packed layer of `weight` as `packed` says it is multiplied:
/// unpacked for each product, or packed by MLX's quantized product.
pub(crate) fn packed(weight: Array, packed: Packed, bias: Option<Array>) -> Linear {
    if packed.dequantize_on_use {
        Box::new(UnpackedOnUse {
            weight,
            packed,
            bias,
        })
    } else {
        Box::new(QuantizedProduct {
            weight,
            packed,
            bias,
        })
    }
}

/// A packed layer without bias unpacked on use, for tests.
#[cfg(test)]
pub(crate) fn packed_on_use(
    weight: Array,
    scales: Array,
    biases: Array,
    q: Quantization,
) -> Linear {
    Box::new(UnpackedOnUse {
        weight,
        packed: Packed {
            scales,
            biases,
            q,
            dequantize_on_use: true,
            on_host: None,
        },
        bias: None,
    })
}

#[cfg(test)]
mod tests {
    use mlx_rs::ops::quantize;
    use mlx_rs::random;

    use super::*;
    use crate::test_support::max_abs_diff;

    fn normal(shape: &[i32], seed: u64) -> Array {
        random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap()
    }

    /// Every way of holding one weight gives its product: all outputs, a
    /// range of outputs (with the bias's), and the parts over column
    /// ranges adding up to the whole, against the plain `x · Wᵀ + b`.
    #[test]
    fn every_holding_gives_the_same_products() {
        let (out, inputs) = (64, 96);
        let q = Quantization::affine(32, 4);
        let (weight, scales, biases) = quantize(normal(&[out, inputs], 1), 32, 4).unwrap();
        let dense = dequantize_f32(&weight, &scales, &biases, q).unwrap();
        let bias = normal(&[out], 2);
        let packed = || Packed {
            scales: scales.clone(),
            biases: biases.clone(),
            q,
            dequantize_on_use: true,
            on_host: None,
        };
        let mut forms: Vec<(&str, Linear)> = vec![
            (
                "transposed",
                Box::new(Transposed {
                    weight_t: dense.t().contiguous().unwrap(),
                    bias: Some(bias.clone()),
                }),
            ),
            (
                "quantized",
                Box::new(QuantizedProduct {
                    weight: weight.clone(),
                    packed: packed(),
                    bias: Some(bias.clone()),
                }),
            ),
            (
                "unpacked on use",
                Box::new(UnpackedOnUse {
                    weight: weight.clone(),
                    packed: packed(),
                    bias: Some(bias.clone()),
                }),
            ),
        ];
        if cpu_kernels::supported() {
            forms.push((
                "in panels",
                Box::new(InPanels {
                    panels: few_rows::to_panels(&dense).unwrap(),
                    bias: Some(bias.clone()),
                    kernels: HostKernels::for_tests(2),
                }),
            ));
        }
        let x = normal(&[3, inputs], 3);
        let want = x.matmul(dense.t()).unwrap().add(&bias).unwrap();
        for (name, linear) in &forms {
            assert_eq!(linear.outputs(), out as usize, "{name}");
            let whole = linear.forward(&x).unwrap();
            assert!(max_abs_diff(&whole, &want) < 1e-3, "{name}: forward");
            let part = linear.forward_outputs(&x, 32..64).unwrap();
            let want_part = want.index((.., 32..64));
            assert!(max_abs_diff(&part, &want_part) < 1e-3, "{name}: outputs");
            let left = linear
                .forward_columns(&x.index((.., 0..32)), 0..32)
                .unwrap();
            let right = linear
                .forward_columns(&x.index((.., 32..96)), 32..96)
                .unwrap();
            let summed = left.add(&right).unwrap().add(&bias).unwrap();
            assert!(max_abs_diff(&summed, &want) < 1e-3, "{name}: columns");
            assert_eq!(linear.slice_group(), None, "{name}: it has a bias");
        }
        let on_use = packed_on_use(weight, scales.clone(), biases.clone(), q);
        assert_eq!(on_use.slice_group(), Some(q));
    }
}

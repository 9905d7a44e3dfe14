//! Fusing a LoRA pair into a linear weight, dense or affine-quantized: the
//! one place this arithmetic is written, for the fuser that writes a fused
//! model (adapter-fuse) and the fusers that apply adapters while streaming
//! blocks (block-stream). Same inputs, same bits, by construction.

use mlx_rs::ops::{dequantize, quantize};
use mlx_rs::{Array, Dtype};

use crate::error::{Error, Result};
use crate::quant::Quantization;

/// How an adapter lays out its matrices, and the arithmetic its reference
/// implementation fuses them with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraLayout {
    /// mlx_lm's: `lora_a` is (in, rank), `lora_b` (rank, out), and
    /// `W' = W + ((scale · Bᵀ) @ Aᵀ)`, the product formed in the adapter's
    /// dtype and only the delta cast to W's dtype (`LoRALinear.fuse`).
    MlxLm,
    /// PEFT's and diffusers': `A` is (rank, in), `B` (out, rank), and
    /// `W' = W + scale · (B @ A)`, computed in f32 and cast back to W's
    /// dtype (mlx-arsenal's streaming fusers).
    Peft,
}

impl LoraLayout {
    fn name(self) -> &'static str {
        match self {
            LoraLayout::MlxLm => "mlx_lm: A (in, rank), B (rank, out)",
            LoraLayout::Peft => "PEFT: A (rank, in), B (out, rank)",
        }
    }
}

/// One LoRA pair and its scale.
#[derive(Debug, Clone, Copy)]
pub struct Lora<'a> {
    /// The down projection (`lora_a` / `lora_A`).
    pub a: &'a Array,
    /// The up projection (`lora_b` / `lora_B`).
    pub b: &'a Array,
    /// The scale (mlx_lm's `lora_parameters.scale`, a source's strength).
    pub scale: f32,
    /// The layout and arithmetic of the adapter.
    pub layout: LoraLayout,
}

/// A linear layer's weight as stored: dense, or MLX affine-quantized
/// (`weight` packed uint32, `scales`, `biases`).
#[derive(Debug, Clone)]
pub struct LinearWeights {
    /// `(out, in)` dense, or `(out, in · bits / 32)` packed.
    pub weight: Array,
    /// Per-group scales of a quantized weight.
    pub scales: Option<Array>,
    /// Per-group biases of a quantized weight.
    pub biases: Option<Array>,
}

impl LinearWeights {
    /// A dense weight.
    pub fn dense(weight: Array) -> LinearWeights {
        LinearWeights {
            weight,
            scales: None,
            biases: None,
        }
    }

    /// Whether every floating-point value (the dense weight, or a quantized
    /// weight's scales and biases) is finite. Evaluates them.
    pub fn is_finite(&self) -> Result<bool> {
        let parts: Vec<&Array> = match &self.scales {
            Some(scales) => std::iter::once(scales).chain(&self.biases).collect(),
            None => vec![&self.weight],
        };
        for part in parts {
            let finite = part.is_finite()?.all(None)?;
            finite.eval()?;
            if !finite.item_exact::<bool>() {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// `weights` with `lora` added. A quantized weight (`quant` given and
/// scales present) is dequantized (to the scales' dtype), fused, and
/// requantized with the same group size and bits; a dense one keeps its
/// dtype.
///
/// # Errors
/// [`Error::LoraShape`] when the pair does not fit the weight; MLX errors.
pub fn fuse_lora(
    weights: &LinearWeights,
    quant: Option<Quantization>,
    lora: Lora<'_>,
) -> Result<LinearWeights> {
    let packed = match (quant, &weights.scales) {
        (Some(q), Some(scales)) => Some((q, scales)),
        _ => None,
    };
    if let Some((q, _)) = packed.filter(|(q, _)| q.mode != crate::QuantMode::Affine) {
        // mlx_lm fuses into affine weights alone, and re-quantizing a fused
        // weight in another mode is not what it writes.
        return Err(Error::Quantization(format!(
            "a LoRA adapter cannot be fused into {}-quantized weights",
            q.mode.name()
        )));
    }
    let dense = match packed {
        Some((q, scales)) => dequantize(
            &weights.weight,
            scales,
            weights.biases.as_ref(),
            q.group_size,
            q.bits,
        )?,
        None => weights.weight.clone(),
    };
    let fused = fused_dense(&dense, lora)?;
    Ok(match packed {
        Some((q, _)) => {
            let (weight, scales, biases) = quantize(&fused, q.group_size, q.bits)?;
            LinearWeights {
                weight,
                scales: Some(scales),
                biases: weights.biases.as_ref().map(|_| biases),
            }
        }
        None => LinearWeights::dense(fused),
    })
}

/// A dense `(out, in)` weight with `lora` added, in the weight's dtype.
pub fn fused_dense(dense: &Array, lora: Lora<'_>) -> Result<Array> {
    let (a, b, w) = (lora.a.shape(), lora.b.shape(), dense.shape());
    let fits = a.len() == 2
        && b.len() == 2
        && w.len() == 2
        && match lora.layout {
            LoraLayout::MlxLm => a[1] == b[0] && a[0] == w[1] && b[1] == w[0],
            LoraLayout::Peft => b[1] == a[0] && b[0] == w[0] && a[1] == w[1],
        };
    if !fits {
        return Err(Error::LoraShape {
            layout: lora.layout.name(),
            a: a.to_vec(),
            b: b.to_vec(),
            weight: w.to_vec(),
        });
    }
    match lora.layout {
        LoraLayout::MlxLm => {
            // A Python float times an array takes the array's dtype.
            let scale = Array::from_f32(lora.scale).as_dtype(lora.b.dtype())?;
            let delta = lora
                .b
                .t()
                .multiply(&scale)?
                .matmul(lora.a.t())?
                .as_dtype(dense.dtype())?;
            Ok(dense.add(&delta)?)
        }
        LoraLayout::Peft => {
            let b = lora.b.as_dtype(Dtype::Float32)?;
            let a = lora.a.as_dtype(Dtype::Float32)?;
            let delta = b.matmul(&a)?.multiply(Array::from_f32(lora.scale))?;
            Ok(dense
                .as_dtype(Dtype::Float32)?
                .add(&delta)?
                .as_dtype(dense.dtype())?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(shape: &[i32], seed: u64) -> Array {
        let key = mlx_rs::random::key(seed).unwrap();
        mlx_rs::random::normal::<f32>(shape, None, None, &key).unwrap()
    }

    fn max_abs_diff(x: &Array, y: &Array) -> f32 {
        let d = x.subtract(y).unwrap().abs().unwrap().max(None).unwrap();
        d.eval().unwrap();
        d.item_exact::<f32>()
    }

    #[test]
    fn both_layouts_add_the_same_delta_to_a_dense_weight() {
        let w = values(&[6, 4], 1);
        let a = values(&[4, 2], 2); // mlx_lm: (in, rank)
        let b = values(&[2, 6], 3); // mlx_lm: (rank, out)
        let mlx_lm = Lora {
            a: &a,
            b: &b,
            scale: 2.0,
            layout: LoraLayout::MlxLm,
        };
        let (at, bt) = (a.t(), b.t());
        let peft = Lora {
            a: &at,
            b: &bt,
            scale: 2.0,
            layout: LoraLayout::Peft,
        };
        let expected = w
            .add(
                b.t()
                    .matmul(a.t())
                    .unwrap()
                    .multiply(Array::from_f32(2.0))
                    .unwrap(),
            )
            .unwrap();
        let x = fused_dense(&w, mlx_lm).unwrap();
        let y = fused_dense(&w, peft).unwrap();
        assert!(max_abs_diff(&x, &expected) < 1e-5);
        assert!(max_abs_diff(&y, &expected) < 1e-5);
    }

    #[test]
    fn quantized_weights_are_requantized_with_their_own_settings() {
        let w = values(&[8, 64], 4);
        let q = Quantization::affine(32, 8);
        let (qw, qs, qb) = quantize(&w, q.group_size, q.bits).unwrap();
        let stored = LinearWeights {
            weight: qw,
            scales: Some(qs),
            biases: Some(qb),
        };
        let a = values(&[64, 2], 5);
        let b = values(&[2, 8], 6);
        let lora = Lora {
            a: &a,
            b: &b,
            scale: 0.5,
            layout: LoraLayout::MlxLm,
        };
        let fused = fuse_lora(&stored, Some(q), lora).unwrap();
        assert!(fused.is_finite().unwrap());
        // By hand: dequantize, add, requantize.
        let dense = dequantize(
            &stored.weight,
            stored.scales.as_ref().unwrap(),
            stored.biases.as_ref(),
            32,
            8,
        )
        .unwrap();
        let (ew, es, eb) = quantize(fused_dense(&dense, lora).unwrap(), 32, 8).unwrap();
        let equal = |x: &Array, y: &Array| x.eq_values(y).unwrap();
        assert!(equal(&fused.weight, &ew));
        assert!(equal(fused.scales.as_ref().unwrap(), &es));
        assert!(equal(fused.biases.as_ref().unwrap(), &eb));
    }

    #[test]
    fn pairs_that_do_not_fit_are_errors_naming_both_shapes() {
        let w = values(&[6, 4], 1);
        let a = values(&[5, 2], 2);
        let b = values(&[2, 6], 3);
        let err = fused_dense(
            &w,
            Lora {
                a: &a,
                b: &b,
                scale: 1.0,
                layout: LoraLayout::MlxLm,
            },
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::LoraShape { a, weight, .. } if a == &[5, 2] && weight == &[6, 4]),
            "{err}"
        );
        let nan = Array::full::<f32>(&[6, 4], Array::from_f32(f32::NAN)).unwrap();
        assert!(!LinearWeights::dense(nan).is_finite().unwrap());
    }
}

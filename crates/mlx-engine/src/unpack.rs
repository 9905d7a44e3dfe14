//! Packed affine weights unpacked to f32 as compiled arithmetic.
//!
//! Why: on the CPU backend, `QuantizedWeights::DequantizeOnUse` unpacks
//! every packed matrix before each product, so unpacking runs over every
//! weight of the model in every forward. MLX's CPU `dequantize` unpacks an
//! element at a time (about 100 M elements/s on the project's machine); the
//! same arithmetic written as a few whole-array operations compiled into
//! one fused kernel runs about 2.5 times as fast (`python -c` with MLX
//! 0.32.2 on a 12288 × 1536 4-bit matrix; the Rust figures are in
//! docs/mlx-engine.md), and for f32 scales gives the same bits.
//!
//! For 2, 4 and 8 bits a byte holds whole elements, little end first (the
//! order MLX packs them in, element `i` of a 32-bit word at bit
//! `bits · i`), so each byte's elements come from integer division and
//! remainder. Other widths straddle bytes and go through `dequantize`.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::ops::{dequantize, stack};
use mlx_rs::{Array, Dtype};
use mlx_support::Quantization;

use crate::fused::{call, compiled_per_shape, Compiled};

thread_local! {
    // Per thread and per shape (see `fused`): MLX work stays on the thread
    // that owns it, and a model has a handful of matrix shapes.
    static UNPACK_2: RefCell<Compiled> = compiled_per_shape(|a| unpack(a, 2));
    static UNPACK_4: RefCell<Compiled> = compiled_per_shape(|a| unpack(a, 4));
    static UNPACK_8: RefCell<Compiled> = compiled_per_shape(|a| unpack(a, 8));
}

/// The packed `(rows, cols · bits / 32)` matrix `weight` with its
/// `(rows, groups)` scales and biases as an f32 `(rows, cols)` matrix:
/// `scale · q + bias` per element, in f32.
pub(crate) fn dequantize_f32(
    weight: &Array,
    scales: &Array,
    biases: &Array,
    q: Quantization,
) -> Result<Array, Exception> {
    let kernel = match q.bits {
        2 => &UNPACK_2,
        4 => &UNPACK_4,
        8 => &UNPACK_8,
        _ => return general(weight, scales, biases, q),
    };
    if weight.ndim() != 2 || weight.dtype() != Dtype::Uint32 || scales.ndim() != 2 {
        return general(weight, scales, biases, q);
    }
    // The words as bytes: `(rows, 4 · words)`, the same memory.
    let bytes = weight.view::<u8>()?;
    let [dense] = call(kernel, &[bytes, scales.clone(), biases.clone()])?;
    Ok(dense)
}

fn general(
    weight: &Array,
    scales: &Array,
    biases: &Array,
    q: Quantization,
) -> Result<Array, Exception> {
    dequantize(weight, scales, biases, q.group_size, q.bits)?.as_dtype(Dtype::Float32)
}

/// The compiled graph: bytes `(rows, n)`, scales and biases `(rows,
/// groups)` → `(rows, groups · group size)` f32.
fn unpack(a: &[Array], bits: i32) -> Result<Vec<Array>, Exception> {
    let (bytes, scales, biases) = (&a[0], &a[1], &a[2]);
    let (rows, groups) = (scales.dim(0), scales.dim(1));
    let per_byte = 8 / bits;
    let elements = if per_byte == 1 {
        bytes.clone()
    } else {
        let levels = Array::from_slice(&[1u8 << bits], &[]);
        let parts = (0..per_byte)
            .map(|j| {
                let shift = Array::from_slice(&[1u8 << (bits * j)], &[]);
                bytes.floor_divide(&shift)?.remainder(&levels)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // `(rows, n, per_byte)`: each byte's elements in order.
        stack(&parts, -1)?
    };
    let elements = elements
        .as_dtype(Dtype::Float32)?
        .reshape(&[rows, groups, -1])?;
    let scales = scales.as_dtype(Dtype::Float32)?.expand_dims(-1)?;
    let biases = biases.as_dtype(Dtype::Float32)?.expand_dims(-1)?;
    let dense = elements.multiply(&scales)?.add(&biases)?;
    Ok(vec![dense.reshape(&[rows, -1])?])
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::quantize;
    use mlx_rs::random;

    /// Equal to MLX's `dequantize` bit for bit with f32 scales, for every
    /// width it unpacks itself and one it leaves to MLX, with several group
    /// sizes and a matrix shape of each kind.
    #[test]
    fn unpacking_equals_mlx_dequantize() {
        for (bits, group_size) in [(2, 32), (4, 64), (4, 32), (8, 64), (8, 128), (3, 64)] {
            for (rows, cols) in [(96, 256), (7, 512)] {
                let key = random::key(bits as u64 * 1000 + rows as u64).unwrap();
                let w = random::normal::<f32>(&[rows, cols], None, None, &key).unwrap();
                let (packed, scales, biases) = quantize(&w, group_size, bits).unwrap();
                let q = Quantization { group_size, bits };
                let ours = dequantize_f32(&packed, &scales, &biases, q).unwrap();
                let mlx = dequantize(&packed, &scales, &biases, group_size, bits).unwrap();
                assert_eq!(ours.shape(), &[rows, cols]);
                ours.eval().unwrap();
                mlx.eval().unwrap();
                let bits_of = |a: &Array| -> Vec<u32> {
                    a.as_slice::<f32>().iter().map(|v| v.to_bits()).collect()
                };
                assert!(
                    bits_of(&ours) == bits_of(&mlx),
                    "{bits}-bit, groups of {group_size}, {rows}×{cols}"
                );
            }
        }
    }
}

//! Packed affine weights unpacked to f32.
//!
//! Why: on the CPU backend, `QuantizedWeights::DequantizeOnUse` unpacks
//! every packed matrix before each product, so unpacking runs over every
//! weight of the model in every forward. MLX's CPU `dequantize` unpacks an
//! element at a time (about 100 M elements/s on the project's machine).
//! Here, for 2, 4 and 8 bits, it is three whole-array steps, each one of
//! MLX's vectorised loops, with the same bits as `dequantize` for f32
//! scales:
//!
//! 1. Spread: each byte's elements, little end first (the order MLX packs
//!    them in, element `i` of a 32-bit word at bit `bits · i`), moved one
//!    to a byte of a wider integer by integer arithmetic: for 4 bits,
//!    `b + 240 · (b / 16)` puts the high nibble in the second byte of a
//!    `u16`. Compiled into one kernel that only ever sees scalars besides
//!    its input, so MLX runs it as a plain loop. Read as bytes (`view`),
//!    the wider integers are the elements in order, one per byte.
//! 2. The bytes to f32.
//! 3. `scale · q + bias`, each group's scale and bias broadcast over its
//!    elements by MLX's own multiply and add.
//!
//! An earlier form interleaved the nibbles with `stack` and fused steps 2
//! and 3 into one compiled kernel: `stack` is a strided byte copy, and a
//! compiled kernel with a broadcast input runs its strided loop, an index
//! computation per element. That form took 4.9–7.8 ms for a 16 MiB slice
//! of E2B's feed-forward matrices, this one 2.2–2.9 ms (MLX 0.32.2 from
//! Python; the engine's figures are in docs/benchmarks.md). Other widths
//! straddle bytes and go through `dequantize`.

use std::cell::RefCell;

use std::ops::Range;

use mlx_rs::error::Exception;
use mlx_rs::ops::dequantize;
use mlx_rs::{Array, Dtype};
use mlx_support::Quantization;

use crate::ops::{call, compiled, Compiled};

thread_local! {
    // Per thread (see `fused`): MLX work stays on the thread that owns it.
    // Element-wise with scalars only, so compiled once for every shape.
    static SPREAD_2: RefCell<Compiled> = compiled(|a| Ok(vec![spread_2(&a[0])?]));
    static SPREAD_4: RefCell<Compiled> = compiled(|a| Ok(vec![spread_4(&a[0])?]));
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
    let unpacked_here = matches!(q.bits, 2 | 4 | 8)
        // The spread's bytes are read in memory order.
        && cfg!(target_endian = "little")
        && weight.ndim() == 2
        && weight.dtype() == Dtype::Uint32
        && scales.ndim() == 2;
    if !unpacked_here {
        return general(weight, scales, biases, q);
    }
    // The words as bytes: `(rows, 4 · words)`, the same memory.
    let bytes = weight.view::<u8>()?;
    let elements = match q.bits {
        2 => call::<1>(&SPREAD_2, &[bytes])?[0].view::<u8>()?,
        4 => call::<1>(&SPREAD_4, &[bytes])?[0].view::<u8>()?,
        _ => bytes,
    };
    let (rows, groups) = (scales.dim(0), scales.dim(1));
    let elements = elements
        .as_dtype(Dtype::Float32)?
        .reshape(&[rows, groups, -1])?;
    let scales = scales.as_dtype(Dtype::Float32)?.expand_dims(-1)?;
    let biases = biases.as_dtype(Dtype::Float32)?.expand_dims(-1)?;
    elements
        .multiply(&scales)?
        .add(&biases)?
        .reshape(&[rows, -1])
}

fn general(
    weight: &Array,
    scales: &Array,
    biases: &Array,
    q: Quantization,
) -> Result<Array, Exception> {
    dequantize(weight, scales, biases, q.group_size, q.bits)?.as_dtype(Dtype::Float32)
}

/// Bytes of two 4-bit elements → `u16`s holding one per byte: the low
/// nibble stays, the high one moves up by 4 bits (`+ 240 · high`).
fn spread_4(bytes: &Array) -> Result<Array, Exception> {
    let u16s = |v: u16| Array::from_slice(&[v], &[]);
    let b = bytes.as_dtype(Dtype::Uint16)?;
    b.floor_divide(u16s(16))?.multiply(u16s(240))?.add(&b)
}

/// Bytes of four 2-bit elements → `u32`s holding one per byte: element
/// `j`, `(b / 4ʲ) mod 4`, moved to bits `8j`.
fn spread_2(bytes: &Array) -> Result<Array, Exception> {
    let u32s = |v: u32| Array::from_slice(&[v], &[]);
    let b = bytes.as_dtype(Dtype::Uint32)?;
    let mut out = b.remainder(u32s(4))?;
    for j in 1..4u32 {
        let element = b.floor_divide(u32s(1 << (2 * j)))?.remainder(u32s(4))?;
        out = out.add(element.multiply(u32s(1 << (8 * j)))?)?;
    }
    Ok(out)
}

/// The packed words and the groups that hold `columns` of a packed row, and
/// the first column they hold: whole quantization groups, from the one
/// that holds `columns.start` to the one that holds its last column.
pub(crate) fn packed_span(
    q: Quantization,
    columns: Range<usize>,
) -> (Range<i32>, Range<i32>, usize) {
    let (gs, bits) = (q.group_size as usize, q.bits as usize);
    let groups = columns.start / gs..columns.end.div_ceil(gs);
    let first = groups.start * gs;
    let words = (first * bits / 32) as i32..(groups.end * gs * bits / 32) as i32;
    (words, groups.start as i32..groups.end as i32, first)
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
                let q = Quantization::affine(group_size, bits);
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

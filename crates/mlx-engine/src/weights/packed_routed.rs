//! Routed products of packed 4-bit experts on the CPU: each choice's row
//! times its expert's matrix, every expert's words read as MLX packs them
//! by [`packed_product`]'s kernel, once for all the rows that chose it.
//!
//! A mixture of experts unpacked its chosen experts to f32 and let MLX's
//! `gather_mm` multiply them. On the CPU that product is bound by memory:
//! a prefill, whose rows choose nearly every expert, wrote and then read
//! eight times the packed bytes of every expert of a layer, and a decode
//! step did the same for each expert to multiply one or two rows. Here
//! nothing is unpacked to memory: the rows that chose an expert are
//! gathered together and multiplied by its packed words, a run of rows at
//! a time. The kernel's sums do not depend on the other rows of a run, so
//! a choice's result is the same bits whichever rows share its expert,
//! whether its experts were taken all at once or in groups, and whichever
//! memory mode held them.

use cpu_kernels::packed::PackedMatrix;
use mlx_rs::Array;
use mlx_support::Quantization;

use crate::error::Result;
use crate::evaluation::{host_slice, Why};
use crate::weights::few_rows::{host_written, PANEL};
use crate::weights::kernels::{multiplies_packed, HostKernels};
use crate::weights::packed_product::{readable, HostMatrix};

/// `(…shape, 1, out)`: for each choice `c` of `experts` (places in the
/// stack, laid out as `shape`), row `c / (choices / rows)` of `x` `(…, in)` times
/// expert `experts[c]`'s matrix of the packed stack `weight` `(n, out, in
/// / 8)` with its `(n, out, in / group)` `scales` and `biases` — the
/// layout of MLX's `gather_mm(x, w, rhs_indices = experts)` for `x` of
/// one row per choice, or of one row per `k` choices broadcast. `None`
/// where the kernel does not take it (not 4 bits, outputs not a multiple
/// of 32, other dtypes or widths): the caller unpacks.
#[expect(
    clippy::too_many_arguments,
    reason = "one product's operands and its routing"
)]
pub(crate) fn routed_product(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    q: Quantization,
    experts: &[u32],
    shape: &[i32],
    kernels: &HostKernels,
) -> Result<Option<Array>> {
    if weight.ndim() != 3 || scales.ndim() != 3 || biases.ndim() != 3 || x.ndim() == 0 {
        return Ok(None);
    }
    let (n, out) = (weight.dim(0) as usize, weight.dim(1) as usize);
    // What else the kernel takes is checked where it is called.
    if !multiplies_packed(q) || n == 0 || out == 0 {
        return Ok(None);
    }
    let flat = |a: &Array| a.reshape(&[(n * out) as i32, a.dim(2)]);
    let (weight, scales, biases) = (flat(weight)?, flat(scales)?, flat(biases)?);
    if !readable(&weight, &scales, &biases) {
        return Ok(None);
    }
    let host = match HostMatrix::read(&weight, &scales, &biases) {
        Ok(host) => host,
        // Not row-contiguous (a view of another array): unpacked instead.
        Err(crate::Error::HostRead { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let Ok(stack) = host.matrix(q) else {
        return Ok(None);
    };
    routed_on_host(x, &stack, out, experts, shape, kernels)
}

/// [`routed_product`] of a stack already on the host — the arrays' data,
/// or the files' mapping — as one packed matrix of `n · out` rows: each
/// choice's row times its expert's `out` rows. `None` where the kernel
/// does not take it (outputs not whole panels, `x`'s width not the
/// stack's, an expert past it, choices not a whole number per row).
pub(crate) fn routed_on_host(
    x: &Array,
    stack: &PackedMatrix<'_>,
    out: usize,
    experts: &[u32],
    shape: &[i32],
    kernels: &HostKernels,
) -> Result<Option<Array>> {
    if x.ndim() == 0 {
        return Ok(None);
    }
    let inputs = x.dim(-1) as usize;
    let rows = x.size().checked_div(inputs).unwrap_or(0);
    let choices = experts.len();
    let n = stack.outputs().checked_div(out).unwrap_or(0);
    let fits = out.is_multiple_of(PANEL)
        && out > 0
        && stack.inputs() == inputs
        && rows > 0
        && choices.is_multiple_of(rows)
        && experts.iter().all(|&e| (e as usize) < n);
    if !fits {
        return Ok(None);
    }
    let x = x
        .as_dtype(mlx_rs::Dtype::Float32)?
        .reshape(&[rows as i32, inputs as i32])?
        .contiguous()?;
    let xs = host_slice::<f32>(Why::Kernel, "the routed rows", &x)?;
    let y = host_written("packed_routed::routed_product", &[choices, out], |sums| {
        let workers = kernels.workers();
        Ok(cpu_kernels::packed::routed(
            stack, out, xs, rows, experts, sums, workers,
        )?)
    })?;
    let mut shape = shape.to_vec();
    shape.extend([1, out as i32]);
    Ok(Some(y.reshape(&shape)?))
}

#[cfg(test)]
mod tests {
    use mlx_rs::ops::{gather_mm, quantize};
    use mlx_rs::random;

    use super::*;
    use crate::test_support::max_abs_diff;
    use crate::weights::unpack::dequantize_f32;

    const Q: Quantization = Quantization::affine(32, 4);

    fn normal(shape: &[i32], seed: u64) -> Array {
        random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap()
    }

    /// Against MLX's `gather_mm` over the experts unpacked to f32, in both
    /// layouts (a row per choice; a row per `k` choices); a choice's sums
    /// the same bits alone as among many rows of its expert; what the
    /// kernel does not take left to the caller.
    #[test]
    fn routed_products_equal_gather_mm_over_the_unpacked_experts() {
        let (n, out, inputs) = (6, 64, 96);
        let (w, s, b) = quantize(normal(&[n, out, inputs], 1), Q.group_size, Q.bits).unwrap();
        let dense = dequantize_f32(
            &w.reshape(&[n * out, -1]).unwrap(),
            &s.reshape(&[n * out, -1]).unwrap(),
            &b.reshape(&[n * out, -1]).unwrap(),
            Q,
        )
        .unwrap()
        .reshape(&[n, out, inputs])
        .unwrap()
        .swap_axes(-1, -2)
        .unwrap();
        // 20 choices among the 6 experts, expert 3 chosen 11 times.
        let ids: Vec<u32> = vec![3, 0, 3, 5, 3, 3, 1, 3, 3, 2, 3, 3, 0, 3, 5, 3, 1, 3, 4, 2];
        let x = normal(&[20, 1, inputs], 2);
        if !cpu_kernels::supported() {
            eprintln!("SKIPPED: this CPU has neither AVX-512F nor AVX2 with FMA; routed products go to MLX");
            return;
        }
        let k = HostKernels::for_tests(2);
        let got = routed_product(&x, &w, &s, &b, Q, &ids, &[20], &k).unwrap();
        let got = got.unwrap();
        let experts = Array::from_slice(&ids, &[20]);
        let want = gather_mm(&x, &dense, None, Some(&experts), Some(false)).unwrap();
        assert_eq!(got.shape(), want.shape());
        assert!(max_abs_diff(&got, &want) < 1e-4);
        // One row per two choices, `(2, 5, 1, 1, in)` against `(2, 5, 2)`.
        let rows = normal(&[2, 5, 1, 1, inputs], 3);
        let got = routed_product(&rows, &w, &s, &b, Q, &ids, &[2, 5, 2], &k)
            .unwrap()
            .unwrap();
        let experts = Array::from_slice(&ids, &[2, 5, 2]);
        let want = gather_mm(&rows, &dense, None, Some(&experts), Some(false)).unwrap();
        assert_eq!(got.shape(), want.shape());
        assert!(max_abs_diff(&got, &want) < 1e-4);
        // Choice 7 (expert 3) alone.
        let whole = routed_product(&x, &w, &s, &b, Q, &ids, &[20], &k)
            .unwrap()
            .unwrap();
        let alone = x.take_axis(Array::from_slice(&[7i32], &[1]), 0).unwrap();
        let alone = routed_product(&alone, &w, &s, &b, Q, &[3], &[1], &k)
            .unwrap()
            .unwrap();
        let whole = whole.as_slice::<f32>();
        assert_eq!(alone.as_slice::<f32>(), &whole[7 * 64..8 * 64]);
        // Left to the caller: 3 bits, an expert past the stack, 48 outputs.
        let left = |x: &Array, w: &Array, s: &Array, b: &Array, q, ids: &[u32]| {
            routed_product(x, w, s, b, q, ids, &[ids.len() as i32], &k)
                .unwrap()
                .is_none()
        };
        let three = Quantization { bits: 3, ..Q };
        assert!(left(&x, &w, &s, &b, three, &ids));
        let mut past = ids.clone();
        past[4] = 6;
        assert!(left(&x, &w, &s, &b, Q, &past));
        let (w48, s48, b48) = quantize(normal(&[n, 48, inputs], 4), 32, 4).unwrap();
        assert!(left(&x, &w48, &s48, &b48, Q, &ids));
    }
}

//! Products with dense f32 weights on the CPU, made for a decode step's
//! few rows.
//!
//! A decode step multiplies every weight by one row per conversation (8 at
//! batch 8). BLAS packs each weight matrix before multiplying it, which for
//! so few rows costs as much as the product: SmolLM2's 210 matrices took
//! 59–64 ms on OpenBLAS's two threads where reading them once takes about
//! 20 (docs/benchmarks.md, "Dense weights in panels"). So on the CPU a
//! dense f32 weight is held *in panels*: `(out / PANEL, in, PANEL)`, each
//! panel the weight's next `PANEL` outputs for every input, contiguous.
//! The kernel reads each panel front to back, eight rows at a time with
//! their `PANEL` sums in registers; the rows after the first eight find
//! the panel in the cache. Every product of such a weight runs here: BLAS
//! cannot read panels, and the `(in, out)` copy it would need cost a
//! prefill more than the kernel's arithmetic.
//!
//! The kernel itself is `cpu_kernels::panels` (MLX-free, its sums the same
//! bits alone or in a batch, not BLAS's order); this module lays weights
//! out for it and hands it MLX arrays' data. It is written for AVX-512F
//! and for AVX2 with FMA (x86-64; the same sums); elsewhere (and on the
//! GPU) weights keep the `(in, out)` layout and every product goes to MLX.

use mlx_rs::Array;

use crate::error::Result;
use crate::evaluation::{host_slice, Why};
use crate::weights::kernels::HostKernels;

pub(crate) use cpu_kernels::PANEL;

/// `w` `(out, in)` in panels `(out / PANEL, in, PANEL)`, lazily.
pub(crate) fn to_panels(w: &Array) -> Result<Array> {
    let (outputs, inputs) = (w.dim(0), w.dim(1));
    Ok(w.reshape(&[outputs / PANEL as i32, PANEL as i32, inputs])?
        .transpose_axes(&[0, 2, 1])?
        .contiguous()?)
}

/// The `(in, out)` matrix of `panels`, lazily: a copy, for BLAS.
pub(crate) fn transposed(panels: &Array) -> Result<Array> {
    let (count, inputs) = (panels.dim(0), panels.dim(1));
    Ok(panels
        .transpose_axes(&[1, 0, 2])?
        .reshape(&[inputs, count * PANEL as i32])?)
}

/// `x · W` for `x` `(…, in)` and `W` held as `panels`: `(…, out)`, in
/// f32 (as MLX promotes a narrower `x` against an f32 weight).
pub(crate) fn product(x: &Array, panels: &Array, kernels: &HostKernels) -> Result<Array> {
    let inputs = panels.dim(1) as usize;
    let outputs = panels.dim(0) as usize * PANEL;
    let fallback = || Ok(x.matmul(transposed(panels)?)?);
    on_host(x, inputs, outputs, fallback, |xs, rows, sums| {
        let w = host_slice::<f32>(Why::Kernel, "a weight in panels", panels)?;
        Ok(cpu_kernels::panels::multiply(
            xs,
            rows,
            inputs,
            w,
            sums,
            kernels.workers(),
        )?)
    })
}

/// A product `(…, in)` → `(…, out)` of `x` computed on the host by
/// `kernel(x, rows, sums)`, which writes the f32 sums `(rows, out)`
/// straight into the result's buffer. `fallback` (MLX's product) answers
/// instead where the kernel cannot: no rows, or a width that does not fit
/// (MLX's error names the shapes).
pub(crate) fn on_host(
    x: &Array,
    inputs: usize,
    outputs: usize,
    fallback: impl FnOnce() -> Result<Array>,
    kernel: impl FnOnce(&[f32], usize, &mut [f32]) -> Result<()>,
) -> Result<Array> {
    let fits = x.ndim() > 0 && x.shape()[x.ndim() - 1] as usize == inputs;
    let rows = x.size().checked_div(inputs).unwrap_or(0);
    if !fits || rows == 0 {
        return fallback();
    }
    let x = if x.dtype() == mlx_rs::Dtype::Float32 {
        x.clone()
    } else {
        x.as_dtype(mlx_rs::Dtype::Float32)?
    };
    let flat = x.reshape(&[rows as i32, inputs as i32])?.contiguous()?;
    let xs = host_slice::<f32>(Why::Kernel, "a product's rows", &flat)?;
    let y = host_written("few_rows::product", &[rows, outputs], |sums| {
        kernel(xs, rows, sums)
    })?;
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = outputs as i32;
    }
    Ok(y.reshape(&shape)?)
}

/// A new f32 array of `shape` whose values `fill` writes on the host,
/// straight into MLX's buffer (`what` names it in errors).
pub(crate) fn host_written(
    what: &'static str,
    shape: &[usize],
    fill: impl FnOnce(&mut [f32]) -> Result<()>,
) -> Result<Array> {
    mlx_support::array_written::<crate::error::Error>(what, st_mmap::Dtype::F32, shape, |bytes| {
        // SAFETY: any bit pattern is an f32; `align_to_mut` only yields
        // the part of the buffer that is aligned for one.
        let (head, values, tail) = unsafe { bytes.align_to_mut::<f32>() };
        if !head.is_empty() || !tail.is_empty() {
            return Err(crate::Error::HostRead {
                what,
                reason: "MLX's buffer is not aligned for f32".into(),
            });
        }
        fill(values)
    })
}

#[cfg(test)]
mod tests {
    use mlx_rs::random;

    use super::*;
    use crate::test_support::max_abs_diff;

    /// Through MLX: one tile of rows and more (the kernel where the CPU
    /// has it), and a narrower input, give `x · Wᵀ` in `x`'s shape; a width
    /// that does not fit is MLX's error.
    #[test]
    fn products_in_panels_equal_the_plain_product() {
        if !cpu_kernels::supported() {
            eprintln!(
                "SKIPPED: this CPU has neither AVX-512F nor AVX2 with FMA; products go to BLAS"
            );
            return;
        }
        let kernels = HostKernels::for_tests(2);
        let key = random::key(7).unwrap();
        let w = random::normal::<f32>(&[96, 40], None, None, &key).unwrap();
        let panels = to_panels(&w).unwrap();
        assert_eq!(panels.shape(), &[3, 40, PANEL as i32]);
        for shape in [[1, 3, 40], [2, 4, 40], [3, 5, 40]] {
            let key = random::key(shape[1] as u64).unwrap();
            let x = random::normal::<f32>(&shape, None, None, &key).unwrap();
            let got = product(&x, &panels, &kernels).unwrap();
            let want = x.matmul(w.t()).unwrap();
            assert_eq!(got.shape(), want.shape());
            let diff = max_abs_diff(&got, &want);
            assert!(diff < 1e-4, "{shape:?}: {diff}");
        }
        let narrow = random::normal::<f32>(&[2, 40], None, None, &key)
            .unwrap()
            .as_dtype(mlx_rs::Dtype::Bfloat16)
            .unwrap();
        let got = product(&narrow, &panels, &kernels).unwrap();
        assert_eq!(got.dtype(), mlx_rs::Dtype::Float32);
        let want = narrow.matmul(w.t()).unwrap();
        assert!(max_abs_diff(&got, &want) < 1e-4);
        let wrong = mlx_rs::ops::ones::<f32>(&[2, 41]).unwrap();
        let refused = product(&wrong, &panels, &kernels).and_then(|y| Ok(y.eval()?));
        assert!(refused.is_err(), "a width that does not fit is MLX's error");
    }
}

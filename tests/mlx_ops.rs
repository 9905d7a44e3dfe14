//! MLX numerics on this platform, checked against naive Rust references.
//!
//! Inputs come from a fixed-seed generator; every expected value is computed
//! here in plain Rust from the same inputs, never taken from MLX.

use std::collections::HashMap;

use anyhow::Result;
use half::{bf16, f16};
use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{dequantize, quantize, quantized_matmul};
use mlx_rs::{Array, Dtype};

/// Deterministic values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn to_f32(a: &Array) -> Result<Vec<f32>> {
    let a = a.as_dtype(Dtype::Float32)?;
    a.eval()?;
    Ok(a.as_slice::<f32>().to_vec())
}

fn naive_matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    c
}

fn assert_close(got: &[f32], want: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

#[test]
fn f32_matmul_matches_naive() -> Result<()> {
    let (m, k, n) = (37, 64, 29);
    let (a, b) = (values(1, m * k), values(2, k * n));
    let c = Array::from_slice(&a, &[m as i32, k as i32])
        .matmul(Array::from_slice(&b, &[k as i32, n as i32]))?;
    assert_eq!(c.shape(), &[m as i32, n as i32]);
    assert_close(
        &to_f32(&c)?,
        &naive_matmul(&a, &b, m, k, n),
        1e-4,
        1e-4,
        "f32 matmul",
    );
    Ok(())
}

#[test]
fn bf16_matmul_matches_naive_on_rounded_inputs() -> Result<()> {
    let (m, k, n) = (16, 48, 24);
    let round = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    let (a, b) = (round(values(3, m * k)), round(values(4, k * n)));
    let wide = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
    let c = Array::from_slice(&a, &[m as i32, k as i32])
        .matmul(Array::from_slice(&b, &[k as i32, n as i32]))?;
    assert_eq!(c.dtype(), Dtype::Bfloat16);
    // The result is rounded to bf16 (8 significant bits): allow that rounding.
    let want = naive_matmul(&wide(&a), &wide(&b), m, k, n);
    assert_close(&to_f32(&c)?, &want, 2e-2, 1.0 / 128.0, "bf16 matmul");
    Ok(())
}

#[test]
fn half_types_cross_the_ffi_boundary_exactly() -> Result<()> {
    // These go through the f16/bf16 accessors the mlx-sys stand-in provides on x86.
    let h = Array::from_slice(&[f16::from_f32(1.5), f16::from_f32(-2.25)], &[2]);
    h.eval()?;
    assert_eq!(
        h.as_slice::<f16>(),
        &[f16::from_f32(1.5), f16::from_f32(-2.25)]
    );
    assert_eq!(h.index(1).item_exact::<f16>(), f16::from_f32(-2.25));
    let b = Array::from_slice(&[bf16::from_f32(0.5), bf16::from_f32(3.0)], &[2]);
    b.eval()?;
    assert_eq!(
        b.as_slice::<bf16>(),
        &[bf16::from_f32(0.5), bf16::from_f32(3.0)]
    );
    let sum = b.sum(None)?;
    assert_eq!(sum.item_exact::<bf16>(), bf16::from_f32(3.5));
    Ok(())
}

#[test]
fn safetensors_round_trip_keeps_values_dtypes_and_metadata() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("weights.safetensors");
    let a = values(5, 6 * 4);
    let b: Vec<bf16> = values(6, 10).into_iter().map(bf16::from_f32).collect();
    let c: Vec<i32> = (0..7).map(|i| i * i - 20).collect();
    let arrays = [
        ("layer.a", Array::from_slice(&a, &[6, 4])),
        ("layer.b", Array::from_slice(&b, &[2, 5])),
        ("c", Array::from_slice(&c, &[7])),
    ];
    let metadata = HashMap::from([
        ("format".to_owned(), "mlx".to_owned()),
        ("note".to_owned(), "round trip ✓".to_owned()),
    ]);
    Array::save_safetensors(arrays.iter().map(|(k, v)| (*k, v)), &metadata, &path)?;

    let (loaded, loaded_meta) = Array::load_safetensors_with_metadata(&path)?;
    assert_eq!(loaded_meta, metadata);
    assert_eq!(loaded.len(), 3);
    let la = &loaded["layer.a"];
    let lb = &loaded["layer.b"];
    let lc = &loaded["c"];
    mlx_rs::transforms::eval([la, lb, lc])?;
    assert_eq!((la.dtype(), la.shape()), (Dtype::Float32, &[6, 4][..]));
    assert_eq!(la.as_slice::<f32>(), &a[..]);
    assert_eq!((lb.dtype(), lb.shape()), (Dtype::Bfloat16, &[2, 5][..]));
    assert_eq!(lb.as_slice::<bf16>(), &b[..]);
    assert_eq!(lc.as_slice::<i32>(), &c[..]);
    Ok(())
}

/// Affine quantization per group of the last axis: each element's error is at
/// most half a quantization step of its group.
fn check_quantization(bits: i32) -> Result<()> {
    let (rows, cols, group) = (32usize, 256usize, 64usize);
    let w = values(7 + bits as u64, rows * cols);
    let wa = Array::from_slice(&w, &[rows as i32, cols as i32]);
    let (wq, scales, biases) = quantize(&wa, group as i32, bits)?;
    assert_eq!(wq.dtype(), Dtype::Uint32);
    assert_eq!(
        wq.shape(),
        &[rows as i32, (cols * bits as usize / 32) as i32]
    );
    assert_eq!(scales.shape(), &[rows as i32, (cols / group) as i32]);
    let deq = to_f32(&dequantize(&wq, &scales, &biases, group as i32, bits)?)?;
    let s = to_f32(&scales)?;
    // MLX snaps each group's grid so that zero is exact, which can push the far
    // end of the range up to one step out: the bound per element is one step,
    // and on average rounding costs a quarter step.
    let (mut total_err, mut total_step) = (0.0f64, 0.0f64);
    for r in 0..rows {
        for c in 0..cols {
            let step = s[r * (cols / group) + c / group].abs();
            let err = (deq[r * cols + c] - w[r * cols + c]).abs();
            assert!(
                err <= step + 1e-6,
                "{bits}-bit ({r},{c}): error {err} > step {step}"
            );
            total_err += f64::from(err);
            total_step += f64::from(step);
        }
    }
    assert!(
        total_err <= 0.3 * total_step,
        "{bits}-bit mean error {} vs mean step {}",
        total_err,
        total_step
    );
    // And the step itself is what `bits` allows for values in [-1, 1).
    let max_step = s.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(
        max_step <= 2.0 / ((1 << bits) - 1) as f32 + 1e-6,
        "{bits}-bit step {max_step}"
    );

    // quantized_matmul computes x @ dequantized(w)ᵀ.
    let x = values(11, 5 * cols);
    let xa = Array::from_slice(&x, &[5, cols as i32]);
    let got = to_f32(&quantized_matmul(
        &xa,
        &wq,
        &scales,
        &biases,
        true,
        group as i32,
        bits,
    )?)?;
    let mut deq_t = vec![0.0f32; cols * rows];
    for r in 0..rows {
        for c in 0..cols {
            deq_t[c * rows + r] = deq[r * cols + c];
        }
    }
    assert_close(
        &got,
        &naive_matmul(&x, &deq_t, 5, cols, rows),
        1e-3,
        1e-4,
        "quantized_matmul",
    );
    Ok(())
}

#[test]
fn quantize_4bit_error_bound_and_quantized_matmul() -> Result<()> {
    check_quantization(4)
}

#[test]
fn quantize_8bit_error_bound_and_quantized_matmul() -> Result<()> {
    check_quantization(8)
}

fn naive_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    heads: usize,
    len: usize,
    dim: usize,
    causal: bool,
) -> Vec<f32> {
    let scale = 1.0 / (dim as f32).sqrt();
    let mut out = vec![0.0f32; heads * len * dim];
    for h in 0..heads {
        let at = |x: &[f32], t: usize, d: usize| x[(h * len + t) * dim + d];
        for i in 0..len {
            let visible = if causal { i + 1 } else { len };
            let scores: Vec<f32> = (0..visible)
                .map(|j| (0..dim).map(|d| at(q, i, d) * at(k, j, d)).sum::<f32>() * scale)
                .collect();
            let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f32 = exps.iter().sum();
            for d in 0..dim {
                out[(h * len + i) * dim + d] =
                    (0..visible).map(|j| exps[j] / total * at(v, j, d)).sum();
            }
        }
    }
    out
}

#[test]
fn scaled_dot_product_attention_matches_naive_softmax_attention() -> Result<()> {
    let (heads, len, dim) = (2usize, 7usize, 16usize);
    let n = heads * len * dim;
    let (q, k, v) = (values(21, n), values(22, n), values(23, n));
    let shape = [1, heads as i32, len as i32, dim as i32];
    let (qa, ka, va) = (
        Array::from_slice(&q, &shape),
        Array::from_slice(&k, &shape),
        Array::from_slice(&v, &shape),
    );
    let scale = 1.0 / (dim as f32).sqrt();

    let plain = fast::scaled_dot_product_attention(&qa, &ka, &va, scale, None, None)?;
    assert_close(
        &to_f32(&plain)?,
        &naive_attention(&q, &k, &v, heads, len, dim, false),
        1e-5,
        1e-4,
        "sdpa",
    );

    let causal = fast::scaled_dot_product_attention(
        &qa,
        &ka,
        &va,
        scale,
        ScaledDotProductAttentionMask::Causal,
        None,
    )?;
    let want = naive_attention(&q, &k, &v, heads, len, dim, true);
    assert_close(&to_f32(&causal)?, &want, 1e-5, 1e-4, "causal sdpa");
    // The first query sees only the first key, so its output is the first value.
    assert_close(
        &to_f32(&causal)?[..dim],
        &v[..dim],
        1e-6,
        0.0,
        "causal row 0",
    );
    Ok(())
}

#[test]
fn rms_norm_matches_formula() -> Result<()> {
    let (rows, dim, eps) = (3usize, 32usize, 1e-5f32);
    let (x, w) = (values(31, rows * dim), values(32, dim));
    let got = fast::rms_norm(
        Array::from_slice(&x, &[rows as i32, dim as i32]),
        Some(&Array::from_slice(&w, &[dim as i32])),
        eps,
    )?;
    let mut want = vec![0.0f32; rows * dim];
    for r in 0..rows {
        let row = &x[r * dim..(r + 1) * dim];
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / dim as f32 + eps).sqrt();
        for d in 0..dim {
            want[r * dim + d] = row[d] * inv * w[d];
        }
    }
    assert_close(&to_f32(&got)?, &want, 1e-5, 1e-5, "rms_norm");
    Ok(())
}

fn naive_rope(
    x: &[f32],
    len: usize,
    dim: usize,
    base: f32,
    offset: usize,
    traditional: bool,
) -> Vec<f32> {
    let half = dim / 2;
    let mut out = x.to_vec();
    for t in 0..len {
        let pos = (offset + t) as f32;
        for i in 0..half {
            let theta = pos * base.powf(-2.0 * i as f32 / dim as f32);
            let (a, b) = if traditional {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (x1, x2) = (x[t * dim + a], x[t * dim + b]);
            out[t * dim + a] = x1 * theta.cos() - x2 * theta.sin();
            out[t * dim + b] = x1 * theta.sin() + x2 * theta.cos();
        }
    }
    out
}

#[test]
fn rope_matches_formula_in_both_layouts() -> Result<()> {
    let (len, dim, base, offset) = (5usize, 16usize, 10000.0f32, 3usize);
    let x = values(41, len * dim);
    let xa = Array::from_slice(&x, &[1, 1, len as i32, dim as i32]);
    for traditional in [false, true] {
        let got = fast::rope(&xa, dim as i32, traditional, base, 1.0, offset as i32, None)?;
        let want = naive_rope(&x, len, dim, base, offset, traditional);
        assert_close(
            &to_f32(&got)?,
            &want,
            1e-4,
            1e-4,
            &format!("rope traditional={traditional}"),
        );
    }
    Ok(())
}

//! SiLU, tanh-approximated GELU and softmax's exponentials as compiled
//! arithmetic.
//!
//! Why: the MLX CPU build for x86 evaluates `exp` one element at a time,
//! each of its fused multiply-adds a library call; with the softmax over
//! every cached position and the SiLU of the MLP, exponentials were about a
//! tenth of a generation run's samples on the project's machine (`perf`).
//! The same function from multiplies and adds, compiled into fused kernels,
//! costs a fraction of that on the CPU and is an ordinary fused kernel on a
//! GPU.
//!
//! The exponential reduces `x = n·ln 2 + r` (`|r| ≤ ln 2 / 2`, ln 2 split in
//! two parts so `r` is exact), evaluates Cephes' polynomial for `eʳ`
//! (within two units in the last place) and scales by `2ⁿ` built from its
//! exponent bits. Inputs are clamped to ±88: results under `e⁻⁸⁷·⁷` are
//! exactly 0 (masked scores vanish), none overflow.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::ops::{maximum, minimum};
use mlx_rs::{Array, Dtype};

use crate::ops::{call, compiled, Compiled, CompiledKey};

// The compiled functions live as long as their thread: MLX keys a compiled
// graph by the function's identity, so a function compiled per call would be
// traced again every time. Thread-local because MLX work stays on the thread
// that owns it (the engine's worker). Shapeless, so new shapes (a longer
// cache every decode step) reuse the graph; reinterpreting the exponent
// bits as floats (`view`) cannot be part of a shapeless graph, so each
// exponential is two kernels: its parts, then their product.
thread_local! {
    static SHIFTED_PARTS: RefCell<Compiled> =
        compiled(|a| exp_parts(&a[0].subtract(&a[1])?));
    static NEGATED_PARTS: RefCell<Compiled> = compiled(|a| exp_parts(&a[0].negative()?));
    static PRODUCT: RefCell<Compiled> = compiled(|a| Ok(vec![a[0].multiply(&a[1])?]));
    // e^(-2z) for GELU's z = √(2/π)·(g + 0.044715·g³).
    static GELU_PARTS: RefCell<Compiled> = compiled(|a| {
        let g = &a[0];
        let cubic = g.multiply(g)?.multiply(g)?.multiply(scalar(0.044715))?;
        let z = g.add(cubic)?.multiply(scalar(SQRT_2_OVER_PI))?;
        exp_parts(&z.multiply(scalar(-2.0))?)
    });
    // silu(g)·u = g·u / (1 + e^-g), with e^-g = a[2]·a[3]; the same form
    // gives GELU's, with e^(-2z) for e^-g.
    static SILU_MUL: RefCell<Compiled> = compiled(|a| {
        let denominator = a[2].multiply(&a[3])?.add(scalar(1.0))?;
        Ok(vec![a[0].multiply(&a[1])?.divide(denominator)?])
    });
}

/// The exponential's two factors: `(eʳ, 2ⁿ)`, the second as floats.
fn factors(parts: &'static CompiledKey, args: &[Array]) -> Result<[Array; 2], Exception> {
    let [e_r, bits] = call(parts, args)?;
    Ok([e_r, bits.view::<f32>()?])
}

/// `silu(gate) · up`: compiled for f32; for bfloat16 and float16 MLX's own
/// operations, as mlx_lm's `swiglu` (`gate · sigmoid(gate) · up`, each step
/// rounded to the inputs' dtype) — the compiled form's f32 constants would
/// widen its result to f32.
pub(crate) fn silu_mul(gate: &Array, up: &Array) -> Result<Array, Exception> {
    if gate.dtype() != Dtype::Float32 || up.dtype() != Dtype::Float32 {
        return gate.multiply(mlx_rs::ops::sigmoid(gate)?)?.multiply(up);
    }
    let [e_r, two_n] = factors(&NEGATED_PARTS, std::slice::from_ref(gate))?;
    let [y] = call(&SILU_MUL, &[gate.clone(), up.clone(), e_r, two_n])?;
    Ok(y)
}

/// `gelu_tanh(gate) · up` for f32 arrays, where MLX's `gelu_approx` is
/// `0.5·g·(1 + tanh z)`, `z = √(2/π)·(g + 0.044715·g³)`: since
/// `0.5·(1 + tanh z)` is the logistic function of `2z`, this is
/// `g·u / (1 + e^(-2z))`, two compiled kernels instead of a dozen
/// element-wise passes (one of them a libm `tanh` per element). Equal to
/// the tanh form within a few units in the last place.
pub(crate) fn gelu_tanh_mul(gate: &Array, up: &Array) -> Result<Array, Exception> {
    let [e_r, two_n] = factors(&GELU_PARTS, std::slice::from_ref(gate))?;
    let [y] = call(&SILU_MUL, &[gate.clone(), up.clone(), e_r, two_n])?;
    Ok(y)
}

/// `exp(x − max)` with `max` broadcast against `x`.
pub(crate) fn exp_shifted(x: &Array, max: &Array) -> Result<Array, Exception> {
    let [e_r, two_n] = factors(&SHIFTED_PARTS, &[x.clone(), max.clone()])?;
    let [y] = call(&PRODUCT, &[e_r, two_n])?;
    Ok(y)
}

const LOG2_E: f32 = std::f32::consts::LOG2_E;
// √(2/π), as MLX's gelu_approx rounds it to f32.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
// ln 2 = LN2_HIGH + LN2_LOW; LN2_HIGH has few mantissa bits so `n·LN2_HIGH`
// is exact for the `n` that occur.
const LN2_HIGH: f32 = 0.693_359_4;
const LN2_LOW: f32 = -2.121_944_4e-4;
// Cephes `expf`: eʳ ≈ 1 + r + r²·P(r), highest power first.
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_6e-1,
    5e-1,
];

fn scalar(v: f32) -> Array {
    Array::from_f32(v)
}

/// `eˣ` from arithmetic as an MLX graph (see the module docs): `eʳ`, and
/// the bits of the float `2ⁿ` as `i32`.
///
/// `n = ⌊x·log₂e + ½⌋` comes from truncating `x·log₂e + 127.5`, which the
/// clamp keeps non-negative, so truncation is the floor, and which is the
/// biased exponent `n + 127` itself. MLX's CPU kernels compute `floor` an
/// element at a time, about ten times slower than the conversion to an
/// integer (a kernel of its own: it was the costliest part of the
/// exponential under `perf`); a conversion, unlike rounding with a
/// `(y + 1.5·2²³) − 1.5·2²³` trick, also survives fast-math compilers.
fn exp_parts(x: &Array) -> Result<Vec<Array>, Exception> {
    let x = maximum(minimum(x, scalar(88.0))?, scalar(-88.0))?;
    // In 0..=254; 0 (for x below about −87.7) gives the float 0.0.
    let biased = x
        .multiply(scalar(LOG2_E))?
        .add(scalar(127.5))?
        .as_dtype(Dtype::Int32)?;
    let n = biased.as_dtype(Dtype::Float32)?.subtract(scalar(127.0))?;
    let r = x
        .subtract(n.multiply(scalar(LN2_HIGH))?)?
        .subtract(n.multiply(scalar(LN2_LOW))?)?;
    let mut p = scalar(P[0]);
    for &c in &P[1..] {
        p = p.multiply(&r)?.add(scalar(c))?;
    }
    let e_r = p.multiply(r.square()?)?.add(&r)?.add(scalar(1.0))?;
    // 2ⁿ: the biased exponent in bits 23..31; at most 254·2²³, no overflow.
    let bits = biased.multiply(Array::from_int(1 << 23))?;
    Ok(vec![e_r, bits])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(a: &Array) -> Vec<f32> {
        a.eval().unwrap();
        a.as_slice::<f32>().to_vec()
    }

    #[test]
    fn exp_is_within_two_ulp_of_std_and_vanishes_far_below_zero() {
        let xs: Vec<f32> = (-8800..=8800).map(|i| i as f32 / 100.0).collect();
        let x = Array::from_slice(&xs, &[xs.len() as i32]);
        let ours = values(&exp_shifted(&x, &scalar(0.0)).unwrap());
        for (&x, &y) in xs.iter().zip(&ours) {
            let want = (x as f64).exp();
            if x < -87.7 {
                assert_eq!(y, 0.0, "exp({x})");
            } else if want >= f32::MIN_POSITIVE as f64 {
                let ulp = f32::EPSILON as f64 * want;
                assert!(
                    (y as f64 - want).abs() <= 2.0 * ulp,
                    "exp({x}) = {y}, want {want}"
                );
            }
        }
        let extremes = Array::from_slice(&[f32::MIN, f32::MAX], &[2]);
        let huge = values(&exp_shifted(&extremes, &scalar(0.0)).unwrap());
        assert_eq!(huge[0], 0.0);
        assert!(huge[1].is_finite() && huge[1] > 1e38);
    }

    #[test]
    fn silu_and_gelu_products_match_their_definitions_with_broadcast_shapes() {
        let g: Vec<f32> = (0..96).map(|i| (i as f32 - 48.0) * 0.37).collect();
        let u: Vec<f32> = (0..96).map(|i| (i as f32 * 0.11).sin()).collect();
        let gate = Array::from_slice(&g, &[2, 3, 16]);
        let up = Array::from_slice(&u, &[2, 3, 16]);
        let ours = values(&silu_mul(&gate, &up).unwrap());
        for ((&g, &u), &y) in g.iter().zip(&u).zip(&ours) {
            let want = g as f64 / (1.0 + (-g as f64).exp()) * u as f64;
            assert!(
                (y as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{g} {u}: {y} vs {want}"
            );
        }
        let gelu = values(&gelu_tanh_mul(&gate, &up).unwrap());
        for ((&g, &u), &y) in g.iter().zip(&u).zip(&gelu) {
            let (g, u) = (g as f64, u as f64);
            let z = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
            let want = 0.5 * g * (1.0 + z.tanh()) * u;
            assert!(
                (y as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "gelu {g} {u}: {y} vs {want}"
            );
        }
        // A new shape and a broadcast maximum reuse the shapeless graphs.
        let rows = Array::from_slice(&g[..8], &[2, 4]);
        let max = Array::from_slice(&[1.0f32, -2.0], &[2, 1]);
        let shifted = values(&exp_shifted(&rows, &max).unwrap());
        for (i, &y) in shifted.iter().enumerate() {
            let want = ((g[i] - [1.0f32, -2.0][i / 4]) as f64).exp();
            assert!(
                (y as f64 - want).abs() <= 2.5e-7 * want,
                "{i}: {y} vs {want}"
            );
        }
    }
}

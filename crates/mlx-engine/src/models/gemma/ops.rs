//! Gemma's arithmetic as mlx_lm computes it: Python floats rounded to
//! the dtype, MLX's `gelu_approx` step for step, float16 residuals, norms.

use mlx_rs::ops::{clip, power, tanh};
use mlx_rs::{Array, Dtype};

use crate::error::Result;
use crate::evaluation::{evaluate, Why};
use crate::models::gemma::config::Version;
use crate::nn::fused::gelu_tanh_mul;
use crate::weights::{KeyPath, Weights};

/// A norm's weight; Gemma 3 scales by (1 + w), and adding the one at load
/// gives the same values mlx_lm computes at each call. The sum is
/// evaluated now, on the thread that loads: lanes read the model's arrays
/// from other threads and cannot compute one (see `lanes`).
pub(super) fn norm(w: &Weights<'_>, version: Version, key: &KeyPath, len: usize) -> Result<Array> {
    let weight = w.vector(key, len)?;
    Ok(match version {
        Version::Four => weight,
        Version::Three => {
            let plus_one = weight.add(Array::from_f32(1.0).as_dtype(weight.dtype())?)?;
            evaluate(Why::Load, [&plus_one])?;
            plus_one
        }
    })
}

/// A Python float as mlx_lm's arithmetic sees it: rounded to the array's
/// dtype.
pub(super) fn scalar(v: f64, dtype: Dtype) -> Result<Array> {
    Ok(Array::from_f32(v as f32).as_dtype(dtype)?)
}

/// `gelu_tanh(gate) · up`: compiled for f32 (see
/// [`crate::nn::fused::gelu_tanh_mul`]), MLX's own operations otherwise.
pub(super) fn gelu_mul(gate: &Array, up: &Array) -> Result<Array> {
    if gate.dtype() == Dtype::Float32 && up.dtype() == Dtype::Float32 {
        return Ok(gelu_tanh_mul(gate, up)?);
    }
    Ok(gelu_tanh(gate)?.multiply(up)?)
}

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, MLX's `gelu_approx`,
/// operation for operation: in bfloat16 each step rounds, so the cube is
/// MLX's `power` (one rounding), not two products.
fn gelu_tanh(x: &Array) -> Result<Array> {
    let dtype = x.dtype();
    let c = |v: f64| scalar(v, dtype);
    let cubed = power(x, c(3.0)?)?;
    let inner = x
        .add(c(0.044715)?.multiply(cubed)?)?
        .multiply(c((2.0 / std::f64::consts::PI).sqrt())?)?;
    Ok(c(0.5)?.multiply(x)?.multiply(c(1.0)?.add(tanh(&inner)?)?)?)
}

/// `x + y`; Gemma 3 in float16 sums in f32 and clips to float16's range,
/// as mlx_lm does (its activations overflow float16).
pub(super) fn residual_add(version: Version, x: &Array, y: &Array) -> Result<Array> {
    if version == Version::Four || x.dtype() != Dtype::Float16 {
        return Ok(x.add(y)?);
    }
    let bound = 65504.0f32;
    let sum = x
        .as_dtype(Dtype::Float32)?
        .add(y.as_dtype(Dtype::Float32)?)?;
    Ok(clip(&sum, (-bound, bound))?.as_dtype(Dtype::Float16)?)
}

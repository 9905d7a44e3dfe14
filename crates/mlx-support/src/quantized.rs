//! MLX's quantized operations in any of its modes. mlx-rs calls them
//! affine alone (it passes no `mode`); these call mlx-c with the mode of a
//! [`Quantization`], and no biases where the mode has none (MXFP4).

use mlx_rs::error::Exception;
use mlx_rs::{Array, Stream};

use crate::{QuantMode, Quantization};

/// An optional int as mlx-c takes it.
fn some(value: i32) -> mlx_sys::mlx_optional_int {
    mlx_sys::mlx_optional_int {
        value,
        has_value: true,
    }
}

/// The mode's name as a C string (static: no allocation per call).
fn mode_name(mode: QuantMode) -> &'static std::ffi::CStr {
    match mode {
        QuantMode::Affine => c"affine",
        QuantMode::Mxfp4 => c"mxfp4",
    }
}

/// The array an mlx-c operation wrote into `fill`'s argument, or the
/// failure it reported (`what` names the operation).
fn array_of(
    what: &str,
    fill: impl FnOnce(*mut mlx_sys::mlx_array) -> std::os::raw::c_int,
) -> Result<Array, Exception> {
    // SAFETY: a fresh empty array handle for the operation to overwrite.
    let mut out = unsafe { mlx_sys::mlx_array_new() };
    let status = fill(&mut out);
    // SAFETY: `out` is a valid handle (still the empty one on failure),
    // owned from here on by the returned value and freed by its drop.
    let array = unsafe { Array::from_ptr(out) };
    if status != 0 {
        return Err(Exception::custom(format!("MLX's {what} failed")));
    }
    Ok(array)
}

/// The null array mlx-c takes for an absent operand.
fn absent() -> Array {
    // SAFETY: a fresh empty handle, owned by the returned value.
    unsafe { Array::from_ptr(mlx_sys::mlx_array_new()) }
}

/// `w` `(…, rows, cols)` packed as `q` says: the words, the scales and,
/// affine, the biases.
pub fn quantize(w: &Array, q: Quantization) -> Result<(Array, Array, Option<Array>), Exception> {
    let stream = Stream::thread_local_or_default();
    // SAFETY: an empty vector, filled by mlx_quantize and freed below.
    let mut parts = unsafe { mlx_sys::mlx_vector_array_new() };
    let no_scale = absent();
    // SAFETY: every handle is valid for the call; the mode is a static C
    // string; mlx-c reports failure as a status, never unwinds.
    let status = unsafe {
        mlx_sys::mlx_quantize(
            &mut parts,
            w.as_ptr(),
            some(q.group_size),
            some(q.bits),
            mode_name(q.mode).as_ptr(),
            no_scale.as_ptr(),
            stream.as_ptr(),
        )
    };
    let taken = (|| {
        if status != 0 {
            return Err(Exception::custom("MLX's quantize failed"));
        }
        // SAFETY: `parts` is the vector mlx_quantize filled.
        let n = unsafe { mlx_sys::mlx_vector_array_size(parts) };
        let mut arrays = Vec::with_capacity(n);
        for i in 0..n {
            arrays.push(array_of("quantize", |out| {
                // SAFETY: `i` is within the vector; `out` is a valid handle.
                unsafe { mlx_sys::mlx_vector_array_get(out, parts, i) }
            })?);
        }
        Ok(arrays)
    })();
    // SAFETY: the vector is freed exactly once; the arrays taken from it
    // hold their own references.
    unsafe { mlx_sys::mlx_vector_array_free(parts) };
    let mut arrays = taken?.into_iter();
    match (arrays.next(), arrays.next(), arrays.next()) {
        (Some(w), Some(scales), biases) if biases.is_some() == q.mode.has_biases() => {
            Ok((w, scales, biases))
        }
        _ => Err(Exception::custom(
            "MLX's quantize gave other parts than its mode has",
        )),
    }
}

/// The packed `w` with its `scales` (and affine `biases`) unpacked, in the
/// scales' dtype.
pub fn dequantize(
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    q: Quantization,
) -> Result<Array, Exception> {
    let stream = Stream::thread_local_or_default();
    let none = absent();
    let no_dtype = mlx_sys::mlx_optional_dtype {
        value: mlx_sys::mlx_dtype__MLX_FLOAT32,
        has_value: false,
    };
    array_of("dequantize", |out| {
        // SAFETY: every handle is valid for the call (`none` stands for
        // absent operands); the mode is a static C string.
        unsafe {
            mlx_sys::mlx_dequantize(
                out,
                w.as_ptr(),
                scales.as_ptr(),
                biases.unwrap_or(&none).as_ptr(),
                some(q.group_size),
                some(q.bits),
                mode_name(q.mode).as_ptr(),
                none.as_ptr(),
                no_dtype,
                stream.as_ptr(),
            )
        }
    })
}

/// Each row of `x` times the packed matrix of its expert in `experts`
/// (`w` `(experts, out, in · bits / 32)`, transposed as `nn.Linear`
/// holds it; `sorted` when the experts ascend): MLX's `gather_qmm`.
pub fn gather_qmm(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    experts: &Array,
    q: Quantization,
    sorted: bool,
) -> Result<Array, Exception> {
    let stream = Stream::thread_local_or_default();
    let none = absent();
    array_of("gather_qmm", |out| {
        // SAFETY: every handle is valid for the call (`none` stands for
        // absent operands); the mode is a static C string.
        unsafe {
            mlx_sys::mlx_gather_qmm(
                out,
                x.as_ptr(),
                w.as_ptr(),
                scales.as_ptr(),
                biases.unwrap_or(&none).as_ptr(),
                none.as_ptr(),
                experts.as_ptr(),
                true,
                some(q.group_size),
                some(q.bits),
                mode_name(q.mode).as_ptr(),
                sorted,
                stream.as_ptr(),
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MXFP4 round trip: 4-bit floats with a shared power-of-two scale per
    /// 32 elements, no biases, within the format's step of the original;
    /// and the product of packed experts equals the product of the same
    /// experts unpacked.
    #[test]
    fn mxfp4_packs_unpacks_and_multiplies() {
        let key = mlx_rs::random::key(3).unwrap();
        let w = mlx_rs::random::normal::<f32>(&[4, 8, 64], None, None, &key).unwrap();
        let q = Quantization {
            group_size: 32,
            bits: 4,
            mode: QuantMode::Mxfp4,
        };
        let (packed, scales, biases) = quantize(&w, q).unwrap();
        assert!(biases.is_none());
        assert_eq!(packed.shape(), [4, 8, 8]);
        assert_eq!(scales.shape(), [4, 8, 2]);
        assert_eq!(scales.dtype(), mlx_rs::Dtype::Uint8);
        let back = dequantize(&packed, &scales, None, q).unwrap();
        let err = back.subtract(&w).unwrap().abs().unwrap().max(None).unwrap();
        assert!(err.item_exact::<f32>() < 1.0, "{}", err.item_exact::<f32>());
        let x = mlx_rs::random::normal::<f32>(&[3, 1, 1, 64], None, None, &key).unwrap();
        let experts = Array::from_slice(&[2u32, 0, 3], &[3, 1]);
        let packed_product = gather_qmm(&x, &packed, &scales, None, &experts, q, false).unwrap();
        let dense =
            mlx_rs::ops::gather_mm(&x, back.swap_axes(-1, -2).unwrap(), None, &experts, None)
                .unwrap();
        let d = packed_product
            .subtract(&dense)
            .unwrap()
            .abs()
            .unwrap()
            .max(None)
            .unwrap();
        assert!(d.item_exact::<f32>() < 1e-3, "{}", d.item_exact::<f32>());
        let affine_mode = mode_name(QuantMode::Affine);
        assert_eq!(affine_mode.to_str().unwrap(), QuantMode::Affine.name());
    }
}

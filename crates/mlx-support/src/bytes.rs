//! Copying between raw tensor bytes and MLX arrays, for code that reads or
//! writes safetensors itself.

use mlx_rs::Array;

use st_mmap::Dtype;

use crate::error::{Error, Result};

/// An MLX array holding a copy of `data`: `shape` elements of `dtype`, little
/// endian, as stored in safetensors. `key` names the tensor in errors.
pub fn array_from_bytes(key: &str, dtype: Dtype, shape: &[usize], data: &[u8]) -> Result<Array> {
    let mlx = checked_dtype(key, dtype)?;
    let dims = checked_shape(key, shape)?;
    let expected = shape
        .iter()
        .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::ShapeTooLarge {
            key: key.to_owned(),
            shape: shape.to_vec(),
        })?;
    if data.len() != expected {
        return Err(Error::ByteLength {
            key: key.to_owned(),
            expected,
            actual: data.len(),
        });
    }
    // SAFETY: `data` holds exactly the elements `dims` and `mlx` describe;
    // mlx_array_new_data copies them before returning.
    let raw = unsafe {
        mlx_sys::mlx_array_new_data(
            data.as_ptr().cast(),
            dims.as_ptr(),
            dims.len() as i32,
            mlx.into(),
        )
    };
    // SAFETY: a fresh array, now owned by the returned value.
    Ok(unsafe { Array::from_ptr(raw) })
}

/// The bytes of `array` in row-major order (evaluating it first).
pub fn array_to_bytes(array: &Array) -> Result<Vec<u8>> {
    let contiguous = array.contiguous()?;
    contiguous.eval()?;
    let len = contiguous.nbytes();
    if len == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the array is evaluated and row-contiguous, so its data pointer
    // addresses `nbytes` valid bytes while `contiguous` lives.
    let bytes = unsafe {
        let ptr = mlx_sys::mlx_array_data_uint8(contiguous.as_ptr());
        std::slice::from_raw_parts(ptr, len).to_vec()
    };
    Ok(bytes)
}

/// The mlx-rs dtype a safetensors dtype becomes (`None`: MLX has none).
pub fn mlx_dtype_of(dtype: Dtype) -> Option<mlx_rs::Dtype> {
    use mlx_rs::Dtype as M;
    Some(match dtype {
        Dtype::BOOL => M::Bool,
        Dtype::U8 => M::Uint8,
        Dtype::I8 => M::Int8,
        Dtype::U16 => M::Uint16,
        Dtype::I16 => M::Int16,
        Dtype::F16 => M::Float16,
        Dtype::BF16 => M::Bfloat16,
        Dtype::U32 => M::Uint32,
        Dtype::I32 => M::Int32,
        Dtype::F32 => M::Float32,
        Dtype::U64 => M::Uint64,
        Dtype::I64 => M::Int64,
        Dtype::F64 => M::Float64,
        Dtype::F8_E4M3 | Dtype::F8_E5M2 => return None,
    })
}

/// `dtype` as an MLX dtype, or an error naming `key`.
pub fn checked_dtype(key: &str, dtype: Dtype) -> Result<mlx_rs::Dtype> {
    mlx_dtype_of(dtype).ok_or_else(|| Error::UnsupportedDtype {
        key: key.to_owned(),
        dtype,
    })
}

/// `shape` as MLX's 32-bit dimensions, or an error naming `key`.
pub fn checked_shape(key: &str, shape: &[usize]) -> Result<Vec<i32>> {
    shape
        .iter()
        .map(|&d| i32::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| Error::ShapeTooLarge {
            key: key.to_owned(),
            shape: shape.to_vec(),
        })
}

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

/// An MLX array of `shape` elements of `dtype` whose bytes `write` fills in
/// place (row-major, little endian); `key` names the tensor in errors.
///
/// For data read or made on the host (rows read from a file):
/// [`array_from_bytes`] would need the whole of it in a host buffer first
/// and then copy it, two copies alive at once; here MLX's buffer is the
/// only one. It starts zeroed, so bytes `write` leaves alone
/// are zero.
pub fn array_written<E: From<Error>>(
    key: &str,
    dtype: Dtype,
    shape: &[usize],
    write: impl FnOnce(&mut [u8]) -> std::result::Result<(), E>,
) -> std::result::Result<Array, E> {
    let mlx = checked_dtype(key, dtype)?;
    let dims = checked_shape(key, shape)?;
    let array = mlx_rs::ops::zeros_dtype(&dims, mlx).map_err(Error::from)?;
    array.eval().map_err(Error::from)?;
    let len = array.nbytes();
    if len == 0 {
        write(&mut [])?;
        return Ok(array);
    }
    // SAFETY: `array` was just made and evaluated here: a row-contiguous
    // buffer of `nbytes` bytes that MLX allocated for it alone (a filled
    // array never shares its scalar input's buffer), which no other array
    // or graph refers to. Its data pointer is only exposed as `const` by
    // mlx-c; the memory itself is writable heap memory. Nothing reads it
    // until `write` returns, and the slice does not outlive this call.
    let bytes = unsafe {
        let ptr = mlx_sys::mlx_array_data_uint8(array.as_ptr()).cast_mut();
        std::slice::from_raw_parts_mut(ptr, len)
    };
    write(bytes)?;
    Ok(array)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_array_written_in_place_holds_what_was_written() {
        let values: Vec<f32> = (0..6).map(|i| i as f32 * 1.5 - 2.0).collect();
        let array = array_written::<Error>("w", Dtype::F32, &[2, 3], |out| {
            assert_eq!(out.len(), 24);
            for (chunk, v) in out.chunks_exact_mut(4).zip(&values) {
                chunk.copy_from_slice(&v.to_le_bytes());
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(array.shape(), &[2, 3]);
        assert_eq!(array.dtype(), mlx_rs::Dtype::Float32);
        assert_eq!(array.as_slice::<f32>(), values.as_slice());
        // Used in a product like any other array.
        let sum = array.sum(None).unwrap();
        assert_eq!(sum.item_exact::<f32>(), values.iter().sum::<f32>());
    }

    #[test]
    fn bytes_left_unwritten_are_zero_and_errors_pass_through() {
        let array = array_written::<Error>("w", Dtype::BF16, &[4], |out| {
            out[..2].copy_from_slice(&0x3f80u16.to_le_bytes());
            Ok(())
        })
        .unwrap();
        let f = array.as_dtype(mlx_rs::Dtype::Float32).unwrap();
        assert_eq!(f.as_slice::<f32>(), &[1.0, 0.0, 0.0, 0.0]);

        let empty = array_written::<Error>("w", Dtype::F32, &[0, 3], |out| {
            assert!(out.is_empty());
            Ok(())
        })
        .unwrap();
        assert_eq!(empty.shape(), &[0, 3]);

        let failed = array_written("w", Dtype::F32, &[2], |_| {
            Err(Error::ByteLength {
                key: "w".into(),
                expected: 8,
                actual: 0,
            })
        });
        assert!(matches!(failed, Err(Error::ByteLength { .. })));
        let unsupported = array_written::<Error>("w", Dtype::F8_E4M3, &[2], |_| Ok(()));
        assert!(matches!(unsupported, Err(Error::UnsupportedDtype { .. })));
    }
}

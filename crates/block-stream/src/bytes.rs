//! Copying between raw tensor bytes and MLX arrays, for code that reads or
//! writes safetensors itself.

use mlx_rs::Array;

use crate::error::Result;
use crate::mapped::{checked_dtype, checked_shape};

/// An MLX array holding a copy of `data`: `shape` elements of `dtype`, little
/// endian, as stored in safetensors. `key` names the tensor in errors.
pub fn array_from_bytes(
    key: &str,
    dtype: st_mmap::Dtype,
    shape: &[usize],
    data: &[u8],
) -> Result<Array> {
    let mlx = checked_dtype(key, dtype)?;
    let dims = checked_shape(key, shape)?;
    let expected = shape.iter().product::<usize>() * dtype.size();
    assert_eq!(
        data.len(),
        expected,
        "{key}: byte length disagrees with shape and dtype"
    );
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

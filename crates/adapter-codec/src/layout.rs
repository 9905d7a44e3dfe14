//! Which safetensors files are adapters this format can carry.

use std::path::Path;

use st_mmap::{Dtype, Header};

use crate::error::{Error, Result};

/// Bytes per element of the dtypes the format shuffles.
pub fn typesize(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::BF16 | Dtype::F16 => Some(2),
        _ => None,
    }
}

/// Checks that the header holds at least one tensor, all of one supported
/// dtype, and returns that dtype.
pub fn adapter_dtype(header: &Header, path: &Path) -> Result<Dtype> {
    let mut tensors = header.tensors().iter();
    let first = tensors.next().ok_or_else(|| Error::NoTensors {
        path: path.to_path_buf(),
    })?;
    if typesize(first.dtype).is_none() {
        return Err(Error::UnsupportedDtype {
            path: path.to_path_buf(),
            tensor: first.name.clone(),
            dtype: first.dtype,
        });
    }
    for t in tensors {
        if t.dtype != first.dtype {
            return Err(Error::MixedDtypes {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                dtype: t.dtype,
                expected: first.dtype,
            });
        }
    }
    Ok(first.dtype)
}

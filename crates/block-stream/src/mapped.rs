//! Zero-copy MLX arrays over memory-mapped safetensors bytes.

use std::ffi::c_void;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};
use mlx_rs::Array;
use st_mmap::Dtype;

use mlx_support::{checked_dtype, checked_shape};

use crate::error::{Error, Result};

/// A private, copy-on-write mapping of one byte range of a weights file.
///
/// Private so that MLX may treat the buffer as its own: if it ever writes
/// into an input it no longer needs (buffer donation), the page is copied
/// and the file is never touched. Arrays made from the range keep it alive
/// (see [`array_over`]); when the last one is freed the range is unmapped,
/// which is what returns a streamed block's memory.
#[derive(Debug)]
pub(crate) struct MappedRange {
    map: MmapMut,
    /// The map's first byte, taken once with write provenance for MLX.
    base: *mut u8,
    /// File offset of `base`.
    offset: u64,
}

// SAFETY: the mapping is plain memory owned by this value; `base` points into
// it and is only dereferenced by MLX through arrays that hold an `Arc` to
// this value. Nothing here is tied to a thread.
unsafe impl Send for MappedRange {}
// SAFETY: shared access only reads through `map` or hands `base` to MLX,
// which synchronises its own use of array buffers.
unsafe impl Sync for MappedRange {}

impl MappedRange {
    /// The mapped bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Maps bytes `start..end` of `file` (the memory-map contract of
    /// `st_mmap::SafetensorsFile::open` applies: the file must not change).
    pub(crate) fn map(path: &Path, file: &File, start: u64, end: u64) -> Result<Arc<MappedRange>> {
        let len = usize::try_from(end - start).expect("a mapped range fits in memory");
        // SAFETY: a private mapping of a file we only read; the caller keeps
        // the file unchanged while mapped (documented contract).
        let mut map = unsafe {
            MmapOptions::new()
                .offset(start)
                .len(len.max(1))
                .map_copy(file)
        }
        .map_err(|source| Error::Map {
            path: path.to_path_buf(),
            offset: start,
            end,
            source,
        })?;
        let base = map.as_mut_ptr();
        Ok(Arc::new(MappedRange {
            map,
            base,
            offset: start,
        }))
    }
}

/// Called by MLX when the last array over a range is freed.
unsafe extern "C" fn release(payload: *mut c_void) {
    // SAFETY: `payload` is the `Box<Arc<MappedRange>>` leaked in `array_over`,
    // and MLX calls this exactly once per array.
    drop(unsafe { Box::from_raw(payload.cast::<Arc<MappedRange>>()) });
}

/// One tensor inside a mapped range.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TensorAt<'a> {
    pub key: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    /// File offset of the tensor's first byte.
    pub file_offset: u64,
    pub len: usize,
}

/// An MLX array over `tensor`'s bytes in `range`, and whether MLX uses
/// those bytes in place.
///
/// The bytes are offered to MLX without a copy (a managed payload that keeps
/// the mapping alive) when they are aligned to the element size. Whether MLX
/// takes them in place is up to its allocator: Metal's can wrap foreign
/// memory; MLX's CPU allocator (Linux) cannot, so MLX copies them into its
/// own buffer at once and releases the mapping. The second value reports
/// which happened, by comparing MLX's data pointer with ours.
pub(crate) fn array_over(range: &Arc<MappedRange>, tensor: TensorAt<'_>) -> Result<(Array, bool)> {
    let dtype: mlx_sys::mlx_dtype = checked_dtype(tensor.key, tensor.dtype)?.into();
    let shape = checked_shape(tensor.key, tensor.shape)?;
    let start = usize::try_from(tensor.file_offset - range.offset).expect("inside the range");
    assert!(
        start + tensor.len <= range.map.len(),
        "tensor outside its mapped range"
    );
    // SAFETY: `start + len` is inside the mapping (checked above).
    let data = unsafe { range.base.add(start) };
    let offer = (data as usize).is_multiple_of(tensor.dtype.size()) && tensor.len > 0;
    // SAFETY: `data` points at `len` valid bytes holding `shape` elements of
    // `dtype` (the header was validated); `shape` lives across the call. On
    // the managed path MLX calls `release` exactly once, when done with them.
    let raw = unsafe {
        if offer {
            let payload = Box::into_raw(Box::new(Arc::clone(range))).cast::<c_void>();
            mlx_sys::mlx_array_new_data_managed_payload(
                data.cast(),
                shape.as_ptr(),
                shape.len() as i32,
                dtype,
                payload,
                Some(release),
            )
        } else {
            // mlx_array_new_data copies the bytes into an MLX buffer.
            mlx_sys::mlx_array_new_data(data.cast(), shape.as_ptr(), shape.len() as i32, dtype)
        }
    };
    // SAFETY: `raw` is a fresh array with data; reading its data pointer
    // (as bytes, whatever the dtype) neither evaluates nor copies.
    let in_place = offer && unsafe { mlx_sys::mlx_array_data_uint8(raw) } == data.cast_const();
    // SAFETY: `raw` is a fresh array that the returned `Array` now owns.
    Ok((unsafe { Array::from_ptr(raw) }, in_place))
}

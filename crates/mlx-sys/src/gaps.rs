//! Items mlx-rs expects that mlx-c only declares on Apple platforms.

#[cfg(not(target_arch = "aarch64"))]
mod half {
    use std::os::raw::c_int;

    use crate::{mlx_array, mlx_array_data_uint16, mlx_array_item_uint16};

    // mlx-c declares the f16/bf16 accessors only where the compiler has native
    // half types (aarch64). mlx-rs uses them everywhere, through the layout
    // bindgen gives on aarch64: `float16_t` wraps the raw bits, `bfloat16_t`
    // is the raw bits. Both are 16-bit patterns, so the u16 accessors, which
    // read the same memory, serve them exactly.

    /// The bits of an IEEE half-precision float.
    #[repr(transparent)]
    #[derive(Debug, Default, Copy, Clone, PartialEq, Eq)]
    pub struct float16_t(pub u16);

    /// The bits of a bfloat16.
    pub type bfloat16_t = u16;

    /// # Safety
    /// Same contract as `mlx_array_item_uint16`; `arr` must hold float16.
    pub unsafe fn mlx_array_item_float16(res: *mut float16_t, arr: mlx_array) -> c_int {
        // SAFETY: float16_t is a transparent u16, so the pointer casts exactly.
        unsafe { mlx_array_item_uint16(res.cast(), arr) }
    }

    /// # Safety
    /// Same contract as `mlx_array_item_uint16`; `arr` must hold bfloat16.
    pub unsafe fn mlx_array_item_bfloat16(res: *mut bfloat16_t, arr: mlx_array) -> c_int {
        // SAFETY: bfloat16_t is u16.
        unsafe { mlx_array_item_uint16(res, arr) }
    }

    /// # Safety
    /// Same contract as `mlx_array_data_uint16`; `arr` must hold float16.
    pub unsafe fn mlx_array_data_float16(arr: mlx_array) -> *const float16_t {
        // SAFETY: forwarding; the data of a 16-bit array is 16-bit elements.
        unsafe { mlx_array_data_uint16(arr).cast() }
    }

    /// # Safety
    /// Same contract as `mlx_array_data_uint16`; `arr` must hold bfloat16.
    pub unsafe fn mlx_array_data_bfloat16(arr: mlx_array) -> *const bfloat16_t {
        // SAFETY: forwarding; the data of a 16-bit array is 16-bit elements.
        unsafe { mlx_array_data_uint16(arr) }
    }
}

#[cfg(not(target_arch = "aarch64"))]
pub use half::*;

/// mlx-rs seeds its random state from the macOS-only `mach_approximate_time`
/// (through the `mach-sys` crate). Elsewhere we export a symbol of that name
/// that returns wall-clock nanoseconds, which serves equally as a seed.
#[cfg(not(target_vendor = "apple"))]
#[no_mangle]
pub extern "C" fn mach_approximate_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

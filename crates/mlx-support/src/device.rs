//! The device policy: choose at run time, never abort for a missing GPU.

use std::fmt;

use mlx_rs::{Device, DeviceType};

/// A kind of device MLX can compute on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ComputeDevice {
    /// MLX's CPU backend (OpenBLAS/reference BLAS on Linux, Accelerate on macOS).
    Cpu,
    /// MLX's GPU backend (Metal on Apple Silicon).
    Gpu,
}

impl fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ComputeDevice::Cpu => "cpu",
            ComputeDevice::Gpu => "gpu",
        })
    }
}

/// Asking for a device this build of MLX cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The device is not available on this machine or in this MLX build.
    #[error("MLX device {requested} is not available here (available: {available:?})")]
    Unavailable {
        /// What was asked for.
        requested: ComputeDevice,
        /// What this machine offers instead.
        available: Vec<ComputeDevice>,
    },
}

impl ComputeDevice {
    fn mlx_device(self) -> Device {
        let kind = match self {
            ComputeDevice::Cpu => DeviceType::Cpu,
            ComputeDevice::Gpu => DeviceType::Gpu,
        };
        Device::new(kind, 0)
    }
}

/// Whether MLX can compute on `device` here. Never panics: mlx-rs's GPU
/// paths abort on Linux, so this asks mlx-c directly.
pub fn is_available(device: ComputeDevice) -> bool {
    let kind = match device {
        ComputeDevice::Cpu => mlx_sys::mlx_device_type__MLX_CPU,
        ComputeDevice::Gpu => mlx_sys::mlx_device_type__MLX_GPU,
    };
    let mut available = false;
    // SAFETY: the handle is created, queried through a valid out-pointer and
    // freed exactly once; mlx-c reports failures as a status, never unwinds.
    let status = unsafe {
        let handle = mlx_sys::mlx_device_new_type(kind, 0);
        let status = mlx_sys::mlx_device_is_available(&mut available, handle);
        mlx_sys::mlx_device_free(handle);
        status
    };
    status == 0 && available
}

/// The device to use by default: the GPU where MLX has one, else the CPU.
pub fn best_device() -> ComputeDevice {
    if is_available(ComputeDevice::Gpu) {
        ComputeDevice::Gpu
    } else {
        ComputeDevice::Cpu
    }
}

/// Makes `device` MLX's default device for this thread's subsequent work.
///
/// # Errors
/// [`DeviceError::Unavailable`] when this machine cannot use `device`.
pub fn use_device(device: ComputeDevice) -> Result<ComputeDevice, DeviceError> {
    if !is_available(device) {
        let available = [ComputeDevice::Cpu, ComputeDevice::Gpu]
            .into_iter()
            .filter(|d| is_available(*d))
            .collect();
        return Err(DeviceError::Unavailable {
            requested: device,
            available,
        });
    }
    Device::set_default(&device.mlx_device());
    Ok(device)
}

/// The device MLX currently uses by default.
pub fn current_device() -> ComputeDevice {
    match Device::try_default().and_then(|d| d.get_type()) {
        Ok(DeviceType::Gpu) => ComputeDevice::Gpu,
        _ => ComputeDevice::Cpu,
    }
}

/// The version of the MLX library loaded at run time, e.g. `"0.32.2"`.
pub fn mlx_version() -> String {
    // SAFETY: the string is created, filled through a valid out-pointer, read
    // while alive (mlx-c keeps it NUL-terminated) and freed exactly once.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let version = if mlx_sys::mlx_version(&mut s) == 0 {
            std::ffi::CStr::from_ptr(mlx_sys::mlx_string_data(s))
                .to_string_lossy()
                .into_owned()
        } else {
            String::from("unknown")
        };
        mlx_sys::mlx_string_free(s);
        version
    }
}

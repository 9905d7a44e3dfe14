//! Run a transformer whose weights do not fit in memory by binding one
//! block's weights at a time into a single shared block module, so peak memory
//! stays near one block instead of all of them.
//!
//! This is the lowest crate that uses MLX, so it also holds the workspace's
//! device policy: [`best_device`] picks the Metal GPU where MLX has one and the
//! CPU otherwise, and [`use_device`] refuses an unavailable device with a typed
//! error instead of letting MLX abort.
//!
//! ```
//! use block_stream::{best_device, use_device, ComputeDevice};
//!
//! let device = best_device();
//! let chosen = use_device(device).expect("the best device is available");
//! assert_eq!(chosen, device);
//! if !cfg!(target_os = "macos") {
//!     // MLX's Linux CPU backend has no GPU: asking for one is an error.
//!     assert!(use_device(ComputeDevice::Gpu).is_err());
//! }
//! ```

mod device;

pub use device::{
    best_device, current_device, is_available, mlx_version, use_device, ComputeDevice, DeviceError,
};

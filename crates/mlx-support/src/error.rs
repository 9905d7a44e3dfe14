//! The crate's error type.

/// Errors of the shared MLX pieces; each names the tensor or setting.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor's dtype has no MLX equivalent.
    #[error("{key:?} has dtype {dtype}, which MLX cannot hold")]
    UnsupportedDtype { key: String, dtype: st_mmap::Dtype },
    /// A dimension does not fit MLX's 32-bit shapes.
    #[error("{key:?} has shape {shape:?}, too large for MLX")]
    ShapeTooLarge { key: String, shape: Vec<usize> },
    /// Bytes that disagree with the shape and dtype they should hold.
    #[error("{key:?}: {actual} bytes for a shape and dtype of {expected} bytes")]
    ByteLength {
        key: String,
        expected: usize,
        actual: usize,
    },
    /// A `quantization` entry of a model config that cannot be used.
    #[error("quantization config: {0}")]
    Quantization(String),
    /// A LoRA pair that does not fit the weight it adapts.
    #[error("LoRA A {a:?} and B {b:?} ({layout}) do not fit a weight of (out, in) = {weight:?}")]
    LoraShape {
        layout: &'static str,
        a: Vec<i32>,
        b: Vec<i32>,
        weight: Vec<i32>,
    },
    /// The device cannot be used.
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
    /// An MLX operation failed.
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

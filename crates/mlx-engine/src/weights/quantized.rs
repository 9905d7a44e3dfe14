//! How quantized weights are held: a choice the whole model makes at load.

/// How to hold quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantizedWeights {
    /// Keep them packed and use MLX's quantized matmul (the fast path on
    /// Apple GPUs).
    Keep,
    /// Keep them packed and dequantize each matrix to f32 just before its
    /// product (the CPU default), evaluating the product at once so that
    /// one dense matrix exists at a time: memory stays near that of the
    /// packed weights, while the product runs on BLAS. MLX's CPU quantized matmul has no
    /// BLAS path and is far slower.
    DequantizeOnUse,
    /// Dequantize to f32 at load: the fastest on the CPU backend, at the
    /// memory of an f32 model. Tables that are only ever read a few rows at
    /// a time (Gemma 4's per-layer embeddings) stay packed all the same.
    DequantizeF32,
}

impl QuantizedWeights {
    /// The choice for the device MLX will use.
    pub fn for_device(device: mlx_support::ComputeDevice) -> QuantizedWeights {
        match device {
            mlx_support::ComputeDevice::Gpu => QuantizedWeights::Keep,
            mlx_support::ComputeDevice::Cpu => QuantizedWeights::DequantizeOnUse,
        }
    }
}

//! Which kernels multiply dense weights: chosen once, at load, for the
//! whole model.

use crate::error::{Error, Result};
use crate::weights::{few_rows, packed_product};

/// Which products multiply dense f32 weights on the CPU.
///
/// The results of the two differ by rounding (each sums in its own order);
/// both are held to the reference by the parity tests, which run each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Kernels {
    /// The fastest this machine has: on a CPU with AVX-512, weights whose
    /// outputs are a multiple of 32 are held in panels for the project's
    /// few-rows kernel; everything else goes to MLX (BLAS on the CPU).
    #[default]
    Native,
    /// MLX's own products for every weight (BLAS on the CPU): what a
    /// machine without AVX-512, and every GPU, runs. For comparing with
    /// the Python original on an AVX-512 machine, or ruling the kernel
    /// out.
    Portable,
}

impl Kernels {
    /// The environment variable [`Kernels::from_env`] reads.
    pub const ENV: &'static str = "MLX_LOWMEM_KERNELS";

    /// `MLX_LOWMEM_KERNELS`: `native` or `portable`; unset (or empty) is
    /// [`Kernels::Native`].
    ///
    /// # Errors
    /// [`Error::Setting`] for any other value.
    pub fn from_env() -> Result<Kernels> {
        let value = std::env::var(Kernels::ENV).unwrap_or_default();
        Kernels::parse(&value)
    }

    fn parse(value: &str) -> Result<Kernels> {
        match value {
            "" | "native" => Ok(Kernels::Native),
            "portable" => Ok(Kernels::Portable),
            other => Err(Error::Setting {
                name: Kernels::ENV,
                value: other.to_owned(),
                expected: "native or portable",
            }),
        }
    }
}

/// How a model's dense products run: the kernels and the device, fixed at
/// load so that no product looks either up again.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Products {
    kernels: Kernels,
    device: mlx_support::ComputeDevice,
}

impl Products {
    /// `kernels` on the device MLX uses now.
    pub(crate) fn at_load(kernels: Kernels) -> Products {
        Products {
            kernels,
            device: mlx_support::current_device(),
        }
    }

    /// Whether a dense weight `(outputs, inputs)` of `dtype` is held in
    /// panels for the few-rows kernel.
    pub(crate) fn holds_in_panels(&self, outputs: usize, dtype: mlx_rs::Dtype) -> bool {
        self.kernels == Kernels::Native
            && self.device == mlx_support::ComputeDevice::Cpu
            && few_rows::holds_in_panels(outputs, dtype)
    }

    /// Whether packed weights quantized as `q`, when they are unpacked on
    /// use, are multiplied by [`packed_product`]'s kernel.
    pub(crate) fn multiplies_packed(&self, q: mlx_support::Quantization) -> bool {
        self.kernels == Kernels::Native
            && self.device == mlx_support::ComputeDevice::Cpu
            && packed_product::runs(q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_read_strictly() {
        assert_eq!(Kernels::parse("").unwrap(), Kernels::Native);
        assert_eq!(Kernels::parse("native").unwrap(), Kernels::Native);
        assert_eq!(Kernels::parse("portable").unwrap(), Kernels::Portable);
        let err = Kernels::parse("blas").unwrap_err();
        assert!(
            err.to_string().contains("MLX_LOWMEM_KERNELS")
                && err.to_string().contains("blas")
                && err.to_string().contains("native or portable"),
            "{err}"
        );
    }

    #[test]
    fn portable_products_never_use_panels() {
        let native = Products {
            kernels: Kernels::Native,
            device: mlx_support::ComputeDevice::Cpu,
        };
        let portable = Products {
            kernels: Kernels::Portable,
            ..native
        };
        assert!(!portable.holds_in_panels(64, mlx_rs::Dtype::Float32));
        assert_eq!(
            native.holds_in_panels(64, mlx_rs::Dtype::Float32),
            few_rows::supported()
        );
        let gpu = Products {
            device: mlx_support::ComputeDevice::Gpu,
            ..native
        };
        assert!(!gpu.holds_in_panels(64, mlx_rs::Dtype::Float32));
    }
}

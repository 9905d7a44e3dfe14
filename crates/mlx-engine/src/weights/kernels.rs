//! Which kernels multiply dense weights: chosen once, at load, for the
//! whole model.

use std::sync::Arc;

use crate::error::{Error, Result};

/// Which products multiply dense f32 weights on the CPU.
///
/// The results of the two differ by rounding (each sums in its own order);
/// both are held to the reference by the parity tests, which run each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Kernels {
    /// The fastest this machine has: on an x86-64 CPU with AVX-512F or
    /// AVX2 and FMA, weights whose
    /// outputs are a multiple of 32 are held in panels for the project's
    /// few-rows kernel; everything else goes to MLX (BLAS on the CPU).
    #[default]
    Native,
    /// MLX's own products for every weight (BLAS on the CPU): what other
    /// CPUs (Apple Silicon's included) and every GPU run. For comparing
    /// with the Python original, or ruling the kernel out.
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

/// How a model's products run, fixed at load from the kernels asked for
/// and the device, so that no product looks either up again; with the
/// threads the project's CPU kernels share out their work over, which the
/// model owns.
#[derive(Debug, Clone)]
pub(crate) struct Products {
    /// The kernels asked for, and the device: what the plan prints.
    #[expect(dead_code, reason = "read where the load's plan is printed")]
    kernels: Kernels,
    #[expect(dead_code, reason = "read where the load's plan is printed")]
    device: mlx_support::ComputeDevice,
    /// Where the native kernels run: `None` where they do not (portable
    /// kernels, the GPU, a CPU the kernels do not run on).
    host: Option<HostKernels>,
}

impl Products {
    /// `kernels` on the device MLX uses now, with a pool of one thread per
    /// core for the native ones.
    ///
    /// # Errors
    /// [`Error::Kernel`] when the pool's threads cannot start.
    pub(crate) fn at_load(kernels: Kernels) -> Result<Products> {
        let device = mlx_support::current_device();
        let native = kernels == Kernels::Native
            && device == mlx_support::ComputeDevice::Cpu
            && cpu_kernels::supported();
        let host = if native {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            Some(HostKernels(Arc::new(cpu_kernels::Pool::new(cores)?)))
        } else {
            None
        };
        Ok(Products {
            kernels,
            device,
            host,
        })
    }

    /// The kernels that hold a dense weight `(outputs, inputs)` of `dtype`
    /// in panels, when they do.
    pub(crate) fn panels_for(&self, outputs: usize, dtype: mlx_rs::Dtype) -> Option<HostKernels> {
        self.host
            .clone()
            .filter(|_| holds_in_panels(outputs, dtype))
    }

    /// The kernels that multiply packed weights quantized as `q` when they
    /// are unpacked on use, when they do.
    pub(crate) fn packed_for(&self, q: mlx_support::Quantization) -> Option<HostKernels> {
        self.host.clone().filter(|_| multiplies_packed(q))
    }
}

/// Whether the panel kernel can hold a weight `(outputs, inputs)` of
/// `dtype`: f32, its outputs whole panels.
fn holds_in_panels(outputs: usize, dtype: mlx_rs::Dtype) -> bool {
    dtype == mlx_rs::Dtype::Float32 && outputs > 0 && outputs.is_multiple_of(cpu_kernels::PANEL)
}

/// Whether the packed kernel multiplies weights quantized as `q`: it reads
/// MLX's 4-bit affine packing only.
pub(crate) fn multiplies_packed(q: mlx_support::Quantization) -> bool {
    q.bits == 4 && q.mode == mlx_support::QuantMode::Affine
}

/// The project's CPU kernels (`cpu-kernels`) as a loaded model uses them:
/// on the pool its load made. Held by each weight they multiply.
#[derive(Clone)]
pub(crate) struct HostKernels(Arc<cpu_kernels::Pool>);

impl HostKernels {
    /// The threads one product may use: as many as OpenBLAS has now, which
    /// is the lanes' share of the cores when the engine shares them out
    /// (`BlasThreads::SharedByLanes`), so that a lane's kernels and its
    /// BLAS products use the same share.
    pub(crate) fn workers(&self) -> cpu_kernels::Workers<'_> {
        self.0
            .workers(mlx_support::blas_threads().unwrap_or(1).max(1))
    }

    /// Kernels on a pool of `threads`, for tests.
    #[cfg(test)]
    pub(crate) fn for_tests(threads: usize) -> HostKernels {
        HostKernels(Arc::new(cpu_kernels::Pool::new(threads).unwrap()))
    }
}

impl std::fmt::Debug for HostKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostKernels({} threads)", self.0.threads())
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
        let native = Products::at_load(Kernels::Native).unwrap();
        let portable = Products::at_load(Kernels::Portable).unwrap();
        assert!(portable.panels_for(64, mlx_rs::Dtype::Float32).is_none());
        assert_eq!(
            native.panels_for(64, mlx_rs::Dtype::Float32).is_some(),
            cpu_kernels::supported()
                && mlx_support::current_device() == mlx_support::ComputeDevice::Cpu
        );
        assert!(native.panels_for(48, mlx_rs::Dtype::Float32).is_none());
        assert!(native.panels_for(64, mlx_rs::Dtype::Bfloat16).is_none());
    }
}

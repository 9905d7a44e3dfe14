//! Which OpenBLAS kernels the process runs, and the best ones its CPU has.
//!
//! On Linux, MLX's CPU backend multiplies matrices with OpenBLAS, which
//! picks its kernels once, when the library loads, from the CPU's model
//! number. A release that does not know a newer CPU falls back to generic
//! kernels (Debian 12's OpenBLAS 0.3.21 runs "Prescott" on a Xeon of family
//! 6, model 207, about a sixth of the speed of its "SkylakeX" kernels there).
//! The environment variable `OPENBLAS_CORETYPE` overrides the choice, but
//! only before the library loads, and libmlx loads it with the program. So
//! a program asks here, first thing in `main`, and re-executes itself with
//! the variable set ([`reexec_with_best_kernels`]); or whoever starts the
//! program sets the variable to [`best_coretype`]'s answer.

use std::ffi::CStr;

/// The kernels OpenBLAS chose for this process (e.g. `Zen`, `SkylakeX`,
/// `Prescott`), or `None` when the process runs no OpenBLAS (macOS's
/// Accelerate, the wheel's reference BLAS).
pub fn kernels_in_use() -> Option<String> {
    #[cfg(unix)]
    {
        let symbol = openblas_symbol(c"openblas_get_corename")?;
        // SAFETY: OpenBLAS exports `char *openblas_get_corename(void)`,
        // which returns a static NUL-terminated string.
        let name = unsafe {
            let get: extern "C" fn() -> *const libc::c_char = std::mem::transmute(symbol);
            let ptr = get();
            if ptr.is_null() {
                return None;
            }
            CStr::from_ptr(ptr)
        };
        Some(name.to_string_lossy().into_owned())
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// An OpenBLAS function of the process, by name, or `None` when no loaded
/// library exports it (macOS's Accelerate, the wheel's reference BLAS).
#[cfg(unix)]
fn openblas_symbol(name: &CStr) -> Option<*mut libc::c_void> {
    // SAFETY: dlsym with RTLD_DEFAULT only looks the name up among the
    // libraries already loaded; a null result means none exports it.
    let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!symbol.is_null()).then_some(symbol)
}

/// How many threads OpenBLAS runs a matrix product on, or `None` when the
/// process runs no OpenBLAS.
pub fn blas_threads() -> Option<usize> {
    #[cfg(unix)]
    {
        let symbol = openblas_symbol(c"openblas_get_num_threads")?;
        // SAFETY: OpenBLAS exports `int openblas_get_num_threads(void)`.
        let n = unsafe {
            let get: extern "C" fn() -> libc::c_int = std::mem::transmute(symbol);
            get()
        };
        usize::try_from(n).ok()
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Runs OpenBLAS's later matrix products on `threads` threads (at least
/// one); returns the count before, or `None` (and changes nothing) when the
/// process runs no OpenBLAS. Unlike `OPENBLAS_NUM_THREADS`, this works
/// after the library has loaded. Callers that run several products at once
/// on their own threads (one per MLX stream) give each a share of the cores
/// this way, instead of every product spreading over all of them and their
/// threads spinning against each other. Call it while no product runs.
pub fn set_blas_threads(threads: usize) -> Option<usize> {
    #[cfg(unix)]
    {
        let before = blas_threads()?;
        let symbol = openblas_symbol(c"openblas_set_num_threads")?;
        let n = libc::c_int::try_from(threads.max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: OpenBLAS exports `void openblas_set_num_threads(int)`.
        unsafe {
            let set: extern "C" fn(libc::c_int) = std::mem::transmute(symbol);
            set(n);
        }
        Some(before)
    }
    #[cfg(not(unix))]
    {
        let _ = threads;
        None
    }
}

/// What decides the best kernels: the CPU's vendor and vector extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuFeatures {
    /// `AuthenticAMD` (or Hygon) rather than Intel.
    pub amd: bool,
    /// AVX2 and FMA.
    pub avx2_fma: bool,
    /// The AVX-512 subsets OpenBLAS's SkylakeX kernels use: F, CD, BW, DQ, VL.
    pub avx512: bool,
}

impl CpuFeatures {
    /// This machine's.
    pub fn detect() -> CpuFeatures {
        #[cfg(target_arch = "x86_64")]
        {
            // CPUID leaf 0 (the vendor) exists on every x86-64 processor.
            let leaf0 = std::arch::x86_64::__cpuid(0);
            let vendor: Vec<u8> = [leaf0.ebx, leaf0.edx, leaf0.ecx]
                .iter()
                .flat_map(|r| r.to_le_bytes())
                .collect();
            CpuFeatures {
                amd: vendor == b"AuthenticAMD" || vendor == b"HygonGenuine",
                avx2_fma: is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
                avx512: is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512cd")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512dq")
                    && is_x86_feature_detected!("avx512vl"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            CpuFeatures::default()
        }
    }

    /// The `OPENBLAS_CORETYPE` these features support best, among the
    /// kernels every OpenBLAS since 0.3.10 has: `SKYLAKEX` with AVX-512,
    /// `ZEN` or `HASWELL` with AVX2 and FMA, none otherwise.
    pub fn best_coretype(self) -> Option<&'static str> {
        match self {
            CpuFeatures { avx512: true, .. } => Some("SKYLAKEX"),
            CpuFeatures {
                avx2_fma: true,
                amd: true,
                ..
            } => Some("ZEN"),
            CpuFeatures { avx2_fma: true, .. } => Some("HASWELL"),
            _ => None,
        }
    }
}

/// [`CpuFeatures::best_coretype`] of this machine.
pub fn best_coretype() -> Option<&'static str> {
    CpuFeatures::detect().best_coretype()
}

/// GFLOP/s of the product of random `m × k` and `k × n` matrices of
/// `dtype`, one figure per timed run (`runs` of them, after `warmup`
/// untimed ones), sorted ascending; each run evaluates its result before the
/// clock stops. What this process's matrix products achieve, for benchmarks
/// to print beside their figures so that figures from different machines
/// can be read.
pub fn gemm_gflops(
    (m, k, n): (i32, i32, i32),
    dtype: mlx_rs::Dtype,
    warmup: usize,
    runs: usize,
) -> crate::Result<Vec<f64>> {
    use mlx_rs::random;
    let key = random::key(7)?;
    let a = random::normal::<f32>(&[m, k], None, None, &key)?.as_dtype(dtype)?;
    let b = random::normal::<f32>(&[k, n], None, None, &key)?.as_dtype(dtype)?;
    mlx_rs::transforms::eval([&a, &b])?;
    let once = || -> crate::Result<f64> {
        let start = std::time::Instant::now();
        a.matmul(&b)?.eval()?;
        Ok(start.elapsed().as_secs_f64())
    };
    for _ in 0..warmup {
        once()?;
    }
    let flops = 2.0 * f64::from(m) * f64::from(k) * f64::from(n);
    let mut gflops = (0..runs.max(1))
        .map(|_| Ok(flops / once()? / 1e9))
        .collect::<crate::Result<Vec<f64>>>()?;
    gflops.sort_by(f64::total_cmp);
    Ok(gflops)
}

/// Whether OpenBLAS runs generic kernels (pre-AVX2 ones) on a CPU that has
/// better: what happens when the library does not know the CPU.
pub fn runs_generic_kernels() -> bool {
    let generic = [
        "Prescott",
        "Core2",
        "Nehalem",
        "Penryn",
        "Dunnington",
        "Atom",
        "Barcelona",
    ];
    match (kernels_in_use(), best_coretype()) {
        (Some(core), Some(_)) => generic.iter().any(|g| core.eq_ignore_ascii_case(g)),
        _ => false,
    }
}

/// For a program's `main`, before anything else: when OpenBLAS picked
/// generic kernels on a CPU that has better and `OPENBLAS_CORETYPE` is not
/// set, re-executes the program with it set to [`best_coretype`] (Unix:
/// the process image is replaced, same arguments, same process id).
/// Returns when nothing needs doing, or with the error that kept the
/// re-execution from happening.
pub fn reexec_with_best_kernels() -> std::io::Result<()> {
    if std::env::var_os("OPENBLAS_CORETYPE").is_some() || !runs_generic_kernels() {
        return Ok(());
    }
    let Some(core) = best_coretype() else {
        return Ok(());
    };
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let exe = std::env::current_exe()?;
        let err = std::process::Command::new(exe)
            .args(std::env::args_os().skip(1))
            .env("OPENBLAS_CORETYPE", core)
            .exec();
        Err(err)
    }
    #[cfg(not(unix))]
    {
        let _ = core;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_kernels_follow_the_features_not_the_model() {
        let f = |amd, avx2_fma, avx512| CpuFeatures {
            amd,
            avx2_fma,
            avx512,
        };
        assert_eq!(f(false, true, true).best_coretype(), Some("SKYLAKEX"));
        assert_eq!(f(true, true, true).best_coretype(), Some("SKYLAKEX"));
        assert_eq!(f(true, true, false).best_coretype(), Some("ZEN"));
        assert_eq!(f(false, true, false).best_coretype(), Some("HASWELL"));
        assert_eq!(f(false, false, false).best_coretype(), None);
    }
}

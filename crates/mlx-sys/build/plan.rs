//! What to build and link on which platform: pure decisions, no I/O.
//!
//! This is the one place where Linux and macOS differ. It is also compiled into
//! the crate's unit tests, so the decisions are checked on every platform.

use std::path::{Path, PathBuf};

/// The MLX release that mlx-c 0.7.0 was written against. The C++ ABI is the
/// interface between the two, so the wheel must match exactly.
pub const MLX_VERSION: &str = "0.32.2";

/// The platforms this stand-in knows how to build for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Platform {
    /// x86-64 Linux: MLX's CPU backend from the `mlx-cpu` wheel.
    LinuxX86_64,
    /// Apple Silicon macOS: Metal + Accelerate from the `mlx-metal` wheel.
    MacosAarch64,
}

impl Platform {
    /// Maps cargo's `CARGO_CFG_TARGET_OS` / `CARGO_CFG_TARGET_ARCH` to a platform.
    pub fn from_target(os: &str, arch: &str) -> Result<Platform, String> {
        match (os, arch) {
            ("linux", "x86_64") => Ok(Platform::LinuxX86_64),
            ("macos", "aarch64") => Ok(Platform::MacosAarch64),
            _ => Err(format!(
                "mlx-sys stand-in: no MLX wheel is pinned for {os}/{arch}; \
                 supported are linux/x86_64 and macos/aarch64. Set MLX_DIR to an \
                 MLX {MLX_VERSION} install prefix to try another platform."
            )),
        }
    }

    /// The pinned wheel for this platform.
    pub fn wheel(self) -> Wheel {
        match self {
            Platform::LinuxX86_64 => Wheel {
                package: "mlx-cpu",
                file_name: "mlx_cpu-0.32.2-py3-none-manylinux_2_35_x86_64.whl",
                pip_platform: "manylinux_2_35_x86_64",
                sha256: "fc5d31b90fc4f457b2f9614ed45651a567d22a6a11a03d114a90a4e10bdd8878",
            },
            Platform::MacosAarch64 => Wheel {
                package: "mlx-metal",
                file_name: "mlx_metal-0.32.2-py3-none-macosx_14_0_arm64.whl",
                pip_platform: "macosx_14_0_arm64",
                sha256: "3825fff379dbc107dd3413e564a06caeaa24819910ec49c0439e454c06a1b9b8",
            },
        }
    }

    /// The C++ standard library to link: libstdc++ with GCC on Linux, libc++ on macOS.
    pub fn cxx_stdlib(self) -> &'static str {
        match self {
            Platform::LinuxX86_64 => "stdc++",
            Platform::MacosAarch64 => "c++",
        }
    }

    /// Whether Debian's OpenBLAS can stand in for the wheel's reference BLAS.
    /// On macOS MLX uses Accelerate, which is always there.
    pub fn can_swap_blas(self) -> bool {
        matches!(self, Platform::LinuxX86_64)
    }
}

/// A pinned PyPI wheel that carries a complete MLX SDK (headers, library, cmake).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wheel {
    pub package: &'static str,
    pub file_name: &'static str,
    pub pip_platform: &'static str,
    pub sha256: &'static str,
}

impl Wheel {
    /// `pip download` requirement, e.g. `mlx-cpu==0.32.2`.
    pub fn requirement(&self) -> String {
        format!("{}=={MLX_VERSION}", self.package)
    }
}

/// Which BLAS the Linux CPU backend ends up calling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)] // "OpenBlas" is the product's name.
pub enum Blas {
    /// The reference BLAS/LAPACK bundled in the wheel (slow, always present).
    Reference,
    /// Debian's `libopenblas0-pthread`, swapped in by symlinks.
    OpenBlas,
    /// Not Linux: the platform's own (Accelerate on macOS).
    Platform,
}

impl Blas {
    /// Decides the BLAS from the platform, the `MLX_BLAS` override and whether
    /// OpenBLAS was found on the system.
    pub fn choose(
        platform: Platform,
        override_env: Option<&str>,
        openblas_found: bool,
    ) -> Result<Blas, String> {
        if !platform.can_swap_blas() {
            return Ok(Blas::Platform);
        }
        match override_env.map(str::trim) {
            None | Some("") | Some("auto") => Ok(if openblas_found {
                Blas::OpenBlas
            } else {
                Blas::Reference
            }),
            Some("reference") => Ok(Blas::Reference),
            Some("openblas") if openblas_found => Ok(Blas::OpenBlas),
            Some("openblas") => Err(format!(
                "MLX_BLAS=openblas but {} was not found; install Debian's libopenblas0-pthread",
                OPENBLAS_DIR
            )),
            Some(other) => Err(format!(
                "MLX_BLAS={other:?} is not one of auto, reference, openblas"
            )),
        }
    }

    /// Name of the unpacked-wheel variant in the cache.
    pub fn variant(self) -> &'static str {
        match self {
            Blas::Reference | Blas::Platform => "reference",
            Blas::OpenBlas => "openblas",
        }
    }
}

/// Where Debian's `libopenblas0-pthread` puts its BLAS/LAPACK.
pub const OPENBLAS_DIR: &str = "/usr/lib/x86_64-linux-gnu/openblas-pthread";

/// For each library the wheel bundles in `mlx_cpu.libs/`, the OpenBLAS file
/// that replaces it. The wheel's `libmlx.so` finds them by its `$ORIGIN`
/// rpath, so replacing the files (with symlinks) swaps the implementation.
pub fn openblas_replacement(bundled_file: &str) -> Option<&'static str> {
    if bundled_file.starts_with("libblas-") {
        Some("libblas.so.3")
    } else if bundled_file.starts_with("liblapack-") {
        Some("liblapack.so.3")
    } else {
        None
    }
}

/// The cache folder for unpacked wheels and downloads: `MLX_SYS_CACHE`, else
/// `$XDG_CACHE_HOME/mlx-sys-standin`, else `~/.cache/mlx-sys-standin`. It is
/// outside `target/` so that `cargo clean` never forces a new download.
pub fn cache_root(
    explicit: Option<PathBuf>,
    xdg_cache: Option<PathBuf>,
    home: Option<PathBuf>,
) -> Option<PathBuf> {
    explicit
        .or_else(|| xdg_cache.map(|x| x.join("mlx-sys-standin")))
        .or_else(|| home.map(|h| h.join(".cache").join("mlx-sys-standin")))
}

/// Where the library folder of an MLX prefix (unpacked wheel or install) is.
pub fn mlx_lib_dir(mlx_prefix: &Path) -> PathBuf {
    mlx_prefix.join("lib")
}

/// The flags that go to the linker for the final binaries, in order.
pub fn link_lines(platform: Platform, mlx_lib_dir: &Path) -> Vec<String> {
    let lib = mlx_lib_dir.display();
    vec![
        format!("cargo:rustc-link-search=native={lib}"),
        "cargo:rustc-link-lib=dylib=mlx".to_owned(),
        format!("cargo:rustc-link-lib=dylib={}", platform.cxx_stdlib()),
        // Read by crates that depend on us as DEP_MLX_LIBDIR; they add the
        // rpath to their own binaries (a library's rpath does not reach them).
        format!("cargo::metadata=libdir={lib}"),
        // This crate's own tests and doc-tests.
        format!("cargo::rustc-link-arg=-Wl,-rpath,{lib}"),
    ]
}

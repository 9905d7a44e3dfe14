//! Build script of the `mlx-sys` stand-in.
//!
//! 1. Find MLX: `MLX_DIR`, else the pinned PyPI wheel unpacked in a cache
//!    outside `target/` (downloaded once with pip, sha256-verified).
//! 2. Find mlx-c: `MLX_C_DIR`, else the registry copy of `mlx-sys` 0.7.0.
//! 3. Compile mlx-c as one translation unit and link it statically.
//! 4. Generate the Rust bindings with bindgen, as upstream does.
//!
//! Failures print one message that says what is missing and how to fix it.

mod mlxc;
mod plan;
mod wheel;

use std::env;
use std::path::PathBuf;

use plan::{Blas, Platform};

fn main() {
    if let Err(message) = run() {
        eprintln!("\nerror: {message}\n");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    for var in [
        "MLX_DIR",
        "MLX_C_DIR",
        "MLX_SYS_CACHE",
        "MLX_BLAS",
        "XDG_CACHE_HOME",
        "LIBCLANG_PATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build");

    let out_dir = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?);
    let platform = Platform::from_target(
        &env::var("CARGO_CFG_TARGET_OS").unwrap_or_default(),
        &env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default(),
    )?;

    let (mlx_prefix, blas) = match env::var_os("MLX_DIR") {
        Some(dir) => (wheel::mlx_prefix_from_override(PathBuf::from(dir))?, None),
        None => {
            let cache = plan::cache_root(
                env::var_os("MLX_SYS_CACHE").map(PathBuf::from),
                env::var_os("XDG_CACHE_HOME").map(PathBuf::from),
                env::var_os("HOME").map(PathBuf::from),
            )
            .ok_or("cannot choose a cache folder: set MLX_SYS_CACHE or HOME")?;
            let openblas_found = std::path::Path::new(plan::OPENBLAS_DIR)
                .join("libblas.so.3")
                .exists();
            let blas = Blas::choose(
                platform,
                env::var("MLX_BLAS").ok().as_deref(),
                openblas_found,
            )?;
            (
                wheel::ensure_unpacked(&cache, platform.wheel(), blas)?,
                Some(blas),
            )
        }
    };

    let mlx_c_dir = match env::var_os("MLX_C_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => mlxc::locate_registry_copy(&out_dir)?,
    };
    mlxc::check_layout(&mlx_c_dir)?;
    let mlx_include = mlx_prefix.join("include");
    mlxc::compile(&mlx_c_dir, &mlx_include, &out_dir, platform)?;
    mlxc::generate_bindings(&mlx_c_dir, &out_dir)?;

    let lib_dir = plan::mlx_lib_dir(&mlx_prefix);
    for line in plan::link_lines(platform, &lib_dir) {
        println!("{line}");
    }
    println!("cargo::metadata=include={}", mlx_include.display());
    println!("cargo::metadata=version={}", plan::MLX_VERSION);
    if let Some(blas) = blas {
        println!("cargo::metadata=blas={}", blas.variant());
        println!("cargo:rustc-env=MLX_SYS_BLAS={}", blas.variant());
    } else {
        println!("cargo:rustc-env=MLX_SYS_BLAS=MLX_DIR");
    }
    println!("cargo:rustc-env=MLX_SYS_LIBDIR={}", lib_dir.display());
    Ok(())
}

//! Raw bindings to mlx-c 0.7.0, standing in for the registry crate `mlx-sys`.
//!
//! The published `mlx-sys` 0.7.0 builds MLX from a git clone and links Apple
//! frameworks, so it cannot build on Linux. This crate has the same name,
//! version and `links = "mlx"` key and is swapped in under `mlx-rs` with
//! `[patch.crates-io]`. Its build script compiles mlx-c (read from the registry
//! copy of `mlx-sys` 0.7.0) against the pinned PyPI wheel of MLX 0.32.2:
//! `mlx-cpu` on x86-64 Linux, `mlx-metal` on Apple Silicon macOS.
//!
//! Nobody is meant to call these functions directly: use `mlx-rs`.
//!
//! ```
//! // Ask MLX for its version through the raw C API.
//! let mut s = unsafe { mlx_sys::mlx_string_new() };
//! // SAFETY: `s` is a valid, owned mlx_string that mlx_version overwrites.
//! assert_eq!(unsafe { mlx_sys::mlx_version(&mut s) }, 0);
//! // SAFETY: `s` holds a NUL-terminated string owned by `s`.
//! let version = unsafe { std::ffi::CStr::from_ptr(mlx_sys::mlx_string_data(s)) };
//! assert_eq!(version.to_str().unwrap(), mlx_sys::MLX_VERSION);
//! // SAFETY: `s` is freed exactly once.
//! unsafe { mlx_sys::mlx_string_free(s) };
//! ```
//!
//! # Build-time settings
//!
//! - `MLX_DIR`: an MLX 0.32.2 install prefix or unpacked wheel to use instead
//!   of the cached download.
//! - `MLX_C_DIR`: a folder holding mlx-c's `mlx/c/*.{h,cpp}`.
//! - `MLX_SYS_CACHE`: where the wheel is downloaded and unpacked
//!   (default `~/.cache/mlx-sys-standin`).
//! - `MLX_BLAS` (Linux): `auto` (OpenBLAS when installed), `openblas` or
//!   `reference`.
//!
//! Crates that build binaries or tests against this one should add an rpath to
//! `DEP_MLX_LIBDIR` in their build script, so binaries run from any shell.

#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case)]
#![allow(clippy::all, missing_debug_implementations, rust_2018_idioms)]
#![allow(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

mod gaps;

pub use gaps::*;

/// The MLX version this crate was built against.
pub const MLX_VERSION: &str = "0.32.2";

/// Which BLAS the Linux CPU backend calls (`openblas` or `reference`), or
/// `MLX_DIR` when an external MLX was used. Decided at build time.
pub const BLAS: &str = env!("MLX_SYS_BLAS");

/// The folder holding the `libmlx` that binaries load at run time.
pub const LIB_DIR: &str = env!("MLX_SYS_LIBDIR");

#[cfg(test)]
#[path = "../build/plan.rs"]
#[allow(dead_code)]
mod plan;

#[cfg(test)]
mod plan_tests;

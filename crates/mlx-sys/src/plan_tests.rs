//! Tests of the build script's decisions (`build/plan.rs`), run on any host.

use std::path::{Path, PathBuf};

use crate::plan::{self, Blas, Platform};

#[test]
fn platforms_map_to_their_wheels() {
    let linux = Platform::from_target("linux", "x86_64").unwrap();
    assert_eq!(linux.wheel().package, "mlx-cpu");
    assert!(linux.wheel().file_name.contains("manylinux"));
    assert_eq!(linux.cxx_stdlib(), "stdc++");

    let mac = Platform::from_target("macos", "aarch64").unwrap();
    assert_eq!(mac.wheel().package, "mlx-metal");
    assert!(mac.wheel().file_name.ends_with("macosx_14_0_arm64.whl"));
    assert_eq!(mac.cxx_stdlib(), "c++");

    let err = Platform::from_target("windows", "x86_64").unwrap_err();
    assert!(
        err.contains("windows/x86_64") && err.contains("MLX_DIR"),
        "{err}"
    );
}

#[test]
fn wheels_are_pinned_to_the_mlx_c_release() {
    for platform in [Platform::LinuxX86_64, Platform::MacosAarch64] {
        let wheel = platform.wheel();
        assert_eq!(wheel.requirement(), format!("{}==0.32.2", wheel.package));
        assert!(wheel.file_name.contains("-0.32.2-"));
        assert_eq!(wheel.sha256.len(), 64);
        assert!(wheel.sha256.bytes().all(|b| b.is_ascii_hexdigit()));
    }
    assert_eq!(plan::MLX_VERSION, crate::MLX_VERSION);
}

#[test]
fn blas_choice_follows_override_and_availability() {
    let linux = Platform::LinuxX86_64;
    assert_eq!(Blas::choose(linux, None, true), Ok(Blas::OpenBlas));
    assert_eq!(Blas::choose(linux, None, false), Ok(Blas::Reference));
    assert_eq!(Blas::choose(linux, Some("auto"), true), Ok(Blas::OpenBlas));
    assert_eq!(
        Blas::choose(linux, Some("reference"), true),
        Ok(Blas::Reference)
    );
    assert!(Blas::choose(linux, Some("openblas"), false)
        .unwrap_err()
        .contains("libopenblas0-pthread"));
    assert!(Blas::choose(linux, Some("mkl"), true).is_err());
    // macOS always uses Accelerate, whatever is asked.
    assert_eq!(
        Blas::choose(Platform::MacosAarch64, Some("openblas"), false),
        Ok(Blas::Platform)
    );
}

#[test]
fn only_bundled_blas_and_lapack_are_swapped() {
    assert_eq!(
        plan::openblas_replacement("libblas-bd8a282c.so.3.10.0"),
        Some("libblas.so.3")
    );
    assert_eq!(
        plan::openblas_replacement("liblapack-86b2c207.so.3.10.0"),
        Some("liblapack.so.3")
    );
    assert_eq!(
        plan::openblas_replacement("libgfortran-f7379c93.so.5.0.0"),
        None
    );
}

#[test]
fn cache_root_precedence() {
    let p = |s: &str| Some(PathBuf::from(s));
    assert_eq!(plan::cache_root(p("/a"), p("/x"), p("/h")), p("/a"));
    assert_eq!(
        plan::cache_root(None, p("/x"), p("/h")),
        p("/x/mlx-sys-standin")
    );
    assert_eq!(
        plan::cache_root(None, None, p("/h")),
        p("/h/.cache/mlx-sys-standin")
    );
    assert_eq!(plan::cache_root(None, None, None), None);
}

#[test]
fn link_lines_name_mlx_the_stdlib_and_publish_libdir() {
    let lib = Path::new("/cache/mlx/lib");
    let linux = plan::link_lines(Platform::LinuxX86_64, lib);
    assert!(linux.contains(&"cargo:rustc-link-lib=dylib=mlx".to_owned()));
    assert!(linux.contains(&"cargo:rustc-link-lib=dylib=stdc++".to_owned()));
    assert!(linux.contains(&"cargo::metadata=libdir=/cache/mlx/lib".to_owned()));
    assert!(!linux
        .iter()
        .any(|l| l.contains("framework") || l.ends_with("=c++")));

    let mac = plan::link_lines(Platform::MacosAarch64, lib);
    assert!(mac.contains(&"cargo:rustc-link-lib=dylib=c++".to_owned()));
    assert!(!mac.iter().any(|l| l.contains("stdc++")));
}

//! Where `_native` finds libmlx at run time.
//!
//! Installed from a wheel, beside the `mlx` package it depends on
//! (`site-packages/mlx/lib/libmlx.*`, the same MLX 0.32.2 build): the
//! process then holds one MLX, whichever of the two modules is imported
//! first loading it for both (the library's name is the same). In a
//! checkout (`maturin develop`), the libmlx this workspace was built
//! against, as for every other crate's binaries.
fn main() {
    let beside_mlx = if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        "@loader_path/../mlx/lib"
    } else {
        "$ORIGIN/../mlx/lib"
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{beside_mlx}");
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}

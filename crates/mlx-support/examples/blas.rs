//! Which BLAS kernels this process runs, and the best this CPU has:
//! `cargo run -p mlx-support --example blas`. With `--env`, prints only
//! `OPENBLAS_CORETYPE=…` when OpenBLAS would run generic kernels on a CPU
//! that has better ones (what `cargo xtask` sets for the programs it runs),
//! and nothing otherwise.

fn main() {
    let env_only = std::env::args().any(|a| a == "--env");
    if env_only {
        if std::env::var_os("OPENBLAS_CORETYPE").is_none() && mlx_support::runs_generic_kernels() {
            if let Some(core) = mlx_support::best_coretype() {
                println!("OPENBLAS_CORETYPE={core}");
            }
        }
        return;
    }
    println!(
        "kernels in use: {}",
        mlx_support::kernels_in_use().unwrap_or_else(|| "none (no OpenBLAS loaded)".into())
    );
    println!(
        "best for this CPU: {}",
        mlx_support::best_coretype().unwrap_or("none beyond the generic ones")
    );
    println!(
        "OPENBLAS_CORETYPE: {}",
        std::env::var("OPENBLAS_CORETYPE").unwrap_or_else(|_| "unset".into())
    );
    println!("generic fallback: {}", mlx_support::runs_generic_kernels());
}

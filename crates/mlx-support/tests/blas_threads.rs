//! OpenBLAS's thread count set after the library loaded. Its own test
//! binary: the count is the process's, and no other test's products run
//! while it changes.

#[test]
fn the_thread_count_set_is_the_one_read_back() {
    // A product first, so that MLX (and with it the BLAS) is loaded.
    let rates = mlx_support::gemm_gflops((64, 64, 64), mlx_rs::Dtype::Float32, 0, 1).unwrap();
    assert!(rates[0] > 0.0);
    if mlx_support::kernels_in_use().is_none() {
        // No OpenBLAS (macOS's Accelerate): nothing to set, and nothing set.
        assert_eq!(mlx_support::blas_threads(), None);
        assert_eq!(mlx_support::set_blas_threads(1), None);
        return;
    }
    let before = mlx_support::blas_threads().expect("OpenBLAS is loaded");
    assert!(before >= 1);
    assert_eq!(mlx_support::set_blas_threads(1), Some(before));
    assert_eq!(mlx_support::blas_threads(), Some(1));
    // Zero means one: a product always has a thread.
    assert_eq!(mlx_support::set_blas_threads(0), Some(1));
    assert_eq!(mlx_support::blas_threads(), Some(1));
    // Products still run, and the count goes back.
    let after = mlx_support::gemm_gflops((64, 64, 64), mlx_rs::Dtype::Float32, 0, 1).unwrap();
    assert!(after[0] > 0.0);
    assert_eq!(mlx_support::set_blas_threads(before), Some(1));
    assert_eq!(mlx_support::blas_threads(), Some(before));
}

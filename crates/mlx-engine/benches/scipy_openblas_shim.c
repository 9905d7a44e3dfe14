/* Measurement only, never linked into the project: lets the engine's
 * bench child run on the scipy-openblas32 wheel's OpenBLAS, whose symbols
 * all carry a `scipy_` prefix, by forwarding the unprefixed names that
 * libmlx and mlx-support look up. Build and use (docs/benchmarks.md, "A
 * newer OpenBLAS from PyPI"):
 *
 *   L=.../scipy_openblas32/lib
 *   cc -O2 -shared -fPIC scipy_openblas_shim.c -o shim.so \
 *      -L$L -lscipy_openblas -Wl,-rpath,$L
 *   LD_PRELOAD=$PWD/shim.so target/release/deps/engine-<hash> child ...
 */

void scipy_cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                       float alpha, const float *a, int lda, const float *b, int ldb,
                       float beta, float *c, int ldc);
void scipy_openblas_set_num_threads(int threads);
int scipy_openblas_get_num_threads(void);
char *scipy_openblas_get_corename(void);
char *scipy_openblas_get_config(void);

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    scipy_cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void openblas_set_num_threads(int threads) { scipy_openblas_set_num_threads(threads); }
int openblas_get_num_threads(void) { return scipy_openblas_get_num_threads(); }
char *openblas_get_corename(void) { return scipy_openblas_get_corename(); }
char *openblas_get_config(void) { return scipy_openblas_get_config(); }

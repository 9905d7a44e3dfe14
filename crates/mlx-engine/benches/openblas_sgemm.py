"""f32 GEMM rates of one OpenBLAS shared library, on the engine's shapes.

Compares OpenBLAS builds before choosing one for MLX (docs/benchmarks.md,
"A newer OpenBLAS from PyPI"). Loads the library with ctypes, prints its
build configuration and the kernels it chose, then times row-major
`cblas_sgemm` on SmolLM2's shapes: a decode step's feed-forward product
(8 rows), its output head (8 rows against 49,152 columns), a prefill's
feed-forward product (512 rows) and 1024³. Best of five timed rounds after
three warm-up calls; the largest difference from a float64 product is
printed as a sanity check.

Usage (the interop venv has numpy):

    python openblas_sgemm.py /lib/x86_64-linux-gnu/libopenblas.so.0
    OPENBLAS_CORETYPE=SKYLAKEX python openblas_sgemm.py /lib/x86_64-linux-gnu/libopenblas.so.0
    python openblas_sgemm.py .../scipy_openblas32/lib/libscipy_openblas.so --prefix scipy_
"""

import argparse
import ctypes
import time

import numpy as np

ROW_MAJOR, NO_TRANS = 101, 111
SHAPES = [(8, 1536, 576, 200), (8, 49152, 576, 5), (512, 1536, 576, 20), (1024, 1024, 1024, 5)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("library")
    parser.add_argument("--prefix", default="", help="symbol prefix, e.g. scipy_")
    args = parser.parse_args()
    lib = ctypes.CDLL(args.library)

    def symbol(name, restype=None):
        f = getattr(lib, args.prefix + name)
        f.restype = restype
        return f

    config = symbol("openblas_get_config", ctypes.c_char_p)().decode()
    core = symbol("openblas_get_corename", ctypes.c_char_p)().decode()
    print(f"{config} | kernels {core}")
    sgemm = symbol("cblas_sgemm")
    i, p, f = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    rng = np.random.default_rng(0)
    for m, n, k, reps in SHAPES:
        a = rng.random((m, k), dtype=np.float32)
        b = rng.random((k, n), dtype=np.float32)
        c = np.zeros((m, n), dtype=np.float32)

        def call():
            sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, m, n, k, 1.0, a.ctypes.data, k,
                  b.ctypes.data, n, 0.0, c.ctypes.data, n)

        for _ in range(3):
            call()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                call()
            best = min(best, (time.perf_counter() - start) / reps)
        err = float(np.abs(c - a.astype(np.float64) @ b.astype(np.float64)).max())
        print(f"{m}x{k}·{k}x{n}: {2 * m * n * k / best / 1e9:.1f} GFLOP/s (max error {err:.1e})")


if __name__ == "__main__":
    main()

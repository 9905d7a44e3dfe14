//! `mlx_lowmem._native`: the compiled half of the `mlx_lowmem` Python
//! package (PyO3, abi3 for CPython ≥ 3.10, built with maturin).
//!
//! The Python half (`python/mlx_lowmem/`) gives the originals' names and
//! signatures (spawnllm's `MlxEngine`, `AdapterCodec`, `AdapterFuser`) and
//! their asyncio face; this half holds what does the work, as blocking calls
//! that release the GIL while MLX, the codec or the fuse run:
//!
//! - `engine::Engine`: an [`mlx_engine::MlxEngine`] with a Python logits
//!   processor factory and progress callback, and `submit` for Python jobs
//!   on its worker thread.
//! - `tokenizer::Tokenizer`: the engine's tokenizer with the methods
//!   mlx_lm's `TokenizerWrapper` users call.
//! - `adapter`: the codec's encode/decode/digest/dtype and the fuse.
//!
//! Errors become the Python exceptions of `mlx_lowmem._errors` (one
//! hierarchy rooted in `MlxLowmemError`), built by `errors`.

mod adapter;
mod engine;
mod errors;
mod processor;
mod tokenizer;

use pyo3::prelude::*;

/// The module Python imports as `mlx_lowmem._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::Engine>()?;
    m.add_class::<tokenizer::Tokenizer>()?;
    m.add_function(wrap_pyfunction!(adapter::codec_encode, m)?)?;
    m.add_function(wrap_pyfunction!(adapter::codec_decode, m)?)?;
    m.add_function(wrap_pyfunction!(adapter::codec_digest, m)?)?;
    m.add_function(wrap_pyfunction!(adapter::codec_dtype, m)?)?;
    m.add_function(wrap_pyfunction!(adapter::fuse, m)?)?;
    m.add("MLX_VERSION", mlx_support::mlx_version())?;
    Ok(())
}

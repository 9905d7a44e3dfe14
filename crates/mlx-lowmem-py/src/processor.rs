//! A Python logits processor called as mlx_lm calls it.
//!
//! mlx_lm's `batch_generate` calls each processor once per row,
//! `processor(tokens, logits)` with `logits` of shape `(1, vocab)` as
//! `mlx.core` arrays. The process holds one libmlx (see build.rs), but an
//! `mlx.core.array` is a Python object only the `mlx` package's bindings
//! make: each step's logits cross as float32 bytes through the host
//! (`mlx_lowmem._crossing`, which builds the `mlx.core` arrays, or numpy
//! ones without `mlx`), and the result comes back the same way.

use std::sync::{Arc, Mutex};

use mlx_engine::LogitsProcessor;
use mlx_rs::error::Exception;
use mlx_rs::Array;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The processor the factory returned, and where a Python exception it
/// raises is kept so that the caller sees that very exception.
pub(crate) struct PythonProcessor {
    pub(crate) processor: Py<PyAny>,
    pub(crate) raised: Arc<Mutex<Option<PyErr>>>,
}

impl LogitsProcessor for PythonProcessor {
    fn process(&mut self, logits: &Array) -> Result<Array, Exception> {
        let shape = logits.shape().to_vec();
        let [rows, vocab] = shape[..] else {
            return Err(Exception::custom(format!(
                "logits of shape {shape:?}, expected (rows, vocab)"
            )));
        };
        let floats = logits.as_dtype(mlx_rs::Dtype::Float32)?;
        floats.eval()?;
        let bytes: Vec<u8> = floats
            .as_slice::<f32>()
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let processed = Python::attach(|py| -> PyResult<Vec<f32>> {
            let out = py
                .import("mlx_lowmem._crossing")?
                .getattr("process_rows")?
                .call1((
                    self.processor.bind(py),
                    PyBytes::new(py, &bytes),
                    rows,
                    vocab,
                ))?;
            let out = out.cast::<PyBytes>()?.as_bytes();
            Ok(out
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect())
        });
        match processed {
            Ok(values) => Ok(Array::from_slice(&values, &shape)),
            Err(e) => {
                let message = e.to_string();
                *self.raised.lock().expect("not poisoned") = Some(e);
                Err(Exception::custom(format!(
                    "the logits processor raised {message}"
                )))
            }
        }
    }
}

/// Stands in for a processor whose factory raised: the engine's first use
/// of it (the prefix's pass at load, or the first step) fails with the
/// factory's exception, which the caller then sees.
pub(crate) struct FactoryFailed(pub(crate) String);

impl LogitsProcessor for FactoryFailed {
    fn process(&mut self, _: &Array) -> Result<Array, Exception> {
        Err(Exception::custom(format!(
            "the logits processor factory raised {}",
            self.0
        )))
    }
}

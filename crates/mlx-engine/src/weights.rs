//! Reading a model's weights from its safetensors files into the layers
//! every decoder uses: linear layers (dense or quantized, with mlx_lm's
//! per-module quantization) and embedding tables. Every weight's shape is
//! checked against the one the config implies as it loads, so a checkpoint
//! that does not fit its config is an error naming the file and key, not a
//! failed product later.

use std::path::{Path, PathBuf};

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, dequantize, quantized_matmul};
use mlx_rs::{Array, Dtype};
use mlx_support::{array_from_bytes, Quantization, QuantizationConfig};
use st_mmap::SafetensorsSet;

use crate::error::{Error, Result};

/// How to hold quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantizedWeights {
    /// Keep them packed and use MLX's quantized matmul (the fast path on
    /// Apple GPUs).
    Keep,
    /// Keep them packed and dequantize each matrix to f32 just before its
    /// product (the CPU default), evaluating the product at once so that
    /// one dense matrix exists at a time: memory stays near that of the
    /// packed weights, while the product runs on BLAS. MLX's CPU quantized matmul has no
    /// BLAS path and is far slower.
    DequantizeOnUse,
    /// Dequantize to f32 at load: the fastest on the CPU backend, at the
    /// memory of an f32 model. Tables that are only ever read a few rows at
    /// a time (Gemma 4's per-layer embeddings) stay packed all the same.
    DequantizeF32,
}

impl QuantizedWeights {
    /// The choice for the device MLX will use.
    pub fn for_device(device: mlx_support::ComputeDevice) -> QuantizedWeights {
        match device {
            mlx_support::ComputeDevice::Gpu => QuantizedWeights::Keep,
            mlx_support::ComputeDevice::Cpu => QuantizedWeights::DequantizeOnUse,
        }
    }
}

/// The weights of one model folder, read through a key prefix (`model.`,
/// or `language_model.model.` in a multimodal checkpoint).
pub(crate) struct Weights<'a> {
    pub dir: &'a Path,
    pub set: &'a SafetensorsSet,
    pub quant: &'a QuantizationConfig,
    pub mode: QuantizedWeights,
}

impl Weights<'_> {
    /// Whether the files hold `key`.
    pub fn has(&self, key: &str) -> bool {
        self.set.tensor(key).is_some()
    }

    fn file_of(&self, key: &str) -> PathBuf {
        self.set
            .file_of(key)
            .map_or_else(|| self.dir.to_path_buf(), Path::to_path_buf)
    }

    fn missing(&self, key: &str) -> Error {
        Error::MissingWeight {
            dir: self.dir.to_path_buf(),
            key: key.to_owned(),
        }
    }

    /// `key`, whose shape must be `expected`.
    pub fn array(&self, key: &str, expected: &[usize]) -> Result<Array> {
        let view = self.set.tensor(key).ok_or_else(|| self.missing(key))?;
        if view.shape != expected {
            return Err(Error::WeightShape {
                path: self.file_of(key),
                key: key.to_owned(),
                expected: expected.to_vec(),
                actual: view.shape.to_vec(),
            });
        }
        let array = array_from_bytes(key, view.dtype, view.shape, view.data)?;
        // The array is a copy: the mapped pages read to make it would
        // otherwise stay resident until the whole model is loaded, doubling
        // the peak memory of loading.
        self.set.release(key);
        Ok(array)
    }

    /// A norm's weight vector of `len`.
    pub fn vector(&self, key: &str, len: usize) -> Result<Array> {
        self.array(key, &[len])
    }

    /// The packed form of `{prefix}.weight` `(rows, cols)` when the files
    /// hold `.scales` for it.
    fn packed(&self, prefix: &str, rows: usize, cols: usize) -> Result<Option<(Array, Packed)>> {
        if !self.has(&format!("{prefix}.scales")) {
            return Ok(None);
        }
        // The module's own entry (mixed-precision checkpoints), else the
        // default.
        let q = self
            .quant
            .of(prefix)
            .ok_or_else(|| Error::UncoveredQuantization {
                path: self.dir.join("config.json"),
                module: prefix.to_owned(),
            })?;
        let (gs, bits) = (q.group_size as usize, q.bits as usize);
        let weight_key = format!("{prefix}.weight");
        if !cols.is_multiple_of(gs) || !(cols * bits).is_multiple_of(32) {
            // No packing of these bits fits the row: the checkpoint's
            // shape is not the config's.
            let actual = self
                .set
                .tensor(&weight_key)
                .map_or_else(Vec::new, |v| v.shape.to_vec());
            return Err(Error::WeightShape {
                path: self.file_of(&weight_key),
                key: weight_key,
                expected: vec![rows, cols],
                actual,
            });
        }
        let weight = self.array(&weight_key, &[rows, cols * bits / 32])?;
        let groups = [rows, cols / gs];
        let packed = Packed {
            scales: self.array(&format!("{prefix}.scales"), &groups)?,
            biases: self.array(&format!("{prefix}.biases"), &groups)?,
            q,
            dequantize_on_use: self.mode != QuantizedWeights::Keep,
        };
        Ok(Some((weight, packed)))
    }

    /// `{prefix}.weight` (+ `.bias`) of a layer from `inputs` to `outputs`,
    /// quantized when `.scales` exists.
    pub fn linear(&self, prefix: &str, inputs: usize, outputs: usize) -> Result<Linear> {
        let bias_key = format!("{prefix}.bias");
        let bias = if self.has(&bias_key) {
            Some(self.array(&bias_key, &[outputs])?)
        } else {
            None
        };
        let Some((weight, packed)) = self.packed(prefix, outputs, inputs)? else {
            let weight = self.array(&format!("{prefix}.weight"), &[outputs, inputs])?;
            return Ok(Linear {
                weight: transposed(&weight)?,
                bias,
                packed: None,
            });
        };
        Ok(match self.mode {
            QuantizedWeights::DequantizeF32 => Linear {
                weight: transposed(&packed.dense_f32(&weight)?)?,
                bias,
                packed: None,
            },
            QuantizedWeights::Keep | QuantizedWeights::DequantizeOnUse => Linear {
                weight,
                bias,
                packed: Some(packed),
            },
        })
    }

    /// The embedding table `{prefix}.weight` `(vocab, dim)`. `as_head`: it
    /// also serves as the tied output projection, so it is laid out for
    /// that product; otherwise it is only ever gathered from and stays
    /// packed in every mode.
    pub fn embedding(
        &self,
        prefix: &str,
        vocab: usize,
        dim: usize,
        as_head: bool,
    ) -> Result<Embedding> {
        let packed = self.packed(prefix, vocab, dim)?;
        Ok(match packed {
            None => {
                let table = self.array(&format!("{prefix}.weight"), &[vocab, dim])?;
                if as_head {
                    Embedding::DenseT(transposed(&table)?)
                } else {
                    Embedding::Dense(table)
                }
            }
            Some((weight, packed)) if as_head && self.mode == QuantizedWeights::DequantizeF32 => {
                Embedding::DenseT(transposed(&packed.dense_f32(&weight)?)?)
            }
            Some((weight, packed)) => Embedding::Packed { weight, packed },
        })
    }
}

/// `wᵀ`, evaluated as a contiguous matrix so the original can be dropped.
///
/// Dense weights are held as `(in, out)`: with the product `x · W` on rows
/// of few tokens (decoding), OpenBLAS repacks that layout somewhat faster
/// than the checkpoint's `(out, in)` read transposed (a micro-benchmark on
/// the project's machine; no difference at hundreds of rows). Done once at
/// load, a matrix at a time, so loading holds one extra matrix at most.
fn transposed(w: &Array) -> Result<Array> {
    let t = w.t().contiguous()?;
    t.eval()?;
    Ok(t)
}

/// What unpacks a quantized weight matrix.
pub(crate) struct Packed {
    scales: Array,
    biases: Array,
    q: Quantization,
    /// Dequantize before each product instead of MLX's quantized matmul.
    dequantize_on_use: bool,
}

impl Packed {
    /// The dense matrix of the packed `weight` (or of some of its rows,
    /// given the matching rows of the scales and biases), in the scales'
    /// dtype.
    fn dense_rows(&self, weight: &Array, scales: &Array, biases: &Array) -> Result<Array> {
        let (gs, bits) = (self.q.group_size, self.q.bits);
        Ok(dequantize(weight, scales, biases, gs, bits)?)
    }

    /// The dense matrix in f32, which MLX's CPU backend multiplies with BLAS.
    fn dense_f32(&self, weight: &Array) -> Result<Array> {
        Ok(self
            .dense_rows(weight, &self.scales, &self.biases)?
            .as_dtype(Dtype::Float32)?)
    }

    fn quantized_matmul(&self, x: &Array, weight: &Array) -> Result<Array> {
        let (gs, bits) = (self.q.group_size, self.q.bits);
        Ok(quantized_matmul(
            x,
            weight,
            &self.scales,
            &self.biases,
            true,
            gs,
            bits,
        )?)
    }
}

/// A linear layer, `x @ Wᵀ + b`, dense or quantized.
pub(crate) struct Linear {
    /// Dense: `Wᵀ`, `(in, out)`. Packed: as stored, `(out, in / pack)`.
    weight: Array,
    bias: Option<Array>,
    packed: Option<Packed>,
}

impl Linear {
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let y = match &self.packed {
            Some(p) if p.dequantize_on_use => {
                // Evaluated here, so that the dense matrix is freed before
                // the next one exists: a forward holds one at a time, not
                // the whole model in f32.
                let y = x.matmul(p.dense_f32(&self.weight)?.t())?;
                y.eval()?;
                y
            }
            Some(p) => p.quantized_matmul(x, &self.weight)?,
            None => x.matmul(&self.weight)?,
        };
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
}

/// Rows of a tied output head dequantized at a time: a slice of a
/// 262,144-entry vocabulary in f32 instead of the whole table.
const HEAD_ROWS: i32 = 32_768;

/// A token embedding table.
pub(crate) enum Embedding {
    /// Dense and transposed, `(dim, vocab)`: the layout of the tied output
    /// projection's product (see [`transposed`]).
    DenseT(Array),
    /// Dense rows `(vocab, dim)`, only gathered from.
    Dense(Array),
    /// Packed rows: gathered rows are dequantized.
    Packed { weight: Array, packed: Packed },
}

impl Embedding {
    /// The rows of `tokens` `(B, L)`: `(B, L, dim)`.
    pub fn lookup(&self, tokens: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::DenseT(t) => t.take_axis(tokens, 1)?.transpose_axes(&[1, 2, 0])?,
            Embedding::Dense(rows) => rows.take_axis(tokens, 0)?,
            Embedding::Packed { weight, packed } => packed.dense_rows(
                &weight.take_axis(tokens, 0)?,
                &packed.scales.take_axis(tokens, 0)?,
                &packed.biases.take_axis(tokens, 0)?,
            )?,
        })
    }

    /// `x · tableᵀ`: the tied output projection, `(…, vocab)`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::DenseT(t) => x.matmul(t)?,
            Embedding::Dense(rows) => x.matmul(rows.t())?,
            Embedding::Packed { weight, packed } if !packed.dequantize_on_use => {
                packed.quantized_matmul(x, weight)?
            }
            Embedding::Packed { weight, packed } => {
                // The whole table in f32 would be as large as an f32
                // model's embedding; a slice at a time is enough.
                let vocab = weight.dim(0);
                let mut parts = Vec::new();
                let mut start = 0;
                while start < vocab {
                    let end = (start + HEAD_ROWS).min(vocab);
                    let rows = packed
                        .dense_rows(
                            &weight.index(start..end),
                            &packed.scales.index(start..end),
                            &packed.biases.index(start..end),
                        )?
                        .as_dtype(Dtype::Float32)?;
                    let part = x.matmul(rows.t())?;
                    // One slice in f32 at a time (see `Linear::forward`).
                    part.eval()?;
                    parts.push(part);
                    start = end;
                }
                concatenate(&parts, -1)?
            }
        })
    }
}

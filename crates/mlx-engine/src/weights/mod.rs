//! Reading a model's weights from its safetensors files into the layers
//! every decoder uses: linear layers (dense or quantized, with mlx_lm's
//! per-module quantization) and embedding tables. Every weight's shape is
//! checked against the one the config implies as it loads, so a checkpoint
//! that does not fit its config is an error naming the file and key, not a
//! failed product later.

pub(crate) mod few_rows;
pub(crate) mod layers;
pub(crate) mod mapped;
pub(crate) mod memory_mode;
pub(crate) mod slices;
pub(crate) mod unpack;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{dequantize, quantized_matmul};
use mlx_rs::Array;
use mlx_support::{array_from_bytes, Quantization, QuantizationConfig};
use st_mmap::{SafetensorsSet, TensorView};

use crate::error::{Error, Result};
use crate::weights::mapped::MappedTable;
use crate::weights::memory_mode::MemoryMode;
use crate::weights::slices::{head_slice_rows, in_row_slices, slice_rows};
use crate::weights::unpack::dequantize_f32;

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
    pub set: &'a Arc<SafetensorsSet>,
    pub quant: &'a QuantizationConfig,
    pub mode: QuantizedWeights,
    pub memory: MemoryMode,
    /// One streamed layer's weights by key ([`MemoryMode::Streamed`]):
    /// arrays are taken from here instead of copied from the files, and
    /// nothing is evaluated while the layer is built, so that its weights
    /// are read when (and only when) the layer runs.
    pub streamed: Option<&'a HashMap<String, Array>>,
    /// Adapters applied to streamed layers as they are read.
    pub lora: &'a Arc<Vec<block_stream::BlockLoraSource>>,
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

    /// The view of `key`, whose shape must be `expected`.
    fn view(&self, key: &str, expected: &[usize]) -> Result<TensorView<'_>> {
        let view = self.set.tensor(key).ok_or_else(|| self.missing(key))?;
        if view.shape != expected {
            return Err(Error::WeightShape {
                path: self.file_of(key),
                key: key.to_owned(),
                expected: expected.to_vec(),
                actual: view.shape.to_vec(),
            });
        }
        Ok(view)
    }

    /// `key`, whose shape must be `expected`.
    pub fn array(&self, key: &str, expected: &[usize]) -> Result<Array> {
        let view = self.view(key, expected)?;
        if let Some(array) = self.streamed.and_then(|block| block.get(key)) {
            return Ok(array.clone());
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
        let Some(q) = self.packing(prefix, rows, cols)? else {
            return Ok(None);
        };
        let (gs, bits) = (q.group_size as usize, q.bits as usize);
        let weight = self.array(&format!("{prefix}.weight"), &[rows, cols * bits / 32])?;
        let groups = [rows, cols / gs];
        let packed = Packed {
            scales: self.array(&format!("{prefix}.scales"), &groups)?,
            biases: self.array(&format!("{prefix}.biases"), &groups)?,
            q,
            dequantize_on_use: self.mode != QuantizedWeights::Keep,
        };
        Ok(Some((weight, packed)))
    }

    /// How `{prefix}.weight` `(rows, cols)` is packed, when the files hold
    /// `.scales` for it: the module's quantization, checked to fit the
    /// row length.
    fn packing(&self, prefix: &str, rows: usize, cols: usize) -> Result<Option<Quantization>> {
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
        Ok(Some(q))
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
            return self.dense_linear(&weight, bias);
        };
        match self.mode {
            QuantizedWeights::DequantizeF32 => self.dense_linear(&packed.dense_f32(&weight)?, bias),
            QuantizedWeights::Keep | QuantizedWeights::DequantizeOnUse => Ok(Linear {
                weight,
                bias,
                layout: Layout::Packed(packed),
            }),
        }
    }

    /// A dense linear layer of `weight` `(out, in)`, laid out once for its
    /// products: in [`few_rows`] panels where that kernel runs, else as
    /// `Wᵀ` `(in, out)`, which OpenBLAS repacks somewhat faster than the
    /// checkpoint's `(out, in)` read transposed on rows of few tokens (a
    /// micro-benchmark on the project's machine; no difference at hundreds
    /// of rows). Evaluated now, a matrix at a time, so that loading holds
    /// one extra matrix at most and lanes read only computed arrays; in a
    /// streamed layer, when the layer runs.
    fn dense_linear(&self, weight: &Array, bias: Option<Array>) -> Result<Linear> {
        let panels = few_rows::holds_in_panels(weight.dim(0) as usize, weight.dtype());
        let laid_out = if panels {
            few_rows::to_panels(weight)?
        } else {
            weight.t().contiguous()?
        };
        if self.streamed.is_none() {
            laid_out.eval()?;
        }
        Ok(Linear {
            weight: laid_out,
            bias,
            layout: if panels {
                Layout::Panels
            } else {
                Layout::Transposed
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
        if self.memory.maps_tables() {
            return self.mapped_embedding(prefix, vocab, dim, as_head);
        }
        let packed = self.packed(prefix, vocab, dim)?;
        Ok(match packed {
            None => Embedding::Dense(self.array(&format!("{prefix}.weight"), &[vocab, dim])?),
            Some((weight, packed)) if as_head && self.mode == QuantizedWeights::DequantizeF32 => {
                // Evaluated here: lanes only read arrays computed before
                // they start.
                let rows = packed.dense_f32(&weight)?;
                rows.eval()?;
                Embedding::Dense(rows)
            }
            Some((weight, packed)) => Embedding::Packed { weight, packed },
        })
    }
}

impl Weights<'_> {
    /// [`embedding`](Self::embedding) left in the files: the shapes are
    /// checked now, the rows read at each lookup.
    fn mapped_embedding(
        &self,
        prefix: &str,
        vocab: usize,
        dim: usize,
        as_head: bool,
    ) -> Result<Embedding> {
        let weight = format!("{prefix}.weight");
        let Some(q) = self.packing(prefix, vocab, dim)? else {
            self.view(&weight, &[vocab, dim])?;
            return Ok(Embedding::Mapped(Box::new(MappedTable::dense(
                self.set.clone(),
                weight,
                vocab,
                dim,
            ))));
        };
        let (gs, bits) = (q.group_size as usize, q.bits as usize);
        self.view(&weight, &[vocab, dim * bits / 32])?;
        let groups = [vocab, dim / gs];
        let (scales, biases) = (format!("{prefix}.scales"), format!("{prefix}.biases"));
        self.view(&scales, &groups)?;
        self.view(&biases, &groups)?;
        Ok(Embedding::Mapped(Box::new(MappedTable::packed(
            self.set.clone(),
            [weight, scales, biases],
            q,
            vocab,
            dim,
            self.mode,
            as_head,
        ))))
    }
}

/// What unpacks a quantized weight matrix.
pub(crate) struct Packed {
    pub scales: Array,
    pub biases: Array,
    pub q: Quantization,
    /// Dequantize before each product instead of MLX's quantized matmul.
    pub dequantize_on_use: bool,
}

impl Packed {
    /// The dense matrix of the packed `weight` (or of some of its rows,
    /// given the matching rows of the scales and biases), in the scales'
    /// dtype.
    pub fn dense_rows(&self, weight: &Array, scales: &Array, biases: &Array) -> Result<Array> {
        let (gs, bits) = (self.q.group_size, self.q.bits);
        Ok(dequantize(weight, scales, biases, gs, bits)?)
    }

    /// The dense matrix in f32, which MLX's CPU backend multiplies with BLAS.
    pub fn dense_f32(&self, weight: &Array) -> Result<Array> {
        Ok(dequantize_f32(weight, &self.scales, &self.biases, self.q)?)
    }

    /// `x · W[rows]ᵀ` for the packed `weight`: the outputs `rows` alone,
    /// those rows unpacked to f32.
    fn product_with_rows(&self, x: &Array, weight: &Array, rows: Range<usize>) -> Result<Array> {
        let r = rows.start as i32..rows.end as i32;
        let dense = dequantize_f32(
            &weight.index(r.clone()),
            &self.scales.index(r.clone()),
            &self.biases.index(r),
            self.q,
        )?;
        Ok(x.matmul(dense.t())?)
    }

    /// `x · Wᵀ` for the packed `weight`, unpacked to f32 and multiplied a
    /// slice of rows at a time (see [`in_row_slices`]).
    fn product_in_slices(&self, x: &Array, weight: &Array) -> Result<Array> {
        let (rows, dim) = (weight.dim(0) as usize, x.dim(-1) as usize);
        in_row_slices(rows, slice_rows(dim), |r| {
            self.product_with_rows(x, weight, r)
        })
    }

    pub fn quantized_matmul(&self, x: &Array, weight: &Array) -> Result<Array> {
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
    /// Laid out as `layout` says.
    weight: Array,
    bias: Option<Array>,
    layout: Layout,
}

/// How a [`Linear`] holds its weight.
enum Layout {
    /// Dense, `Wᵀ` `(in, out)`, multiplied by MLX.
    Transposed,
    /// Dense, in [`few_rows`] panels `(out / PANEL, in, PANEL)`, multiplied
    /// by its kernel.
    Panels,
    /// Packed as stored, `(out, in / pack)`.
    Packed(Packed),
}

impl Linear {
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let y = match &self.layout {
            Layout::Packed(p) if p.dequantize_on_use => p.product_in_slices(x, &self.weight)?,
            Layout::Packed(p) => p.quantized_matmul(x, &self.weight)?,
            Layout::Panels => few_rows::product(x, &self.weight)?,
            Layout::Transposed => x.matmul(&self.weight)?,
        };
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
}

impl Linear {
    /// The outputs `outputs` of [`forward`](Self::forward) alone, from
    /// those rows of the weight.
    pub(crate) fn forward_outputs(&self, x: &Array, outputs: Range<usize>) -> Result<Array> {
        let r = outputs.start as i32..outputs.end as i32;
        let y = match &self.layout {
            Layout::Packed(p) if p.dequantize_on_use => {
                p.product_with_rows(x, &self.weight, outputs)?
            }
            Layout::Packed(p) => quantized_matmul(
                x,
                self.weight.index(r.clone()),
                p.scales.index(r.clone()),
                &p.biases.index(r.clone()),
                true,
                p.q.group_size,
                p.q.bits,
            )?,
            Layout::Panels => self.panel_outputs(x, outputs)?,
            Layout::Transposed => x.matmul(self.weight.index((.., r.clone())))?,
        };
        Ok(match &self.bias {
            Some(b) => y.add(b.index(r))?,
            None => y,
        })
    }

    /// The product's `outputs` for a weight held in panels: from the panels
    /// that hold them when they start and end on a panel's edge, else the
    /// whole product's columns.
    fn panel_outputs(&self, x: &Array, outputs: Range<usize>) -> Result<Array> {
        let aligned = outputs.start.is_multiple_of(few_rows::PANEL)
            && outputs.end.is_multiple_of(few_rows::PANEL);
        if aligned {
            let panels = self.weight.index(
                (outputs.start / few_rows::PANEL) as i32..(outputs.end / few_rows::PANEL) as i32,
            );
            return few_rows::product(x, &panels);
        }
        let r = outputs.start as i32..outputs.end as i32;
        Ok(x.matmul(few_rows::transposed(&self.weight)?.index((.., r)))?)
    }

    /// The packed weight, when it is unpacked before each product and the
    /// layer has no bias: what [`crate::nn::mlp`] slices.
    pub(crate) fn unpacked_on_use(&self) -> Option<OnUse<'_>> {
        match (&self.layout, &self.bias) {
            (Layout::Packed(packed), None) if packed.dequantize_on_use => Some(OnUse {
                weight: &self.weight,
                packed,
            }),
            _ => None,
        }
    }

    /// A packed linear layer unpacked on use, for tests.
    #[cfg(test)]
    pub(crate) fn packed_on_use(
        weight: Array,
        scales: Array,
        biases: Array,
        q: Quantization,
    ) -> Linear {
        Linear {
            weight,
            bias: None,
            layout: Layout::Packed(Packed {
                scales,
                biases,
                q,
                dequantize_on_use: true,
            }),
        }
    }
}

/// The packed words and the groups that hold `columns` of a packed row, and
/// the first column they hold: whole quantization groups, from the one
/// that holds `columns.start` to the one that holds its last column.
fn packed_span(q: Quantization, columns: Range<usize>) -> (Range<i32>, Range<i32>, usize) {
    let (gs, bits) = (q.group_size as usize, q.bits as usize);
    let groups = columns.start / gs..columns.end.div_ceil(gs);
    let first = groups.start * gs;
    let words = (first * bits / 32) as i32..(groups.end * gs * bits / 32) as i32;
    (words, groups.start as i32..groups.end as i32, first)
}

/// A packed weight without bias, unpacked before each product, taken in
/// parts (see [`Linear::unpacked_on_use`]).
pub(crate) struct OnUse<'a> {
    weight: &'a Array,
    packed: &'a Packed,
}

impl OnUse<'_> {
    pub(crate) fn q(&self) -> Quantization {
        self.packed.q
    }

    /// The output width.
    pub(crate) fn outputs(&self) -> usize {
        self.weight.dim(0) as usize
    }

    /// `x · W[rows]ᵀ`: the outputs `rows` alone.
    pub(crate) fn product_with_rows(&self, x: &Array, rows: Range<usize>) -> Result<Array> {
        self.packed.product_with_rows(x, self.weight, rows)
    }

    /// `x · W[:, columns]ᵀ` for `x` as wide as `columns`: the part of the
    /// product summed over those inputs. `columns` are whole quantization
    /// groups.
    pub(crate) fn product_with_columns(&self, x: &Array, columns: Range<usize>) -> Result<Array> {
        let p = self.packed;
        let (words, groups, _) = packed_span(p.q, columns);
        // Contiguous copies of the packed columns (an eighth of the f32
        // slice at 4 bits): the unpacking reads its words as bytes.
        let dense = dequantize_f32(
            &self.weight.index((.., words)).contiguous()?,
            &p.scales.index((.., groups.clone())).contiguous()?,
            &p.biases.index((.., groups)).contiguous()?,
            p.q,
        )?;
        Ok(x.matmul(dense.t())?)
    }
}

/// A token embedding table.
pub(crate) enum Embedding {
    /// Dense rows `(vocab, dim)`. As a tied output head they are multiplied
    /// as they are, `x · rowsᵀ` (BLAS's transpose flag), not transposed at
    /// load as [`Linear`] weights are: with the vocabulary as the product's
    /// columns that layout is the faster one at every row count measured
    /// (SmolLM2's head, 8 rows: 13 against 20 ms on two OpenBLAS threads;
    /// CHANGELOG.md), in the head's slices, as a table left in the
    /// files is.
    Dense(Array),
    /// Packed rows: gathered rows are dequantized.
    Packed { weight: Array, packed: Packed },
    /// Left in the files ([`MemoryMode::MappedTables`]).
    Mapped(Box<MappedTable>),
}

impl Embedding {
    /// The rows of `tokens` `(B, L)`: `(B, L, dim)`.
    pub fn lookup(&self, tokens: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::Dense(rows) => rows.take_axis(tokens, 0)?,
            Embedding::Packed { weight, packed } => packed.dense_rows(
                &weight.take_axis(tokens, 0)?,
                &packed.scales.take_axis(tokens, 0)?,
                &packed.biases.take_axis(tokens, 0)?,
            )?,
            Embedding::Mapped(table) => table.lookup(tokens)?,
        })
    }

    /// The rows of `tokens` `(B, L)` as the table holds them, to be
    /// unpacked a range of columns at a time.
    pub fn gather(&self, tokens: &Array) -> Result<GatheredRows> {
        Ok(match self {
            Embedding::Dense(_) => GatheredRows::Dense(self.lookup(tokens)?),
            Embedding::Packed { weight, packed } => GatheredRows::Packed {
                weight: weight.take_axis(tokens, 0)?,
                scales: packed.scales.take_axis(tokens, 0)?,
                biases: packed.biases.take_axis(tokens, 0)?,
                q: packed.q,
                f32_rows: false,
            },
            Embedding::Mapped(table) => table.gather(tokens)?,
        })
    }

    /// `x · tableᵀ`: the tied output projection, `(…, vocab)`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::Dense(rows) => {
                let vocab = rows.dim(0) as usize;
                in_row_slices(vocab, head_slice_rows(rows.dim(1) as usize), |r| {
                    Ok(x.matmul(rows.index(r.start as i32..r.end as i32).t())?)
                })?
            }
            Embedding::Packed { weight, packed } if !packed.dequantize_on_use => {
                packed.quantized_matmul(x, weight)?
            }
            Embedding::Mapped(table) => table.as_linear(x)?,
            Embedding::Packed { weight, packed } => packed.product_in_slices(x, weight)?,
        })
    }
}

/// A table's rows for some tokens, `(B, L, …)`, as the table holds them
/// (see [`Embedding::gather`]). Gemma 4 reads its per-layer table a layer's
/// columns at a time: the whole rows unpacked are 35 layers wide.
pub(crate) enum GatheredRows {
    Dense(Array),
    /// `f32_rows`: unpacked to f32 ([`dequantize_f32`]), else to the scales'
    /// dtype, as the table's own lookup does.
    Packed {
        weight: Array,
        scales: Array,
        biases: Array,
        q: Quantization,
        f32_rows: bool,
    },
}

impl GatheredRows {
    /// `columns` of every row, `(B, L, columns.len())`: the values a lookup
    /// gives there.
    pub(crate) fn columns(&self, columns: Range<usize>) -> Result<Array> {
        let range = |r: Range<usize>| r.start as i32..r.end as i32;
        Ok(match self {
            GatheredRows::Dense(a) => a.index((.., .., range(columns))),
            GatheredRows::Packed {
                weight,
                scales,
                biases,
                q,
                f32_rows,
            } => {
                // A layer's columns of Gemma 4's table need not be whole
                // groups: the covering groups are unpacked.
                let (words, groups, first) = packed_span(*q, columns.clone());
                let w = weight.index((.., .., words));
                let (s, b) = (
                    scales.index((.., .., groups.clone())),
                    biases.index((.., .., groups)),
                );
                let dense = if *f32_rows {
                    dequantize_f32(&w, &s, &b, *q)?
                } else {
                    dequantize(&w, &s, &b, q.group_size, q.bits)?
                };
                if dense.dim(-1) as usize == columns.len() {
                    dense
                } else {
                    dense.index((.., .., range(columns.start - first..columns.end - first)))
                }
            }
        })
    }

    /// The rows of position `at` of axis 1 alone, the axis kept.
    pub(crate) fn at_position(&self, at: i32) -> Result<GatheredRows> {
        let keep = |a: &Array| crate::nn::cache::at_position(a, 1, at);
        Ok(match self {
            GatheredRows::Dense(a) => GatheredRows::Dense(keep(a)?),
            GatheredRows::Packed {
                weight,
                scales,
                biases,
                q,
                f32_rows,
            } => GatheredRows::Packed {
                weight: keep(weight)?,
                scales: keep(scales)?,
                biases: keep(biases)?,
                q: *q,
                f32_rows: *f32_rows,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gathered packed table's columns, whole groups or not, and its
    /// last position alone, are the lookup's values there, bit for bit.
    #[test]
    fn gathered_columns_equal_the_lookup() {
        let key = mlx_rs::random::key(7).unwrap();
        let table = mlx_rs::random::normal::<f32>(&[10, 128], None, None, &key).unwrap();
        let (weight, scales, biases) = mlx_rs::ops::quantize(&table, 32, 4).unwrap();
        let q = Quantization {
            group_size: 32,
            bits: 4,
        };
        let table = Embedding::Packed {
            weight,
            packed: Packed {
                scales,
                biases,
                q,
                dequantize_on_use: true,
            },
        };
        let tokens = Array::from_slice(&[3, 1, 4, 1, 5, 9], &[2, 3]);
        let looked_up = table.lookup(&tokens).unwrap();
        let gathered = table.gather(&tokens).unwrap();
        let bits = |a: &Array| -> Vec<u32> {
            let a = a
                .as_dtype(mlx_rs::Dtype::Float32)
                .unwrap()
                .contiguous()
                .unwrap();
            a.eval().unwrap();
            a.as_slice::<f32>().iter().map(|v| v.to_bits()).collect()
        };
        for (start, end) in [(0, 32), (32, 96), (40, 56), (16, 48), (0, 128)] {
            let columns = gathered.columns(start..end).unwrap();
            let expected = looked_up.index((.., .., start as i32..end as i32));
            assert_eq!(columns.shape(), expected.shape());
            assert!(bits(&columns) == bits(&expected), "columns {start}..{end}");
        }
        let last = gathered.at_position(2).unwrap().columns(16..48).unwrap();
        let expected = looked_up.index((.., 2..3, 16..48));
        assert!(bits(&last) == bits(&expected));
    }
}

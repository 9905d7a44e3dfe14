//! Reading a model's weights from its safetensors files into the layers
//! every decoder uses: linear layers (dense or quantized, with mlx_lm's
//! per-module quantization) and embedding tables. Every weight's shape is
//! checked against the one the config implies as it loads, so a checkpoint
//! that does not fit its config is an error naming the file and key, not a
//! failed product later.

pub(crate) mod embedding;
pub(crate) mod few_rows;
pub(crate) mod kernels;
pub(crate) mod key;
pub(crate) mod mapped;
pub(crate) mod memory_mode;
pub(crate) mod packed;
pub(crate) mod packed_product;
pub(crate) mod packed_routed;
pub(crate) mod quantized;
pub(crate) mod routed;
pub(crate) mod rows;
pub(crate) mod slices;
pub(crate) mod unpack;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::quantized_matmul;
use mlx_rs::Array;
use mlx_support::{array_from_bytes, Quantization, QuantizationConfig};
use st_mmap::{SafetensorsSet, TensorView};

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, Why};
pub(crate) use crate::weights::embedding::Embedding;
use crate::weights::kernels::{HostKernels, Products};
pub(crate) use crate::weights::key::KeyPath;
use crate::weights::mapped::MappedTable;
use crate::weights::memory_mode::MemoryMode;
pub(crate) use crate::weights::packed::Packed;
pub use crate::weights::quantized::QuantizedWeights;
pub(crate) use crate::weights::rows::GatheredRows;
use crate::weights::unpack::{dequantize_f32, packed_span};

/// The weights of one model folder, read through a key prefix (`model.`,
/// or `language_model.model.` in a multimodal checkpoint).
pub(crate) struct Weights<'a> {
    pub dir: &'a Path,
    pub set: &'a Arc<SafetensorsSet>,
    pub quant: &'a QuantizationConfig,
    pub mode: QuantizedWeights,
    /// Which kernels multiply dense weights.
    pub products: Products,
    pub memory: MemoryMode,
    /// One streamed layer's weights ([`MemoryMode::Streamed`]): arrays
    /// are taken from here instead of copied from the files, and nothing
    /// is evaluated while the layer is built, so that its weights are read
    /// when (and only when) the layer runs.
    pub streamed: Option<StreamedBlock<'a>>,
    /// Adapters applied to streamed layers as they are read.
    pub lora: &'a Arc<Vec<block_stream::BlockLoraSource>>,
}

/// One block's arrays as the streamer hands them out, by parameter name
/// within the block: a key of the files is looked up by parsing it against
/// the block prefix, not by rebuilding keys.
#[derive(Clone, Copy)]
pub(crate) struct StreamedBlock<'a> {
    pub prefix: &'a st_mmap::BlockPrefix,
    pub index: usize,
    pub params: &'a HashMap<String, Array>,
}

impl StreamedBlock<'_> {
    /// The array of the files' `key`, when it is one of this block's.
    fn get(&self, key: &str) -> Option<&Array> {
        match self.prefix.parse(key) {
            Ok(Some((index, param))) if index == self.index => self.params.get(param),
            _ => None,
        }
    }
}

impl Weights<'_> {
    /// Whether the files hold `key`.
    pub fn has(&self, key: &KeyPath) -> bool {
        self.set.tensor(key.as_str()).is_some()
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
    pub fn array(&self, key: &KeyPath, expected: &[usize]) -> Result<Array> {
        let key = key.as_str();
        let view = self.view(key, expected)?;
        if let Some(array) = self.streamed.as_ref().and_then(|block| block.get(key)) {
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
    pub fn vector(&self, key: &KeyPath, len: usize) -> Result<Array> {
        self.array(key, &[len])
    }

    /// The packed form of `module`'s `weight` `(rows, cols)` when the
    /// files hold `scales` for it.
    fn packed(
        &self,
        module: &KeyPath,
        rows: usize,
        cols: usize,
    ) -> Result<Option<(Array, Packed)>> {
        let Some(q) = self.packing(module, rows, cols)? else {
            return Ok(None);
        };
        let (gs, bits) = (q.group_size as usize, q.bits as usize);
        let weight = self.array(&module.join("weight"), &[rows, cols * bits / 32])?;
        let groups = [rows, cols / gs];
        let packed = Packed {
            scales: self.array(&module.join("scales"), &groups)?,
            biases: self.array(&module.join("biases"), &groups)?,
            q,
            dequantize_on_use: self.mode != QuantizedWeights::Keep,
            on_host: self.products.packed_for(q),
        };
        Ok(Some((weight, packed)))
    }

    /// How `module`'s `weight` `(rows, cols)` is packed, when the files
    /// hold `scales` for it: the module's quantization, checked to fit the
    /// row length.
    fn packing(&self, module: &KeyPath, rows: usize, cols: usize) -> Result<Option<Quantization>> {
        if !self.has(&module.join("scales")) {
            return Ok(None);
        }
        let prefix = module.as_str();
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
        let weight_key = module.join("weight").to_string();
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

    /// `module`'s `weight` (and `bias`) of a layer from `inputs` to
    /// `outputs`, quantized when `scales` exists.
    pub fn linear(&self, module: &KeyPath, inputs: usize, outputs: usize) -> Result<Linear> {
        let bias_key = module.join("bias");
        let bias = if self.has(&bias_key) {
            Some(self.array(&bias_key, &[outputs])?)
        } else {
            None
        };
        let Some((weight, packed)) = self.packed(module, outputs, inputs)? else {
            let weight = self.array(&module.join("weight"), &[outputs, inputs])?;
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
        let panels = self
            .products
            .panels_for(weight.dim(0) as usize, weight.dtype());
        let laid_out = if panels.is_some() {
            few_rows::to_panels(weight)?
        } else {
            weight.t().contiguous()?
        };
        if self.streamed.is_none() {
            evaluate(Why::Load, [&laid_out])?;
        }
        Ok(Linear {
            weight: laid_out,
            bias,
            layout: match panels {
                Some(kernels) => Layout::Panels(kernels),
                None => Layout::Transposed,
            },
        })
    }

    /// The embedding table `module`'s `weight` `(vocab, dim)`. `as_head`: it
    /// also serves as the tied output projection, so it is laid out for
    /// that product; otherwise it is only ever gathered from and stays
    /// packed in every mode.
    pub fn embedding(
        &self,
        module: &KeyPath,
        vocab: usize,
        dim: usize,
        as_head: bool,
    ) -> Result<Embedding> {
        if self.memory.maps_tables() {
            return self.mapped_embedding(module, vocab, dim, as_head);
        }
        let packed = self.packed(module, vocab, dim)?;
        Ok(match packed {
            None => Embedding::Dense(self.array(&module.join("weight"), &[vocab, dim])?),
            Some((weight, packed)) if as_head && self.mode == QuantizedWeights::DequantizeF32 => {
                // Evaluated here: lanes only read arrays computed before
                // they start.
                let rows = packed.dense_f32(&weight)?;
                evaluate(Why::Load, [&rows])?;
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
        module: &KeyPath,
        vocab: usize,
        dim: usize,
        as_head: bool,
    ) -> Result<Embedding> {
        let weight = module.join("weight").to_string();
        let Some(q) = self.packing(module, vocab, dim)? else {
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
        let (scales, biases) = (
            module.join("scales").to_string(),
            module.join("biases").to_string(),
        );
        self.view(&scales, &groups)?;
        self.view(&biases, &groups)?;
        Ok(Embedding::Mapped(Box::new(MappedTable::packed(
            self.set.clone(),
            [weight, scales, biases],
            q,
            vocab,
            dim,
            (self.mode, self.products.packed_for(q)),
            as_head,
        ))))
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
    /// by these kernels.
    Panels(HostKernels),
    /// Packed as stored, `(out, in / pack)`.
    Packed(Packed),
}

impl Linear {
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let y = match &self.layout {
            Layout::Packed(p) if p.dequantize_on_use => p.product_in_slices(x, &self.weight)?,
            Layout::Packed(p) => p.quantized_matmul(x, &self.weight)?,
            Layout::Panels(kernels) => few_rows::product(x, &self.weight, kernels)?,
            // MLX's `nn.Linear` adds its bias inside the product (`addmm`):
            // one rounding, where a product then a sum rounds twice in
            // bfloat16.
            Layout::Transposed => match &self.bias {
                Some(b) => return Ok(mlx_rs::ops::addmm(b, x, &self.weight, None, None)?),
                None => x.matmul(&self.weight)?,
            },
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
            Layout::Panels(kernels) => self.panel_outputs(x, outputs, kernels)?,
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
    fn panel_outputs(
        &self,
        x: &Array,
        outputs: Range<usize>,
        kernels: &HostKernels,
    ) -> Result<Array> {
        let aligned = outputs.start.is_multiple_of(few_rows::PANEL)
            && outputs.end.is_multiple_of(few_rows::PANEL);
        if aligned {
            let panels = self.weight.index(
                (outputs.start / few_rows::PANEL) as i32..(outputs.end / few_rows::PANEL) as i32,
            );
            return few_rows::product(x, &panels, kernels);
        }
        let r = outputs.start as i32..outputs.end as i32;
        Ok(x.matmul(few_rows::transposed(&self.weight)?.index((.., r)))?)
    }

    /// The packed weight, when it is unpacked before each product and the
    /// layer has no bias: what the gated MLP (`nn/mlp.rs`) slices.
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
                on_host: None,
            }),
        }
    }
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
        if let Some(y) = p.on_kernel(x, self.weight, 0..self.outputs(), columns.clone())? {
            return Ok(y);
        }
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

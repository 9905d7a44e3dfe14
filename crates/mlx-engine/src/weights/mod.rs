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
pub(crate) mod linear;
pub(crate) mod mapped;
pub(crate) mod memory_mode;
pub(crate) mod packed;
pub(crate) mod packed_product;
pub(crate) mod packed_routed;
pub(crate) mod plan;
pub(crate) mod quantized;
pub(crate) mod routed;
pub(crate) mod routing_counts;
pub(crate) mod row_lora;
pub(crate) mod rows;
pub(crate) mod slices;
pub(crate) mod unpack;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlx_rs::Array;
use mlx_support::{array_from_bytes, Quantization, QuantizationConfig};
use st_mmap::{SafetensorsSet, TensorView};

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, Why};
pub(crate) use crate::weights::embedding::Embedding;
use crate::weights::embedding::{DenseTable, PackedTable};
pub(crate) use crate::weights::key::KeyPath;
pub(crate) use crate::weights::linear::Linear;
use crate::weights::linear::{InPanels, Transposed};
use crate::weights::mapped::MappedTable;
pub(crate) use crate::weights::packed::Packed;
use crate::weights::plan::Plan;
pub use crate::weights::quantized::QuantizedWeights;
pub(crate) use crate::weights::rows::GatheredRows;

/// What a model's weights are read from and how they are held: the one
/// place a [`Weights`] view is made, at load and for each streamed layer.
#[derive(Clone)]
pub(crate) struct WeightSource {
    pub dir: PathBuf,
    pub set: Arc<SafetensorsSet>,
    pub quant: QuantizationConfig,
    pub plan: Plan,
    /// Adapters applied to streamed layers as they are read.
    pub lora: Arc<Vec<block_stream::BlockLoraSource>>,
    /// Adapters kept unfused and applied per row (`row_lora`).
    pub row_adapters: Option<Arc<row_lora::RowAdapters>>,
}

impl WeightSource {
    /// The weights as the load reads them.
    pub(crate) fn weights(&self) -> Weights<'_> {
        self.view(None)
    }

    /// One streamed layer's weights, taken from `block`.
    pub(crate) fn streamed<'a>(&'a self, block: StreamedBlock<'a>) -> Weights<'a> {
        self.view(Some(block))
    }

    fn view<'a>(&'a self, streamed: Option<StreamedBlock<'a>>) -> Weights<'a> {
        Weights {
            dir: &self.dir,
            set: &self.set,
            quant: &self.quant,
            plan: &self.plan,
            streamed,
            source: self,
        }
    }
}

/// The weights of one model folder, read through a key prefix (`model.`,
/// or `language_model.model.` in a multimodal checkpoint). Made by a
/// [`WeightSource`].
pub(crate) struct Weights<'a> {
    pub dir: &'a Path,
    pub set: &'a Arc<SafetensorsSet>,
    pub quant: &'a QuantizationConfig,
    /// How the weights are held and multiplied.
    pub plan: &'a Plan,
    /// One streamed layer's weights ([`MemoryMode::Streamed`]): arrays
    /// are taken from here instead of copied from the files, and nothing
    /// is evaluated while the layer is built, so that its weights are read
    /// when (and only when) the layer runs.
    pub streamed: Option<StreamedBlock<'a>>,
    /// Where these came from (what a streamed layer is read again from).
    pub source: &'a WeightSource,
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
        let Some(q) = self.affine_packing(module, rows, cols)? else {
            return Ok(None);
        };
        let (gs, bits) = (q.group_size as usize, q.bits as usize);
        let weight = self.array(&module.join("weight"), &[rows, cols * bits / 32])?;
        let groups = [rows, cols / gs];
        let packed = Packed {
            scales: self.array(&module.join("scales"), &groups)?,
            biases: self.array(&module.join("biases"), &groups)?,
            q,
            dequantize_on_use: self.plan.quantized != QuantizedWeights::Keep,
            on_host: self.plan.products.packed_for(q),
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

    /// [`packing`](Self::packing), for modules read as affine alone (every
    /// module but a mixture of experts' experts): another mode is a typed
    /// error naming the module.
    fn affine_packing(
        &self,
        module: &KeyPath,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Quantization>> {
        let q = self.packing(module, rows, cols)?;
        match q {
            Some(q) if q.mode != mlx_support::QuantMode::Affine => {
                Err(Error::UnsupportedQuantization {
                    path: self.dir.join("config.json"),
                    module: module.to_string(),
                    mode: q.mode.name(),
                })
            }
            q => Ok(q),
        }
    }

    /// `module`'s `weight` (and `bias`) of a layer from `inputs` to
    /// `outputs`, quantized when `scales` exists.
    pub fn linear(&self, module: &KeyPath, inputs: usize, outputs: usize) -> Result<Linear> {
        let base = self.base_linear(module, inputs, outputs)?;
        match &self.source.row_adapters {
            Some(adapters) => adapters.wrap(module.as_str(), inputs, base),
            None => Ok(base),
        }
    }

    fn base_linear(&self, module: &KeyPath, inputs: usize, outputs: usize) -> Result<Linear> {
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
        Ok(match self.plan.quantized {
            QuantizedWeights::DequantizeF32 => {
                return self.dense_linear(&packed.dense_f32(&weight)?, bias)
            }
            QuantizedWeights::Keep | QuantizedWeights::DequantizeOnUse => {
                linear::packed(weight, packed, bias)
            }
        })
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
        let kernels = self
            .plan
            .products
            .panels_for(weight.dim(0) as usize, weight.dtype());
        let laid_out = if kernels.is_some() {
            few_rows::to_panels(weight)?
        } else {
            weight.t().contiguous()?
        };
        if self.streamed.is_none() {
            evaluate(Why::Load, [&laid_out])?;
        }
        Ok(match kernels {
            Some(kernels) => Box::new(InPanels {
                panels: laid_out,
                bias,
                kernels,
            }),
            None => Box::new(Transposed {
                weight_t: laid_out,
                bias,
            }),
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
        if self.plan.memory.maps_tables() {
            return self.mapped_embedding(module, vocab, dim, as_head);
        }
        let packed = self.packed(module, vocab, dim)?;
        Ok(match packed {
            None => Box::new(DenseTable(
                self.array(&module.join("weight"), &[vocab, dim])?,
            )),
            Some((weight, packed))
                if as_head && self.plan.quantized == QuantizedWeights::DequantizeF32 =>
            {
                // Evaluated here: lanes only read arrays computed before
                // they start.
                let rows = packed.dense_f32(&weight)?;
                evaluate(Why::Load, [&rows])?;
                Box::new(DenseTable(rows))
            }
            Some((weight, packed)) => {
                // The head product of the same arrays (handles, not copies).
                let head = Packed {
                    scales: packed.scales.clone(),
                    biases: packed.biases.clone(),
                    q: packed.q,
                    dequantize_on_use: packed.dequantize_on_use,
                    on_host: packed.on_host.clone(),
                };
                Box::new(PackedTable {
                    head: linear::packed(weight.clone(), head, None),
                    weight,
                    packed,
                })
            }
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
        let Some(q) = self.affine_packing(module, vocab, dim)? else {
            self.view(&weight, &[vocab, dim])?;
            return Ok(Box::new(MappedTable::dense(
                self.set.clone(),
                weight,
                vocab,
                dim,
            )));
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
        Ok(Box::new(MappedTable::packed(
            self.set.clone(),
            [weight, scales, biases],
            q,
            vocab,
            dim,
            (self.plan.quantized, self.plan.products.packed_for(q)),
            as_head,
        )))
    }
}

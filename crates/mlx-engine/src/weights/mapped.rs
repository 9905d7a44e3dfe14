//! Embedding tables left in their files ([`MemoryMode::MappedTables`]).
//!
//! A lookup needs a few rows per token, so it reads just those rows with
//! positioned reads ([`SafetensorsSet::read_rows_into`], straight into
//! the buffer of the MLX array that holds them): the pages go through
//! the page cache but never into the process's resident set, and nothing
//! has to be released afterwards. The rows then go through the same
//! operations as the resident table's (gather, then dequantize), so the
//! results are the same bit for bit. A tied output head needs every row:
//! it is computed a slice at a time, each slice read the same way,
//! unpacked, multiplied in the same slices as the
//! resident head and freed before the next.
//!
//! [`MemoryMode::MappedTables`]: crate::MemoryMode::MappedTables

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use mlx_rs::ops::dequantize;
use mlx_rs::{Array, Dtype};
use mlx_support::{array_written, Quantization};
use st_mmap::SafetensorsSet;

use crate::error::{Error, Result};
use crate::evaluation::{host_slice, Why};
use crate::weights::embedding::Table;
use crate::weights::kernels::HostKernels;
use crate::weights::quantized::QuantizedWeights;
use crate::weights::rows::GatheredRows;
use crate::weights::slices::{head_slice_rows, in_row_slices};
use crate::weights::unpack::dequantize_f32;
use crate::weights::{few_rows, packed_product};

/// One table in the files: its weight and, when packed, its scales and
/// biases, all `vocab` rows long.
pub(crate) struct MappedTable {
    set: Arc<SafetensorsSet>,
    weight: String,
    packing: Option<Packing>,
    vocab: usize,
    /// Elements per row, unpacked.
    dim: usize,
}

/// A packed table's scales, biases and how to unpack them.
struct Packing {
    scales: String,
    biases: String,
    q: Quantization,
    /// The head uses MLX's quantized product (Apple GPUs).
    quantized_head: bool,
    /// The head is multiplied by the packed kernel where it takes a slice,
    /// as the resident head is (see `Packed::on_host`).
    on_host: Option<HostKernels>,
    /// Unpacked rows come out in f32: the resident table of this mode is
    /// dequantized to f32 at load.
    f32_rows: bool,
}

/// Rows read from a table.
struct Rows {
    weight: Array,
    /// Scales and biases, when packed.
    packing: Option<(Array, Array)>,
}

impl MappedTable {
    /// A dense `(vocab, dim)` table under `key`.
    pub fn dense(set: Arc<SafetensorsSet>, key: String, vocab: usize, dim: usize) -> MappedTable {
        MappedTable {
            set,
            weight: key,
            packing: None,
            vocab,
            dim,
        }
    }

    /// A packed table: `keys` are its weight, scales and biases. `as_head`,
    /// `mode` and `on_host` (the packed kernel multiplies it) say what the
    /// resident table would have been, whose results this one repeats.
    pub fn packed(
        set: Arc<SafetensorsSet>,
        [weight, scales, biases]: [String; 3],
        q: Quantization,
        vocab: usize,
        dim: usize,
        (mode, on_host): (QuantizedWeights, Option<HostKernels>),
        as_head: bool,
    ) -> MappedTable {
        MappedTable {
            set,
            weight,
            packing: Some(Packing {
                scales,
                biases,
                q,
                quantized_head: mode == QuantizedWeights::Keep,
                on_host: on_host.filter(|_| mode == QuantizedWeights::DequantizeOnUse),
                f32_rows: as_head && mode == QuantizedWeights::DequantizeF32,
            }),
            vocab,
            dim,
        }
    }

    /// The rows of `tokens`, each distinct one read from the file once.
    fn gathered(&self, tokens: &Array) -> Result<Rows> {
        // A prefill piece is a column slice of the padded block: copied
        // into a contiguous array before its ids are read.
        let ids = tokens.as_dtype(Dtype::Int32)?.contiguous()?;
        let ids = host_slice::<i32>(Why::Host, "token ids", &ids)?;
        // Each distinct token read once, consecutive ones in one read.
        let mut distinct = ids.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        for &id in [distinct.first(), distinct.last()].into_iter().flatten() {
            if usize::try_from(id).map_or(true, |id| id >= self.vocab) {
                return Err(Error::TokenOutOfRange {
                    id: id as u32,
                    vocab: self.vocab,
                });
            }
        }
        let mut runs: Vec<Range<usize>> = Vec::new();
        for &id in &distinct {
            let id = id as usize;
            match runs.last_mut() {
                Some(run) if run.end == id => run.end += 1,
                _ => runs.push(id..id + 1),
            }
        }
        let rows = self.read(&runs)?;
        // Where each token's row is among the distinct rows.
        let position: Vec<i32> = ids
            .iter()
            .map(|id| distinct.binary_search(id).unwrap_or_default() as i32)
            .collect();
        let position = Array::from_slice(&position, tokens.shape());
        Ok(Rows {
            weight: rows.weight.take_axis(&position, 0)?,
            packing: match &rows.packing {
                Some((s, b)) => Some((s.take_axis(&position, 0)?, b.take_axis(&position, 0)?)),
                None => None,
            },
        })
    }

    /// The key's presence and shape were checked at load and the set does
    /// not change, so this is for the impossible case.
    fn missing(&self, key: &str) -> Error {
        Error::MissingWeight {
            dir: self
                .set
                .file_of(&self.weight)
                .unwrap_or(Path::new(""))
                .to_path_buf(),
            key: key.to_owned(),
        }
    }

    /// The rows `runs` of the table, one run after another.
    fn read(&self, runs: &[Range<usize>]) -> Result<Rows> {
        let weight = self.read_tensor(&self.weight, runs)?;
        let packing = match &self.packing {
            Some(p) => Some((
                self.read_tensor(&p.scales, runs)?,
                self.read_tensor(&p.biases, runs)?,
            )),
            None => None,
        };
        Ok(Rows { weight, packing })
    }

    /// The rows `runs` of `key`, read straight into one MLX buffer, so
    /// that they exist once (not read into a vector, then copied by MLX).
    fn read_tensor(&self, key: &str, runs: &[Range<usize>]) -> Result<Array> {
        let missing = || self.missing(key);
        let view = self.set.tensor(key).ok_or_else(missing)?;
        let mut shape = view.shape.to_vec();
        shape[0] = runs.iter().map(ExactSizeIterator::len).sum();
        array_written(key, view.dtype, &shape, |out| {
            // Whole rows: the header check made a tensor's byte length its
            // shape's product times the element size.
            let row_bytes = out.len().checked_div(shape[0]).unwrap_or(0);
            let mut at = 0;
            for run in runs {
                let end = at + run.len() * row_bytes;
                if !self
                    .set
                    .read_rows_into(key, run.clone(), &mut out[at..end])?
                {
                    return Err(missing());
                }
                at = end;
            }
            Ok(())
        })
    }

    /// Rows as the resident table's lookup returns them.
    fn unpacked(&self, rows: &Rows) -> Result<Array> {
        Ok(match (&self.packing, &rows.packing) {
            (Some(p), Some((s, b))) if p.f32_rows => dequantize_f32(&rows.weight, s, b, p.q)?,
            (Some(p), Some((s, b))) => dequantize(&rows.weight, s, b, p.q.group_size, p.q.bits)?,
            _ => rows.weight.clone(),
        })
    }
}

impl Table for MappedTable {
    /// The rows of `tokens` `(B, L)`: `(B, L, dim)`.
    fn lookup(&self, tokens: &Array) -> Result<Array> {
        self.unpacked(&self.gathered(tokens)?)
    }

    /// The rows of `tokens` as the file holds them.
    fn gather(&self, tokens: &Array) -> Result<GatheredRows> {
        let rows = self.gathered(tokens)?;
        Ok(match (&self.packing, rows.packing) {
            (Some(p), Some((scales, biases))) => GatheredRows::Packed {
                weight: rows.weight,
                scales,
                biases,
                q: p.q,
                f32_rows: p.f32_rows,
            },
            _ => GatheredRows::Dense(rows.weight),
        })
    }

    /// `x · tableᵀ`: the tied output projection, `(…, vocab)`, a slice of
    /// rows read at a time.
    fn as_linear(&self, x: &Array) -> Result<Array> {
        let mut step = head_slice_rows(self.dim);
        let kernel = self
            .packing
            .as_ref()
            .and_then(|p| p.on_host.as_ref())
            .filter(|_| self.vocab.is_multiple_of(few_rows::PANEL));
        if kernel.is_some() {
            // Slices the kernel takes whole, so that every output is its
            // sum, as in the resident head's one product.
            step = (step / few_rows::PANEL).max(1) * few_rows::PANEL;
        }
        in_row_slices(self.vocab, step, |range| {
            // A dense table's rows, multiplied as the resident head's are.
            let Some(p) = &self.packing else {
                let rows = self.read_tensor(&self.weight, std::slice::from_ref(&range))?;
                return Ok(x.matmul(rows.t())?);
            };
            let rows = self.read(std::slice::from_ref(&range))?;
            let (scales, biases) = rows
                .packing
                .as_ref()
                .ok_or_else(|| self.missing(&p.scales))?;
            if let Some(kernels) = kernel {
                let n = range.len();
                let product = packed_product::product(
                    x,
                    &rows.weight,
                    scales,
                    biases,
                    p.q,
                    0..n,
                    0..self.dim,
                    kernels,
                )?;
                if let Some(y) = product {
                    return Ok(y);
                }
            }
            Ok(if p.quantized_head {
                let (gs, bits) = (p.q.group_size, p.q.bits);
                mlx_rs::ops::quantized_matmul(x, &rows.weight, scales, biases, true, gs, bits)?
            } else {
                // The resident heads of both modes are multiplied as
                // `x · rowsᵀ`, in f32.
                x.matmul(dequantize_f32(&rows.weight, scales, biases, p.q)?.t())?
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use mlx_rs::ops::indexing::IndexOp;

    use super::*;

    /// A table of several head slices, the last one partial: the mapped
    /// head's product equals the resident table's, bit for bit.
    #[test]
    fn the_head_read_in_slices_equals_the_resident_head() {
        let dim = 2048;
        let step = head_slice_rows(dim);
        let vocab = 2 * step + 17;
        let table =
            mlx_rs::random::normal::<f32>(&[vocab as i32, dim as i32], None, None, None).unwrap();
        let x = mlx_rs::random::normal::<f32>(&[3, dim as i32], None, None, None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        Array::save_safetensors([("t", &table)], None, dir.path().join("model.safetensors"))
            .unwrap();
        let set = Arc::new(SafetensorsSet::open_dir(dir.path()).unwrap());
        let mapped = MappedTable::dense(set, "t".into(), vocab, dim);

        let rows = mapped
            .read_tensor("t", std::slice::from_ref(&(5..9)))
            .unwrap();
        let wanted = table.index(5..9);
        assert_eq!(rows.as_slice::<f32>(), wanted.as_slice::<f32>());
        // Several runs (a lookup's distinct ids), one after another.
        let rows = mapped.read_tensor("t", &[0..2, 7..8, 40..43]).unwrap();
        let wanted = mlx_rs::ops::concatenate(
            &[table.index(0..2), table.index(7..8), table.index(40..43)],
            0,
        )
        .unwrap();
        assert_eq!(rows.shape(), &[6, dim as i32]);
        assert_eq!(rows.as_slice::<f32>(), wanted.as_slice::<f32>());

        let head = mapped.as_linear(&x).unwrap();
        let resident = crate::weights::embedding::DenseTable(table)
            .as_linear(&x)
            .unwrap();
        assert_eq!(head.shape(), &[3, vocab as i32]);
        assert_eq!(head.as_slice::<f32>(), resident.as_slice::<f32>());
    }

    /// A lookup with repeated, unordered and neighbouring ids returns the
    /// resident table's rows in the tokens' order and shape; an id past
    /// the table (or negative) is the typed error.
    #[test]
    fn a_lookup_gives_the_rows_of_the_tokens_in_their_order() {
        let (vocab, dim) = (40, 8);
        let table =
            mlx_rs::random::normal::<f32>(&[vocab as i32, dim as i32], None, None, None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        Array::save_safetensors([("t", &table)], None, dir.path().join("model.safetensors"))
            .unwrap();
        let set = Arc::new(SafetensorsSet::open_dir(dir.path()).unwrap());
        let mapped = MappedTable::dense(set, "t".into(), vocab, dim);

        let tokens = Array::from_slice(&[7, 3, 4, 5, 3, 39, 0, 7], &[2, 4]);
        let rows = mapped.lookup(&tokens).unwrap();
        let wanted = table.take_axis(&tokens, 0).unwrap();
        assert_eq!(rows.shape(), &[2, 4, dim as i32]);
        assert_eq!(rows.as_slice::<f32>(), wanted.as_slice::<f32>());

        for bad in [40, -1] {
            let err = mapped.lookup(&Array::from_slice(&[1, bad], &[1, 2]));
            assert!(
                matches!(err, Err(Error::TokenOutOfRange { vocab: 40, .. })),
                "{bad}: {err:?}"
            );
        }
    }

    /// The same for a packed table unpacked on use (E2B's head on the CPU),
    /// whose resident head is multiplied in a packed matrix's 16 MiB slices
    /// and the mapped one in the head's 8 MiB: the products still agree.
    #[test]
    fn a_packed_head_read_in_slices_equals_the_resident_head() {
        let dim = 2048;
        let vocab = 2 * head_slice_rows(dim) + 64;
        let table =
            mlx_rs::random::normal::<f32>(&[vocab as i32, dim as i32], None, None, None).unwrap();
        let (weight, scales, biases) = mlx_rs::ops::quantize(&table, 64, 4).unwrap();
        let x = mlx_rs::random::normal::<f32>(&[3, dim as i32], None, None, None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        Array::save_safetensors(
            [
                ("t.weight", &weight),
                ("t.scales", &scales),
                ("t.biases", &biases),
            ],
            None,
            dir.path().join("model.safetensors"),
        )
        .unwrap();
        let set = Arc::new(SafetensorsSet::open_dir(dir.path()).unwrap());
        let q = Quantization::affine(64, 4);
        let keys = ["t.weight", "t.scales", "t.biases"].map(String::from);
        let mode = QuantizedWeights::DequantizeOnUse;
        let mapped = MappedTable::packed(set, keys, q, vocab, dim, (mode, None), true);
        let resident = crate::weights::linear::packed_on_use(weight, scales, biases, q);
        let head = mapped.as_linear(&x).unwrap();
        let wanted = resident.forward(&x).unwrap();
        assert_eq!(head.shape(), &[3, vocab as i32]);
        assert_eq!(head.as_slice::<f32>(), wanted.as_slice::<f32>());
    }
}

//! Token embedding tables behind one narrow trait: looked up, gathered
//! for some tokens, and used as the tied output head. One implementation
//! per way a table is held, chosen at load: dense rows ([`DenseTable`]),
//! packed rows ([`PackedTable`], its head product the packed [`Linear`]
//! the plan chose), or left in the files (`MappedTable`).

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use crate::error::Result;
use crate::weights::linear::Linear;
use crate::weights::packed::Packed;
use crate::weights::rows::GatheredRows;
use crate::weights::slices::{head_slice_rows, in_row_slices};

/// A token embedding table as the model holds it.
pub(crate) type Embedding = Box<dyn Table>;

/// What a model asks of an embedding table.
pub(crate) trait Table {
    /// The rows of `tokens` `(B, L)`: `(B, L, dim)`.
    fn lookup(&self, tokens: &Array) -> Result<Array>;

    /// The rows of `tokens` `(B, L)` as the table holds them, to be
    /// unpacked a range of columns at a time.
    fn gather(&self, tokens: &Array) -> Result<GatheredRows>;

    /// `x · tableᵀ`: the tied output projection, `(…, vocab)`.
    fn as_linear(&self, x: &Array) -> Result<Array>;
}

/// Dense rows `(vocab, dim)`. As a tied output head they are multiplied as
/// they are, `x · rowsᵀ` (BLAS's transpose flag), not transposed at load as
/// [`Linear`] weights are: with the vocabulary as the product's columns
/// that layout is the faster one at every row count measured (SmolLM2's
/// head, 8 rows: 13 against 20 ms on two OpenBLAS threads; CHANGELOG.md),
/// in the head's slices, as a table left in the files is.
pub(crate) struct DenseTable(pub Array);

impl Table for DenseTable {
    fn lookup(&self, tokens: &Array) -> Result<Array> {
        Ok(self.0.take_axis(tokens, 0)?)
    }

    fn gather(&self, tokens: &Array) -> Result<GatheredRows> {
        Ok(GatheredRows::Dense(self.lookup(tokens)?))
    }

    fn as_linear(&self, x: &Array) -> Result<Array> {
        let rows = &self.0;
        let vocab = rows.dim(0) as usize;
        in_row_slices(vocab, head_slice_rows(rows.dim(1) as usize), |r| {
            Ok(x.matmul(rows.index(r.start as i32..r.end as i32).t())?)
        })
    }
}

/// Packed rows: gathered rows are unpacked (to the scales' dtype, as
/// mlx_lm's lookup does); as the head, the packed layer `head` of the same
/// arrays.
pub(crate) struct PackedTable {
    pub weight: Array,
    pub packed: Packed,
    pub head: Linear,
}

impl Table for PackedTable {
    fn lookup(&self, tokens: &Array) -> Result<Array> {
        let packed = &self.packed;
        packed.dense_rows(
            &self.weight.take_axis(tokens, 0)?,
            &packed.scales.take_axis(tokens, 0)?,
            &packed.biases.take_axis(tokens, 0)?,
        )
    }

    fn gather(&self, tokens: &Array) -> Result<GatheredRows> {
        let packed = &self.packed;
        Ok(GatheredRows::Packed {
            weight: self.weight.take_axis(tokens, 0)?,
            scales: packed.scales.take_axis(tokens, 0)?,
            biases: packed.biases.take_axis(tokens, 0)?,
            q: packed.q,
            f32_rows: false,
        })
    }

    fn as_linear(&self, x: &Array) -> Result<Array> {
        self.head.forward(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_support::Quantization;

    /// A gathered packed table's columns, whole groups or not, and its
    /// last position alone, are the lookup's values there, bit for bit.
    #[test]
    fn gathered_columns_equal_the_lookup() {
        let key = mlx_rs::random::key(7).unwrap();
        let table = mlx_rs::random::normal::<f32>(&[10, 128], None, None, &key).unwrap();
        let (weight, scales, biases) = mlx_rs::ops::quantize(&table, 32, 4).unwrap();
        let q = Quantization::affine(32, 4);
        let head = crate::weights::linear::packed_on_use(
            weight.clone(),
            scales.clone(),
            biases.clone(),
            q,
        );
        let table = PackedTable {
            weight,
            packed: Packed {
                scales,
                biases,
                q,
                dequantize_on_use: true,
                on_host: None,
            },
            head,
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

//! Each module's pairs held stacked over the adapters served, and how a
//! load or an unload restacks them.

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::{Array, Dtype};

use super::{adapter_error, NamedAdapter};
use crate::error::Result;

/// One module's pairs over the adapters served, stacked: `lora_a` of
/// every adapter `(K, in, r)`, `lora_b` `(K, r, out)`, zeros where an
/// adapter has a lower rank than the highest or does not adapt the module.
pub(super) struct Stacked {
    pub a: Array,
    pub b: Array,
    /// Each adapter's rank; 0 where it does not adapt the module.
    pub ranks: Vec<usize>,
    /// Each adapter's own dtypes of `lora_a` and `lora_b`: a stack of
    /// several dtypes is held in f32, and an adapter's pair taken out of
    /// it again (when another adapter is unloaded) goes back to them.
    pub dtypes: Vec<(Dtype, Dtype)>,
}

impl Stacked {
    /// The pair of the adapter at `position`, as its file holds it;
    /// `None` where it does not adapt the module.
    pub fn pair(&self, position: usize) -> Result<Option<(Array, Array)>> {
        let rank = self.ranks[position] as i32;
        if rank == 0 {
            return Ok(None);
        }
        let (a_dtype, b_dtype) = self.dtypes[position];
        let p = position as i32;
        let a = self.a.index((p, .., ..rank)).as_dtype(a_dtype)?;
        let b = self.b.index((p, ..rank, ..)).as_dtype(b_dtype)?;
        Ok(Some((a, b)))
    }
}

/// An adapter's pair for `module`, copied out of its file: `lora_a`
/// `(in, r)`, `lora_b` `(r, out)`; `None` where it does not adapt it.
pub(super) fn pair_of(
    adapter: &block_stream::MlxLmAdapter,
    module: &str,
) -> Result<Option<(Array, Array)>> {
    let Some((a_key, b_key)) = adapter.pairs().get(module) else {
        return Ok(None);
    };
    let load = |key: &str| -> Result<Array> {
        let t = adapter
            .file()
            .tensor(key)
            .expect("a key of the file's own header");
        Ok(mlx_support::array_from_bytes(
            key, t.dtype, t.shape, t.data,
        )?)
    };
    Ok(Some((load(a_key)?, load(b_key)?)))
}

/// `module`'s pairs over `adapters` (`pairs[k]` adapter `k`'s), stacked,
/// ranks padded with zeros, in the dtype they share, or f32; `None` when
/// no adapter adapts the module. A pair whose inputs or outputs differ
/// from the first's is [`Error::Adapter`](crate::Error::Adapter) naming
/// both adapters.
pub(super) fn stack(
    adapters: &[&NamedAdapter],
    pairs: &[Option<(Array, Array)>],
    module: &str,
) -> Result<Option<Stacked>> {
    let present: Vec<(usize, &(Array, Array))> = pairs
        .iter()
        .enumerate()
        .filter_map(|(k, pair)| pair.as_ref().map(|p| (k, p)))
        .collect();
    let Some(&(first, (a0, b0))) = present.first() else {
        return Ok(None);
    };
    let (inputs, outputs) = (a0.dim(0), b0.dim(1));
    let ranks: Vec<usize> = pairs
        .iter()
        .map(|pair| pair.as_ref().map_or(0, |(a, _)| a.dim(1) as usize))
        .collect();
    let rank = *ranks.iter().max().unwrap_or(&0) as i32;
    let same_dtype = present
        .iter()
        .all(|(_, (a, b))| a.dtype() == a0.dtype() && b.dtype() == a0.dtype());
    let dtype = if same_dtype {
        a0.dtype()
    } else {
        Dtype::Float32
    };
    let mut a_parts = Vec::with_capacity(pairs.len());
    let mut b_parts = Vec::with_capacity(pairs.len());
    let mut dtypes = Vec::with_capacity(pairs.len());
    for (k, pair) in pairs.iter().enumerate() {
        let r = ranks[k] as i32;
        let (a, b) = match pair {
            Some((a, b)) => {
                let fits = a.shape() == [inputs, r] && b.shape() == [r, outputs];
                if !fits {
                    let (other, this) = (&adapters[first], &adapters[k]);
                    return Err(adapter_error(
                        &this.name,
                        &this.dir,
                        &format!(
                            "{module}.lora_a {:?} and .lora_b {:?} do not fit the layer adapter {:?} adapts ({inputs} to {outputs})",
                            a.shape(),
                            b.shape(),
                            other.name
                        ),
                    ));
                }
                dtypes.push((a.dtype(), b.dtype()));
                (a.as_dtype(dtype)?, b.as_dtype(dtype)?)
            }
            None => {
                dtypes.push((dtype, dtype));
                (
                    zeros_dtype(&[inputs, 0], dtype)?,
                    zeros_dtype(&[0, outputs], dtype)?,
                )
            }
        };
        a_parts.push(concatenate(
            &[a, zeros_dtype(&[inputs, rank - r], dtype)?],
            1,
        )?);
        b_parts.push(concatenate(
            &[b, zeros_dtype(&[rank - r, outputs], dtype)?],
            0,
        )?);
    }
    Ok(Some(Stacked {
        a: mlx_rs::ops::stack(&a_parts, 0)?,
        b: mlx_rs::ops::stack(&b_parts, 0)?,
        ranks,
        dtypes,
    }))
}

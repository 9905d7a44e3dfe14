//! Keys and values of past positions: a prefix shared by every row of a
//! batch, held once, and the positions each row owns, appended in place.

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::Array;

use crate::error::Result;

/// Room added whenever a row-owned buffer must grow, so that decoding
/// appends in place instead of copying the whole cache at every step.
const GROW_BY: i32 = 64;

/// One layer's keys or values owned by the rows, `(B, kv_heads, capacity,
/// head_dim)`; slots from the cache's `own_len` on are not yet written.
#[derive(Debug, Clone)]
struct Owned {
    keys: Array,
    values: Array,
}

/// Keys and values of every layer for the positions seen so far.
///
/// A cache made by [`fork`](Self::fork) starts with a *shared* prefix: one
/// copy of its keys and values, `(kv_heads, len, head_dim)` per layer, that
/// every row attends to. Attention reads it with one matrix product for the
/// whole batch, and it is never repeated per row (the way a prompt cache is
/// usually copied into every row of a batch). Positions after it are *owned*
/// by the rows, left-padded by [`pads`](Self::pads) where rows differ in
/// length; a mask passed to [`Model::forward`](crate::Model::forward)
/// covers the owned positions only.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    shared: Vec<(Array, Array)>,
    shared_len: i32,
    owned: Vec<Option<Owned>>,
    own_len: i32,
    /// Per row, how many owned slots (at their start) are padding. Rotary
    /// positions of a row's new tokens are `len() - pad`, so padding does
    /// not shift them; the mask must hide the padded slots.
    pads: Vec<i32>,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> KvCache {
        KvCache::default()
    }

    /// Positions cached, shared and owned.
    pub fn len(&self) -> i32 {
        self.shared_len + self.own_len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Per row, how many of its first owned slots are padding.
    pub fn pads(&self) -> &[i32] {
        &self.pads
    }

    /// Declares how many of each row's first owned slots will be padding,
    /// before any owned position is written (a left-padded prefill).
    ///
    /// # Errors
    /// [`Error::Cache`](crate::Error::Cache) once owned positions exist, for
    /// a negative pad, or when a forked cache's row count differs.
    pub fn set_pads(&mut self, pads: Vec<i32>) -> Result<()> {
        if self.own_len != 0 {
            return Err(cache_err(format!(
                "padding is set before the rows own positions; they own {}",
                self.own_len
            )));
        }
        if pads.iter().any(|&p| p < 0) {
            return Err(cache_err(format!("negative padding in {pads:?}")));
        }
        if !self.pads.is_empty() && self.pads.len() != pads.len() {
            return Err(cache_err(format!(
                "{} pads for a cache of {} rows",
                pads.len(),
                self.pads.len()
            )));
        }
        self.pads = pads;
        Ok(())
    }

    /// Positions owned by the rows (padding included): what a mask's last
    /// axis covers, before the new positions.
    pub fn own_len(&self) -> i32 {
        self.own_len
    }

    /// A cache for `rows` rows that all continue from this one-row cache,
    /// which becomes their shared prefix without being copied per row.
    pub fn fork(&self, rows: i32) -> Result<KvCache> {
        let mut shared = Vec::with_capacity(self.owned.len().max(self.shared.len()));
        if self.own_len == 0 {
            shared.clone_from(&self.shared);
        } else {
            for (layer, owned) in self.owned.iter().enumerate() {
                let owned = owned.as_ref().ok_or_else(|| empty_layer(layer))?;
                if owned.keys.dim(0) != 1 {
                    let what = format!(
                        "only a one-row cache can be shared, this one has {} rows",
                        owned.keys.dim(0)
                    );
                    return Err(cache_err(what));
                }
                let mine = |a: &Array| a.index((0, .., ..self.own_len, ..));
                let joined = |own: Array, shared: Option<&Array>| -> Result<Array> {
                    Ok(match shared {
                        Some(s) => concatenate(&[s, &own], 1)?,
                        None => own,
                    })
                };
                let before = self.shared.get(layer);
                shared.push((
                    joined(mine(&owned.keys), before.map(|s| &s.0))?,
                    joined(mine(&owned.values), before.map(|s| &s.1))?,
                ));
            }
        }
        Ok(KvCache {
            shared,
            shared_len: self.len(),
            owned: Vec::new(),
            own_len: 0,
            pads: vec![0; rows.max(0) as usize],
        })
    }

    /// Stacks caches forked from the same one along the batch axis, with
    /// room for `spare` more positions. Those with fewer owned positions
    /// than the longest are left-padded, counted in [`pads`](Self::pads).
    pub fn stack(mut parts: Vec<KvCache>, spare: i32) -> Result<KvCache> {
        if parts.len() == 1 {
            // One part: nothing to pad or join; appending grows it once.
            return Ok(parts.pop().expect("one part"));
        }
        let Some(first) = parts.first() else {
            return Ok(KvCache::new());
        };
        if parts.iter().any(|p| p.shared_len != first.shared_len) {
            let what = "cannot stack caches forked from different prefixes";
            return Err(cache_err(what.to_owned()));
        }
        let own_len = parts.iter().map(|c| c.own_len).max().unwrap_or(0);
        let layer_count = parts.iter().map(|c| c.owned.len()).max().unwrap_or(0);
        let mut owned = Vec::with_capacity(layer_count);
        for layer in 0..layer_count {
            let mut keys = Vec::with_capacity(parts.len());
            let mut values = Vec::with_capacity(parts.len());
            for part in &parts {
                let own = part
                    .owned
                    .get(layer)
                    .and_then(Option::as_ref)
                    .ok_or_else(|| empty_layer(layer))?;
                let widen = |a: &Array| -> Result<Array> {
                    let filled = a.index((.., .., ..part.own_len, ..));
                    let pad = own_len - part.own_len;
                    Ok(concatenate(
                        &[empty_slots(a, pad)?, filled, empty_slots(a, spare)?],
                        2,
                    )?)
                };
                keys.push(widen(&own.keys)?);
                values.push(widen(&own.values)?);
            }
            owned.push(Some(Owned {
                keys: concatenate(&keys, 0)?,
                values: concatenate(&values, 0)?,
            }));
        }
        let pads = parts
            .iter()
            .flat_map(|c| c.pads.iter().map(move |p| p + own_len - c.own_len))
            .collect();
        let first = parts.swap_remove(0);
        Ok(KvCache {
            shared: first.shared,
            shared_len: first.shared_len,
            owned,
            own_len,
            pads,
        })
    }

    /// Layer `layer`'s shared keys and values, `(kv_heads, len, head_dim)`.
    pub(crate) fn shared(&self, layer: usize) -> Option<(&Array, &Array)> {
        self.shared.get(layer).map(|(k, v)| (k, v))
    }

    /// Writes `keys` and `values` `(B, kv_heads, L, head_dim)` after the
    /// owned positions of `layer` (in place when there is room) and returns
    /// all owned keys and values including them. Call
    /// [`advance`](Self::advance) once every layer has appended.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        keys: Array,
        values: Array,
    ) -> Result<(Array, Array)> {
        if self.owned.len() <= layer {
            self.owned.resize(layer + 1, None);
        }
        let (at, new) = (self.own_len, keys.dim(2));
        let end = at + new;
        let slot = &mut self.owned[layer];
        match slot {
            None if at == 0 => {
                *slot = Some(Owned { keys, values });
            }
            None => return Err(empty_layer(layer)),
            Some(own) if own.keys.dim(2) >= end => {
                own.keys.try_index_mut((.., .., at..end, ..), &keys)?;
                own.values.try_index_mut((.., .., at..end, ..), &values)?;
            }
            Some(own) => {
                let grow = |buffer: &Array, new: &Array| -> Result<Array> {
                    let filled = buffer.index((.., .., ..at, ..));
                    Ok(concatenate(
                        &[filled, new.clone(), empty_slots(new, GROW_BY)?],
                        2,
                    )?)
                };
                *own = Owned {
                    keys: grow(&own.keys, &keys)?,
                    values: grow(&own.values, &values)?,
                };
            }
        }
        let own = slot.as_ref().expect("filled above");
        Ok((
            own.keys.index((.., .., ..end, ..)),
            own.values.index((.., .., ..end, ..)),
        ))
    }

    /// Counts `new` positions appended to every layer.
    pub(crate) fn advance(&mut self, new: i32) {
        self.own_len += new;
    }
}

/// `n` zero positions shaped and typed like `like` `(B, kv_heads, _, head_dim)`.
fn empty_slots(like: &Array, n: i32) -> Result<Array> {
    let shape = like.shape();
    let zeros = Array::zeros::<f32>(&[shape[0], shape[1], n, shape[3]])?;
    Ok(zeros.as_dtype(like.dtype())?)
}

fn empty_layer(layer: usize) -> crate::Error {
    cache_err(format!("the cache has no keys for layer {layer}"))
}

fn cache_err(message: String) -> crate::Error {
    crate::Error::Cache(message)
}

/// The attention mask over owned positions for a batch whose rows are
/// left-padded by `pads[i]` slots, for `new` positions after `cached` owned
/// ones: `(B, 1, new, cached + new)`, true where attention is allowed.
pub(crate) fn padded_causal_mask(pads: &[usize], cached: usize, new: usize) -> Array {
    let total = cached + new;
    let mut mask = Vec::with_capacity(pads.len() * new * total);
    for &pad in pads {
        for i in 0..new {
            mask.extend((0..total).map(|j| j >= pad && j <= cached + i));
        }
    }
    Array::from_slice(&mask, &[pads.len() as i32, 1, new as i32, total as i32])
}

//! Keys and values of past positions: a prefix shared by every row of a
//! batch, held once, and the positions each row owns, appended in place.

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::Array;

use crate::error::Result;
use crate::evaluation::{evaluate, Why};
use crate::nn::row_groups::RowGroup;
use crate::ops::at_position;

/// Room added whenever a row-owned buffer must grow, so that decoding
/// appends in place instead of copying the whole cache at every step.
const GROW_BY: i32 = 64;

/// One layer's keys and values owned by the rows, `(B, kv_heads, capacity,
/// head_dim)`. The buffer's first slot is owned slot `start`: a layer with
/// an attention window drops the slots no later query can see. Slots from
/// the cache's `own_len` on are not yet written.
#[derive(Debug, Clone)]
struct Owned {
    keys: Array,
    values: Array,
    start: i32,
    window: Option<i32>,
}

impl Owned {
    fn new(keys: Array, values: Array, window: Option<i32>) -> Owned {
        Owned {
            keys,
            values,
            start: 0,
            window,
        }
    }
}

/// The masks of one layer's attention for the positions about to be
/// appended (true = may attend): over the rows' owned slots from the
/// layer's first kept one, `(B or 1, 1, new, kept + new)`, and over the
/// shared prefix's kept positions, `(B, new, prefix)`. `None` where
/// everything is visible.
#[derive(Debug, Default)]
pub(crate) struct LayerMask {
    pub own: Option<Array>,
    pub shared: Option<Array>,
}

impl LayerMask {
    /// The mask of the last of `new` queries alone.
    pub(crate) fn of_last(&self, new: i32) -> Result<LayerMask> {
        let last = |m: &Array, axis| at_position(m, axis, new - 1);
        Ok(LayerMask {
            own: self.own.as_ref().map(|m| last(m, 2)).transpose()?,
            shared: self.shared.as_ref().map(|m| last(m, 1)).transpose()?,
        })
    }

    /// The mask of `group`'s rows (a mask of one row applies to all).
    pub(crate) fn of_rows(&self, group: &RowGroup) -> LayerMask {
        LayerMask {
            own: self.own.as_ref().map(|m| group.of_broadcast(m)),
            shared: self.shared.as_ref().map(|m| group.of_broadcast(m)),
        }
    }
}

/// One layer's keys and values, `(kv_heads, positions, head_dim)` each.
pub(crate) type LayerKv = (Array, Array);

/// Keys and values of every layer for the positions seen so far.
///
/// A layer with an attention window (Gemma's sliding layers) keeps only
/// the positions a later query can still see: its memory is bounded by the
/// window, not by the prompt. Layers that read another layer's keys and
/// values (Gemma 4's KV-shared layers) have no entries of their own.
///
/// A cache made by [`fork`](Self::fork) starts with a *shared* prefix: one
/// copy of its keys and values, `(kv_heads, len, head_dim)` per layer, that
/// every row attends to. Attention reads it with one matrix product for the
/// whole batch, and it is never repeated per row (the way a prompt cache is
/// usually copied into every row of a batch). Positions after it are *owned*
/// by the rows, left-padded ([`fork_padded`](Self::fork_padded)) where rows differ in
/// length; a mask passed to [`Model::forward`](crate::Model::forward)
/// covers the owned positions only.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Per layer, `(kv_heads, kept, head_dim)`: the prefix's last `kept`
    /// positions (all of them without a window).
    shared: Vec<Option<(Array, Array)>>,
    shared_len: i32,
    owned: Vec<Option<Owned>>,
    own_len: i32,
    /// Per row, how many owned slots (at their start) are padding. Rotary
    /// positions of a row's new tokens are `len() - pad`, so padding does
    /// not shift them; the mask must hide the padded slots.
    pads: Vec<i32>,
    /// Owned keys and values go to the forward's attention and are not
    /// kept (see [`discard_owned`](Self::discard_owned)).
    discard_owned: bool,
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
    pub(crate) fn pads(&self) -> &[i32] {
        &self.pads
    }

    /// Declares how many of each row's first owned slots will be padding,
    /// before any owned position is written (a left-padded prefill).
    ///
    /// # Errors
    /// [`Error::Cache`](crate::Error::Cache) once owned positions exist, for
    /// a negative pad, or when a forked cache's row count differs.
    pub(crate) fn set_pads(&mut self, pads: Vec<i32>) -> Result<()> {
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

    /// Keeps none of the rows' own keys and values: the one forward this
    /// cache is for hands each layer's to its attention, and they die with
    /// it. For a prefill that nothing reads afterwards (one token, the
    /// classification case), whose keys and values would otherwise stay
    /// alive across every layer and group until the chunk ends. A forward
    /// after that one fails with [`Error::Cache`](crate::Error::Cache).
    pub(crate) fn discard_owned(&mut self) {
        self.discard_owned = true;
    }

    /// A cache for one row per entry of `pads` that all continue from this
    /// one-row cache, row `i` left-padded by `pads[i]` slots: for a batch
    /// of suffixes of different lengths, each padded on the left to the
    /// longest, as mlx_lm pads a batch. The model's masks hide the padding.
    ///
    /// # Errors
    /// [`Error::Cache`](crate::Error::Cache) for a negative pad, or when
    /// this cache holds more than one row.
    pub fn fork_padded(&self, pads: Vec<i32>) -> Result<KvCache> {
        let mut cache = self.fork(pads.len() as i32)?;
        cache.set_pads(pads)?;
        Ok(cache)
    }

    /// Positions owned by the rows (padding included), for tests.
    #[cfg(test)]
    pub(crate) fn own_len(&self) -> i32 {
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
                let Some(owned) = owned else {
                    // A layer that reads another's keys and values.
                    shared.push(None);
                    continue;
                };
                if owned.keys.dim(0) != 1 {
                    let what = format!(
                        "only a one-row cache can be shared, this one has {} rows",
                        owned.keys.dim(0)
                    );
                    return Err(cache_err(what));
                }
                let filled = self.own_len - owned.start;
                // A windowed layer that dropped slots holds at least the
                // window's worth of them: the older prefix is not needed.
                let before = match self.shared.get(layer) {
                    Some(Some(s)) if owned.start == 0 => Some(s),
                    _ => None,
                };
                let joined = |own: &Array, before: Option<&Array>| -> Result<Array> {
                    let own = own.index((0, .., ..filled, ..));
                    let all = match before {
                        Some(s) => concatenate(&[s, &own], 1)?,
                        None => own,
                    };
                    Ok(match owned.window {
                        Some(w) => last_positions(&all, w - 1)?,
                        None => all,
                    })
                };
                shared.push(Some((
                    joined(&owned.keys, before.map(|s| &s.0))?,
                    joined(&owned.values, before.map(|s| &s.1))?,
                )));
            }
        }
        Ok(KvCache {
            shared,
            shared_len: self.len(),
            owned: Vec::new(),
            own_len: 0,
            pads: vec![0; rows.max(0) as usize],
            discard_owned: false,
        })
    }

    /// A one-row cache whose whole length is its shared prefix: per layer
    /// the kept `(kv_heads, kept, head_dim)` keys and values (`None` for a
    /// layer that reads another's), `len` positions in all. What a prefix
    /// cache read back from disk is.
    pub(crate) fn from_shared(shared: Vec<Option<LayerKv>>, len: i32) -> KvCache {
        KvCache {
            shared,
            shared_len: len,
            owned: Vec::new(),
            own_len: 0,
            pads: vec![0],
            discard_owned: false,
        }
    }

    /// The shared prefix's keys and values per layer and its length, when
    /// the cache holds nothing else (a prefix forked for one row): what a
    /// prefix cache on disk stores. `None` once rows own positions.
    pub(crate) fn shared_parts(&self) -> Option<(&[Option<LayerKv>], i32)> {
        (self.own_len == 0).then_some((&self.shared[..], self.shared_len))
    }

    /// Computes every array this cache holds, so that other threads can
    /// read it (MLX evaluates a lazy array on the stream that made it).
    pub(crate) fn evaluate(&self) -> Result<()> {
        evaluate(Why::Step, self.arrays())?;
        Ok(())
    }

    /// Every key and value array this cache holds, shared and owned.
    pub(crate) fn arrays(&self) -> impl Iterator<Item = &Array> {
        let shared = self.shared.iter().flatten().flat_map(|(k, v)| [k, v]);
        let owned = self
            .owned
            .iter()
            .flatten()
            .flat_map(|o| [&o.keys, &o.values]);
        shared.chain(owned)
    }

    /// Stacks caches forked from the same one along the batch axis, with
    /// room for `spare` more positions. Those with fewer owned positions
    /// than the longest are left-padded, counted in [`pads`](Self::pads).
    pub(crate) fn stack(mut parts: Vec<KvCache>, spare: i32) -> Result<KvCache> {
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
            let layers: Vec<Option<&Owned>> = parts
                .iter()
                .map(|p| p.owned.get(layer).and_then(Option::as_ref))
                .collect();
            if layers.iter().all(Option::is_none) {
                owned.push(None);
                continue;
            }
            // Part `p`'s slot `s` becomes slot `s + shift` of the stack. The
            // stack keeps the slots every part still has (a part that
            // dropped slots kept at least the window's worth).
            let mut start = 0;
            for (part, own) in parts.iter().zip(&layers) {
                let own = own.ok_or_else(|| empty_layer(layer))?;
                if own.start > 0 {
                    start = start.max(own.start + own_len - part.own_len);
                }
            }
            let mut keys = Vec::with_capacity(parts.len());
            let mut values = Vec::with_capacity(parts.len());
            let mut window = None;
            for (part, own) in parts.iter().zip(&layers) {
                let own = own.ok_or_else(|| empty_layer(layer))?;
                window = own.window;
                let shift = own_len - part.own_len;
                // From the part's slot `from` on, after `pad` empty slots.
                let from = (start - shift).max(0);
                let pad = (shift - start).max(0);
                let widen = |a: &Array| -> Result<Array> {
                    let filled = a.index((.., .., from - own.start..part.own_len - own.start, ..));
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
                start,
                window,
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
            discard_owned: false,
        })
    }

    /// Keeps the rows `keep` (indices into this cache's rows, in the order
    /// given) and drops the others: a finished row leaves a running batch
    /// and its slot is free at once. The owned slots that every kept row
    /// has as padding go too, so that a batch that rows keep joining and
    /// leaving holds the longest live row, not its whole history. Rotary
    /// positions (`len() - pad`) and masks are unchanged for the kept rows.
    ///
    /// # Errors
    /// [`Error::Cache`](crate::Error::Cache) for an index past the rows.
    pub(crate) fn retain_rows(&mut self, keep: &[usize]) -> Result<()> {
        let rows = self.pads.len().max(1);
        if let Some(&bad) = keep.iter().find(|&&r| r >= rows) {
            return Err(cache_err(format!("row {bad} of a cache of {rows} rows")));
        }
        let pads: Vec<i32> = keep
            .iter()
            .map(|&r| self.pads.get(r).copied().unwrap_or(0))
            .collect();
        let cut = pads.iter().copied().min().unwrap_or(0);
        let index = Array::from_slice(
            &keep.iter().map(|&r| r as i32).collect::<Vec<_>>(),
            &[keep.len() as i32],
        );
        for own in self.owned.iter_mut().flatten() {
            // Buffer slot `i` is owned slot `start + i`.
            let from = (cut - own.start).max(0);
            let select = |a: &Array| -> Result<Array> {
                let rows = a.take_axis(&index, 0)?;
                Ok(if from > 0 {
                    rows.index((.., .., from.., ..))
                } else {
                    rows
                })
            };
            own.keys = select(&own.keys)?;
            own.values = select(&own.values)?;
            own.start = (own.start - cut).max(0);
        }
        self.own_len -= cut;
        self.pads = pads.iter().map(|p| p - cut).collect();
        Ok(())
    }

    /// Bytes of keys and values this cache holds (capacity included).
    pub(crate) fn nbytes(&self) -> usize {
        self.arrays().map(Array::nbytes).sum()
    }

    /// Layer `layer`'s shared keys and values, `(kv_heads, kept, head_dim)`.
    pub(crate) fn shared(&self, layer: usize) -> Option<(&Array, &Array)> {
        self.shared.get(layer)?.as_ref().map(|(k, v)| (k, v))
    }

    /// The first owned slot `layer` still holds.
    fn start(&self, layer: usize) -> i32 {
        self.owned
            .get(layer)
            .and_then(Option::as_ref)
            .map_or(0, |o| o.start)
    }

    /// The masks for `new` positions about to be appended to `layer`,
    /// whose queries see keys up to `window` positions back (themselves
    /// included) or, without a window, all earlier ones; left padding is
    /// hidden.
    pub(crate) fn mask(&self, layer: usize, new: i32, window: Option<i32>) -> LayerMask {
        let pads: &[i32] = if self.pads.is_empty() {
            &[0]
        } else {
            &self.pads
        };
        let rows = pads.len();
        let start = self.start(layer);
        let keys = self.own_len + new - start;
        let visible = |q: i32, s: i32| s <= q && window.is_none_or(|w| q - s < w);
        let mut own = Vec::with_capacity(rows * (new * keys) as usize);
        for &pad in pads {
            for i in 0..new {
                let q = self.own_len + i;
                own.extend((start..start + keys).map(|s| s >= pad && visible(q, s)));
            }
        }
        let own = (!own.iter().all(|&v| v))
            .then(|| Array::from_slice(&own, &[rows as i32, 1, new, keys]));
        // The prefix sits before every row's padding: query slot `q` of a
        // row padded by `pad` is `q - pad` positions after the prefix.
        let shared = match (window, self.shared(layer)) {
            (Some(w), Some((k, _))) => {
                let kept = k.dim(1);
                let mut mask = Vec::with_capacity(rows * (new * kept) as usize);
                for &pad in pads {
                    for i in 0..new {
                        let after = self.own_len + i - pad;
                        mask.extend((0..kept).map(|j| after + kept - j < w));
                    }
                }
                (!mask.iter().all(|&v| v))
                    .then(|| Array::from_slice(&mask, &[rows as i32, new, kept]))
            }
            _ => None,
        };
        LayerMask { own, shared }
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
        window: Option<i32>,
    ) -> Result<(Array, Array)> {
        if self.discard_owned {
            if self.own_len != 0 {
                let what = "this cache keeps no owned positions to append after";
                return Err(cache_err(what.to_owned()));
            }
            return Ok((keys, values));
        }
        if self.owned.len() <= layer {
            self.owned.resize(layer + 1, None);
        }
        let slot = &mut self.owned[layer];
        let start = slot.as_ref().map_or(0, |o| o.start);
        // Buffer positions.
        let (at, new) = (self.own_len - start, keys.dim(2));
        let end = at + new;
        match slot {
            None if at == 0 => {
                *slot = Some(Owned::new(keys, values, window));
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
                own.keys = grow(&own.keys, &keys)?;
                own.values = grow(&own.values, &values)?;
            }
        }
        let own = slot.as_ref().expect("filled above");
        Ok((
            own.keys.index((.., .., ..end, ..)),
            own.values.index((.., .., ..end, ..)),
        ))
    }

    /// Counts `new` positions appended to every layer, and drops from
    /// windowed layers the slots no later query can see (a window's worth
    /// are kept; the copy is made once [`GROW_BY`] slots can go).
    pub(crate) fn advance(&mut self, new: i32) -> Result<()> {
        self.own_len += new;
        for own in self.owned.iter_mut().flatten() {
            let Some(window) = own.window else { continue };
            let keep = (window - 1).max(0);
            let filled = self.own_len - own.start;
            if filled - keep < GROW_BY {
                continue;
            }
            // A new buffer: a slice would keep the old one alive.
            let kept = |a: &Array| -> Result<Array> {
                let last = a.index((.., .., filled - keep..filled, ..));
                Ok(concatenate(&[last, empty_slots(a, GROW_BY)?], 2)?)
            };
            own.keys = kept(&own.keys)?;
            own.values = kept(&own.values)?;
            own.start = self.own_len - keep;
        }
        Ok(())
    }
}

/// The last `n` positions of `(kv_heads, len, head_dim)`, as an array of
/// their own.
fn last_positions(a: &Array, n: i32) -> Result<Array> {
    let len = a.dim(1);
    if len <= n {
        return Ok(a.clone());
    }
    let last = a.index((.., len - n.max(0).., ..));
    // A copy, not a view that keeps the whole prefix alive.
    Ok(concatenate(&[last, a.index((.., 0..0, ..))], 1)?)
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

#[cfg(test)]
mod tests;

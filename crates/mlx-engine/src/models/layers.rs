//! A decoder's layers, held in memory or streamed from the files one at a
//! time ([`MemoryMode::Streamed`]).
//!
//! Both decoders build a layer with the same function in either case: a
//! streamed layer is built from the arrays `block_stream::BlockStreamer`
//! hands out for its block (MLX's lazy loads, with an adapter's LoRA fused
//! where one is given), so it is checked and computed exactly as a resident
//! one, and its weights are read when the forward evaluates that layer.
//!
//! [`MemoryMode::Streamed`]: crate::MemoryMode::Streamed

use std::collections::HashMap;
use std::ops::{Deref, Range};
use std::sync::{Mutex, PoisonError};

use block_stream::{BlockLoraSource, BlockStreamer, CheckpointLoraFuser};
use mlx_rs::Array;
use st_mmap::BlockPrefix;

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, Why};
use crate::nn::cache::KvCache;
use crate::weights::memory_mode::MemoryMode;
use crate::weights::{KeyPath, StreamedBlock, WeightSource, Weights};

/// Builds layer `i` from the weights.
type LoadLayer<L> = Box<dyn Fn(&Weights<'_>, usize) -> Result<L> + Send + Sync>;

/// A decoder's layers.
pub(crate) struct Layers<L> {
    /// The layers held (all of them, or one pipeline stage's): their
    /// indices in the model, which name their weights and cache slots.
    range: Range<usize>,
    held: Held<L>,
}

enum Held<L> {
    Resident(Vec<L>),
    Streamed(Box<Stream<L>>),
}

/// How generation runs a model's forwards: what where its layers live asks
/// of it, so that generation follows a schedule and never reads the memory
/// mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Schedule {
    /// The layers are in memory: chunks may run side by side (lanes), and
    /// each prefill group is a forward of its own, evaluated before the
    /// next one runs.
    Independent,
    /// One chunk at a time, each as large as the batch size allows, its
    /// prefill groups independent forwards: each chunk copies the routed
    /// experts its rows chose out of the files, so two half chunks side by
    /// side would read an expert both chose twice, and hold twice the
    /// experts at once (a mixture of experts whose experts stay in the
    /// files and are not multiplied where they lie).
    WholeChunks,
    /// The layers are read from the files at each forward: one chunk at a
    /// time, on the worker, and a chunk's prefill groups in one forward
    /// layer by layer, so that each layer is read once for all of them.
    LayerByLayer,
}

impl Schedule {
    /// The lanes to run, of `wanted`.
    pub(crate) fn lanes(self, wanted: usize) -> usize {
        match self {
            Schedule::Independent => wanted,
            Schedule::WholeChunks | Schedule::LayerByLayer => 1,
        }
    }

    /// Rows per chunk for `conversations` at `batch_size` over `lanes`:
    /// the batch size, or smaller and even where that gives every lane a
    /// chunk and the schedule allows it.
    pub(crate) fn chunk_rows(self, batch_size: usize, conversations: usize, lanes: usize) -> usize {
        let even = conversations.div_ceil(lanes.max(1));
        match self {
            Schedule::Independent => batch_size.min(even).max(1),
            Schedule::WholeChunks | Schedule::LayerByLayer => batch_size.max(1),
        }
    }
}

/// What builds a streamed layer each time it runs.
pub(crate) struct Stream<L> {
    streamer: Mutex<BlockStreamer>,
    prefix: BlockPrefix,
    source: WeightSource,
    load: LoadLayer<L>,
}

/// One forward in progress, as a decoder keeps it between layers.
pub(crate) trait Forward {
    /// Ends the forward after the last layer: advances its cache past its
    /// positions and returns its hidden state.
    fn finish(self) -> Result<Array>;
}

/// A layer while it runs: borrowed from memory, or built for this forward
/// and dropped after it.
pub(crate) enum LayerRef<'a, L> {
    Borrowed(&'a L),
    Owned(L),
}

impl<L> Deref for LayerRef<'_, L> {
    type Target = L;

    fn deref(&self) -> &L {
        match self {
            LayerRef::Borrowed(l) => l,
            LayerRef::Owned(l) => l,
        }
    }
}

impl<L> Layers<L> {
    /// Layers `range` under `layers` (`model.layers`): built now, or, when
    /// `w` streams them, checked now (each built once from unread loads,
    /// so that a checkpoint that does not fit its config fails here and not
    /// in the first forward) and built again at each use.
    pub(crate) fn load(
        w: &Weights<'_>,
        layers: &KeyPath,
        range: Range<usize>,
        load: impl Fn(&Weights<'_>, usize) -> Result<L> + Send + Sync + 'static,
    ) -> Result<Layers<L>> {
        if w.plan.memory != MemoryMode::Streamed {
            let held = range.clone().map(|i| load(w, i)).collect::<Result<_>>()?;
            return Ok(Layers {
                range,
                held: Held::Resident(held),
            });
        }
        let prefix = layers.children();
        let streamer = BlockStreamer::from_set(w.set.clone(), prefix.as_str())
            .map_err(|e| stream_error(w.dir, e))?
            .with_fuser(CheckpointLoraFuser::new(prefix.as_str(), w.quant.clone()));
        let stream = Stream {
            streamer: Mutex::new(streamer),
            prefix,
            source: w.source.clone(),
            load: Box::new(load),
        };
        for i in range.clone() {
            drop(stream.layer(i)?);
        }
        Ok(Layers {
            range,
            held: Held::Streamed(Box::new(stream)),
        })
    }

    /// Whether `f` holds for any layer held in memory (none when the
    /// layers are streamed, built anew at each use).
    pub(crate) fn any_held(&self, f: impl Fn(&L) -> bool) -> bool {
        match &self.held {
            Held::Resident(layers) => layers.iter().any(f),
            Held::Streamed(_) => false,
        }
    }

    /// Whether the layers are read from the files at each forward.
    fn streamed(&self) -> bool {
        matches!(self.held, Held::Streamed(_))
    }

    /// How generation runs forwards over these layers.
    pub(crate) fn schedule(&self) -> Schedule {
        if self.streamed() {
            Schedule::LayerByLayer
        } else {
            Schedule::Independent
        }
    }

    /// The hidden states of independent forwards of `tokens` over
    /// `caches` (one cache each, extended; e.g. the prefill groups of a
    /// chunk): `begin` starts a forward before the first layer, `step(i,
    /// layer, pass)` applies layer `i` to one and returns what it computed
    /// from the layer's weights. Layer by layer: streamed, each layer is
    /// read once for all the forwards, and each forward's outputs are
    /// evaluated before the next one runs (so only one forward's
    /// activations exist at a time) and before the layer goes; resident,
    /// the steps only build the lazy graph, which the caller evaluates.
    pub(crate) fn forward_each<'c, P: Forward>(
        &self,
        tokens: &[Array],
        caches: &'c mut [KvCache],
        begin: impl Fn(&Array, &'c mut KvCache) -> Result<P>,
        mut step: impl FnMut(usize, &L, &mut P) -> Result<Vec<Array>>,
    ) -> Result<Vec<Array>> {
        let mut passes = tokens
            .iter()
            .zip(caches.iter_mut())
            .map(|(tokens, cache)| begin(tokens, cache))
            .collect::<Result<Vec<_>>>()?;
        for i in self.range.clone() {
            let layer = self.get(i)?;
            for pass in passes.iter_mut() {
                let outputs = step(i, &layer, pass)?;
                if self.streamed() {
                    evaluate(Why::Layer, &outputs)?;
                }
            }
        }
        passes.into_iter().map(Forward::finish).collect()
    }

    /// Layer `i` (an index in the model, within the range held), for one
    /// forward.
    fn get(&self, i: usize) -> Result<LayerRef<'_, L>> {
        match &self.held {
            Held::Resident(layers) => Ok(LayerRef::Borrowed(&layers[i - self.range.start])),
            Held::Streamed(stream) => Ok(LayerRef::Owned(stream.layer(i)?)),
        }
    }
}

impl<L> Stream<L> {
    /// Layer `i` built from its block's lazy loads, adapted by the LoRA
    /// sources.
    fn layer(&self, i: usize) -> Result<L> {
        let sources: Vec<&BlockLoraSource> = self.source.lora.iter().collect();
        let weights = self
            .streamer
            .lock()
            // A panic while it was held left no half-made state behind: the
            // streamer's only mutable state is a cache of lazy loads.
            .unwrap_or_else(PoisonError::into_inner)
            .block_weights(i, &sources)
            .map_err(|e| stream_error(&self.source.dir, e))?;
        let params: HashMap<String, Array> = weights.into_iter().collect();
        let w = self.source.streamed(StreamedBlock {
            prefix: &self.prefix,
            index: i,
            params: &params,
        });
        (self.load)(&w, i)
    }
}

fn stream_error(dir: &std::path::Path, source: block_stream::Error) -> Error {
    Error::Stream {
        dir: dir.to_path_buf(),
        source: Box::new(source),
    }
}

#[cfg(test)]
mod tests {
    use super::Schedule;

    /// Independent forwards cut a small request into even chunks, one per
    /// lane; the schedules that read per chunk keep whole batches.
    #[test]
    fn only_independent_forwards_split_a_request_for_the_lanes() {
        assert_eq!(Schedule::Independent.chunk_rows(8, 8, 2), 4);
        assert_eq!(Schedule::Independent.chunk_rows(8, 64, 2), 8);
        assert_eq!(Schedule::Independent.chunk_rows(8, 1, 2), 1);
        assert_eq!(Schedule::WholeChunks.chunk_rows(8, 8, 2), 8);
        assert_eq!(Schedule::LayerByLayer.chunk_rows(8, 8, 1), 8);
        assert_eq!(Schedule::Independent.lanes(2), 2);
        assert_eq!(Schedule::WholeChunks.lanes(2), 1);
        assert_eq!(Schedule::LayerByLayer.lanes(2), 1);
    }
}

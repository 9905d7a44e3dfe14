//! Chunks of a `generate` call run side by side, each on its own thread.
//!
//! On the CPU, MLX runs a stream's work on one thread, so between matrix
//! products (which OpenBLAS spreads over the cores) the other cores wait:
//! the element-wise work, attention's small products and the reductions of
//! a prefill are most of a step's time and run on one core. A *lane* is a
//! thread with its own MLX stream (MLX ≥ 0.32 gives every thread its own
//! default stream and command encoder) that takes the next chunk, prefills
//! and decodes it, and returns its tokens. With two lanes both cores do a
//! chunk's whole work. OpenBLAS's thread count is the process's and cannot
//! safely change while products run, so sharing the cores out between the
//! lanes is the program's call, at its start ([`share_blas_threads`]).
//!
//! What lanes share is read-only and computed before they start: the
//! model's weights (evaluated at load) and the prefix cache (evaluated when
//! the prefix is prefilled). An array is computed on the stream that built
//! it, so a lane builds and evaluates only its own graphs. The logits
//! processor is the caller's and not `Send`: a lane with one to apply sends
//! its evaluated logits to the calling thread, which applies it and picks
//! the tokens ([`Coordinator`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use mlx_rs::Array;

use crate::models::Model;
use crate::nn::cache::KvCache;

/// How many chunks an engine runs side by side unless told
/// ([`EngineConfig::lanes`](crate::EngineConfig::lanes)): two on the CPU
/// with at least two cores, the layers in memory (resident, or with the
/// tables mapped: measured on SmolLM2 and E2B's shapes, docs/benchmarks.md
/// "Lanes"); one otherwise: the GPU runs a stream's work over
/// its own cores, and streamed layers run one chunk at a time.
pub fn default_lanes(device: mlx_support::ComputeDevice, memory: crate::MemoryMode) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    if device == mlx_support::ComputeDevice::Cpu && memory != crate::MemoryMode::Streamed {
        cores.min(2)
    } else {
        1
    }
}

/// Gives each of `lanes` lanes an equal share of the cores for OpenBLAS's
/// matrix products (at least one thread each); returns OpenBLAS's thread
/// count before, or `None` without OpenBLAS. Call it while no MLX work
/// runs on any other thread (at the start of `main`, or before the engine
/// starts): the count is the process's, and changing it while a product
/// ran on another thread changed that product's results here (parity
/// tests run in parallel with an engine that changed it failed). Without
/// it, the lanes' products each spread over all the cores and wait for
/// each other: on two cores, SmolLM2 classification took 8.6 and 9.5 s on
/// two lanes of two threads, 9.0 and 10.1 s on one lane, 7.7 and 7.8 s on
/// two lanes of one thread (an early version; docs/benchmarks.md, "Lanes",
/// has the later figures).
pub fn share_blas_threads(lanes: usize) -> Option<usize> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    mlx_support::set_blas_threads((cores / lanes.max(1)).max(1))
}

/// What the lanes read: the model and the prefix cache, both evaluated.
pub(crate) struct Shared<'a> {
    pub model: &'a Model,
    pub prefix_cache: &'a KvCache,
    pub eos: &'a [u32],
}

// SAFETY: `Shared` is only built by `generate_batch` for lanes, which only
// read it. Model and KvCache hold MLX arrays: reference-counted handles
// (atomic counts) to buffers that were evaluated on the worker before the
// lanes start (the model at load, the prefix cache in `GenState::new`), so
// a lane uses them as inputs to its own graphs and never computes them (an
// unevaluated one would be an MLX error in the lane, "no stream in current
// thread", not a race). Nothing in Model changes through `&self` except the
// layer streamer of `MemoryMode::Streamed`, behind a Mutex, and lanes are
// not used when layers are streamed.
unsafe impl Sync for Shared<'_> {}

/// A lane's request to the calling thread.
enum Request {
    /// The tokens to pick from these (evaluated) logits.
    Pick(Array, Sender<crate::Result<Vec<i32>>>),
    /// Chunk `index` finished.
    Done(usize, crate::Result<Vec<Vec<u32>>>),
}

/// The calling thread's side: what it does for the lanes.
pub(crate) trait Coordinator {
    /// Picks each row's next token from its last logits (the processor's
    /// job, on this thread).
    fn pick(&mut self, logits: &Array) -> crate::Result<Vec<i32>>;
    /// Takes chunk `index`'s tokens; `false` (an error) stops the lanes:
    /// no chunk starts after it, and those running end at their next pick.
    fn finish(&mut self, index: usize, tokens: crate::Result<Vec<Vec<u32>>>) -> bool;
}

/// Runs `chunks` on `lanes` threads: each takes the next chunk and calls
/// `run(shared, chunk, pick)`, where `pick` picks the next tokens from a
/// step's logits through `coordinator.pick` on this thread (for a
/// processor that must stay here; `run` may pick in the lane instead).
/// Returns when every lane has stopped; `coordinator.finish` has then seen
/// every chunk that ran. If no lane thread can be started, the chunks run
/// here, one after another.
pub(crate) fn run<C, F>(
    lanes: usize,
    chunks: &[&[usize]],
    shared: &Shared<'_>,
    coordinator: &mut C,
    run: F,
) where
    C: Coordinator,
    F: Fn(
            &Shared<'_>,
            &[usize],
            &mut dyn FnMut(&Array) -> crate::Result<Vec<i32>>,
        ) -> crate::Result<Vec<Vec<u32>>>
        + Sync,
{
    let next = AtomicUsize::new(0);
    let (tx, rx): (Sender<Request>, Receiver<Request>) = unbounded();
    std::thread::scope(|scope| {
        let mut started = 0;
        for lane in 0..lanes {
            let tx = tx.clone();
            let (next, run) = (&next, &run);
            let spawned = std::thread::Builder::new()
                .name(format!("mlx-engine-lane-{lane}"))
                .spawn_scoped(scope, move || loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    let Some(chunk) = chunks.get(index) else {
                        break;
                    };
                    let mut remote = |logits: &Array| -> crate::Result<Vec<i32>> {
                        // Computed here, on the lane's stream: the caller's
                        // thread only reads it.
                        logits.eval()?;
                        let (reply_tx, reply_rx) = bounded(1);
                        tx.send(Request::Pick(logits.clone(), reply_tx))
                            .map_err(|_| crate::Error::LanesStopped)?;
                        reply_rx.recv().map_err(|_| crate::Error::LanesStopped)?
                    };
                    let tokens = run(shared, chunk, &mut remote);
                    if tx.send(Request::Done(index, tokens)).is_err() {
                        break;
                    }
                });
            match spawned {
                Ok(_) => started += 1,
                // Fewer lanes then; the chunks still all run.
                Err(e) => tracing::warn!("could not start a lane: {e}"),
            }
        }
        drop(tx);
        if started == 0 {
            for (index, chunk) in chunks.iter().enumerate() {
                let tokens = run(shared, chunk, &mut |logits| coordinator.pick(logits));
                if !coordinator.finish(index, tokens) {
                    break;
                }
            }
            return;
        }
        let mut stopped = false;
        for request in rx {
            match request {
                Request::Pick(logits, reply) => {
                    // After an error, the lanes' chunks end at their next step.
                    let picked = if stopped {
                        Err(crate::Error::LanesStopped)
                    } else {
                        coordinator.pick(&logits)
                    };
                    let _ = reply.send(picked);
                }
                Request::Done(index, tokens) => {
                    if !stopped && !coordinator.finish(index, tokens) {
                        stopped = true;
                        next.store(chunks.len(), Ordering::Relaxed);
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::default_lanes;
    use crate::MemoryMode;
    use mlx_support::ComputeDevice;

    #[test]
    fn two_lanes_on_the_cpu_unless_layers_are_streamed() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let two = if cores >= 2 { 2 } else { 1 };
        assert_eq!(default_lanes(ComputeDevice::Cpu, MemoryMode::Resident), two);
        assert_eq!(
            default_lanes(ComputeDevice::Cpu, MemoryMode::MappedTables),
            two
        );
        assert_eq!(default_lanes(ComputeDevice::Cpu, MemoryMode::Streamed), 1);
        assert_eq!(default_lanes(ComputeDevice::Gpu, MemoryMode::Resident), 1);
    }
}

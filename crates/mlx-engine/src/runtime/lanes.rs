//! The engine's executor: chunks of a `generate` call run side by side on
//! lane threads the engine starts once, with the model loaded.
//!
//! On the CPU, MLX runs a stream's work on one thread, so between matrix
//! products (which OpenBLAS spreads over the cores) the other cores wait:
//! the element-wise work, attention's small products and the reductions of
//! a prefill are most of a step's time and run on one core. A *lane* is a
//! thread with its own MLX stream (MLX ≥ 0.32 gives every thread its own
//! default stream and command encoder) that takes the next chunk, prefills
//! and decodes it, and returns its tokens. With two lanes both cores do a
//! chunk's whole work. OpenBLAS's thread count is the process's and cannot
//! safely change while products run, so the executor shares the cores out
//! between its lanes once, before they start, when the configuration asks
//! ([`BlasThreads`]).
//!
//! What lanes read is a [`ForLanes`]: the model and the prefix cache,
//! evaluated before any lane sees them. An array is computed on the stream
//! that built it, so a lane builds and evaluates only its own graphs. The
//! logits processor is the caller's and not `Send`: a lane with one to
//! apply sends its evaluated logits to the calling thread, which applies it
//! and picks the tokens ([`Coordinator`]).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use mlx_rs::Array;

use crate::evaluation::{evaluate, Why};
use crate::models::{Model, Schedule};
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

/// Whether the engine sets OpenBLAS's thread count for its lanes
/// ([`EngineConfig::blas_threads`](crate::EngineConfig::blas_threads)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BlasThreads {
    /// Leave the count as the process has it (OpenBLAS's default: every
    /// core), for programs that run other MLX work beside the engine.
    #[default]
    Unchanged,
    /// Give each lane an equal share of the cores (at least one thread),
    /// once, before the lanes start. The count is the process's: the first
    /// engine in a process that asks sets it, and later ones keep it (a
    /// change while a product runs on another thread changed that
    /// product's results here). Without it, the lanes' products each
    /// spread over all the cores and wait for each other: on two cores,
    /// SmolLM2 classification took 8.6 and 9.5 s on two lanes of two
    /// threads, 7.7 and 7.8 s on two lanes of one thread (an early
    /// version; docs/benchmarks.md, "Lanes", has the later figures).
    SharedByLanes,
}

/// The thread count the first engine asking for [`BlasThreads::SharedByLanes`]
/// set, for the process's life.
static BLAS_SHARE: OnceLock<Option<usize>> = OnceLock::new();

/// Sets OpenBLAS's thread count for `lanes` lanes the first time it is
/// asked in this process; returns the count in force for the kernels.
fn share_blas_threads(lanes: usize) -> Option<usize> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let wanted = (cores / lanes.max(1)).max(1);
    let set = *BLAS_SHARE.get_or_init(|| {
        mlx_support::set_blas_threads(wanted)?;
        Some(wanted)
    });
    if set.is_some_and(|threads| threads != wanted) {
        tracing::warn!(
            wanted,
            set,
            "OpenBLAS's threads were shared out by an earlier engine; kept"
        );
    }
    set
}

/// What the lanes read: the model and the prefix cache, both evaluated.
/// The only way to build one is [`ForLanes::new`], which makes sure of it.
pub(crate) struct ForLanes {
    model: Arc<Model>,
    prefix_cache: Arc<KvCache>,
    eos: Arc<[u32]>,
}

// SAFETY: a `ForLanes` gives only shared references to what it holds, and
// `new` builds one only for a model that does not stream its layers (the
// one part of a Model that changes through `&self`, its layer streamer, is
// then unused) and after evaluating the prefix cache; the model's weights
// are evaluated at load in every other mode. MLX arrays are
// reference-counted handles (atomic counts) to those computed buffers, so
// a lane uses them as inputs to its own graphs and never computes them.
// Gathered table rows and routed experts are read through `st-mmap`'s set,
// which is Sync.
unsafe impl Sync for ForLanes {}
// SAFETY: as for Sync: what moves to a lane is a reference-counted view of
// evaluated, read-only arrays. The worker holds the model and the prefix
// cache for the engine's life, and a lane lets go of its view before it
// reports its chunk done (`serve`), so the last reference to either is
// never dropped on a lane.
unsafe impl Send for ForLanes {}

impl ForLanes {
    /// The lanes' view of `model` and `prefix_cache`, or `None` when the
    /// model's schedule runs one chunk at a time, on the worker.
    pub(crate) fn new(
        model: &Arc<Model>,
        prefix_cache: &Arc<KvCache>,
        eos: &[u32],
    ) -> crate::Result<Option<ForLanes>> {
        if model.schedule() == Schedule::LayerByLayer {
            return Ok(None);
        }
        prefix_cache.evaluate()?;
        Ok(Some(ForLanes {
            model: model.clone(),
            prefix_cache: prefix_cache.clone(),
            eos: eos.into(),
        }))
    }

    fn view(&self) -> View<'_> {
        View {
            model: &self.model,
            prefix_cache: &self.prefix_cache,
            eos: &self.eos,
        }
    }
}

/// What a chunk reads, on a lane or on the worker.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub model: &'a Model,
    pub prefix_cache: &'a KvCache,
    pub eos: &'a [u32],
}

/// Picks a step's next tokens from its evaluated logits.
pub(crate) type Pick<'a> = &'a mut dyn FnMut(&Array) -> crate::Result<Vec<i32>>;

/// Picks tokens from a step's evaluated logits on the lane itself.
pub(crate) type LanePick = fn(&Array) -> crate::Result<Vec<i32>>;

/// A chunk's work for a lane: its tokens, given how to pick them.
pub(crate) type ChunkWork =
    Box<dyn FnOnce(View<'_>, Pick<'_>) -> crate::Result<Vec<Vec<u32>>> + Send>;

/// A lane's message to the calling thread.
enum Request {
    /// The tokens to pick from these (evaluated) logits.
    Pick(Array, Sender<crate::Result<Vec<i32>>>),
    /// Chunk `index` finished.
    Done(usize, crate::Result<Vec<Vec<u32>>>),
}

/// One chunk sent to the lanes.
struct Job {
    index: usize,
    work: ChunkWork,
    shared: Arc<ForLanes>,
    /// How the lane picks tokens itself, when no processor has to be
    /// applied on the calling thread.
    lane_pick: Option<LanePick>,
    /// Set when a chunk failed: the rest end without running.
    stopped: Arc<AtomicBool>,
    replies: Sender<Request>,
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

/// The lane threads, started with the engine and ended with it.
pub(crate) struct Executor {
    jobs: Option<Sender<Job>>,
    lanes: Vec<JoinHandle<()>>,
}

impl Executor {
    /// Starts `lanes` lane threads (none for one lane: the worker runs its
    /// chunks itself), after sharing OpenBLAS's threads out among them
    /// when `blas` asks. A lane that cannot be started is a warning: the
    /// chunks still all run, on fewer lanes.
    pub(crate) fn start(lanes: usize, blas: BlasThreads) -> Executor {
        if blas == BlasThreads::SharedByLanes {
            let threads = share_blas_threads(lanes);
            tracing::debug!(?threads, lanes, "OpenBLAS threads for the lanes");
        }
        if lanes <= 1 {
            return Executor {
                jobs: None,
                lanes: Vec::new(),
            };
        }
        let (tx, rx) = unbounded::<Job>();
        let handles: Vec<JoinHandle<()>> = (0..lanes)
            .filter_map(|lane| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("mlx-engine-lane-{lane}"))
                    .spawn(move || serve(&rx))
                    .map_err(|e| tracing::warn!("could not start a lane: {e}"))
                    .ok()
            })
            .collect();
        Executor {
            jobs: (!handles.is_empty()).then_some(tx),
            lanes: handles,
        }
    }

    /// How many chunks run at once.
    pub(crate) fn lanes(&self) -> usize {
        self.lanes.len().max(1)
    }

    /// Runs every chunk of `works` on the lanes (in order of their index,
    /// each on the next free lane) and hands the results to `coordinator`
    /// as they come, answering the lanes' picks meanwhile. Returns when
    /// every chunk has been finished or skipped; `coordinator.finish` has
    /// then seen every chunk that ran. Without lanes, for a single chunk,
    /// or for a model that streams its layers, the chunks run here, one
    /// after another.
    pub(crate) fn run<C: Coordinator>(
        &self,
        here: View<'_>,
        shared: (&Arc<Model>, &Arc<KvCache>),
        works: Vec<ChunkWork>,
        lane_pick: Option<LanePick>,
        coordinator: &mut C,
    ) {
        let lanes = match &self.jobs {
            Some(jobs) if works.len() > 1 => {
                ForLanes::new(shared.0, shared.1, here.eos).map(|view| view.map(|v| (jobs, v)))
            }
            _ => Ok(None),
        };
        let (jobs, shared) = match lanes {
            Ok(Some(lanes)) => lanes,
            Ok(None) => {
                for (index, work) in works.into_iter().enumerate() {
                    let tokens = work(here, &mut |logits| coordinator.pick(logits));
                    if !coordinator.finish(index, tokens) {
                        break;
                    }
                }
                return;
            }
            Err(e) => {
                coordinator.finish(0, Err(e));
                return;
            }
        };
        let shared = Arc::new(shared);
        let stopped = Arc::new(AtomicBool::new(false));
        let (replies, requests) = unbounded();
        let mut pending = 0;
        for (index, work) in works.into_iter().enumerate() {
            let job = Job {
                index,
                work,
                shared: shared.clone(),
                lane_pick,
                stopped: stopped.clone(),
                replies: replies.clone(),
            };
            if jobs.send(job).is_err() {
                // Every lane has ended (each catches its chunks' panics,
                // so only a failed start leaves none): the chunk's error.
                coordinator.finish(index, Err(crate::Error::LanesStopped));
                break;
            }
            pending += 1;
        }
        drop(replies);
        let mut failed = false;
        while pending > 0 {
            let Ok(request) = requests.recv() else {
                break;
            };
            match request {
                Request::Pick(logits, reply) => {
                    // After an error, the lanes' chunks end at their next step.
                    let picked = if failed {
                        Err(crate::Error::LanesStopped)
                    } else {
                        coordinator.pick(&logits)
                    };
                    let _ = reply.send(picked);
                }
                Request::Done(index, tokens) => {
                    pending -= 1;
                    if !failed && !coordinator.finish(index, tokens) {
                        failed = true;
                        stopped.store(true, Ordering::Relaxed);
                    }
                }
            }
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        // The lanes end when the queue closes; each finishes its chunk
        // first, and no chunk outlives the `run` that sent it.
        self.jobs.take();
        for lane in self.lanes.drain(..) {
            let _ = lane.join();
        }
    }
}

/// A lane's loop: runs chunks until the executor closes its queue.
fn serve(jobs: &Receiver<Job>) {
    for job in jobs {
        let Job {
            index,
            work,
            shared,
            lane_pick,
            stopped,
            replies,
        } = job;
        let tokens = if stopped.load(Ordering::Relaxed) {
            Err(crate::Error::LanesStopped)
        } else {
            let mut remote = |logits: &Array| -> crate::Result<Vec<i32>> {
                // Computed here, on the lane's stream: the caller's thread
                // only reads it.
                evaluate(Why::Step, [logits])?;
                let (reply_tx, reply_rx) = bounded(1);
                replies
                    .send(Request::Pick(logits.clone(), reply_tx))
                    .map_err(|_| crate::Error::LanesStopped)?;
                reply_rx.recv().map_err(|_| crate::Error::LanesStopped)?
            };
            let mut local = |logits: &Array| {
                lane_pick.map_or(Err(crate::Error::LanesStopped), |pick| pick(logits))
            };
            let pick: Pick<'_> = if lane_pick.is_some() {
                &mut local
            } else {
                &mut remote
            };
            // A panic in a chunk is that chunk's error; the lane serves on.
            catch_unwind(AssertUnwindSafe(|| work(shared.view(), pick)))
                .unwrap_or_else(|p| Err(crate::Error::LanePanicked(crate::error::panic_message(p))))
        };
        // Let go of the model before saying the chunk is done: once the
        // caller has every chunk's answer, no lane holds any of it, so the
        // model is always dropped on the worker.
        drop(shared);
        // The caller waits for one Done per chunk it sent.
        let _ = replies.send(Request::Done(index, tokens));
    }
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

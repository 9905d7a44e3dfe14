//! `MlxEngine`: one named worker thread owns the model, the tokenizer and the
//! shared prefix's cache; callers send it commands and wait for replies.
//!
//! Failure policy: a failed load is reported to `ensure_loaded` and to every
//! later call; an error in one request fails that request only; a panic in a
//! job becomes that job's error and the worker keeps serving; after `close`
//! (or if the worker is gone) every call gets `EngineError::Closed` at once.
//! Nobody waits forever.

mod adapter_calls;
mod start;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{unbounded, Sender};

use crate::error::{panic_message, EngineError};
use crate::models::Model;
use crate::runtime::generate::{generate_batch, GenState, Generation};
use crate::runtime::options::{EngineConfig, GenerateOptions};
use crate::runtime::serving::grammar::Grammars;
use crate::runtime::serving::scheduler::Scheduler;
use crate::runtime::serving::{
    Completion, CompletionStream, Counters, Pending, ServingMetrics, SharedCounters, StreamEvent,
};
use crate::tokenizer::{Message, Tokenizer};

/// What a job submitted with [`MlxEngine::submit`] gets to work with.
pub struct Worker {
    model: Arc<Model>,
    tokenizer: Tokenizer,
    state: GenState,
    serving: Scheduler,
    /// Whether adapters loaded later are hashed (for the prefix folder).
    adapter_digests: bool,
}

impl Worker {
    /// One serving step; a panic in it fails the requests it held, and
    /// the worker goes on.
    fn serve_step(&mut self) {
        let Worker {
            model,
            tokenizer,
            serving,
            ..
        } = self;
        let stepped = catch_unwind(AssertUnwindSafe(|| serving.step(model, tokenizer)));
        if let Err(p) = stepped {
            serving.fail_all(&EngineError::Panicked(panic_message(p)));
        }
    }

    /// The loaded model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Its tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The shared prefix's token ids (the prefix messages rendered without
    /// a generation prompt); empty without prefix messages.
    pub fn prefix_tokens(&self) -> &[u32] {
        self.state.prefix_tokens()
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

/// A job for the worker, given the loaded worker or the load's error.
type Job = Box<dyn FnOnce(Result<&mut Worker, &EngineError>) + Send>;

enum Command {
    Run(Job),
    Serve(Box<Pending>),
    Close,
}

/// A reply that can be waited for (`wait`) or awaited (it is a `Future`,
/// independent of any async runtime).
#[derive(Debug)]
pub struct Reply<T>(oneshot::Receiver<Result<T, EngineError>>);

impl<T> Reply<T> {
    /// Blocks until the worker answers.
    pub fn wait(self) -> Result<T, EngineError> {
        self.0.recv().unwrap_or(Err(EngineError::Closed))
    }

    fn ready(value: Result<T, EngineError>) -> Reply<T> {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(value);
        Reply(rx)
    }
}

impl<T> std::future::Future for Reply<T> {
    type Output = Result<T, EngineError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0)
            .poll(cx)
            .map(|r| r.unwrap_or(Err(EngineError::Closed)))
    }
}

/// The worker's queue and thread.
#[derive(Debug)]
struct Running {
    tx: Sender<Command>,
    handle: JoinHandle<()>,
}

/// Batched generation on a worker thread that owns MLX.
#[derive(Debug)]
pub struct MlxEngine {
    /// The worker's thread: a call from it would wait for itself.
    worker: std::thread::ThreadId,
    /// The worker's queue and thread, until the engine is closed.
    running: Mutex<Option<Running>>,
    /// The load's result, once the worker has it.
    loaded: Arc<OnceLock<Result<(), EngineError>>>,
    /// With a distributed placement: how long blocking calls wait.
    peer_timeout: Option<std::time::Duration>,
    /// Serving's counters, shared with the worker.
    counters: SharedCounters,
    /// Serving requests that may wait.
    max_queue: usize,
    /// Structured outputs' grammar factory, once the model is loaded.
    grammars: Arc<OnceLock<Grammars>>,
}

impl MlxEngine {
    /// Starts the worker, which loads the model and computes the prefix
    /// cache. Returns at once; see [`ensure_loaded`](Self::ensure_loaded).
    pub fn new(config: EngineConfig) -> Result<MlxEngine, EngineError> {
        if config.batch_size == 0 {
            return Err(EngineError::InvalidConfig(
                "batch_size must be at least 1".into(),
            ));
        }
        let peer_timeout = config.placement.group().map(|_| config.peer_timeout);
        let (tx, rx) = unbounded::<Command>();
        let loaded = Arc::new(OnceLock::new());
        let load_result = loaded.clone();
        let counters: SharedCounters = Arc::new(Counters::default());
        let worker_counters = counters.clone();
        let max_queue = config.max_queue;
        let grammars = Arc::new(OnceLock::new());
        let worker_grammars = grammars.clone();
        let handle = std::thread::Builder::new()
            .name(config.worker_name.clone())
            .spawn(move || {
                let mut worker = catch_unwind(AssertUnwindSafe(|| {
                    start::load(config, worker_counters.clone(), &worker_grammars)
                }))
                .unwrap_or_else(|p| Err(EngineError::Panicked(panic_message(p))));
                let _ = load_result.set(worker.as_ref().map(|_| ()).map_err(Clone::clone));
                serve(&rx, &mut worker, &worker_counters);
            })
            .map_err(|e| EngineError::Spawn(e.to_string()))?;
        Ok(MlxEngine {
            worker: handle.thread().id(),
            running: Mutex::new(Some(Running { tx, handle })),
            loaded,
            peer_timeout,
            counters,
            max_queue,
            grammars,
        })
    }

    /// Waits for the load to finish; returns its error (every time) or Ok.
    pub fn ensure_loaded(&self) -> Result<(), EngineError> {
        self.wait_for_peers(self.ensure_loaded_async())
    }

    /// Waits for `reply`; with a distributed placement, at most the peer
    /// timeout, after which the engine is abandoned: its worker may be
    /// blocked in MLX waiting for a peer and cannot be stopped, so it is
    /// left to end with the process.
    fn wait_for_peers<T>(&self, reply: Reply<T>) -> Result<T, EngineError> {
        let Some(timeout) = self.peer_timeout else {
            return reply.wait();
        };
        match reply.0.recv_timeout(timeout) {
            Ok(result) => result,
            Err(oneshot::RecvTimeoutError::Timeout) => {
                // Dropping the handle detaches the thread: joining it could
                // wait forever.
                self.running.lock().expect("not poisoned").take();
                Err(EngineError::PeerTimeout { waited: timeout })
            }
            Err(oneshot::RecvTimeoutError::Disconnected) => Err(EngineError::Closed),
        }
    }

    /// [`ensure_loaded`](Self::ensure_loaded) as a [`Reply`]: resolves when
    /// the load has finished, without blocking the caller.
    pub fn ensure_loaded_async(&self) -> Reply<()> {
        if !self.is_running() {
            return Reply::ready(Err(EngineError::Closed));
        }
        if std::thread::current().id() == self.worker {
            return Reply::ready(Err(EngineError::CalledFromWorker));
        }
        if let Some(loaded) = self.loaded.get() {
            return Reply::ready(loaded.clone());
        }
        // The worker runs jobs only after loading: this one sees the result.
        self.send(|worker| worker.map(|_| ()).map_err(Clone::clone))
    }

    fn is_running(&self) -> bool {
        self.running.lock().expect("not poisoned").is_some()
    }

    fn send<T: Send + 'static>(
        &self,
        job: impl FnOnce(Result<&mut Worker, &EngineError>) -> Result<T, EngineError> + Send + 'static,
    ) -> Reply<T> {
        if std::thread::current().id() == self.worker {
            // The worker runs one job at a time: this one would wait for
            // itself. A job has the Worker to do the work directly.
            return Reply::ready(Err(EngineError::CalledFromWorker));
        }
        let (reply_tx, reply_rx) = oneshot::channel();
        let command = Command::Run(Box::new(move |worker| {
            let result = catch_unwind(AssertUnwindSafe(|| job(worker)))
                .unwrap_or_else(|p| Err(EngineError::Panicked(panic_message(p))));
            let _ = reply_tx.send(result);
        }));
        if self.post(command) {
            Reply(reply_rx)
        } else {
            Reply::ready(Err(EngineError::Closed))
        }
    }

    /// Puts `command` on the worker's queue; false once the engine is
    /// closed.
    fn post(&self, command: Command) -> bool {
        self.running
            .lock()
            .expect("not poisoned")
            .as_ref()
            .is_some_and(|running| running.tx.send(command).is_ok())
    }

    /// Runs `job` on the worker with the model and tokenizer.
    pub fn submit<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut Worker) -> T + Send + 'static,
    ) -> Reply<T> {
        self.send(move |worker| worker.map(job).map_err(Clone::clone))
    }

    /// Generates up to `options.max_tokens` tokens (greedy) for each
    /// conversation; the texts come back in the given order, with the
    /// call's throughput. See the crate docs.
    pub fn generate_async(
        &self,
        conversations: Vec<Vec<Message>>,
        options: GenerateOptions,
    ) -> Reply<Generation> {
        let mut options = options;
        self.send(move |worker| {
            let worker = worker.map_err(Clone::clone)?;
            generate_batch(
                &worker.model,
                &worker.tokenizer,
                &mut worker.state,
                &conversations,
                &mut options,
            )
        })
    }

    /// Blocking [`generate_async`](Self::generate_async).
    pub fn generate(
        &self,
        conversations: Vec<Vec<Message>>,
        options: GenerateOptions,
    ) -> Result<Generation, EngineError> {
        self.wait_for_peers(self.generate_async(conversations, options))
    }

    /// Answers `completion` as a stream of tokens, decoded together with
    /// the other requests running (continuous batching; see
    /// [`Completion`]). Returns at once; the request waits for a slot in a
    /// queue of at most [`EngineConfig::max_queue`]. Dropping the stream
    /// cancels it.
    ///
    /// # Errors
    /// [`EngineError::QueueFull`] when the queue is full,
    /// [`EngineError::InvalidRequest`] for no messages or `max_tokens` 0,
    /// [`EngineError::InvalidConfig`] with a distributed placement (serving
    /// runs in one process), [`EngineError::Closed`] after `close`. Errors
    /// of the request itself (its prompt too long, a failed forward) come
    /// as the stream's [`StreamEvent::Failed`].
    ///
    /// ```
    /// use mlx_engine::{Completion, EngineConfig, Message, MlxEngine, StreamEvent};
    ///
    /// # fn main() -> Result<(), mlx_engine::EngineError> {
    /// # let Some(fixture) = std::env::var_os("MLX_LOWMEM_SMOLLM2") else {
    /// #     eprintln!("SKIP: MLX_LOWMEM_SMOLLM2 is not set (cargo xtask fixtures)");
    /// #     return Ok(());
    /// # };
    /// # let model_dir = std::path::Path::new(&fixture).join("f32");
    /// let engine = MlxEngine::new(EngineConfig::new(model_dir).batch_size(8))?;
    /// let question = vec![Message::new("user", "What is the capital of France?")];
    /// let mut stream = engine.complete(Completion::new(question).max_tokens(12))?;
    /// let mut text = String::new();
    /// while let Some(event) = stream.blocking_next() {
    ///     match event {
    ///         StreamEvent::Token { text: piece, .. } | StreamEvent::Text(piece) => {
    ///             text.push_str(&piece)
    ///         }
    ///         StreamEvent::Finished(_) => break,
    ///         StreamEvent::Failed(e) => return Err(e),
    ///         _ => {}
    ///     }
    /// }
    /// assert!(text.contains("Paris"), "{text}");
    /// # Ok(())
    /// # }
    /// ```
    pub fn complete(&self, completion: Completion) -> Result<CompletionStream, EngineError> {
        if self.peer_timeout.is_some() {
            return Err(EngineError::InvalidConfig(
                "serving runs in one process, not with a distributed placement".into(),
            ));
        }
        if completion.messages.is_empty() {
            return Err(EngineError::InvalidRequest("no messages".into()));
        }
        if completion.max_tokens == 0 {
            return Err(EngineError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        // Compiled here, so that a schema it cannot enforce is refused at
        // once, and off the worker, which is decoding the other rows.
        let matcher = match &completion.constraint {
            None => None,
            Some(constraint) => {
                self.ensure_loaded()?;
                let grammars = self.grammars.get().ok_or(EngineError::Closed)?;
                let mut grammar = grammars.matcher(constraint)?;
                // Refused now rather than answered with JSON cut short.
                let max_tokens = completion.max_tokens;
                let shortest = grammar
                    .shortest_answer(max_tokens)
                    .map_err(|e| EngineError::UnsupportedSchema(e.to_string()))?;
                if shortest.is_none() {
                    let needed = grammar
                        .shortest_answer(8 * max_tokens + 256)
                        .ok()
                        .flatten()
                        .map_or_else(|| "longer than that".into(), |n| n.to_string());
                    return Err(EngineError::MaxTokensTooSmall { max_tokens, needed });
                }
                Some(grammar)
            }
        };
        let limit = self.max_queue;
        self.counters
            .waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                (w < limit).then_some(w + 1)
            })
            .map_err(|_| EngineError::QueueFull { limit })?;
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let command = Command::Serve(Box::new(Pending {
            completion,
            matcher,
            events,
        }));
        if !self.post(command) {
            self.counters.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::Closed);
        }
        Ok(CompletionStream { events: rx })
    }

    /// Serving's counters now: queue, running rows, tokens, prefix store.
    pub fn serving_metrics(&self) -> ServingMetrics {
        self.counters.snapshot()
    }

    /// The process's peak resident set size in bytes, from the OS (`VmHWM`
    /// on Linux, `ru_maxrss` elsewhere, whose unit differs by platform).
    pub fn peak_memory_bytes(&self) -> Option<u64> {
        mlx_support::ProcessMemory::read().peak_rss
    }

    /// MLX's own peak memory (its allocator's high-water mark), in bytes.
    pub fn mlx_peak_memory_bytes(&self) -> Reply<usize> {
        self.submit(|_| mlx_rs::memory::peak_memory().unwrap_or(0))
    }

    /// Lets queued jobs finish, then stops the worker. Later calls get
    /// [`EngineError::Closed`]. Called from a job on the worker itself, it
    /// stops the worker after that job without waiting for it.
    pub fn close(&self) {
        let Some(Running { tx, handle }) = self.running.lock().expect("not poisoned").take() else {
            return;
        };
        let _ = tx.send(Command::Close);
        // On the worker itself, the thread ends after this job: joining it
        // would wait for itself.
        if std::thread::current().id() != self.worker {
            let _ = handle.join();
        }
    }
}

impl Drop for MlxEngine {
    fn drop(&mut self) {
        self.close();
    }
}

/// The worker's loop: runs jobs and queues serving requests as they come,
/// and between them, while requests wait or run, takes serving steps.
fn serve(
    rx: &crossbeam_channel::Receiver<Command>,
    worker: &mut Result<Worker, EngineError>,
    counters: &Counters,
) {
    loop {
        let idle = worker.as_ref().map_or(true, |w| w.serving.is_idle());
        let mut next = if idle {
            match rx.recv() {
                Ok(command) => Some(command),
                Err(_) => return,
            }
        } else {
            rx.try_recv().ok()
        };
        // Requests that find the worker idle wait a moment for those sent
        // with them, so that they are prefilled together rather than each
        // after the other's step (see `EngineConfig::admission_window`).
        let gather_until = match worker.as_ref() {
            Ok(w) if idle => Some(Instant::now() + w.serving.admission_window()),
            _ => None,
        };
        while let Some(command) = next {
            match command {
                Command::Run(job) => job(worker.as_mut().map_err(|e| &*e)),
                Command::Serve(pending) => match worker.as_mut() {
                    Ok(w) => w.serving.enqueue(*pending),
                    Err(e) => {
                        counters.waiting.fetch_sub(1, Ordering::SeqCst);
                        let _ = pending.events.send(StreamEvent::Failed(e.clone()));
                    }
                },
                Command::Close => {
                    if let Ok(w) = worker.as_mut() {
                        w.serving.fail_all(&EngineError::Closed);
                    }
                    return;
                }
            }
            next = rx.try_recv().ok();
            if next.is_none() {
                let room = worker
                    .as_ref()
                    .is_ok_and(|w| w.serving.has_room_beside_waiting());
                if let Some(until) = gather_until.filter(|_| room) {
                    next = rx.recv_deadline(until).ok();
                }
            }
        }
        if let Ok(w) = worker.as_mut() {
            if !w.serving.is_idle() {
                w.serve_step();
            }
        }
    }
}

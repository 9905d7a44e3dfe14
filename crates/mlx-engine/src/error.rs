//! The crate's error type.

use std::path::PathBuf;
use std::sync::Arc;

/// Errors from loading and running models.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading a model file failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `config.json` is missing a field or has a wrong one.
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    /// The model's architecture is not implemented here.
    #[error("model_type {model_type:?} is not supported; supported: {supported:?}")]
    UnsupportedArchitecture {
        model_type: String,
        supported: &'static [&'static str],
    },
    /// A weight the architecture needs is not in the model folder's files.
    #[error("{dir}: weight {key:?} is missing")]
    MissingWeight { dir: PathBuf, key: String },
    /// A weight's shape does not fit the config.
    #[error("{path}: weight {key:?} has shape {actual:?}, the config implies {expected:?}")]
    WeightShape {
        path: PathBuf,
        key: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    /// A weight's element type is not the one its quantization reads.
    #[error("{path}: weight {key:?} holds {actual}, where {expected} are read")]
    WeightDtype {
        path: PathBuf,
        key: String,
        expected: &'static str,
        actual: String,
    },
    /// A module's weights are quantized but `config.json`'s `quantization`
    /// gives no group size and bits for it.
    #[error("{path}: {module} is quantized in the weights but `quantization` does not cover it")]
    UncoveredQuantization { path: PathBuf, module: String },
    /// A module quantized in a mode the engine reads for a mixture of
    /// experts' experts alone (MXFP4 outside the experts).
    #[error(
        "{path}: {module} is quantized as {mode}, which the engine reads for a mixture of \
         experts' experts alone; quantize it affine (mlx_lm.convert -q)"
    )]
    UnsupportedQuantization {
        path: PathBuf,
        module: String,
        mode: &'static str,
    },
    /// A weights file is invalid.
    #[error(transparent)]
    Safetensors(#[from] st_mmap::Error),

    /// Streaming a decoder layer's weights failed
    /// ([`MemoryMode::Streamed`](crate::MemoryMode::Streamed)).
    #[error("{dir}: streaming a layer: {source}")]
    Stream {
        dir: PathBuf,
        // Boxed: its LoRA errors name file, key, block and parameter, and
        // would make every `Result` of the engine that much larger.
        source: Box<block_stream::Error>,
    },
    /// An adapter served per row does not fit the model (a pair whose
    /// module is no linear layer of it, or whose shapes do not fit), or
    /// a forward's rows and its choice of adapters disagree.
    #[error("adapter {name:?} ({dir}): {message}")]
    Adapter {
        name: String,
        dir: PathBuf,
        message: String,
    },
    /// A tensor could not become an MLX array.
    #[error(transparent)]
    Tensor(#[from] mlx_support::Error),
    /// Tokenizing or rendering the chat template failed.
    #[error("tokenizer or chat template: {0}")]
    Template(String),
    /// The shared prefix alone is longer than the prompt limit.
    #[error("the prefix messages are {tokens} tokens long; the prompt limit is {limit}")]
    PrefixTooLong { tokens: usize, limit: usize },
    /// A token id outside the model's embedding table.
    #[error("token id {id} is outside the model's vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    /// The logits processor returned logits of another shape.
    #[error("the logits processor returned shape {actual:?} for logits of shape {expected:?}")]
    ProcessorShape {
        expected: Vec<i32>,
        actual: Vec<i32>,
    },
    /// The model produced NaN logits (NaN or infinite weights, or a
    /// processor that wrote NaN).
    #[error("the model produced NaN logits: its weights hold NaN or infinite values, or the logits processor wrote NaN")]
    NotFiniteLogits,
    /// The grammar engine refused a step of a constrained row.
    #[error("structured output failed: {0}")]
    Constraint(String),
    /// A lane lost the thread that applies the logits processor (it
    /// stopped on another chunk's error).
    #[error("the generation stopped while a chunk waited for its tokens to be picked")]
    LanesStopped,
    /// A chunk's work panicked on its lane (the lane serves on).
    #[error("a chunk panicked on its lane: {0}")]
    LanePanicked(String),
    /// A key/value cache used against its invariants (a bug in the caller
    /// of [`KvCache`](crate::KvCache)).
    #[error("key/value cache: {0}")]
    Cache(String),
    /// A rank of a distributed placement disagrees with the others, or an
    /// exchange with a peer failed (a peer rank that exited closes its
    /// sockets: MLX reports "connection to a peer was lost").
    #[error("rank {rank}: {message}")]
    Distributed { rank: usize, message: String },
    /// The ranks of a group loaded another model than rank 0: `file` of
    /// rank `other`'s model folder (a weights file, `config.json`, the
    /// tokenizer, its config, the chat template or the generation config)
    /// is not rank 0's. Every rank gets this error at load.
    #[error(
        "rank {rank}: rank {other} loaded another model than rank 0: its {file} {how} \
         (start every rank on the same model folder)"
    )]
    DifferentModel {
        rank: usize,
        other: usize,
        file: String,
        how: String,
    },
    /// A pipeline stage was asked for a part of the model another rank
    /// holds (a bug in the caller of the model).
    #[error("{what} is held by another pipeline stage")]
    NotOnThisStage { what: &'static str },
    /// A setting (an environment variable) holds a value it cannot take.
    #[error("{name}={value:?} is not a setting: expected {expected}")]
    Setting {
        name: &'static str,
        value: String,
        expected: &'static str,
    },
    /// Adapters fused into layers as they are read were given with a
    /// memory mode that does not stream the layers.
    #[error(
        "LoRA on the fly needs MemoryMode::Streamed, not {memory:?} \
         (fuse the adapter into the folder with adapter-fuse instead)"
    )]
    AdaptersNeedStreamedLayers { memory: crate::MemoryMode },
    /// An MLX operation failed.
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    /// One of the project's CPU kernels refused a product (a bug in the
    /// engine's choice of kernel: it asks only for products they take).
    #[error("CPU kernel: {0}")]
    Kernel(#[from] cpu_kernels::Error),
    /// An adapter shipped compressed (the adapter codec's `.zst`) could
    /// not be decoded; the codec's error names the file.
    #[error(transparent)]
    Codec(#[from] adapter_codec::Error),
    /// An array's elements could not be read on the host.
    #[error("reading {what} on the host: {reason}")]
    HostRead { what: &'static str, reason: String },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the engine. Cloneable: one load error reaches every caller.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The configuration cannot work (e.g. batch size 0).
    #[error("invalid engine configuration: {0}")]
    InvalidConfig(String),
    /// The worker thread could not be started.
    #[error("cannot start the worker thread: {0}")]
    Spawn(String),
    /// Loading the model failed; every call reports it.
    #[error("loading the model failed: {0}")]
    Load(Arc<Error>),
    /// A conversation does not start with the engine's prefix messages.
    #[error("conversation {index} does not start with the engine's prefix messages")]
    PrefixMismatch { index: usize },
    /// A conversation has nothing after the prefix messages to answer.
    #[error("conversation {index} is only the engine's prefix messages: nothing to answer")]
    NothingAfterPrefix { index: usize },
    /// A conversation's prompt is longer than the engine allows.
    #[error("conversation {index} is {tokens} tokens long; the limit is {limit} (EngineConfig::max_prompt_tokens)")]
    PromptTooLong {
        index: usize,
        tokens: usize,
        limit: usize,
    },
    /// A blocking call was made from a job running on the worker itself,
    /// which would wait for itself forever.
    #[error("called from a job on the engine's own worker thread, which would wait for itself; use the Worker the job receives")]
    CalledFromWorker,
    /// Generating failed for this request.
    #[error("generation failed: {0}")]
    Generate(Arc<Error>),
    /// A job panicked on the worker (the worker goes on).
    #[error("a job panicked on the worker: {0}")]
    Panicked(String),
    /// The engine was closed, or its worker is gone.
    #[error("the engine is closed")]
    Closed,
    /// The serving queue holds `limit` requests already; try again later.
    #[error("{limit} requests are waiting already (EngineConfig::max_queue); try again later")]
    QueueFull { limit: usize },
    /// A request's deadline passed before it was done.
    #[error("the request's deadline passed before it was done")]
    DeadlineExceeded,
    /// A structured-output schema the grammar engine cannot enforce (a
    /// keyword it does not implement, an unsatisfiable schema), in its
    /// words; or a tokenizer whose vocabulary it cannot read.
    #[error("the response schema cannot be enforced: {0}")]
    UnsupportedSchema(String),
    /// `max_tokens` is below the fewest tokens any answer under the
    /// request's schema needs: every answer would be cut short.
    #[error("max_tokens {max_tokens} is too few: the shortest answer under this schema is {needed} tokens")]
    MaxTokensTooSmall { max_tokens: usize, needed: String },
    /// A request named an adapter the engine does not serve
    /// (`EngineConfig::named_adapter`, `MlxEngine::load_adapter`).
    #[error("no adapter is called {0:?}")]
    UnknownAdapter(String),
    /// Loading (or unloading) an adapter served per row failed
    /// (`MlxEngine::load_adapter`); the adapters served are as before.
    #[error("loading an adapter failed: {0}")]
    AdapterLoad(Arc<Error>),
    /// An adapter that requests running or waiting use cannot be unloaded
    /// (`MlxEngine::unload_adapter`); unload it once they are done.
    #[error("adapter {name:?} is used by {requests} running or waiting requests; unload it once they are done")]
    AdapterInUse { name: String, requests: usize },
    /// A request that cannot be served as asked (e.g. `max_tokens` 0).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// With a distributed placement, the worker did not answer within
    /// `EngineConfig::peer_timeout` (a peer rank stopped without exiting,
    /// or this rank was called without the others); the engine is closed.
    #[error("no answer within {waited:?}: a peer rank is not taking part (the engine is closed; end this rank)")]
    PeerTimeout { waited: std::time::Duration },
}

/// The message a panic carried (`panic!` with a literal or a formatted
/// string), for the error that reports it.
pub(crate) fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
}

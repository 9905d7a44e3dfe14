//! How an engine is configured and how one generation runs: the options
//! the engine and batched generation share.

use std::path::PathBuf;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use crate::distributed::Placement;
use crate::models::{MemoryMode, QuantizedWeights};
use crate::runtime::lanes::BlasThreads;
use crate::tokenizer::{Message, SpecialTokens, Tokenizer};
use crate::weights::kernels::Kernels;

/// Changes the logits `(batch, vocab)` of each decoding step, e.g. to allow
/// only a set of label tokens.
pub trait LogitsProcessor {
    /// Returns the logits to pick the next tokens from.
    fn process(&mut self, logits: &Array) -> Result<Array, Exception>;
}

impl<F: FnMut(&Array) -> Result<Array, Exception>> LogitsProcessor for F {
    fn process(&mut self, logits: &Array) -> Result<Array, Exception> {
        self(logits)
    }
}

/// Builds the logits processor from the loaded tokenizer, on the worker.
pub type LogitsProcessorFactory = Box<dyn FnOnce(&Tokenizer) -> Box<dyn LogitsProcessor> + Send>;

/// What the shared prefix's cache holds: which positions every
/// conversation attends to before its own turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PrefixCache {
    /// The prefix messages' tokens, nothing else (the default): each
    /// conversation reads exactly its own prompt, as mlx_lm's
    /// `batch_generate` over the whole prompt would.
    #[default]
    Clean,
    /// The prefix's tokens, then the token generated after them (greedy,
    /// under the logits processor): what spawnllm's `MlxEngine` caches. It
    /// builds its shared cache with mlx_lm's `batch_generate([prefix],
    /// max_tokens=1, return_prompt_caches=True)`, whose cache also holds
    /// the token it generated, so every conversation it answers attends to
    /// that token between the prefix and its own turn (its positions move
    /// by one too). Choose this to give the same answers as the Python
    /// original on the same model (with [`QuantizedWeights::Keep`] on the
    /// CPU, so that the arithmetic is mlx_lm's too).
    ///
    /// [`QuantizedWeights::Keep`]: crate::QuantizedWeights::Keep
    WithGeneratedToken,
}

/// How to start an engine: [`EngineConfig::new`] with the model folder,
/// then the options that differ from the defaults.
///
/// ```no_run
/// use mlx_engine::{EngineConfig, Message};
///
/// let config = EngineConfig::new("models/fused")
///     .prefix_messages(vec![Message::new("system", "Rate the review from 1 to 5.")])
///     .batch_size(2)
///     .max_prompt_tokens(4096);
/// ```
pub struct EngineConfig {
    pub(crate) model_dir: PathBuf,
    pub(crate) logits_processor_factory: Option<LogitsProcessorFactory>,
    pub(crate) prefix_messages: Vec<Message>,
    pub(crate) batch_size: usize,
    pub(crate) lanes: Option<usize>,
    pub(crate) blas_threads: BlasThreads,
    pub(crate) worker_name: String,
    pub(crate) quantized: Option<QuantizedWeights>,
    pub(crate) kernels: Option<Kernels>,
    pub(crate) memory: Option<MemoryMode>,
    pub(crate) lora: Vec<block_stream::BlockLoraSource>,
    pub(crate) adapters: Vec<PathBuf>,
    pub(crate) named_adapters: Vec<(String, PathBuf)>,
    pub(crate) max_prompt_tokens: Option<usize>,
    pub(crate) special_tokens: SpecialTokens,
    pub(crate) prefix_cache: PrefixCache,
    pub(crate) placement: Placement,
    pub(crate) peer_timeout: std::time::Duration,
    pub(crate) max_queue: usize,
    pub(crate) prefix_store_bytes: usize,
    pub(crate) admission_window: std::time::Duration,
    pub(crate) prefix_cache_dir: Option<(PathBuf, u64)>,
}

impl EngineConfig {
    /// An engine for the mlx_lm-format model folder `model_dir` (e.g. what
    /// `adapter-fuse` returns), with the defaults: no prefix messages, no
    /// logits processor, batches of 8, quantized weights held the faster way
    /// for the device, prompts up to the model's context length, special
    /// tokens in messages read as text.
    pub fn new(model_dir: impl Into<PathBuf>) -> EngineConfig {
        EngineConfig {
            model_dir: model_dir.into(),
            logits_processor_factory: None,
            prefix_messages: Vec::new(),
            batch_size: 8,
            lanes: None,
            blas_threads: BlasThreads::Unchanged,
            worker_name: "mlx-engine".to_owned(),
            quantized: None,
            kernels: None,
            memory: None,
            lora: Vec::new(),
            adapters: Vec::new(),
            named_adapters: Vec::new(),
            max_prompt_tokens: None,
            special_tokens: SpecialTokens::AsText,
            prefix_cache: PrefixCache::Clean,
            placement: Placement::Local,
            peer_timeout: DEFAULT_PEER_TIMEOUT,
            max_queue: DEFAULT_MAX_QUEUE,
            prefix_store_bytes: DEFAULT_PREFIX_STORE_BYTES,
            admission_window: DEFAULT_ADMISSION_WINDOW,
            prefix_cache_dir: None,
        }
    }

    /// How many [`complete`](crate::MlxEngine::complete) requests may wait
    /// for a slot (default [`DEFAULT_MAX_QUEUE`]); one more is refused
    /// with [`EngineError::QueueFull`](crate::EngineError::QueueFull).
    pub fn max_queue(mut self, n: usize) -> EngineConfig {
        self.max_queue = n;
        self
    }

    /// Bytes of prompt prefixes' keys and values that serving keeps for
    /// later requests (default [`DEFAULT_PREFIX_STORE_BYTES`]); the least
    /// recently used go first. The prefix messages' cache is held besides.
    pub fn prefix_store_bytes(mut self, bytes: usize) -> EngineConfig {
        self.prefix_store_bytes = bytes;
        self
    }

    /// How long a serving request that finds the engine idle waits for
    /// others sent with it (default [`DEFAULT_ADMISSION_WINDOW`]), so
    /// that requests that arrive together are prefilled in one step
    /// instead of each waiting for the step of the one before; the wait
    /// ends early once a batch's worth waits. Zero: the first request
    /// starts alone at once. A request that arrives while rows run never
    /// waits for it: it joins at the next step.
    pub fn admission_window(mut self, window: std::time::Duration) -> EngineConfig {
        self.admission_window = window;
        self
    }

    /// A folder where computed prefixes are kept across restarts (created
    /// if missing): the prefix messages', and the shared system prompts
    /// serving computes; at most `max_bytes` of them (the least recently
    /// used go first). A later engine with the same model files, adapters,
    /// prefix tokens and arithmetic reads a prefix from there instead of
    /// computing it, and answers bit for bit the same, also for a
    /// [`PrefixCache::WithGeneratedToken`] prefix under a logits processor
    /// (the file keeps the state that token is picked from); a file that
    /// does not match, is truncated or is corrupt is a warning naming it,
    /// and the prefix is computed again. Not used with a distributed
    /// placement. Default: none.
    pub fn prefix_cache_dir(mut self, dir: impl Into<PathBuf>, max_bytes: u64) -> EngineConfig {
        self.prefix_cache_dir = Some((dir.into(), max_bytes));
        self
    }

    /// Messages every conversation starts with; their cache is computed once.
    pub fn prefix_messages(mut self, messages: Vec<Message>) -> EngineConfig {
        self.prefix_messages = messages;
        self
    }

    /// What the prefix's cache holds (default [`PrefixCache::Clean`];
    /// [`PrefixCache::WithGeneratedToken`] answers as spawnllm does).
    pub fn prefix_cache(mut self, prefix_cache: PrefixCache) -> EngineConfig {
        self.prefix_cache = prefix_cache;
        self
    }

    /// Conversations per batch (at least 1): the most that go through the
    /// model together. With [`lanes`](Self::lanes), a call with fewer
    /// conversations than lanes times this size runs smaller, even batches,
    /// one per lane.
    pub fn batch_size(mut self, batch_size: usize) -> EngineConfig {
        self.batch_size = batch_size;
        self
    }

    /// How many chunks (of [`batch_size`](Self::batch_size) conversations)
    /// run side by side, each on its own thread and MLX stream (at least
    /// 1). Default: [`default_lanes`](crate::default_lanes), 2 on the CPU
    /// with two or more cores unless the layers are streamed, else 1. On
    /// the CPU, MLX runs a stream's element-wise work on
    /// one core; two chunks at once keep both cores busy, at the cost of a
    /// second chunk's activations in memory. With OpenBLAS, give each lane
    /// its share of the cores with
    /// [`blas_threads`](Self::blas_threads) (docs/benchmarks.md,
    /// "Lanes", has the figures). Layers streamed from the files
    /// ([`MemoryMode::Streamed`]) always run one chunk at a time. Results do
    /// not depend on it.
    pub fn lanes(mut self, lanes: usize) -> EngineConfig {
        self.lanes = Some(lanes.max(1));
        self
    }

    /// Whether the engine sets OpenBLAS's (process-wide) thread count for
    /// its lanes before they start (default [`BlasThreads::Unchanged`]).
    /// [`BlasThreads::SharedByLanes`] is what a program that runs one
    /// engine wants; leave it unchanged where other MLX work runs in the
    /// process while the engine starts.
    pub fn blas_threads(mut self, blas_threads: BlasThreads) -> EngineConfig {
        self.blas_threads = blas_threads;
        self
    }

    /// Builds the processor applied to every decoding step from the loaded
    /// tokenizer, on the worker (e.g. to allow only label tokens).
    pub fn logits_processor(
        mut self,
        factory: impl FnOnce(&Tokenizer) -> Box<dyn LogitsProcessor> + Send + 'static,
    ) -> EngineConfig {
        self.logits_processor_factory = Some(Box::new(factory));
        self
    }

    /// The worker thread's name (default `mlx-engine`).
    pub fn worker_name(mut self, name: impl Into<String>) -> EngineConfig {
        self.worker_name = name.into();
        self
    }

    /// How to hold quantized weights (default: the faster for the device).
    pub fn quantized(mut self, quantized: QuantizedWeights) -> EngineConfig {
        self.quantized = Some(quantized);
        self
    }

    /// Which kernels multiply dense weights (default:
    /// [`Kernels::from_env`], the fastest this machine has unless
    /// `MLX_LOWMEM_KERNELS=portable`).
    pub fn kernels(mut self, kernels: Kernels) -> EngineConfig {
        self.kernels = Some(kernels);
        self
    }

    /// Where the weights live (default: [`Checkpoint::default_memory`]: the
    /// size of the model folder's weight files and of what mapped tables
    /// leave in them, and [`mlx_support::memory_limit`]).
    ///
    /// [`Checkpoint::default_memory`]: crate::Checkpoint::default_memory
    pub fn memory(mut self, memory: MemoryMode) -> EngineConfig {
        self.memory = Some(memory);
        self
    }

    /// An adapter applied on the fly instead of fused into the folder:
    /// each streamed layer's weights get `source`'s LoRA as they are read
    /// (block-stream's `CheckpointLoraFuser`: dense or quantized module by
    /// module, mlx_lm's arithmetic for an mlx_lm adapter, so the layer
    /// equals what `mlx_lm fuse` would write). Needs
    /// [`MemoryMode::Streamed`], which the default then is; another
    /// explicit mode is [`EngineError::InvalidConfig`]. Sources add up.
    ///
    /// [`EngineError::InvalidConfig`]: crate::EngineError::InvalidConfig
    pub fn lora(mut self, source: block_stream::BlockLoraSource) -> EngineConfig {
        self.lora.push(source);
        self
    }

    /// An mlx_lm adapter folder (`adapter_config.json` and
    /// `adapters.safetensors`) applied on the fly: its scale and strictly
    /// paired `lora_a` / `lora_b` are read with block-stream's
    /// `MlxLmAdapter`, and the layers' key prefix comes from the model
    /// (`model.layers.` for llama, where Gemma's checkpoint keeps them), so
    /// nothing is copied by hand. As [`lora`](Self::lora): needs
    /// [`MemoryMode::Streamed`], which the default then is; an adapter
    /// module outside the model's layers, or an unpaired half, is an error
    /// at load.
    pub fn adapter(mut self, dir: impl Into<PathBuf>) -> EngineConfig {
        self.adapters.push(dir.into());
        self
    }

    /// An mlx_lm adapter folder served unfused under `name` (or the
    /// adapter codec's compressed file as a program ships it: the
    /// `adapters.safetensors.zst` itself, or a folder holding it, with its
    /// `adapter_config.json` beside it; decoded at load): a
    /// [`Completion`](crate::Completion) that names it
    /// ([`Completion::adapter`](crate::Completion::adapter)) gets its
    /// LoRA on its own row, `y = x·Wᵀ + s·(x·A)·B` as mlx_lm's
    /// `LoRALinear` computes it, while rows of other adapters and of none
    /// decode in the same batch over one copy of the base weights. Any
    /// memory mode. Its pairs are copied into memory at load (an adapter
    /// is small beside its base); a pair whose module is no linear layer of
    /// the model, or whose shapes do not fit it, fails the load naming the
    /// adapter and the key. Rows without an adapter give the base model's
    /// bits. [`complete`](crate::MlxEngine::complete) picks one per
    /// request, [`generate`](crate::MlxEngine::generate) one per call
    /// ([`GenerateOptions::adapter`]).
    ///
    /// ```no_run
    /// use mlx_engine::{Completion, EngineConfig, Message, MlxEngine};
    ///
    /// let engine = MlxEngine::new(
    ///     EngineConfig::new("models/base")
    ///         .named_adapter("sentiment", "adapters/sentiment")
    ///         .named_adapter("topic", "adapters/topic"),
    /// )?;
    /// let ask = |adapter: &str| {
    ///     let messages = vec![Message::new("user", "The lid leaks.")];
    ///     engine.complete(Completion::new(messages).max_tokens(4).adapter(adapter))
    /// };
    /// // Both decode in one batch.
    /// let (a, b) = (ask("sentiment")?, ask("topic")?);
    /// println!("{} / {}", a.collect()?.text, b.collect()?.text);
    /// # Ok::<(), mlx_engine::EngineError>(())
    /// ```
    pub fn named_adapter(
        mut self,
        name: impl Into<String>,
        dir: impl Into<PathBuf>,
    ) -> EngineConfig {
        self.named_adapters.push((name.into(), dir.into()));
        self
    }

    /// The longest prompt (prefix and conversation, in tokens) a
    /// conversation may have; longer ones are
    /// [`EngineError::PromptTooLong`](crate::EngineError::PromptTooLong). Default: the model's
    /// `max_position_embeddings`, else [`DEFAULT_MAX_PROMPT_TOKENS`].
    pub fn max_prompt_tokens(mut self, tokens: usize) -> EngineConfig {
        self.max_prompt_tokens = Some(tokens);
        self
    }

    /// How special-token strings in message contents are tokenized
    /// (default [`SpecialTokens::AsText`]).
    pub fn special_tokens_in_messages(mut self, policy: SpecialTokens) -> EngineConfig {
        self.special_tokens = policy;
        self
    }

    /// Runs as one rank of `placement` (default [`Placement::Local`]).
    /// Every rank starts an engine with the same model folder and
    /// placement, and calls `generate` with the same conversations; see
    /// [`Placement`] and docs/distributed.md. One chunk runs at a time
    /// (no [`lanes`](Self::lanes)): the ranks exchange in one order.
    pub fn placement(mut self, placement: Placement) -> EngineConfig {
        self.placement = placement;
        self
    }

    /// With a distributed [`placement`](Self::placement), how long a call
    /// waits for the worker before it returns
    /// [`EngineError::PeerTimeout`](crate::EngineError::PeerTimeout)
    /// (default [`DEFAULT_PEER_TIMEOUT`]): a peer rank that stopped
    /// without exiting (its sockets open) leaves MLX waiting without a
    /// deadline. After a timeout the engine is closed and the process
    /// should exit, which ends the job's other ranks' waits too.
    pub fn peer_timeout(mut self, timeout: std::time::Duration) -> EngineConfig {
        self.peer_timeout = timeout;
        self
    }
}

/// How long a distributed engine's calls wait for their ranks by default:
/// far longer than any step, short enough that a stuck job ends.
pub const DEFAULT_PEER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Serving requests that may wait for a slot, by default.
pub const DEFAULT_MAX_QUEUE: usize = 256;

/// Bytes of shared prefixes serving keeps, by default (256 MiB: SmolLM2's
/// cache of a 600-token prompt is 28 MB, Gemma 3 270M's about 11 MB).
pub const DEFAULT_PREFIX_STORE_BYTES: usize = 256 << 20;

/// How long a serving request that finds the engine idle waits for others
/// sent with it, by default: clients that send together (a pool of
/// workers whose answers came in one step) arrive within a millisecond or
/// two of each other on one machine; a lone request loses this much.
pub const DEFAULT_ADMISSION_WINDOW: std::time::Duration = std::time::Duration::from_millis(3);

/// The prompt limit of a model whose config names no context length.
pub const DEFAULT_MAX_PROMPT_TOKENS: usize = 8192;

impl std::fmt::Debug for EngineConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineConfig")
            .field("model_dir", &self.model_dir)
            .field("prefix_messages", &self.prefix_messages)
            .field("batch_size", &self.batch_size)
            .field("lanes", &self.lanes)
            .field("blas_threads", &self.blas_threads)
            .field("worker_name", &self.worker_name)
            .field("quantized", &self.quantized)
            .field("kernels", &self.kernels)
            .field("memory", &self.memory)
            .field("max_prompt_tokens", &self.max_prompt_tokens)
            .field("special_tokens", &self.special_tokens)
            .field("prefix_cache", &self.prefix_cache)
            .field("placement", &self.placement)
            .field("prefix_cache_dir", &self.prefix_cache_dir)
            .finish_non_exhaustive()
    }
}

/// How one [`generate`](crate::MlxEngine::generate) call runs: how many
/// tokens to generate (default 1: classification), and a progress callback.
///
/// ```
/// use mlx_engine::GenerateOptions;
///
/// let options = GenerateOptions::new()
///     .max_tokens(32)
///     .on_progress(|done| eprintln!("{done} more conversations answered"));
/// ```
pub struct GenerateOptions {
    pub(crate) max_tokens: usize,
    pub(crate) on_progress: Box<dyn FnMut(usize) + Send>,
    pub(crate) adapter: Option<String>,
}

impl GenerateOptions {
    /// One token per conversation, no progress callback.
    pub fn new() -> GenerateOptions {
        GenerateOptions {
            max_tokens: 1,
            on_progress: Box::new(|_| {}),
            adapter: None,
        }
    }

    /// Tokens to generate per conversation at most (greedy; generation of a
    /// conversation stops early at an end-of-sequence token).
    pub fn max_tokens(mut self, max_tokens: usize) -> GenerateOptions {
        self.max_tokens = max_tokens;
        self
    }

    /// Every conversation of the call decodes with the adapter served as
    /// `name` ([`EngineConfig::named_adapter`]); the prefix messages' cache
    /// under it is computed on its first use (or read from the prefix
    /// folder) and kept. An unknown name is
    /// [`EngineError::UnknownAdapter`](crate::EngineError::UnknownAdapter).
    pub fn adapter(mut self, name: impl Into<String>) -> GenerateOptions {
        self.adapter = Some(name.into());
        self
    }

    /// Called on the worker after each batch with the number of
    /// conversations it answered.
    pub fn on_progress(
        mut self,
        on_progress: impl FnMut(usize) + Send + 'static,
    ) -> GenerateOptions {
        self.on_progress = Box::new(on_progress);
        self
    }
}

impl Default for GenerateOptions {
    fn default() -> GenerateOptions {
        GenerateOptions::new()
    }
}

impl std::fmt::Debug for GenerateOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenerateOptions")
            .field("max_tokens", &self.max_tokens)
            .finish_non_exhaustive()
    }
}

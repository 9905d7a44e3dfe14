//! Continuous batching: requests that arrive one by one, each answered as
//! a stream of tokens, decoded together with whatever else is running.
//!
//! A request ([`Completion`]) goes to the worker's queue; at the next step
//! the worker renders and tokenizes it, finds the longest cached prefix of
//! its tokens in the [prefix store](prefix_store), prefills the rest, and
//! its row joins the decoding batch of the rows that share that prefix. A
//! row leaves the batch the step it finishes (end of sequence, a stop
//! string, `max_tokens`, or its stream dropped by the caller), and its
//! slot is taken by the next waiting request. At most
//! [`EngineConfig::batch_size`](crate::EngineConfig::batch_size) rows
//! decode together; at most
//! [`EngineConfig::max_queue`](crate::EngineConfig::max_queue) wait.
//!
//! Sampling happens on the host, per row, from the step's logits:
//! greedy (the argmax, the first one on ties, as MLX's), or with a
//! temperature, nucleus (`top_p`) and a seed of the request's own.

pub(crate) mod grammar;
pub(crate) mod prefix_store;
pub(crate) mod sampling;
pub(crate) mod scheduler;
pub(crate) mod text;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::EngineError;
use crate::tokenizer::Message;

pub use grammar::Constraint;

/// How a row picks each next token.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Sampling {
    /// 0 (the default): greedy. Otherwise the logits are divided by it
    /// before the draw.
    pub temperature: f32,
    /// Nucleus sampling: draw among the most likely tokens whose
    /// probabilities add up to at least this (1 or more: all tokens).
    pub top_p: f32,
    /// The draw's seed: the same request with the same seed gives the
    /// same tokens. Without one, a seed is drawn from the OS.
    pub seed: Option<u64>,
    /// Added to the logits of these token ids before anything else
    /// (OpenAI's `logit_bias`; -100 bans a token, +100 forces it).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling::greedy()
    }
}

impl Sampling {
    /// Greedy: the most likely token every time.
    pub fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            seed: None,
            logit_bias: Vec::new(),
        }
    }

    /// Sampling at `temperature` (0: greedy).
    pub fn temperature(mut self, temperature: f32) -> Sampling {
        self.temperature = temperature;
        self
    }

    /// Nucleus sampling over the top `top_p` of the probability.
    pub fn top_p(mut self, top_p: f32) -> Sampling {
        self.top_p = top_p;
        self
    }

    /// A seed that makes the draws reproducible.
    pub fn seed(mut self, seed: u64) -> Sampling {
        self.seed = Some(seed);
        self
    }

    /// Biases added to these tokens' logits.
    pub fn logit_bias(mut self, bias: Vec<(u32, f32)>) -> Sampling {
        self.logit_bias = bias;
        self
    }
}

/// One request for [`MlxEngine::complete`](crate::MlxEngine::complete): a
/// conversation to answer, as a stream of tokens.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Completion {
    /// The conversation, rendered with the model's chat template and a
    /// generation prompt.
    pub messages: Vec<Message>,
    /// At most this many tokens are generated (end of sequence not
    /// counted).
    pub max_tokens: usize,
    /// How each token is picked.
    pub sampling: Sampling,
    /// With `Some(k)`, every token comes with its log-probability and the
    /// `k` most likely tokens' (OpenAI's `logprobs` / `top_logprobs`).
    pub logprobs: Option<usize>,
    /// Generation stops before the first of these strings; it is not part
    /// of the text.
    pub stop: Vec<String>,
    /// A request still running then ends with
    /// [`EngineError::DeadlineExceeded`].
    pub deadline: Option<std::time::Instant>,
    /// What the answer must be (JSON under a schema); every token is
    /// picked among those that keep it so.
    pub constraint: Option<Constraint>,
    /// The adapter (an [`EngineConfig::named_adapter`] name) this row
    /// decodes with; `None`: the base model.
    ///
    /// [`EngineConfig::named_adapter`]: crate::EngineConfig::named_adapter
    pub adapter: Option<String>,
}

impl Completion {
    /// A greedy completion of `messages`, up to 16 tokens.
    pub fn new(messages: Vec<Message>) -> Completion {
        Completion {
            messages,
            max_tokens: 16,
            sampling: Sampling::greedy(),
            logprobs: None,
            stop: Vec::new(),
            deadline: None,
            constraint: None,
            adapter: None,
        }
    }

    /// Decodes with the adapter served as `name`.
    pub fn adapter(mut self, name: impl Into<String>) -> Completion {
        self.adapter = Some(name.into());
        self
    }

    /// At most `n` tokens.
    pub fn max_tokens(mut self, n: usize) -> Completion {
        self.max_tokens = n;
        self
    }

    /// How tokens are picked.
    pub fn sampling(mut self, sampling: Sampling) -> Completion {
        self.sampling = sampling;
        self
    }

    /// Log-probabilities with the `top` most likely alternatives.
    pub fn logprobs(mut self, top: usize) -> Completion {
        self.logprobs = Some(top);
        self
    }

    /// Stop strings.
    pub fn stop(mut self, stop: Vec<String>) -> Completion {
        self.stop = stop;
        self
    }

    /// Holds the answer to `constraint`.
    pub fn constraint(mut self, constraint: Constraint) -> Completion {
        self.constraint = Some(constraint);
        self
    }

    /// The time by which the request must be done.
    pub fn deadline(mut self, deadline: std::time::Instant) -> Completion {
        self.deadline = Some(deadline);
        self
    }
}

/// A token and its log-probability (natural log, of the logits after
/// `logit_bias`, before the temperature).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's id.
    pub id: u32,
    /// Its text alone (special tokens included).
    pub text: String,
    /// Its log-probability.
    pub logprob: f32,
}

/// What a [`CompletionStream`] hands back.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum StreamEvent {
    /// A generated token: the text it settles (possibly empty: an
    /// incomplete UTF-8 sequence, or what could still become a stop
    /// string, waits for the next token) and, if asked, its logprobs.
    Token {
        /// The token's id.
        id: u32,
        /// Text that follows the text already handed back.
        text: String,
        /// The token's log-probability and the top alternatives.
        logprobs: Option<(TokenLogprob, Vec<TokenLogprob>)>,
    },
    /// Text held back (the start of a possible stop string, an incomplete
    /// character) and settled at the end, without a new token.
    Text(String),
    /// The end: why, and what was counted. The last event.
    Finished(Finish),
    /// The request failed; the last event.
    Failed(EngineError),
}

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FinishReason {
    /// End of sequence or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// How a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Finish {
    /// Why.
    pub reason: FinishReason,
    /// Tokens of the rendered prompt.
    pub prompt_tokens: usize,
    /// Of those, how many came from the prefix store's cache.
    pub cached_tokens: usize,
    /// Tokens generated (end of sequence not counted).
    pub completion_tokens: usize,
}

/// The events of one request, as they are made. Dropping the stream
/// cancels the request: its row leaves the batch at the next step.
#[derive(Debug)]
pub struct CompletionStream {
    pub(crate) events: tokio::sync::mpsc::UnboundedReceiver<StreamEvent>,
}

impl CompletionStream {
    /// The next event, blocking; `None` once the last was handed back.
    /// Not from inside an async runtime: use [`next`](Self::next) there.
    pub fn blocking_next(&mut self) -> Option<StreamEvent> {
        self.events.blocking_recv()
    }

    /// The next event; `None` once the last was handed back.
    pub async fn next(&mut self) -> Option<StreamEvent> {
        self.events.recv().await
    }

    /// Waits for the whole answer: its text, its tokens' logprobs (if
    /// asked) and how it ended.
    pub fn collect(mut self) -> Result<CompletionText, EngineError> {
        let mut answer = CompletionText::default();
        while let Some(event) = self.blocking_next() {
            match event {
                StreamEvent::Token { id, text, logprobs } => {
                    answer.tokens.push(id);
                    answer.text.push_str(&text);
                    answer.logprobs.extend(logprobs);
                }
                StreamEvent::Text(text) => answer.text.push_str(&text),
                StreamEvent::Finished(finish) => {
                    answer.finish = Some(finish);
                    return Ok(answer);
                }
                StreamEvent::Failed(e) => return Err(e),
            }
        }
        Err(EngineError::Closed)
    }
}

/// A whole answer (see [`CompletionStream::collect`]).
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct CompletionText {
    /// The text.
    pub text: String,
    /// The generated tokens' ids.
    pub tokens: Vec<u32>,
    /// Each token's logprob and the top alternatives, if asked.
    pub logprobs: Vec<(TokenLogprob, Vec<TokenLogprob>)>,
    /// How it ended.
    pub finish: Option<Finish>,
}

/// Counters of an engine's serving, shared between the worker and the
/// handles (see [`MlxEngine::serving_metrics`](crate::MlxEngine::serving_metrics)).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub requests: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub prefix_misses: AtomicU64,
    pub prefix_folder_reads: AtomicU64,
    pub prefix_entries: AtomicUsize,
    pub prefix_bytes: AtomicUsize,
    pub steps: AtomicU64,
    /// Seconds the worker spent in steps, in microseconds.
    pub busy_micros: AtomicU64,
}

/// A snapshot of an engine's serving counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[non_exhaustive]
pub struct ServingMetrics {
    /// Requests accepted and not yet prefilled.
    pub waiting: usize,
    /// Rows decoding.
    pub running: usize,
    /// Requests accepted since the start.
    pub requests: u64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Of those, tokens whose cache came from the prefix store.
    pub cached_prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Requests that found a cached prefix.
    pub prefix_hits: u64,
    /// Requests with a shareable prefix the store did not hold.
    pub prefix_misses: u64,
    /// Of those, how many read it from the prefix cache folder
    /// ([`EngineConfig::prefix_cache_dir`](crate::EngineConfig::prefix_cache_dir))
    /// instead of computing it.
    pub prefix_folder_reads: u64,
    /// Prefixes held by the store.
    pub prefix_entries: usize,
    /// Their keys' and values' bytes.
    pub prefix_bytes: usize,
    /// Steps taken: each prefills the requests admitted to it and decodes
    /// one token for every running row.
    pub steps: u64,
    /// Seconds the worker spent prefilling and decoding.
    pub busy_seconds: f64,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> ServingMetrics {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ServingMetrics {
            waiting: self.waiting.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            requests: get(&self.requests),
            prompt_tokens: get(&self.prompt_tokens),
            cached_prompt_tokens: get(&self.cached_prompt_tokens),
            generated_tokens: get(&self.generated_tokens),
            prefix_hits: get(&self.prefix_hits),
            prefix_misses: get(&self.prefix_misses),
            prefix_folder_reads: get(&self.prefix_folder_reads),
            prefix_entries: self.prefix_entries.load(Ordering::Relaxed),
            prefix_bytes: self.prefix_bytes.load(Ordering::Relaxed),
            steps: get(&self.steps),
            busy_seconds: get(&self.busy_micros) as f64 / 1e6,
        }
    }
}

/// A request on its way to the worker.
#[derive(Debug)]
pub(crate) struct Pending {
    pub completion: Completion,
    /// The completion's constraint, compiled on the caller's thread.
    pub matcher: Option<grammar::RowGrammar>,
    pub events: tokio::sync::mpsc::UnboundedSender<StreamEvent>,
}

pub(crate) type SharedCounters = Arc<Counters>;

//! Batched greedy generation on the worker, on copies of the prefix cache.

use std::collections::HashMap;
use std::sync::Arc;

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::Array;
use mlx_support::distributed::Group;

use crate::distributed::{self, Placement};
use crate::error::EngineError;
use crate::evaluation::{evaluate, host_slice, Why};
use crate::models::{Model, Schedule};
use crate::nn::cache::KvCache;
use crate::runtime::adapters;
use crate::runtime::lanes::{self, BlasThreads, ChunkWork, Executor, View};
use crate::runtime::options::{GenerateOptions, LogitsProcessor, PrefixCache};
use crate::runtime::prefill::{padded_block, prefill, prefill_groups, PREFILL_CHUNK};
use crate::runtime::prefix_disk::{self, load_or_compute, PrefixBinding, PrefixDisk};
use crate::tokenizer::{Message, SpecialTokens, Tokenizer};

/// What generation keeps between requests.
pub(crate) struct GenState {
    prefix_messages: Vec<Message>,
    prefix_tokens: Vec<u32>,
    prefix_cache: Arc<KvCache>,
    /// Whether the prefix's cache holds its tokens and nothing else.
    prefix_is_clean: bool,
    processor: Option<Box<dyn LogitsProcessor>>,
    batch_size: usize,
    /// Runs chunks side by side (see [`lanes`]).
    executor: Executor,
    schedule: Schedule,
    eos: Vec<u32>,
    max_prompt_tokens: usize,
    special_tokens: SpecialTokens,
    /// The ranks this engine generates with, if any, and whether each
    /// answers its own share of the conversations.
    group: Option<(Group, bool)>,
    /// The prefix's caches under each per-row adapter asked for so far.
    adapter_prefixes: HashMap<usize, Arc<KvCache>>,
    /// Where prefixes are kept across restarts, and what they are bound
    /// to.
    prefix_disk: Option<(PrefixDisk, PrefixBinding)>,
}

/// The generation settings of an [`EngineConfig`](crate::EngineConfig).
pub(crate) struct GenSettings {
    pub prefix_messages: Vec<Message>,
    pub processor: Option<Box<dyn LogitsProcessor>>,
    pub batch_size: usize,
    pub lanes: usize,
    pub blas_threads: BlasThreads,
    pub max_prompt_tokens: usize,
    pub special_tokens: SpecialTokens,
    pub prefix_cache: PrefixCache,
    pub placement: Placement,
    /// Where the prefix's computed cache is kept across restarts, and what
    /// it is bound to there.
    pub prefix_disk: Option<(PrefixDisk, PrefixBinding)>,
}

impl GenState {
    /// The shared prefix's token ids.
    pub(crate) fn prefix_tokens(&self) -> &[u32] {
        &self.prefix_tokens
    }

    /// The prefix's tokens and cache, for serving's prefix store: only a
    /// cache that holds exactly those tokens can continue any prompt that
    /// starts with them.
    pub(crate) fn shareable_prefix(&self) -> Option<(Vec<u32>, KvCache)> {
        (self.prefix_is_clean && !self.prefix_tokens.is_empty())
            .then(|| (self.prefix_tokens.clone(), (*self.prefix_cache).clone()))
    }

    /// Renders the prefix messages (no generation prompt) and runs them once.
    pub(crate) fn new(
        model: &Model,
        tokenizer: &Tokenizer,
        settings: GenSettings,
    ) -> crate::Result<GenState> {
        let GenSettings {
            prefix_messages,
            mut processor,
            batch_size,
            lanes,
            blas_threads,
            max_prompt_tokens,
            special_tokens,
            prefix_cache: what_to_cache,
            placement,
            prefix_disk,
        } = settings;
        let group = placement.group().map(|g| {
            let data = matches!(placement, Placement::DataParallel { .. });
            (g.clone(), data)
        });
        let prefix_tokens = if prefix_messages.is_empty() {
            Vec::new()
        } else {
            tokenizer.chat_tokens(&prefix_messages, false, special_tokens)?
        };
        if prefix_tokens.len() > max_prompt_tokens {
            return Err(crate::Error::PrefixTooLong {
                tokens: prefix_tokens.len(),
                limit: max_prompt_tokens,
            });
        }
        let prefix_cache = prefix_cache_under(
            model,
            &prefix_tokens,
            None,
            prefix_disk.as_ref(),
            what_to_cache,
            processor.as_deref_mut(),
        )?;
        let schedule = model.schedule();
        #[expect(
            clippy::arc_with_non_send_sync,
            reason = "the Arc crosses to the lanes only inside a ForLanes, which says why that is sound"
        )]
        let prefix_cache = Arc::new(prefix_cache);
        Ok(GenState {
            prefix_messages,
            prefix_tokens,
            prefix_cache,
            prefix_is_clean: what_to_cache == PrefixCache::Clean,
            processor,
            batch_size,
            executor: Executor::start(schedule.lanes(lanes), blas_threads),
            schedule,
            eos: tokenizer.eos_ids().iter().copied().collect(),
            max_prompt_tokens,
            special_tokens,
            group,
            adapter_prefixes: HashMap::new(),
            prefix_disk,
        })
    }

    /// Forgets the prefix's cache under the adapter in `slot` (unloaded).
    pub(crate) fn forget_adapter(&mut self, slot: usize) {
        self.adapter_prefixes.remove(&slot);
    }

    /// The prefix's cache under the per-row adapter `slot` (none: the
    /// one computed at load), computed on first use.
    fn prefix_under(&mut self, model: &Model, slot: Option<usize>) -> crate::Result<Arc<KvCache>> {
        let Some(slot) = slot.filter(|_| !self.prefix_tokens.is_empty()) else {
            return Ok(Arc::clone(&self.prefix_cache));
        };
        if let Some(cache) = self.adapter_prefixes.get(&slot) {
            return Ok(Arc::clone(cache));
        }
        let disk = prefix_disk::disk_under_adapter(self.prefix_disk.as_ref(), model, Some(slot));
        let what = match self.prefix_is_clean {
            true => PrefixCache::Clean,
            false => PrefixCache::WithGeneratedToken,
        };
        let cache = prefix_cache_under(
            model,
            &self.prefix_tokens,
            Some(slot),
            disk.as_ref(),
            what,
            self.processor.as_deref_mut(),
        )?;
        #[expect(
            clippy::arc_with_non_send_sync,
            reason = "the Arc crosses to the lanes only inside a ForLanes, which says why that is sound"
        )]
        let cache = Arc::new(cache);
        self.adapter_prefixes.insert(slot, Arc::clone(&cache));
        Ok(cache)
    }
}

/// The cache of the prefix `tokens` under adapter `slot` (empty without
/// tokens): read from the prefix folder or computed, then, for
/// [`PrefixCache::WithGeneratedToken`], with the token `processor` (or
/// the argmax) picks after it.
fn prefix_cache_under(
    model: &Model,
    tokens: &[u32],
    slot: Option<usize>,
    disk: Option<&(PrefixDisk, PrefixBinding)>,
    what: PrefixCache,
    processor: Option<&mut (dyn LogitsProcessor + 'static)>,
) -> crate::Result<KvCache> {
    if tokens.is_empty() {
        return Ok(KvCache::new());
    }
    let (prefix, _) = load_or_compute(model, tokens, slot, disk)?;
    if what == PrefixCache::Clean {
        return Ok(prefix.cache);
    }
    let logits = model.with_adapter(slot, || model.head(&prefix.last_hidden))?;
    let next = pick_tokens(processor, &logits)?[0] as u32;
    tracing::debug!(token = next, "the prefix's cache holds its generated token");
    prefix_disk::then_token(model, prefix.cache, tokens, next, slot, disk)
}

fn gen_err(e: impl Into<crate::Error>) -> EngineError {
    EngineError::Generate(Arc::new(e.into()))
}

/// Throughput of one `generate` call. Rates never divide by zero.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenerationStats {
    /// Conversations answered.
    pub conversations: usize,
    /// Prompt tokens prefilled (suffixes only: the prefix is cached once).
    pub prompt_tokens: usize,
    /// Tokens generated (EOS not counted).
    pub generated_tokens: usize,
    /// Wall time on the worker, seconds.
    pub seconds: f64,
}

impl GenerationStats {
    fn per_second(&self, n: usize) -> f64 {
        if self.seconds > 0.0 {
            n as f64 / self.seconds
        } else {
            0.0
        }
    }

    /// Conversations per second.
    pub fn conversations_per_s(&self) -> f64 {
        self.per_second(self.conversations)
    }

    /// Prompt tokens per second.
    pub fn prompt_tokens_per_s(&self) -> f64 {
        self.per_second(self.prompt_tokens)
    }

    /// Generated tokens per second.
    pub fn generated_tokens_per_s(&self) -> f64 {
        self.per_second(self.generated_tokens)
    }
}

/// What a [`generate`](crate::MlxEngine::generate) call returns.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Generation {
    /// One text per conversation, in the order given.
    pub texts: Vec<String>,
    /// Throughput of the call.
    pub stats: GenerationStats,
}

/// Generates for every conversation; texts come back in the given order.
pub(crate) fn generate_batch(
    model: &Arc<Model>,
    tokenizer: &Tokenizer,
    state: &mut GenState,
    conversations: &[Vec<Message>],
    options: &mut GenerateOptions,
) -> Result<Generation, EngineError> {
    let _span = tracing::info_span!(
        "generate",
        conversations = conversations.len(),
        max_tokens = options.max_tokens
    )
    .entered();
    let max_tokens = options.max_tokens;
    let start = std::time::Instant::now();
    let stats = GenerationStats {
        conversations: conversations.len(),
        ..GenerationStats::default()
    };
    // Before anything a rank could refuse alone: the ranks were given one
    // request, so each refuses it, or none does.
    if let Some((group, _)) = &state.group {
        distributed::data::same_request(group, conversations, max_tokens).map_err(gen_err)?;
    }
    let slot = adapters::slot_of(model, options.adapter.as_deref())?;
    let prefix_cache = state.prefix_under(model, slot).map_err(gen_err)?;
    let p = state.prefix_messages.len();
    let mut suffixes = Vec::with_capacity(conversations.len());
    let vocab = model.config().vocab_size;
    for (index, conversation) in conversations.iter().enumerate() {
        if conversation.len() < p || conversation[..p] != state.prefix_messages[..] {
            return Err(EngineError::PrefixMismatch { index });
        }
        if conversation.len() == p {
            return Err(EngineError::NothingAfterPrefix { index });
        }
        let tokens = tokenizer
            .chat_tokens(conversation, true, state.special_tokens)
            .map_err(gen_err)?;
        if tokens.len() > state.max_prompt_tokens {
            return Err(EngineError::PromptTooLong {
                index,
                tokens: tokens.len(),
                limit: state.max_prompt_tokens,
            });
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(gen_err(crate::Error::TokenOutOfRange { id, vocab }));
        }
        let suffix = tokens
            .strip_prefix(state.prefix_tokens.as_slice())
            .ok_or(EngineError::PrefixMismatch { index })?;
        if suffix.is_empty() {
            return Err(EngineError::NothingAfterPrefix { index });
        }
        suffixes.push(suffix.to_vec());
    }
    // Similar lengths together: sort (stably) by the last message's length.
    let mut order: Vec<usize> = (0..conversations.len()).collect();
    order.sort_by_key(|&i| {
        conversations[i]
            .last()
            .map_or(0, |m| m.content.chars().count())
    });
    let data_parallel = match &state.group {
        Some((group, true)) => Some(group),
        _ => None,
    };
    if let Some(group) = data_parallel {
        let lengths: Vec<usize> = suffixes.iter().map(Vec::len).collect();
        let owner = distributed::data::shares(&lengths, group.size());
        order.retain(|&i| owner[i] == group.rank());
    }
    // Every lane gets a chunk where the schedule allows: with fewer
    // conversations than lanes times the batch size, smaller, even chunks.
    let (schedule, lanes) = (state.schedule, state.executor.lanes());
    let size = schedule.chunk_rows(state.batch_size, order.len(), lanes);
    let chunks: Vec<&[usize]> = order.chunks(size).collect();
    let works: Vec<ChunkWork> = chunks
        .iter()
        .map(|chunk| {
            let rows: Vec<Vec<u32>> = chunk.iter().map(|&i| suffixes[i].clone()).collect();
            let work: ChunkWork = Box::new(move |view: View<'_>, pick: lanes::Pick<'_>| {
                let _span = tracing::info_span!("chunk", rows = rows.len()).entered();
                let rows: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
                // On the thread that runs the chunk, lane or worker.
                let model = view.model;
                model.with_adapter(slot, || generate_chunk(view, pick, &rows, max_tokens))
            });
            work
        })
        .collect();
    let mut done = Finished {
        chunks: &chunks,
        suffixes: &suffixes,
        tokenizer,
        texts: vec![String::new(); conversations.len()],
        stats,
        on_progress: &mut options.on_progress,
        processor: state.processor.as_deref_mut(),
        failure: None,
    };
    // Without a processor, each lane picks its tokens itself.
    let lane_pick: Option<lanes::LanePick> = match done.processor {
        None => Some(|logits| pick_tokens(None, logits)),
        Some(_) => None,
    };
    let here = View {
        model,
        prefix_cache: &prefix_cache,
        eos: &state.eos,
    };
    state
        .executor
        .run(here, (model, &prefix_cache), works, lane_pick, &mut done);
    let (mut texts, mut stats) = (done.texts, done.stats);
    if let Some(group) = data_parallel {
        let counts = (stats.prompt_tokens, stats.generated_tokens);
        let failed = done.failure.is_some();
        let gathered = distributed::data::gather_texts(group, texts, counts, failed);
        if let Some(e) = done.failure {
            return Err(e);
        }
        let (all, (prompt, generated)) = gathered.map_err(gen_err)?;
        texts = all;
        stats.prompt_tokens = prompt;
        stats.generated_tokens = generated;
    } else if let Some(e) = done.failure {
        return Err(e);
    }
    stats.seconds = start.elapsed().as_secs_f64();
    Ok(Generation { texts, stats })
}

/// The chunks' results as they come, in any order: texts in place, stats,
/// progress; the first error stops the rest.
struct Finished<'a, 'p> {
    chunks: &'a [&'a [usize]],
    suffixes: &'a [Vec<u32>],
    tokenizer: &'a Tokenizer,
    texts: Vec<String>,
    stats: GenerationStats,
    on_progress: &'a mut (dyn FnMut(usize) + Send),
    processor: Option<&'p mut (dyn LogitsProcessor + 'static)>,
    failure: Option<EngineError>,
}

impl Finished<'_, '_> {
    fn record(&mut self, index: usize, generated: Vec<Vec<u32>>) -> Result<(), EngineError> {
        let chunk = self.chunks[index];
        self.stats.prompt_tokens += chunk.iter().map(|&i| self.suffixes[i].len()).sum::<usize>();
        self.stats.generated_tokens += generated.iter().map(Vec::len).sum::<usize>();
        for (&i, tokens) in chunk.iter().zip(generated) {
            self.texts[i] = self.tokenizer.decode(&tokens).map_err(gen_err)?;
        }
        (self.on_progress)(chunk.len());
        Ok(())
    }
}

impl lanes::Coordinator for Finished<'_, '_> {
    fn pick(&mut self, logits: &Array) -> crate::Result<Vec<i32>> {
        pick_tokens(self.processor.as_deref_mut(), logits)
    }

    fn finish(&mut self, index: usize, tokens: crate::Result<Vec<Vec<u32>>>) -> bool {
        if self.failure.is_some() {
            return false;
        }
        let outcome = tokens
            .map_err(gen_err)
            .and_then(|generated| self.record(index, generated));
        match outcome {
            Ok(()) => true,
            Err(e) => {
                self.failure = Some(e);
                false
            }
        }
    }
}

/// Each row's next token: the logits through `processor` (if any), then
/// the greedy choice. NaN logits (from NaN or infinite weights) have no
/// maximum, so argmax would pick an arbitrary token: they are an error.
pub(crate) fn pick_tokens(
    processor: Option<&mut (dyn LogitsProcessor + '_)>,
    logits: &Array,
) -> crate::Result<Vec<i32>> {
    let logits = match processor {
        Some(processor) => {
            let processed = processor.process(logits)?;
            if processed.shape() != logits.shape() {
                return Err(crate::Error::ProcessorShape {
                    expected: logits.shape().to_vec(),
                    actual: processed.shape().to_vec(),
                });
            }
            processed
        }
        None => logits.clone(),
    };
    let next = argmax_axis(&logits, -1, None)?.as_dtype(mlx_rs::Dtype::Int32)?;
    let finite = logits.is_nan()?.any(None)?.logical_not()?;
    evaluate(Why::Step, [&next, &finite])?;
    if !host_slice::<bool>(Why::Step, "the logits' finiteness", &finite)?[0] {
        return Err(crate::Error::NotFiniteLogits);
    }
    Ok(host_slice::<i32>(Why::Step, "next tokens", &next)?.to_vec())
}

/// Prefills the rows' suffixes on forks of the prefix cache (left-padded
/// after the prefix, the padding hidden by the mask and skipped by the
/// rotary positions) in groups of similar length, then decodes the whole
/// chunk greedily as one batch.
fn generate_chunk(
    view: View<'_>,
    pick: lanes::Pick<'_>,
    rows: &[&[u32]],
    max_tokens: usize,
) -> crate::Result<Vec<Vec<u32>>> {
    let View {
        model,
        prefix_cache,
        eos,
    } = view;
    let b = rows.len();
    let lengths: Vec<usize> = rows.iter().map(|r| r.len()).collect();
    let mut parts = Vec::new();
    let mut lasts = Vec::new();
    let prefill_span = tracing::debug_span!("prefill", rows = b).entered();
    let groups = prefill_groups(&lengths, model.pass_cost_tokens());
    let one_piece =
        |g: &std::ops::Range<usize>| lengths[g.clone()].iter().all(|&n| n <= PREFILL_CHUNK);
    if model.schedule() == Schedule::LayerByLayer && groups.iter().all(one_piece) {
        // Every group in one forward, layer by layer: each layer is read
        // once for the whole chunk.
        let mut blocks = Vec::with_capacity(groups.len());
        for group in &groups {
            let mut cache = prefix_cache.fork(group.len() as i32)?;
            if max_tokens == 1 {
                cache.discard_owned();
            }
            blocks.push(padded_block(&mut cache, &rows[group.clone()])?);
            parts.push(cache);
        }
        lasts = model.last_hidden_each(&blocks, &mut parts)?;
    } else {
        for group in groups {
            let keep = max_tokens > 1;
            let (cache, last) = prefill(model, prefix_cache, &rows[group], keep)?;
            if keep {
                parts.push(cache);
            } else {
                // Computed now, so that what the group's forward holds goes
                // before the next group's runs.
                evaluate(Why::Piece, [&last])?;
            }
            lasts.push(last);
        }
    }
    // One output projection for the whole chunk: per group, it would
    // repack (or, with the tables mapped, read) the head's weights once
    // per group.
    let mut last = model.head(&concatenate(&lasts, 0)?)?;
    drop(prefill_span);
    let _decode_span = tracing::debug_span!("decode", rows = b, max_tokens).entered();
    // One cache for decoding: the groups' caches, padded to the longest,
    // with room for the tokens to come.
    let mut cache = if max_tokens > 1 {
        KvCache::stack(parts, max_tokens as i32)?
    } else {
        KvCache::new()
    };
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); b];
    let mut done = vec![false; b];
    for step in 0..max_tokens {
        let ids = pick(&last)?;
        for (row, &id) in ids.iter().enumerate() {
            if done[row] {
                continue;
            }
            if eos.contains(&(id as u32)) {
                done[row] = true;
            } else {
                out[row].push(id as u32);
            }
        }
        if step + 1 == max_tokens || done.iter().all(|&d| d) {
            break;
        }
        last = model.forward_last(&Array::from_slice(&ids, &[b as i32, 1]), &mut cache)?;
    }
    Ok(out)
}

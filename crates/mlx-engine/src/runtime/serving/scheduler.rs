//! The worker's side of continuous batching: waiting requests, running
//! rows grouped by the prefix they share, and one step at a time.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Instant;

use mlx_rs::Array;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::EngineError;
use crate::evaluation::{host_slice, Why};
use crate::models::Model;
use crate::nn::cache::KvCache;
use crate::runtime::adapters;
use crate::runtime::prefill::{prefill_groups, prefill_into};
use crate::runtime::prefix_disk::{self, load_or_compute, Origin, PrefixBinding, PrefixDisk};
use crate::runtime::serving::grammar::RowGrammar;
use crate::runtime::serving::prefix_store::{Found, PrefixStore};
use crate::runtime::serving::sampling::{Picked, Sampler};
use crate::runtime::serving::text::RowText;
use crate::runtime::serving::{
    Finish, FinishReason, Pending, SharedCounters, StreamEvent, TokenLogprob,
};
use crate::tokenizer::{Message, SpecialTokens, Tokenizer};

/// Room for this many more positions when rows join a batch.
const JOIN_SPARE: i32 = 32;

/// How the worker serves: limits and the prefix store's size.
#[derive(Debug, Clone)]
pub(crate) struct SchedulerSettings {
    pub batch_size: usize,
    pub max_prompt_tokens: usize,
    pub special_tokens: SpecialTokens,
    pub prefix_store_bytes: usize,
    /// How long a request that finds the worker idle waits for company.
    pub admission_window: std::time::Duration,
    /// Where shared prefixes are kept across restarts, and what they are
    /// bound to there.
    pub prefix_disk: Option<(PrefixDisk, PrefixBinding)>,
}

/// A request's row while it decodes.
#[derive(Debug)]
struct Row {
    events: UnboundedSender<StreamEvent>,
    sampler: Sampler,
    logprobs: Option<usize>,
    max_tokens: usize,
    deadline: Option<Instant>,
    generated: Vec<u32>,
    text: RowText,
    prompt_tokens: usize,
    cached_tokens: usize,
    /// The token picked last, which the next step feeds.
    next: u32,
    /// The row's structured-output constraint, if any.
    matcher: Option<RowGrammar>,
    /// The per-row adapter's slot, if any.
    adapter: Option<usize>,
}

/// Rows that share one prefix's cache, decoded as one batch.
#[derive(Debug)]
struct Cohort {
    prefix: u64,
    cache: KvCache,
    rows: Vec<Row>,
}

/// A request admitted this step, its prompt tokenized.
struct Admitted {
    row: Row,
    prefix: Found,
    suffix: Vec<u32>,
}

/// See the module's docs.
#[derive(Debug)]
pub(crate) struct Scheduler {
    settings: SchedulerSettings,
    waiting: VecDeque<Pending>,
    cohorts: Vec<Cohort>,
    store: PrefixStore,
    counters: SharedCounters,
}

impl Scheduler {
    /// A scheduler whose store starts with `pinned` (the engine's prefix
    /// messages' tokens and cache), if any.
    pub(crate) fn new(
        settings: SchedulerSettings,
        counters: SharedCounters,
        pinned: Option<(Vec<u32>, KvCache)>,
    ) -> Scheduler {
        let mut store = PrefixStore::new(settings.prefix_store_bytes);
        if let Some((tokens, cache)) = pinned {
            store.insert(None, tokens, cache, true);
        }
        let scheduler = Scheduler {
            settings,
            waiting: VecDeque::new(),
            cohorts: Vec::new(),
            store,
            counters,
        };
        scheduler.publish();
        scheduler
    }

    /// Whether nothing waits or runs.
    pub(crate) fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.cohorts.is_empty()
    }

    /// How long a request that finds the worker idle waits for others.
    pub(crate) fn admission_window(&self) -> std::time::Duration {
        self.settings.admission_window
    }

    /// Whether nothing runs and requests wait that a batch has room
    /// beside: then one more arriving now would be prefilled with them.
    pub(crate) fn has_room_beside_waiting(&self) -> bool {
        self.cohorts.is_empty()
            && !self.waiting.is_empty()
            && self.waiting.len() < self.settings.batch_size
    }

    /// How many requests running or waiting use the adapter `name`, in
    /// `slot` (not those cancelled, which leave at the next step).
    pub(crate) fn using_adapter(&self, name: &str, slot: usize) -> usize {
        let running = self.cohorts.iter().flat_map(|c| &c.rows);
        let running = running.filter(|r| r.adapter == Some(slot) && !r.events.is_closed());
        let waiting = self
            .waiting
            .iter()
            .filter(|p| p.completion.adapter.as_deref() == Some(name) && !p.events.is_closed());
        running.count() + waiting.count()
    }

    /// Forgets what it keeps for the adapter in `slot` (unloaded).
    pub(crate) fn forget_adapter(&mut self, slot: usize) {
        self.store.forget_adapter(slot);
        self.publish();
    }

    /// Queues a request for the next step.
    pub(crate) fn enqueue(&mut self, pending: Pending) {
        self.waiting.push_back(pending);
    }

    /// Ends every waiting and running request with `error`.
    pub(crate) fn fail_all(&mut self, error: &EngineError) {
        for pending in self.waiting.drain(..) {
            let _ = pending.events.send(StreamEvent::Failed(error.clone()));
        }
        for cohort in self.cohorts.drain(..) {
            for row in cohort.rows {
                let _ = row.events.send(StreamEvent::Failed(error.clone()));
            }
        }
        self.counters.waiting.store(0, Ordering::Relaxed);
        self.publish();
    }

    /// One step: admits waiting requests into free slots (prefilling
    /// them, which picks their first token), then decodes one token for
    /// every running row.
    pub(crate) fn step(&mut self, model: &Model, tokenizer: &Tokenizer) {
        let start = Instant::now();
        // Counted as it begins: a caller that has its answer sees the step
        // that gave it counted.
        self.counters.steps.fetch_add(1, Ordering::Relaxed);
        let eos: Vec<u32> = tokenizer.eos_ids().iter().copied().collect();
        self.admit(model, tokenizer, &eos);
        let mut cohorts = std::mem::take(&mut self.cohorts);
        for cohort in &mut cohorts {
            drop_gone_rows(cohort);
            if cohort.rows.is_empty() {
                continue;
            }
            if let Err(e) = decode(model, tokenizer, &eos, cohort, &self.counters) {
                let error = EngineError::Generate(std::sync::Arc::new(e));
                for row in cohort.rows.drain(..) {
                    let _ = row.events.send(StreamEvent::Failed(error.clone()));
                }
            }
        }
        cohorts.retain(|c| !c.rows.is_empty());
        self.cohorts = cohorts;
        let micros = start.elapsed().as_micros() as u64;
        self.counters
            .busy_micros
            .fetch_add(micros, Ordering::Relaxed);
        self.publish();
    }

    fn running(&self) -> usize {
        self.cohorts.iter().map(|c| c.rows.len()).sum()
    }

    fn publish(&self) {
        let (entries, bytes) = self.store.size();
        let c = &self.counters;
        c.running.store(self.running(), Ordering::Relaxed);
        c.prefix_entries.store(entries, Ordering::Relaxed);
        c.prefix_bytes.store(bytes, Ordering::Relaxed);
    }

    /// Takes waiting requests into free slots, prefills them by shared
    /// prefix, and adds the rows that go on to their prefix's batch.
    fn admit(&mut self, model: &Model, tokenizer: &Tokenizer, eos: &[u32]) {
        let free = self.settings.batch_size.saturating_sub(self.running());
        let mut admitted: Vec<Admitted> = Vec::new();
        while admitted.len() < free {
            let Some(pending) = self.waiting.pop_front() else {
                break;
            };
            self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
            if pending.events.is_closed() {
                continue;
            }
            if past(pending.completion.deadline) {
                let _ = pending
                    .events
                    .send(StreamEvent::Failed(EngineError::DeadlineExceeded));
                continue;
            }
            let adapter = match adapters::slot_of(model, pending.completion.adapter.as_deref()) {
                Ok(slot) => slot,
                Err(e) => {
                    let _ = pending.events.send(StreamEvent::Failed(e));
                    continue;
                }
            };
            match self.tokenize(model, tokenizer, &pending, adapter) {
                Ok((prefix, suffix, prompt_tokens)) => {
                    let matcher = pending.matcher;
                    let c = pending.completion;
                    let row = Row {
                        events: pending.events,
                        sampler: Sampler::new(c.sampling),
                        logprobs: c.logprobs,
                        max_tokens: c.max_tokens,
                        deadline: c.deadline,
                        generated: Vec::new(),
                        text: RowText::new(c.stop),
                        prompt_tokens,
                        cached_tokens: prefix.len,
                        next: 0,
                        matcher,
                        adapter,
                    };
                    admitted.push(Admitted {
                        row,
                        prefix,
                        suffix,
                    });
                }
                Err(e) => {
                    let _ = pending.events.send(StreamEvent::Failed(e));
                }
            }
        }
        // By prefix, then by length: neighbours prefill together.
        admitted.sort_by_key(|a| (a.prefix.id, a.suffix.len()));
        let mut rest = admitted.into_iter().peekable();
        while let Some(id) = rest.peek().map(|a| a.prefix.id) {
            let mut same: Vec<Admitted> = Vec::new();
            while let Some(a) = rest.next_if(|a| a.prefix.id == id) {
                same.push(a);
            }
            let lengths: Vec<usize> = same.iter().map(|a| a.suffix.len()).collect();
            let mut same = same.into_iter();
            for group in prefill_groups(&lengths, model.pass_cost_tokens()) {
                let rows: Vec<Admitted> = same.by_ref().take(group.len()).collect();
                let senders: Vec<_> = rows.iter().map(|a| a.row.events.clone()).collect();
                if let Err(e) = self.prefill(model, tokenizer, eos, rows) {
                    let error = EngineError::Generate(std::sync::Arc::new(e));
                    for events in senders {
                        let _ = events.send(StreamEvent::Failed(error.clone()));
                    }
                }
            }
        }
    }

    /// The prompt's tokens, checked, split at the longest prefix the store
    /// holds, or computes the leading system messages' prefix for it.
    fn tokenize(
        &mut self,
        model: &Model,
        tokenizer: &Tokenizer,
        pending: &Pending,
        adapter: Option<usize>,
    ) -> Result<(Found, Vec<u32>, usize), EngineError> {
        let messages = &pending.completion.messages;
        let special = self.settings.special_tokens;
        let gen_err = |e: crate::Error| EngineError::Generate(std::sync::Arc::new(e));
        let prompt = tokenizer
            .chat_tokens(messages, true, special)
            .map_err(gen_err)?;
        let limit = self.settings.max_prompt_tokens;
        if prompt.len() > limit {
            return Err(EngineError::PromptTooLong {
                index: 0,
                tokens: prompt.len(),
                limit,
            });
        }
        let vocab = model.config().vocab_size;
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(gen_err(crate::Error::TokenOutOfRange { id, vocab }));
        }
        let found = self.store.lookup(adapter, &prompt);
        let shareable = shared_messages(messages)
            .map(|leading| tokenizer.chat_tokens(leading, false, special))
            .transpose()
            .map_err(gen_err)?
            .filter(|t| !t.is_empty() && t.len() < prompt.len() && prompt.starts_with(t));
        let prefix = match (found, shareable) {
            (Some(found), Some(tokens)) if found.len >= tokens.len() => {
                self.counters.prefix_hits.fetch_add(1, Ordering::Relaxed);
                found
            }
            (_, Some(tokens)) => {
                self.counters.prefix_misses.fetch_add(1, Ordering::Relaxed);
                let disk = prefix_disk::disk_under_adapter(
                    self.settings.prefix_disk.as_ref(),
                    model,
                    adapter,
                );
                let (prefix, origin) =
                    load_or_compute(model, &tokens, adapter, disk.as_ref()).map_err(gen_err)?;
                if origin == Origin::Folder {
                    let reads = &self.counters.prefix_folder_reads;
                    reads.fetch_add(1, Ordering::Relaxed);
                }
                self.store.insert(adapter, tokens, prefix.cache, false)
            }
            (Some(found), None) => {
                self.counters.prefix_hits.fetch_add(1, Ordering::Relaxed);
                found
            }
            (None, None) => Found {
                id: 0,
                len: 0,
                cache: KvCache::new(),
            },
        };
        let c = &self.counters;
        c.requests.fetch_add(1, Ordering::Relaxed);
        c.prompt_tokens
            .fetch_add(prompt.len() as u64, Ordering::Relaxed);
        c.cached_prompt_tokens
            .fetch_add(prefix.len as u64, Ordering::Relaxed);
        let suffix = prompt[prefix.len..].to_vec();
        Ok((prefix, suffix, prompt.len()))
    }

    /// Prefills `group` (one prefix, similar lengths) as one block, picks
    /// each row's first token, and adds the rows that go on to their
    /// prefix's batch.
    fn prefill(
        &mut self,
        model: &Model,
        tokenizer: &Tokenizer,
        eos: &[u32],
        group: Vec<Admitted>,
    ) -> crate::Result<()> {
        let prefix = group[0].prefix.clone();
        let mut cache = prefix.cache.fork(group.len() as i32)?;
        let rows: Vec<&[u32]> = group.iter().map(|a| a.suffix.as_slice()).collect();
        let adapters: Vec<Option<usize>> = group.iter().map(|a| a.row.adapter).collect();
        let logits = model.with_adapters(&adapters, || {
            let last = prefill_into(model, &mut cache, &rows)?;
            model.head(&last)
        })?;
        let logits = host_logits(&logits)?;
        let vocab = logits.len() / group.len();
        let mut keep = Vec::new();
        let mut joining = Vec::new();
        for (i, admitted) in group.into_iter().enumerate() {
            let mut row = admitted.row;
            let row_logits = &logits[i * vocab..(i + 1) * vocab];
            if emit(&mut row, row_logits, tokenizer, eos, &self.counters)? {
                keep.push(i);
                joining.push(row);
            }
        }
        if joining.is_empty() {
            return Ok(());
        }
        cache.retain_rows(&keep)?;
        match self.cohorts.iter_mut().find(|c| c.prefix == prefix.id) {
            Some(cohort) => {
                let running = std::mem::take(&mut cohort.cache);
                cohort.cache = KvCache::stack(vec![running, cache], JOIN_SPARE)?;
                cohort.rows.extend(joining);
            }
            None => self.cohorts.push(Cohort {
                prefix: prefix.id,
                cache,
                rows: joining,
            }),
        }
        Ok(())
    }
}

/// The leading system (or developer) messages: what requests of one
/// application share. `None` without any, or when nothing follows them.
fn shared_messages(messages: &[Message]) -> Option<&[Message]> {
    let n = messages
        .iter()
        .take_while(|m| m.role == "system" || m.role == "developer")
        .count();
    (n > 0 && n < messages.len()).then(|| &messages[..n])
}

fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// Takes out the rows whose caller dropped its stream or whose deadline
/// passed; their slots are free at once.
fn drop_gone_rows(cohort: &mut Cohort) {
    let keep: Vec<usize> = (0..cohort.rows.len())
        .filter(|&i| {
            let row = &cohort.rows[i];
            if row.events.is_closed() {
                return false;
            }
            if past(row.deadline) {
                let _ = row
                    .events
                    .send(StreamEvent::Failed(EngineError::DeadlineExceeded));
                return false;
            }
            true
        })
        .collect();
    retain(cohort, &keep);
}

/// Keeps rows `keep` of the cohort, cache and all. A cache that cannot
/// drop rows fails them all (it never happens with valid indices).
fn retain(cohort: &mut Cohort, keep: &[usize]) {
    if keep.len() == cohort.rows.len() {
        return;
    }
    if keep.is_empty() {
        cohort.rows.clear();
        cohort.cache = KvCache::new();
        return;
    }
    if let Err(e) = cohort.cache.retain_rows(keep) {
        let error = EngineError::Generate(std::sync::Arc::new(e));
        for row in cohort.rows.drain(..) {
            let _ = row.events.send(StreamEvent::Failed(error.clone()));
        }
        return;
    }
    let mut rows: Vec<Option<Row>> = cohort.rows.drain(..).map(Some).collect();
    cohort.rows = keep.iter().filter_map(|&i| rows[i].take()).collect();
}

/// One decoding step of a cohort: feeds each row's last token, picks the
/// next, and lets finished rows go.
fn decode(
    model: &Model,
    tokenizer: &Tokenizer,
    eos: &[u32],
    cohort: &mut Cohort,
    counters: &SharedCounters,
) -> crate::Result<()> {
    let ids: Vec<i32> = cohort.rows.iter().map(|r| r.next as i32).collect();
    let tokens = Array::from_slice(&ids, &[ids.len() as i32, 1]);
    let adapters: Vec<Option<usize>> = cohort.rows.iter().map(|r| r.adapter).collect();
    let logits =
        model.with_adapters(&adapters, || model.forward_last(&tokens, &mut cohort.cache))?;
    let logits = host_logits(&logits)?;
    let vocab = logits.len() / ids.len();
    let mut keep = Vec::with_capacity(ids.len());
    for (i, row) in cohort.rows.iter_mut().enumerate() {
        if emit(
            row,
            &logits[i * vocab..(i + 1) * vocab],
            tokenizer,
            eos,
            counters,
        )? {
            keep.push(i);
        }
    }
    retain(cohort, &keep);
    Ok(())
}

/// The logits `(B, vocab)` on the host, as f32.
fn host_logits(logits: &Array) -> crate::Result<Vec<f32>> {
    let logits = logits.as_dtype(mlx_rs::Dtype::Float32)?;
    Ok(host_slice::<f32>(Why::Host, "logits", &logits)?.to_vec())
}

/// Picks a row's next token from its logits and hands it back; returns
/// whether the row goes on. A row whose caller is gone stops here.
fn emit(
    row: &mut Row,
    logits: &[f32],
    tokenizer: &Tokenizer,
    eos: &[u32],
    counters: &SharedCounters,
) -> crate::Result<bool> {
    let masked;
    let logits = match &mut row.matcher {
        Some(grammar) => {
            masked = grammar.mask(logits, row.max_tokens - row.generated.len())?;
            masked.as_slice()
        }
        None => logits,
    };
    let Picked { id, logprob, top } = row
        .sampler
        .pick(logits, row.logprobs)
        .ok_or(crate::Error::NotFiniteLogits)?;
    if let Some(grammar) = &mut row.matcher {
        if !eos.contains(&id) {
            grammar.consume(id)?;
        }
    }
    let finish = |row: &Row, reason| {
        StreamEvent::Finished(Finish {
            reason,
            prompt_tokens: row.prompt_tokens,
            cached_tokens: row.cached_tokens,
            completion_tokens: row.generated.len(),
        })
    };
    if eos.contains(&id) {
        let whole = tokenizer.decode(&row.generated)?;
        let tail = row.text.advance(&whole, true).text;
        if !tail.is_empty() {
            let _ = row.events.send(StreamEvent::Text(tail));
        }
        let _ = row.events.send(finish(row, FinishReason::Stop));
        return Ok(false);
    }
    row.generated.push(id);
    counters.generated_tokens.fetch_add(1, Ordering::Relaxed);
    // A constraint that is met (the JSON closed) ends the row as EOS would.
    let complete = row.matcher.as_ref().is_some_and(RowGrammar::is_complete);
    let last = row.generated.len() >= row.max_tokens || complete;
    let whole = tokenizer.decode(&row.generated)?;
    let settled = row.text.advance(&whole, last);
    let logprobs = match logprob {
        Some(logprob) => {
            let entry = |id: u32, logprob: f32| -> crate::Result<TokenLogprob> {
                Ok(TokenLogprob {
                    id,
                    text: tokenizer.decode_with_special_tokens(&[id], false)?,
                    logprob,
                })
            };
            let top = top
                .into_iter()
                .map(|(id, lp)| entry(id, lp))
                .collect::<crate::Result<Vec<_>>>()?;
            Some((entry(id, logprob)?, top))
        }
        None => None,
    };
    let sent = row.events.send(StreamEvent::Token {
        id,
        text: settled.text,
        logprobs,
    });
    if sent.is_err() {
        return Ok(false);
    }
    let reason = if settled.stopped || complete {
        FinishReason::Stop
    } else if last {
        FinishReason::Length
    } else {
        row.next = id;
        return Ok(true);
    };
    let _ = row.events.send(finish(row, reason));
    Ok(false)
}

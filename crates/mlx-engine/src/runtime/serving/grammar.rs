//! Structured outputs: a row's tokens held to a JSON schema by llguidance
//! (the grammar engine llama.cpp and mistral.rs use), its mask applied to
//! that row's logits at every step.
//!
//! The token set llguidance walks is built once per engine, on the first
//! constrained request, from the model's `tokenizer.json` (byte-level or
//! byte-fallback vocabularies, what llama, qwen and Gemma ship), padded to
//! the logits' width: ids the tokenizer does not spell are never allowed.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::error::EngineError;

/// What a constrained answer must be.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Constraint {
    /// JSON valid under this JSON Schema (OpenAI's `json_schema` format).
    /// Whitespace between tokens is left out unless the schema's
    /// `x-guidance` options say otherwise: a small model given the choice
    /// can pad an answer with newlines until `max_tokens`.
    JsonSchema(serde_json::Value),
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
}

/// Tokens with these texts close what is open (a string, an array, an
/// object) or give the shortest value, in this order of preference: what a
/// row whose token budget runs out is finished with.
const CLOSERS: [&[u8]; 7] = [b"\"", b"}", b"]", b"1", b"0", b",", b":"];

/// When this few tokens are left, a constrained row checks whether it
/// must start closing its JSON to finish within `max_tokens`.
const CLOSING_WINDOW: usize = 48;

/// A row's compiled constraint, and whether it is closing its JSON.
pub(crate) struct RowGrammar {
    matcher: Matcher,
    closers: Arc<Vec<u32>>,
    /// Each token's length in bytes.
    lengths: Arc<Vec<u32>>,
    eos: u32,
    closing: bool,
}

impl std::fmt::Debug for RowGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowGrammar")
            .field("stopped", &self.matcher.is_stopped())
            .field("closing", &self.closing)
            .finish_non_exhaustive()
    }
}

fn constraint_err(e: impl std::fmt::Display) -> crate::Error {
    crate::Error::Constraint(e.to_string())
}

impl RowGrammar {
    /// `logits` with every token the constraint forbids now at -inf. With
    /// `remaining` tokens left (this one included), a row that could not
    /// otherwise finish its JSON in time is given only the token that
    /// closes it fastest, so that the answer parses even when the model
    /// would go on (a small model repeating a word inside a string).
    pub(crate) fn mask(&mut self, logits: &[f32], remaining: usize) -> crate::Result<Vec<f32>> {
        if !self.closing && remaining <= CLOSING_WINDOW {
            let needed = self.closing_length(remaining)?;
            self.closing = needed.is_none_or(|n| n + 1 >= remaining);
        }
        if self.closing {
            let only = closer(&mut self.matcher, &self.closers, &self.lengths, self.eos)?;
            return Ok(logits
                .iter()
                .enumerate()
                .map(|(i, &l)| {
                    if i as u32 == only {
                        l
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect());
        }
        let mask = self.matcher.compute_mask().map_err(constraint_err)?;
        Ok(logits
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                if mask.is_allowed(i as u32) {
                    l
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect())
    }

    /// The fewest tokens an answer can have (what closing from the start
    /// takes, up to `limit`; `None` past it).
    pub(crate) fn shortest_answer(&mut self, limit: usize) -> crate::Result<Option<usize>> {
        self.closing_length(limit)
    }

    /// Takes the token picked (not an end of sequence).
    pub(crate) fn consume(&mut self, id: u32) -> crate::Result<()> {
        self.matcher.consume_token(id).map_err(constraint_err)
    }

    /// Whether the JSON is complete and nothing may follow it.
    pub(crate) fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Tokens the closing path needs from here to an end (at most
    /// `limit`; `None` past it).
    fn closing_length(&mut self, limit: usize) -> crate::Result<Option<usize>> {
        let mut trial = self.matcher.deep_clone();
        for n in 0..=limit {
            if trial.is_stopped() {
                return Ok(Some(n));
            }
            let token = closer(&mut trial, &self.closers, &self.lengths, self.eos)?;
            if token == self.eos {
                return Ok(Some(n));
            }
            trial.consume_token(token).map_err(constraint_err)?;
        }
        Ok(None)
    }
}

/// The token that ends or closes soonest: the end of sequence where the
/// JSON may end, else the first closer allowed, else the longest token
/// allowed (a key the schema forces, in one token where the vocabulary
/// has it).
fn closer(matcher: &mut Matcher, closers: &[u32], lengths: &[u32], eos: u32) -> crate::Result<u32> {
    let mask = matcher.compute_mask().map_err(constraint_err)?;
    if mask.is_allowed(eos) {
        return Ok(eos);
    }
    closers
        .iter()
        .copied()
        .find(|&t| mask.is_allowed(t))
        .or_else(|| {
            mask.iter()
                .max_by_key(|&t| (lengths.get(t as usize).copied().unwrap_or(0), u32::MAX - t))
        })
        .ok_or_else(|| constraint_err("no token can continue the answer"))
}

/// The engine's grammar factory, made on first use.
pub(crate) struct Grammars {
    tokenizer_json: PathBuf,
    vocab_size: usize,
    eos: Vec<u32>,
    factory: OnceLock<Result<Built, String>>,
}

/// What the first constrained request builds.
struct Built {
    factory: Arc<ParserFactory>,
    closers: Arc<Vec<u32>>,
    lengths: Arc<Vec<u32>>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("tokenizer_json", &self.tokenizer_json)
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl Grammars {
    pub(crate) fn new(tokenizer_json: PathBuf, vocab_size: usize, eos: Vec<u32>) -> Grammars {
        Grammars {
            tokenizer_json,
            vocab_size,
            eos,
            factory: OnceLock::new(),
        }
    }

    fn built(&self) -> Result<&Built, EngineError> {
        self.factory
            .get_or_init(|| {
                // The vocabulary reader asserts on shapes it does not know.
                let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.build()));
                match built {
                    Ok(result) => result,
                    Err(_) => Err("reading the tokenizer's vocabulary panicked".into()),
                }
            })
            .as_ref()
            .map_err(|e| {
                EngineError::UnsupportedSchema(format!(
                    "structured outputs are not available for {}: {e}",
                    self.tokenizer_json.display()
                ))
            })
    }

    fn build(&self) -> Result<Built, String> {
        let text = std::fs::read(&self.tokenizer_json).map_err(|e| e.to_string())?;
        let json: serde_json::Value = serde_json::from_slice(&text).map_err(|e| e.to_string())?;
        let mut words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())?;
        words.resize(self.vocab_size, Vec::new());
        let closers = CLOSERS
            .iter()
            .filter_map(|text| words.iter().position(|w| w == text))
            .map(|id| id as u32)
            .collect();
        let lengths = words.iter().map(|w| w.len() as u32).collect();
        let first_eos = *self
            .eos
            .first()
            .ok_or("the model has no end-of-sequence token")?;
        let info = TokRxInfo::new(words.len() as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&self.eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Built {
            factory: Arc::new(factory),
            closers: Arc::new(closers),
            lengths: Arc::new(lengths),
        })
    }

    /// A matcher for `constraint`; a schema llguidance cannot enforce (a
    /// keyword it does not implement, an unsatisfiable one) is
    /// [`EngineError::UnsupportedSchema`] with its words.
    pub(crate) fn matcher(&self, constraint: &Constraint) -> Result<RowGrammar, EngineError> {
        let schema = match constraint {
            Constraint::JsonSchema(schema) => compact(schema.clone()),
            Constraint::JsonObject => compact(serde_json::json!({"type": "object"})),
        };
        let grammar = TopLevelGrammar::from_json_schema(schema);
        let built = self.built()?;
        let parser = built
            .factory
            .create_parser(grammar)
            .map_err(|e| EngineError::UnsupportedSchema(e.to_string()))?;
        Ok(RowGrammar {
            matcher: Matcher::new(Ok(parser)),
            closers: built.closers.clone(),
            lengths: built.lengths.clone(),
            eos: self.eos[0],
            closing: false,
        })
    }
}

/// `schema` with compact whitespace unless its `x-guidance` options choose.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(object) = schema.as_object_mut() {
        let options = object
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({}));
        if let Some(options) = options.as_object_mut() {
            options
                .entry("whitespace_flexible")
                .or_insert(serde_json::Value::Bool(false));
        }
    }
    schema
}

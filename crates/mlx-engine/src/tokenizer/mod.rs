//! The tokenizer, chat template and stop tokens of a model folder.

pub(crate) mod file;

use std::collections::BTreeSet;
use std::path::Path;

use serde::Serialize;

use crate::error::{Error, Result};

/// How special-token strings inside message contents are tokenized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SpecialTokens {
    /// As plain text (the default): a user who writes `<|im_end|>` gets the
    /// characters, not the control token, so untrusted text cannot end its
    /// turn or open a system message. The chat template's own special
    /// tokens stay special.
    #[default]
    AsText,
    /// As control tokens, as Hugging Face's `apply_chat_template` followed
    /// by `encode` does (and mlx_lm with it): only for trusted content.
    Honor,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// `tokenizer.json` through the `tokenizers` crate, the chat template from
/// `tokenizer_config.json` or `chat_template.jinja` through minijinja, and
/// the end-of-sequence ids from the configs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same vocabulary reading special-token strings as plain text,
    /// made the first time a message's content holds one: it is a copy of
    /// the whole vocabulary (tens of MB for Gemma's), which most programs
    /// never need.
    as_text: std::sync::OnceLock<tokenizers::Tokenizer>,
    /// Ids of the added tokens marked special (control tokens).
    special_ids: BTreeSet<u32>,
    template: Option<String>,
    bos: Option<String>,
    eos: Option<String>,
    eos_ids: BTreeSet<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("eos_ids", &self.eos_ids)
            .field("has_chat_template", &self.template.is_some())
            .finish_non_exhaustive()
    }
}

fn read_json(path: &Path) -> Option<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// A special token given as a string or as `{"content": ...}`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    v.as_str()
        .map(str::to_owned)
        .or_else(|| v.get("content")?.as_str().map(str::to_owned))
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    match v {
        serde_json::Value::Number(n) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|n| n as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// The files of a model folder that [`Tokenizer::load`] reads besides
/// `config.json`: what the ranks of a group compare with the weights.
pub(crate) const FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
];

impl Tokenizer {
    /// Loads the tokenizer of the model folder `dir`.
    pub fn load(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        let inner = crate::tokenizer::file::read(&path).map_err(|e| Error::Config {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let config = read_json(&dir.join("tokenizer_config.json")).unwrap_or_default();
        let template = std::fs::read_to_string(dir.join("chat_template.jinja"))
            .ok()
            .or_else(|| config.get("chat_template")?.as_str().map(str::to_owned));
        let bos = config.get("bos_token").and_then(token_text);
        let eos = config.get("eos_token").and_then(token_text);
        let mut eos_ids = BTreeSet::new();
        for file in ["config.json", "generation_config.json"] {
            if let Some(v) = read_json(&dir.join(file)).and_then(|c| c.get("eos_token_id").cloned())
            {
                eos_ids.extend(ids(&v));
            }
        }
        if let Some(id) = eos.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos_ids.insert(id);
        }
        let special_ids = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        Ok(Tokenizer {
            inner,
            as_text: std::sync::OnceLock::new(),
            special_ids,
            template,
            bos,
            eos,
            eos_ids,
        })
    }

    /// Token ids of `text`, without adding special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with_special_tokens(text, false)
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with_special_tokens(ids, true)
    }

    /// Token ids of `text` as Hugging Face's `encode(text,
    /// add_special_tokens=…)` gives them: with `add_special_tokens`, what
    /// the tokenizer's post-processor adds (e.g. a beginning-of-sequence
    /// token).
    pub fn encode_with_special_tokens(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Template(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids` as Hugging Face's `decode(ids,
    /// skip_special_tokens=…)` gives it.
    pub fn decode_with_special_tokens(
        &self,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Template(e.to_string()))
    }

    /// Ids in the vocabulary, with or without the added tokens (Hugging
    /// Face's `len(tokenizer)` and `tokenizer.vocab_size`).
    pub fn vocab_size(&self, with_added_tokens: bool) -> usize {
        self.inner.get_vocab_size(with_added_tokens)
    }

    /// The end-of-sequence token's text as the tokenizer config names it.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos.as_deref()
    }

    /// The id of a token's text, if it is one token.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Ids that end generation.
    pub fn eos_ids(&self) -> &BTreeSet<u32> {
        &self.eos_ids
    }

    /// Renders `messages` with the chat template (as Hugging Face does:
    /// `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
    /// `raise_exception`, `strftime_now`, `tojson`).
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .template
            .as_deref()
            .ok_or_else(|| Error::Template("the model has no chat template".to_owned()))?;
        let mut env = minijinja::Environment::new();
        // Hugging Face renders chat templates with both on: a template
        // whose block tags stand on lines of their own renders without
        // those lines.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::Template(e.to_string()))?;
        env.set_syntax(syntax);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.add_template("chat", template)
            .map_err(|e| Error::Template(e.to_string()))?;
        let messages: Vec<minijinja::Value> = messages
            .iter()
            .map(|m| {
                let map: std::collections::BTreeMap<String, minijinja::Value> = [
                    ("role".to_owned(), minijinja::Value::from(m.role.clone())),
                    (
                        "content".to_owned(),
                        minijinja::Value::from(m.content.clone()),
                    ),
                ]
                .into_iter()
                .collect();
                minijinja::Value::from(map)
            })
            .collect();
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.clone().unwrap_or_default(),
            eos_token => self.eos.clone().unwrap_or_default(),
        };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| Error::Template(e.to_string()))
    }

    /// The token ids of `messages` rendered with the chat template, with
    /// special-token strings inside the messages' contents read as
    /// `special` says. The template's own special tokens are always
    /// special.
    pub fn chat_tokens(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        special: SpecialTokens,
    ) -> Result<Vec<u32>> {
        let text = self.apply_chat_template(messages, add_generation_prompt)?;
        let encoding = self
            .inner
            .encode(text.as_str(), false)
            .map_err(|e| Error::Template(e.to_string()))?;
        if special == SpecialTokens::Honor {
            return Ok(encoding.get_ids().to_vec());
        }
        let spans = content_spans(&text, messages);
        let in_content =
            |&(start, end): &(usize, usize)| spans.iter().any(|s| start < s.end && end > s.start);
        // A control token whose text stands inside a message's content came
        // from that content, not from the template: it becomes the tokens of
        // its text read as plain text. Everything else keeps the whole
        // text's encoding (what mlx_lm produces), so that ordinary prompts,
        // and the shared prefix's tokens, are unchanged.
        let mut ids = Vec::with_capacity(encoding.len());
        for (&id, offsets) in encoding.get_ids().iter().zip(encoding.get_offsets()) {
            if self.special_ids.contains(&id) && in_content(offsets) {
                let as_text = self.as_text.get_or_init(|| {
                    let mut t = self.inner.clone();
                    t.set_encode_special_tokens(true);
                    t
                });
                let plain = as_text
                    .encode(&text[offsets.0..offsets.1], false)
                    .map_err(|e| Error::Template(e.to_string()))?;
                ids.extend_from_slice(plain.get_ids());
            } else {
                ids.push(id);
            }
        }
        Ok(ids)
    }
}

/// Where each message's content stands in the rendered `text`, in order
/// (byte ranges). Templates may trim a content; a content found neither
/// whole nor trimmed after the previous one is left out.
fn content_spans(text: &str, messages: &[Message]) -> Vec<std::ops::Range<usize>> {
    let mut spans = Vec::new();
    let mut cursor = 0;
    for message in messages {
        for content in [message.content.as_str(), message.content.trim()] {
            if content.is_empty() {
                break;
            }
            if let Some(found) = text[cursor..].find(content) {
                let start = cursor + found;
                spans.push(start..start + content.len());
                cursor = start + content.len();
                break;
            }
        }
    }
    spans
}

/// Hugging Face's `strftime_now(format)`: the local time now, formatted as
/// Python's `strftime` does (Llama 3's templates date their system
/// message with it, gpt-oss's require it). A format chrono cannot read is
/// an error, not a panic.
fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item<'_>> = StrftimeItems::new(&format).collect();
    if items.iter().any(|item| matches!(item, Item::Error)) {
        return Err(minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("strftime_now: {format:?} is not a strftime format"),
        ));
    }
    Ok(chrono::Local::now()
        .format_with_items(items.into_iter())
        .to_string())
}

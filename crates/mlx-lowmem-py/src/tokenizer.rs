//! The engine's tokenizer with what mlx_lm's `TokenizerWrapper` users call
//! (`encode`, `decode`, `eos_token_id`, `vocab_size`,
//! `apply_chat_template`), with Hugging Face's defaults.

use std::sync::Arc;

use mlx_engine::{Message, SpecialTokens};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::raise;

/// The loaded model's tokenizer (`tokenizer.json`, the chat template and
/// the end-of-sequence ids of the model folder).
#[pyclass(frozen, module = "mlx_lowmem._native")]
pub(crate) struct Tokenizer {
    pub(crate) inner: Arc<mlx_engine::Tokenizer>,
}

#[pymethods]
impl Tokenizer {
    /// Token ids of `text`; with `add_special_tokens` (Hugging Face's
    /// default) what the tokenizer adds around a text, e.g. a BOS token.
    #[pyo3(signature = (text, add_special_tokens = true))]
    fn encode(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        py.detach(|| {
            self.inner
                .encode_with_special_tokens(text, add_special_tokens)
        })
        .map_err(|e| raise("TokenizerError", e))
    }

    /// Text of `ids`; special tokens kept unless `skip_special_tokens`
    /// (Hugging Face's default keeps them).
    #[pyo3(signature = (ids, skip_special_tokens = false))]
    fn decode(&self, py: Python<'_>, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        py.detach(|| {
            self.inner
                .decode_with_special_tokens(&ids, skip_special_tokens)
        })
        .map_err(|e| raise("TokenizerError", e))
    }

    /// The end-of-sequence token's id: the one the tokenizer config names,
    /// else the lowest of the model's end-of-sequence ids.
    #[getter]
    fn eos_token_id(&self) -> Option<u32> {
        self.inner
            .eos_token()
            .and_then(|t| self.inner.token_id(t))
            .or_else(|| self.inner.eos_ids().iter().next().copied())
    }

    /// Every id that ends generation (config, generation config, tokenizer
    /// config).
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.inner.eos_ids().iter().copied().collect()
    }

    /// The end-of-sequence token's text, if the tokenizer config names one.
    #[getter]
    fn eos_token(&self) -> Option<String> {
        self.inner.eos_token().map(str::to_owned)
    }

    /// Ids in the base vocabulary, without added tokens (Hugging Face's
    /// `vocab_size`; `len(tokenizer)` counts them too).
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size(false)
    }

    fn __len__(&self) -> usize {
        self.inner.vocab_size(true)
    }

    /// The id of one token's text, or None.
    fn convert_tokens_to_ids(&self, token: &str) -> Option<u32> {
        self.inner.token_id(token)
    }

    /// `messages` (dicts with `role` and `content`) rendered with the
    /// model's chat template: the token ids (`tokenize=True`, Hugging
    /// Face's default) or the text.
    #[pyo3(signature = (messages, tokenize = true, add_generation_prompt = false))]
    fn apply_chat_template(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        tokenize: bool,
        add_generation_prompt: bool,
    ) -> PyResult<Py<PyAny>> {
        let messages = conversation(messages, 0)?;
        let inner = &self.inner;
        if tokenize {
            let ids = py
                .detach(|| {
                    inner.chat_tokens(&messages, add_generation_prompt, SpecialTokens::Honor)
                })
                .map_err(|e| raise("TokenizerError", e))?;
            Ok(PyList::new(py, ids)?.into_any().unbind())
        } else {
            let text = py
                .detach(|| inner.apply_chat_template(&messages, add_generation_prompt))
                .map_err(|e| raise("TokenizerError", e))?;
            Ok(text.into_pyobject(py)?.into_any().unbind())
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<mlx_lowmem Tokenizer: {} ids, end-of-sequence {:?}>",
            self.inner.vocab_size(true),
            self.inner.eos_ids()
        )
    }
}

/// One conversation: a sequence of dicts with string `role` and `content`
/// (what mlx_lm and spawnllm take). `index` names it in errors.
pub(crate) fn conversation(messages: &Bound<'_, PyAny>, index: usize) -> PyResult<Vec<Message>> {
    let mut out = Vec::new();
    for (i, item) in messages.try_iter()?.enumerate() {
        let item = item?;
        let field = |name: &str| -> PyResult<String> {
            let dict = item.cast::<PyDict>().map_err(|_| {
                raise(
                    "ConversationError",
                    format!("conversation {index}, message {i}: expected a dict with 'role' and 'content'"),
                )
            })?;
            match dict.get_item(name)? {
                Some(value) => value.extract::<String>().map_err(|_| {
                    raise(
                        "ConversationError",
                        format!("conversation {index}, message {i}: '{name}' is not a string"),
                    )
                }),
                None => Err(raise(
                    "ConversationError",
                    format!("conversation {index}, message {i}: no '{name}'"),
                )),
            }
        };
        out.push(Message::new(field("role")?, field("content")?));
    }
    Ok(out)
}

//! A word-level tokenizer in Gemma's chat shape, for the tests and benches
//! that label texts as cc-sentiment does on random Gemma checkpoints:
//! Gemma-like turn markers, the digits "1".."5" right after them, then the
//! given words; a chat template of Gemma's form. mlx_lm (through
//! transformers) and the engine both load it.

use std::path::Path;

use serde_json::json;

pub const SPECIALS: [&str; 6] = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
];

/// The ids of "1".."5".
pub fn label_ids() -> Vec<u32> {
    let first = SPECIALS.len() as u32;
    (first..first + 5).collect()
}

/// Writes `tokenizer.json`, `tokenizer_config.json` and
/// `generation_config.json` (EOS `<eos>`) into `dir`: the specials, the
/// digits, then each of `words` not already there. Returns the vocabulary's
/// size.
pub fn write_tokenizer(dir: &Path, words: impl IntoIterator<Item = String>) -> i32 {
    let mut vocab: Vec<String> = SPECIALS.iter().map(|s| (*s).to_owned()).collect();
    vocab.extend((1..=5).map(|n| n.to_string()));
    for w in words {
        if !vocab.contains(&w) {
            vocab.push(w);
        }
    }
    let ids: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, w)| (w.clone(), i.into()))
        .collect();
    let added: Vec<_> = SPECIALS
        .iter()
        .enumerate()
        .map(|(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
        "model": {"type": "WordLevel", "vocab": ids, "unk_token": "<unk>"}
    });
    std::fs::write(
        dir.join("tokenizer.json"),
        st_mmap::json::sorted(&tokenizer).to_string(),
    )
    .unwrap();
    let template = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }} {{ m.content }}<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn>model {% endif %}";
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        st_mmap::json::sorted(&config).to_string(),
    )
    .unwrap();
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": 1}"#).unwrap();
    vocab.len() as i32
}

/// The pieces the `Whitespace` pre-tokenizer makes: runs of word
/// characters, and runs of other non-space characters.
pub fn pieces(text: &str) -> Vec<String> {
    let word = |c: char| c.is_alphanumeric() || c == '_';
    let mut out: Vec<String> = Vec::new();
    let mut last: Option<bool> = None;
    for c in text.chars() {
        if c.is_whitespace() {
            last = None;
            continue;
        }
        let kind = word(c);
        match (last, out.last_mut()) {
            (Some(k), Some(piece)) if k == kind => piece.push(c),
            _ => out.push(c.to_string()),
        }
        last = Some(kind);
    }
    out
}

/// The pieces of `texts`, sorted, once each: the tokenizer's words.
pub fn words_of(texts: &[&str]) -> Vec<String> {
    let mut words: Vec<String> = texts.iter().flat_map(|t| pieces(t)).collect();
    words.sort();
    words.dedup();
    words
}

/// The user message cc-sentiment builds for one text
/// (`cc_sentiment.text.build_user_content`).
pub fn user_content(text: &str) -> String {
    let body = text.trim();
    if body.starts_with("DEVELOPER:") || body.starts_with("AI:") {
        format!("CONVERSATION:\n{body}")
    } else {
        format!("CONVERSATION:\nDEVELOPER: {body}")
    }
}

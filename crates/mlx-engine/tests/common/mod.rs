//! The tiny model the engine's tests run: a random llama with a
//! word-level tokenizer, and helpers around it.

#![allow(dead_code)]

pub mod adapter;
pub mod converted;
pub mod gemma_words;
pub mod logits;
pub mod tiny_gemma;
pub mod tiny_gpt_oss;
pub mod tiny_moe;

use std::path::Path;

use mlx_engine::{
    EngineConfig, KvCache, Message, MlxEngine, Model, QuantizedWeights, SpecialTokens, Tokenizer,
};
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::Array;

pub const VOCAB: i32 = 48;

use test_support::tiny_llama::TinyLlama;
pub use test_support::tiny_llama::{attention_weights, normal};

/// A tiny llama with a word-level tokenizer (`w0`…`w39` and chat markers)
/// and a chat template.
pub fn write_model(dir: &Path) {
    write_model_with(dir, false);
}

/// [`write_model`]; with `special_markers`, the chat markers `<s>`, `<u>`,
/// `<a>` and `<eos>` are special added tokens that the word vocabulary does
/// not know (as control tokens are in real tokenizers): read as text, they
/// become `<unk>`.
pub fn write_model_with(dir: &Path, special_markers: bool) {
    TinyLlama {
        vocab: VOCAB,
        config: serde_json::json!({"eos_token_id": 44}),
        ..TinyLlama::new("llama")
    }
    .write(dir);
    write_tokenizer(dir, special_markers);
}

/// The word-level tokenizer (`w0`…`w39`, `<unk>` 40, chat markers 41–44)
/// and chat template of the test models.
pub fn write_tokenizer(dir: &Path, special_markers: bool) {
    let mut vocab = serde_json::Map::new();
    vocab.insert("<unk>".into(), 40.into());
    for i in 0..40 {
        vocab.insert(format!("w{i}"), i.into());
    }
    let markers = [("<s>", 41), ("<u>", 42), ("<a>", 43), ("<eos>", 44)];
    let mut added = Vec::new();
    for (token, id) in markers {
        if special_markers {
            added.push(serde_json::json!({
                "id": id, "content": token, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }));
        } else {
            vocab.insert(token.into(), id.into());
        }
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(
        dir.join("tokenizer.json"),
        st_mmap::json::sorted(&tokenizer).to_string(),
    )
    .unwrap();
    let template = "{% for m in messages %}{% if m.role == 'system' %}<s> {% elif m.role == 'user' %}<u> {% else %}<a> {% endif %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}<a> {% endif %}";
    let tokenizer_config = serde_json::json!({"chat_template": template, "eos_token": "<eos>"});
    std::fs::write(
        dir.join("tokenizer_config.json"),
        st_mmap::json::sorted(&tokenizer_config).to_string(),
    )
    .unwrap();
}

pub fn system() -> Message {
    Message::new("system", "w1 w2 w3 w4 w5")
}

pub fn conversations() -> Vec<Vec<Message>> {
    [
        "w7",
        "w8 w9 w10 w11 w12 w13",
        "w3",
        "w20 w21 w22",
        "w30 w31 w32 w33 w34 w35 w36 w37",
        "w5 w6",
    ]
    .iter()
    .map(|u| vec![system(), Message::new("user", *u)])
    .collect()
}

pub fn engine(dir: &Path, batch_size: usize) -> MlxEngine {
    MlxEngine::new(
        EngineConfig::new(dir)
            .prefix_messages(vec![system()])
            .batch_size(batch_size)
            .worker_name("mlx-test")
            .quantized(QuantizedWeights::Keep),
    )
    .unwrap()
}

/// Greedy decoding of one conversation over its full prompt, no cache tricks.
pub fn reference(dir: &Path, conversation: &[Message], max_tokens: usize) -> String {
    let model = Model::loader(dir)
        .quantized(QuantizedWeights::Keep)
        .load()
        .unwrap();
    let tokenizer = Tokenizer::load(dir).unwrap();
    let mut ids: Vec<i32> = tokenizer
        .chat_tokens(conversation, true, SpecialTokens::AsText)
        .unwrap()
        .iter()
        .map(|&t| t as i32)
        .collect();
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let logits = model
            .forward(
                &Array::from_slice(&ids, &[1, ids.len() as i32]),
                &mut KvCache::new(),
            )
            .unwrap();
        let next = argmax_axis(logits.index((0, -1)), -1, None).unwrap();
        next.eval().unwrap();
        let id = next.item_exact::<u32>() as i32;
        if tokenizer.eos_ids().contains(&(id as u32)) {
            break;
        }
        out.push(id as u32);
        ids.push(id);
    }
    tokenizer.decode(&out).unwrap()
}

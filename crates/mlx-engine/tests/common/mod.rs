//! The tiny model the engine's tests run: a random llama with a
//! word-level tokenizer, and helpers around it.

#![allow(dead_code)]

pub mod gemma_words;
pub mod logits;
pub mod tiny_gemma;

use std::path::Path;

use mlx_engine::{
    EngineConfig, KvCache, Message, MlxEngine, Model, QuantizedWeights, SpecialTokens, Tokenizer,
};
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::Array;

pub const VOCAB: i32 = 48;

pub fn normal(shape: &[i32], seed: u64, std: f32) -> Array {
    let key = mlx_rs::random::key(seed).unwrap();
    mlx_rs::random::normal::<f32>(shape, None, std, &key).unwrap()
}

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
    let (hidden, heads, kv, inter) = (64, 4, 2, 128);
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": 2, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
        "rope_theta": 10000.0, "tie_word_embeddings": true, "eos_token_id": 44
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut seed = 7;
    let mut w = |shape: &[i32], std: f32| {
        seed += 1;
        normal(shape, seed, std)
    };
    let hd = hidden / heads;
    let mut weights = vec![
        (
            "model.embed_tokens.weight".to_owned(),
            w(&[VOCAB, hidden], 1.0),
        ),
        (
            "model.norm.weight".into(),
            Array::ones::<f32>(&[hidden]).unwrap(),
        ),
    ];
    for i in 0..2 {
        let p = format!("model.layers.{i}.");
        for (name, out, inp) in [
            ("self_attn.q_proj", heads * hd, hidden),
            ("self_attn.k_proj", kv * hd, hidden),
            ("self_attn.v_proj", kv * hd, hidden),
            ("self_attn.o_proj", hidden, heads * hd),
            ("mlp.gate_proj", inter, hidden),
            ("mlp.up_proj", inter, hidden),
            ("mlp.down_proj", hidden, inter),
        ] {
            weights.push((format!("{p}{name}.weight"), w(&[out, inp], 0.2)));
        }
        weights.push((
            format!("{p}input_layernorm.weight"),
            Array::ones::<f32>(&[hidden]).unwrap(),
        ));
        weights.push((
            format!("{p}post_attention_layernorm.weight"),
            Array::ones::<f32>(&[hidden]).unwrap(),
        ));
    }
    Array::save_safetensors(
        weights.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        dir.join("model.safetensors"),
    )
    .unwrap();
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
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = "{% for m in messages %}{% if m.role == 'system' %}<s> {% elif m.role == 'user' %}<u> {% else %}<a> {% endif %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}<a> {% endif %}";
    let tokenizer_config = serde_json::json!({"chat_template": template, "eos_token": "<eos>"});
    std::fs::write(
        dir.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
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
    let model = Model::load(dir, QuantizedWeights::Keep).unwrap();
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

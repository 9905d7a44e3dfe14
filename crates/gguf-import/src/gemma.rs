//! Gemma 3 from a llama.cpp GGUF into an mlx_lm `gemma3_text` folder.
//!
//! The tensors are read and decoded here (`gguf_quants`), not by MLX's
//! loader, which rejects Q5_0 and misreads Q4_K. llama.cpp's conversion
//! conventions for this architecture are undone: it stores every RMS norm
//! weight as 1 + w (Gemma's norms multiply by 1 + w, and mlx_lm applies
//! that itself), its metadata has no local RoPE base and no sliding
//! pattern (llama.cpp assumes 10,000 and every sixth layer global), and its
//! vocabulary is a SentencePiece BPE without merges. The tokenizer is built
//! the way the reference, transformers' GGUF reader for Gemma, builds it:
//! whitespace tokens spelled with `▁`, merges recovered from the vocabulary
//! in file order, byte fallback, control tokens special and user-defined
//! ones matched whole.

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::Array;

use crate::check::{Checked, TensorEntry};
use crate::error::{Error, Result};
use crate::output::{save_weights, write_configs, write_json, ImportWeights};
use crate::quants::dequantize;

/// llama.cpp's local RoPE base and sliding pattern for Gemma 3.
const LOCAL_ROPE_BASE: f64 = 10_000.0;
const SLIDING_PATTERN: usize = 6;
/// Group size and bits of the quantized import (mlx_lm's defaults).
const GROUP: i32 = 64;
const BITS: i32 = 4;

/// The tensor `name` of `checked`, which must have GGUF dimensions `dims`
/// (innermost first).
fn tensor<'a>(checked: &'a Checked, name: &str, dims: &[usize]) -> Result<&'a TensorEntry> {
    let t = checked
        .tensor(name)
        .ok_or_else(|| checked.bad(format!("tensor {name} is missing")))?;
    let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    if t.dims != want {
        return Err(checked.bad(format!(
            "tensor {name} has dimensions {:?}, the metadata implies {want:?}",
            t.dims
        )));
    }
    Ok(t)
}

/// GGUF tensor names → mlx_lm's `gemma3_text` names (without `.weight`).
fn rename(base: &str) -> Option<String> {
    match base {
        "token_embd" => return Some("model.embed_tokens".into()),
        "output_norm" => return Some("model.norm".into()),
        _ => {}
    }
    let (layer, part) = base.strip_prefix("blk.")?.split_once('.')?;
    let module = match part {
        "attn_norm" => "input_layernorm",
        "post_attention_norm" => "post_attention_layernorm",
        "ffn_norm" => "pre_feedforward_layernorm",
        "post_ffw_norm" => "post_feedforward_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{module}"))
}

/// Writes the `gemma3_text` folder for the checked GGUF at `path` into
/// `out` (an empty folder).
pub(crate) fn convert(
    path: &Path,
    checked: &Checked,
    out: &Path,
    weights: ImportWeights,
) -> Result<()> {
    let arch = "gemma3";
    let key = |k: &str| format!("{arch}.{k}");
    let hidden = checked.count(&key("embedding_length"))?;
    let layers = checked.count(&key("block_count"))?;
    let intermediate = checked.count(&key("feed_forward_length"))?;
    let heads = checked.count(&key("attention.head_count"))?;
    let kv_heads = checked.count(&key("attention.head_count_kv"))?;
    let head_dim = checked.count(&key("attention.key_length"))?;
    if checked.count(&key("attention.value_length"))? != head_dim {
        return Err(checked.bad("key and value head sizes differ; Gemma 3's are equal"));
    }
    if heads % kv_heads != 0 || head_dim % 2 != 0 {
        return Err(checked.bad(format!(
            "{heads} heads over {kv_heads} key/value heads of size {head_dim} do not divide evenly"
        )));
    }
    let context = checked.count(&key("context_length"))?;
    let window = checked.count(&key("attention.sliding_window"))?;
    let eps = checked.float(&key("attention.layer_norm_rms_epsilon"))?;
    let rope_base = checked.float(&key("rope.freq_base"))?;
    let tokens = checked
        .texts("tokenizer.ggml.tokens")
        .filter(|t| !t.is_empty())
        .ok_or_else(|| checked.bad("tokenizer.ggml.tokens is missing or empty"))?;
    let vocab = tokens.len();
    if checked.tensor("output.weight").is_some() {
        return Err(checked.bad(
            "the file has its own output.weight; only a head tied to the embedding is supported",
        ));
    }

    // Every tensor the model needs, with the dimensions the metadata gives.
    let (q, kv) = (heads * head_dim, kv_heads * head_dim);
    let mut expected: Vec<(String, Vec<usize>)> = vec![
        ("token_embd".into(), vec![hidden, vocab]),
        ("output_norm".into(), vec![hidden]),
    ];
    for i in 0..layers {
        let b = |p: &str| format!("blk.{i}.{p}");
        expected.extend([
            (b("attn_norm"), vec![hidden]),
            (b("post_attention_norm"), vec![hidden]),
            (b("ffn_norm"), vec![hidden]),
            (b("post_ffw_norm"), vec![hidden]),
            (b("attn_q"), vec![hidden, q]),
            (b("attn_k"), vec![hidden, kv]),
            (b("attn_v"), vec![hidden, kv]),
            (b("attn_output"), vec![q, hidden]),
            (b("attn_q_norm"), vec![head_dim]),
            (b("attn_k_norm"), vec![head_dim]),
            (b("ffn_gate"), vec![hidden, intermediate]),
            (b("ffn_up"), vec![hidden, intermediate]),
            (b("ffn_down"), vec![intermediate, hidden]),
        ]);
    }
    let entries = expected
        .iter()
        .map(|(base, dims)| {
            Ok((
                base.as_str(),
                tensor(checked, &format!("{base}.weight"), dims)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some(extra) = checked.tensors.iter().find(|t| {
        !expected
            .iter()
            .any(|(b, _)| t.name == format!("{b}.weight"))
    }) {
        return Err(checked.bad(format!("unexpected tensor {}", extra.name)));
    }

    let file = std::fs::File::open(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let mut arrays: Vec<(String, Array)> = Vec::new();
    for (base, entry) in entries {
        let target = rename(base).expect("every expected tensor has a name");
        let mut bytes = vec![0u8; entry.size as usize];
        st_mmap::read_exact_at(&file, &mut bytes, entry.start).map_err(|e| Error::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        let mut values = dequantize(entry.ty, &bytes);
        drop(bytes);
        if base.ends_with("norm") {
            // llama.cpp stored 1 + w; mlx_lm adds the 1 itself.
            values.iter_mut().for_each(|v| *v -= 1.0);
        }
        let shape: Vec<i32> = entry.dims.iter().rev().map(|&d| d as i32).collect();
        let w = Array::from_slice(&values, &shape);
        drop(values);
        let quantize = weights == ImportWeights::Quantized && shape.len() == 2;
        if quantize {
            let (wq, scales, biases) = mlx_rs::ops::quantize(&w, GROUP, BITS)?;
            arrays.push((format!("{target}.weight"), wq));
            arrays.push((format!("{target}.scales"), scales));
            arrays.push((format!("{target}.biases"), biases));
        } else {
            arrays.push((format!("{target}.weight"), w));
        }
    }
    save_weights(checked, out, &arrays)?;
    drop(arrays);

    let bos = checked.token_id("tokenizer.ggml.bos_token_id", vocab)?;
    let eos = checked.token_id("tokenizer.ggml.eos_token_id", vocab)?;
    let config = serde_json::json!({
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "vocab_size": vocab,
        "rope_theta": rope_base,
        "rope_local_base_freq": LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": window,
        "sliding_window_pattern": SLIDING_PATTERN,
        "max_position_embeddings": context,
        "tie_word_embeddings": true,
        "bos_token_id": bos,
        "eos_token_id": eos,
    });
    let quantization = (weights == ImportWeights::Quantized).then_some((GROUP, BITS));
    write_configs(out, config, quantization, bos, eos)?;
    write_tokenizer(checked, tokens, out, bos, eos, context)
}

/// ggml's token types that matter here.
const CONTROL: f64 = 3.0;
const USER_DEFINED: f64 = 4.0;

/// The vocabulary as the tokenizer spells it: a token made only of
/// whitespace that holds a space is stored with real spaces, but looked up
/// after the normalizer turned spaces into `▁`.
fn respell(token: &str) -> String {
    if token.contains(' ') && token.trim().is_empty() {
        "\u{2581}".repeat(token.chars().count())
    } else {
        token.to_owned()
    }
}

/// The merges a SentencePiece BPE vocabulary implies: every way to cut a
/// token into two tokens, best first — tokens in file order, then the
/// longer left piece, then the longer right piece.
fn merges(ids: &HashMap<&str, usize>) -> Vec<(String, String)> {
    // Each spelling once, at its last position (a map keyed by spelling).
    let mut order: Vec<(usize, &str)> = ids.iter().map(|(t, &i)| (i, *t)).collect();
    order.sort_unstable();
    let mut merges: Vec<(usize, usize, usize, &str, &str)> = Vec::new();
    for (rank, token) in order {
        let cuts = token.char_indices().skip(1).map(|(at, _)| at);
        for at in cuts {
            let (left, right) = token.split_at(at);
            if ids.contains_key(left) && ids.contains_key(right) {
                let (l, r) = (left.chars().count(), right.chars().count());
                merges.push((rank, usize::MAX - l, usize::MAX - r, left, right));
            }
        }
    }
    merges.sort_unstable();
    merges
        .into_iter()
        .map(|(_, _, _, l, r)| (l.to_owned(), r.to_owned()))
        .collect()
}

fn write_tokenizer(
    checked: &Checked,
    tokens: &[String],
    out: &Path,
    bos: usize,
    eos: usize,
    context: usize,
) -> Result<()> {
    let model = checked.text("tokenizer.ggml.model").unwrap_or_default();
    if model != "llama" {
        return Err(checked.bad(format!(
            "tokenizer model {model:?} is not supported for Gemma 3; only \"llama\" (SentencePiece BPE) is"
        )));
    }
    let types = checked
        .numbers("tokenizer.ggml.token_type")
        .filter(|t| t.len() == tokens.len())
        .ok_or_else(|| checked.bad("tokenizer.ggml.token_type is missing or not one per token"))?;
    let spelled: Vec<String> = tokens.iter().map(|t| respell(t)).collect();
    let mut ids: HashMap<&str, usize> = HashMap::with_capacity(spelled.len());
    for (i, t) in spelled.iter().enumerate() {
        ids.insert(t, i);
    }
    let vocab: serde_json::Map<String, serde_json::Value> = ids
        .iter()
        .map(|(t, &i)| ((*t).to_owned(), i.into()))
        .collect();
    let merges = merges(&ids);
    let added = |i: usize, token: &str, special: bool| {
        serde_json::json!({"id": i, "content": token, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": special})
    };
    // Control tokens are special; user-defined ones (runs of newlines, HTML
    // tags) plain added tokens, matched whole on the raw text, where their
    // file spelling is in the vocabulary.
    let mut added_tokens: Vec<serde_json::Value> = Vec::new();
    for (i, (token, &ty)) in tokens.iter().zip(types).enumerate() {
        if ty == CONTROL {
            added_tokens.push(added(i, token, true));
        }
    }
    for (token, &ty) in tokens.iter().zip(types) {
        if ty == USER_DEFINED {
            if let Some(&id) = ids.get(token.as_str()) {
                added_tokens.push(added(id, token, false));
            }
        }
    }
    let unk = checked
        .number("tokenizer.ggml.unknown_token_id")
        .and_then(|u| tokens.get(u as usize))
        .cloned()
        .unwrap_or_else(|| "<unk>".into());
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": tokens[bos], "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {tokens[bos].clone(): {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    write_json(&out.join("tokenizer.json"), &tokenizer)?;
    let name = |id: Option<f64>| id.and_then(|i| tokens.get(i as usize)).cloned();
    write_json(
        &out.join("tokenizer_config.json"),
        &serde_json::json!({
            "tokenizer_class": "GemmaTokenizer",
            "bos_token": tokens[bos],
            "eos_token": tokens[eos],
            "pad_token": name(checked.number("tokenizer.ggml.padding_token_id")),
            "unk_token": unk,
            "add_bos_token": true,
            "add_eos_token": false,
            "clean_up_tokenization_spaces": false,
            "model_max_length": context,
        }),
    )?;
    Ok(())
}

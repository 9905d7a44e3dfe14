//! Importing a llama-architecture GGUF (e.g. SmolLM2) into an mlx_lm-format
//! model folder: weights through MLX's GGUF loader, `tokenizer.json` built
//! from the GGUF vocabulary and merges, chat template and special tokens.

use std::path::Path;

use mlx_rs::io::GgufFile;
use mlx_rs::ops::dequantize;
use mlx_rs::{Array, Dtype};

use crate::error::{Error, Result};
use crate::output::{save_weights, write_configs, write_json, ImportWeights};

/// The GGUF being imported: where errors point.
struct Source<'a> {
    path: &'a Path,
    g: GgufFile,
}

impl Source<'_> {
    fn bad(&self, message: impl std::fmt::Display) -> Error {
        Error::Gguf {
            path: self.path.to_path_buf(),
            message: message.to_string(),
        }
    }
}

/// Undoes llama.cpp's interleaving of q/k rows within each head, which its
/// converter applies for its own RoPE layout (per head, rows (2, d/2) were
/// stored as (d/2, 2)).
fn unpermute(a: &Array, heads: i32) -> Result<Array> {
    let shape = a.shape().to_vec();
    let (rows, cols) = (shape[0], shape[1]);
    let half = rows / heads / 2;
    Ok(a.reshape(&[heads, half, 2, cols])?
        .transpose_axes(&[0, 2, 1, 3])?
        .reshape(&[rows, cols])?)
}

/// Imports `gguf` into the folder `out`, replacing it if it exists.
///
/// The file's structure is checked before MLX reads it (counts, lengths and
/// tensor extents against the file's size; tensor types the import can
/// convert), and the model's numbers before they size anything. The folder
/// is built beside `out` and renamed into place: an error leaves `out` as
/// it was.
pub fn import_gguf(gguf: &Path, out: &Path, weights: ImportWeights) -> Result<()> {
    let checked = crate::check::check(gguf)?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    std::fs::create_dir_all(&parent).map_err(io(&parent))?;
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "import".into());
    let building = tempfile::Builder::new()
        .prefix(&format!(".{name}.partial-"))
        .tempdir_in(&parent)
        .map_err(io(&parent))?;
    match checked.text("general.architecture") {
        // Its tensor types are beyond MLX's loader: read here.
        Some("gemma3") => crate::gemma::convert(gguf, &checked, building.path(), weights)?,
        _ => {
            check_mlx_loads(gguf, &checked)?;
            let g = GgufFile::load(gguf).map_err(|e| Error::Gguf {
                path: gguf.to_path_buf(),
                message: e.to_string(),
            })?;
            let source = Source { path: gguf, g };
            convert(&source, &checked, building.path(), weights)?;
        }
    }
    // The tokenizer must load as the engine loads it (a corrupt merges list
    // fails here) before the folder is published.
    tokenizers::Tokenizer::from_file(building.path().join("tokenizer.json"))
        .map_err(|e| checked.bad(format!("the vocabulary does not make a tokenizer: {e}")))?;
    // Replace `out` whole: the old folder is moved aside first, so that at
    // every moment `out` is either the old import or the new one.
    let aside = match out.exists() {
        true => {
            let old = tempfile::Builder::new()
                .prefix(&format!(".{name}.old-"))
                .tempdir_in(&parent)
                .map_err(io(&parent))?;
            std::fs::rename(out, old.path().join("previous")).map_err(io(out))?;
            Some(old)
        }
        false => None,
    };
    let built = building.keep();
    if let Err(e) = std::fs::rename(&built, out) {
        // Put the previous import back; the new one goes.
        if let Some(old) = &aside {
            let _ = std::fs::rename(old.path().join("previous"), out);
        }
        let _ = std::fs::remove_dir_all(&built);
        return Err(io(out)(e));
    }
    Ok(())
}

/// The llama path reads tensors through MLX's loader, which converts only
/// these types (and decodes Q4_K wrongly, so it is not offered it).
fn check_mlx_loads(path: &Path, checked: &crate::check::Checked) -> Result<()> {
    use crate::check::{F16, F32, Q4_0, Q4_1, Q8_0};
    let loadable = [F32, F16, Q4_0, Q4_1, Q8_0];
    match checked.tensors.iter().find(|t| !loadable.contains(&t.ty)) {
        Some(t) => Err(Error::Gguf {
            path: path.to_path_buf(),
            message: format!(
                "tensor {:?} has ggml type {} ({}), which this importer does not convert for this architecture (supported: F32, F16, Q4_0, Q4_1, Q8_0)",
                t.name, t.ty.id, t.ty.name
            ),
        }),
        None => Ok(()),
    }
}

/// Writes the mlx_lm folder for `source` into `out` (an empty folder).
fn convert(
    source: &Source<'_>,
    checked: &crate::check::Checked,
    out: &Path,
    weights: ImportWeights,
) -> Result<()> {
    let g = &source.g;
    let arch = g
        .get_metadata_string("general.architecture")
        .map_err(|e| source.bad(e))?
        .unwrap_or_default();
    if arch != "llama" {
        return Err(Error::UnsupportedArchitecture {
            model_type: arch,
            supported: &["llama"],
        });
    }
    let heads = checked.count("llama.attention.head_count")?;
    let kv_heads = checked.count("llama.attention.head_count_kv")?;
    let layers = checked.count("llama.block_count")?;
    let hidden = checked.count("llama.embedding_length")?;
    let intermediate = checked.count("llama.feed_forward_length")?;
    let context = checked.count("llama.context_length")?;
    if heads % kv_heads != 0 || hidden % heads != 0 || (hidden / heads) % 2 != 0 {
        return Err(source.bad(format!(
            "{heads} heads of {kv_heads} key/value heads over {hidden} dimensions do not divide evenly into even head sizes"
        )));
    }
    for i in 0..layers {
        let key = format!("blk.{i}.attn_q.weight");
        if !checked.tensors.iter().any(|t| t.name == key) {
            return Err(source.bad(format!(
                "llama.block_count is {layers} but there is no tensor {key}"
            )));
        }
    }
    let tensors = g.arrays().map_err(|e| source.bad(e))?;
    let tied = !tensors.contains_key("output.weight");
    let (heads, kv_heads) = (heads as i32, kv_heads as i32);

    let mut out_tensors: Vec<(String, Array)> = Vec::new();
    let mut quantized_any = false;
    let mut names: Vec<&String> = tensors.keys().filter(|k| k.ends_with(".weight")).collect();
    names.sort();
    for name in names {
        let base = name.trim_end_matches(".weight");
        let target = rename(base).ok_or_else(|| source.bad(format!("unexpected tensor {name}")))?;
        let permute = if base.ends_with("attn_q") {
            Some(heads)
        } else if base.ends_with("attn_k") {
            Some(kv_heads)
        } else {
            None
        };
        let w = &tensors[name];
        if let Some(h) = permute {
            // Rows regroup per head in pairs: they must divide evenly.
            if w.ndim() != 2 || w.shape()[0] % (2 * h) != 0 {
                return Err(source.bad(format!(
                    "{name} has shape {:?}, which does not split into {h} heads",
                    w.shape()
                )));
            }
        }
        let scales = tensors.get(&format!("{base}.scales"));
        let biases = tensors.get(&format!("{base}.biases"));
        match (scales, biases) {
            (Some(s), Some(b)) => {
                // GGUF blocks hold 32 elements; the packing gives the bits
                // (Q4_0/Q4_1: 4, Q8_0: 8).
                let group = 32;
                let elements = s.shape()[1] * group;
                let bits = w.shape()[1] * 32 / elements;
                if ![4, 8].contains(&bits) || w.shape()[1] * 32 % elements != 0 {
                    return Err(source.bad(format!(
                        "{name}: only 4- and 8-bit 32-element blocks are supported"
                    )));
                }
                let (s, b) = (s.as_dtype(Dtype::Float32)?, b.as_dtype(Dtype::Float32)?);
                // Only 4-bit layers stay quantized, so that one global
                // `quantization` entry describes them all.
                let keep = weights == ImportWeights::Quantized && bits == 4;
                match keep {
                    false => {
                        let mut dense = dequantize(w, &s, &b, group, bits)?;
                        if let Some(h) = permute {
                            dense = unpermute(&dense, h)?;
                        }
                        out_tensors.push((format!("{target}.weight"), dense));
                    }
                    true => {
                        quantized_any = true;
                        let fix = |a: &Array| -> Result<Array> {
                            permute.map_or(Ok(a.clone()), |h| unpermute(a, h))
                        };
                        out_tensors.push((format!("{target}.weight"), fix(w)?));
                        out_tensors.push((format!("{target}.scales"), fix(&s)?));
                        out_tensors.push((format!("{target}.biases"), fix(&b)?));
                    }
                }
            }
            _ => {
                let mut dense = w.as_dtype(Dtype::Float32)?;
                if let Some(h) = permute {
                    dense = unpermute(&dense, h)?;
                }
                out_tensors.push((format!("{target}.weight"), dense));
            }
        }
    }
    save_weights(checked, out, &out_tensors)?;

    let tokens = g
        .get_metadata_strings("tokenizer.ggml.tokens")
        .map_err(|e| source.bad(e))?
        .unwrap_or_default();
    if tokens.is_empty() {
        return Err(source.bad("tokenizer.ggml.tokens is missing or empty"));
    }
    let bos = checked.token_id("tokenizer.ggml.bos_token_id", tokens.len())?;
    let eos = checked.token_id("tokenizer.ggml.eos_token_id", tokens.len())?;
    let config = serde_json::json!({
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden / heads as usize,
        "rms_norm_eps": checked.float("llama.attention.layer_norm_rms_epsilon")?,
        "rope_theta": checked.float("llama.rope.freq_base")?,
        "max_position_embeddings": context,
        "vocab_size": tokens.len(),
        "tie_word_embeddings": tied,
        "bos_token_id": bos,
        "eos_token_id": eos,
    });
    write_configs(out, config, quantized_any.then_some((32, 4)), bos, eos)?;
    write_tokenizer(source, &tokens, out, bos, eos)?;
    Ok(())
}

/// GGUF tensor names → mlx_lm's.
fn rename(base: &str) -> Option<String> {
    let fixed = match base {
        "token_embd" => return Some("model.embed_tokens".into()),
        "output_norm" => return Some("model.norm".into()),
        "output" => return Some("lm_head".into()),
        _ => base,
    };
    let rest = fixed.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let module = match part {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{module}"))
}

/// A byte-level BPE `tokenizer.json` (GPT-2 style, as `tokenizer.ggml.model
/// = "gpt2"` means), digits split one by one first (SmolLM's pre-tokenizer),
/// control tokens (type 3) as special added tokens.
fn write_tokenizer(
    source: &Source<'_>,
    tokens: &[String],
    out: &Path,
    bos: usize,
    eos: usize,
) -> Result<()> {
    let g = &source.g;
    let model = g
        .get_metadata_string("tokenizer.ggml.model")
        .map_err(|e| source.bad(e))?
        .unwrap_or_default();
    if model != "gpt2" {
        return Err(source.bad(format!(
            "tokenizer model {model:?} is not supported; only \"gpt2\" (byte-level BPE) is"
        )));
    }
    let merges = g
        .get_metadata_strings("tokenizer.ggml.merges")
        .map_err(|e| source.bad(e))?
        .unwrap_or_default();
    let types: Vec<i32> = match g
        .get_metadata_array("tokenizer.ggml.token_type")
        .map_err(|e| source.bad(e))?
    {
        Some(a) => {
            let a = a.as_dtype(Dtype::Int32)?;
            a.eval()?;
            a.as_slice::<i32>().to_vec()
        }
        None => vec![1; tokens.len()],
    };
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i.into()))
        .collect();
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types.get(*i) == Some(&3))
        .map(|(i, t)| {
            serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    write_json(&out.join("tokenizer.json"), &tokenizer)?;
    let mut tokenizer_config = serde_json::json!({
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": tokens.get(bos),
        "eos_token": tokens.get(eos),
        "pad_token": tokens.get(eos),
        "unk_token": tokens.get(eos),
        "add_prefix_space": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 8192,
    });
    if let Some(template) = g
        .get_metadata_string("tokenizer.chat_template")
        .map_err(|e| source.bad(e))?
    {
        tokenizer_config["chat_template"] = template.into();
    }
    write_json(&out.join("tokenizer_config.json"), &tokenizer_config)?;
    Ok(())
}

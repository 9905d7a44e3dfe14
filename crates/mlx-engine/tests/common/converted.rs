//! Tiny checkpoints as users get them: written in f32 here, then cast
//! (and quantized) by mlx_lm 0.32.2's own `convert`
//! (`tests/parity/mlx_lm_convert.py`).

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};
use test_support::tiny_llama::TinyLlama;

use super::tiny_gemma::{write_gemma3, Layout};
use super::tiny_gpt_oss::write_gpt_oss;
use super::tiny_moe::{write_mixtral, write_qwen3_moe};
use super::VOCAB;

/// How mlx_lm's `convert` quantizes: `(bits, group_size)`.
pub type Quantize = Option<(u32, u32)>;

/// The tiny f32 model of `family` (llama, qwen2, qwen3, qwen3_moe,
/// mixtral, gpt_oss, gemma3), with a tokenizer transformers can load (`convert`
/// loads and saves it).
pub fn write_f32(family: &str, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    match family {
        "qwen3_moe" => write_qwen3_moe(dir),
        "mixtral" => write_mixtral(dir),
        "gpt_oss" => write_gpt_oss(dir),
        "gemma3" => write_gemma3(dir, Layout::Text),
        "llama" | "qwen2" | "qwen3" => {
            let model_type = match family {
                "llama" => "llama",
                "qwen2" => "qwen2",
                _ => "qwen3",
            };
            TinyLlama {
                layers: 3,
                vocab: VOCAB,
                // mlx_lm's qwen3 requires both (the others ignore them).
                config: json!({"eos_token_id": 44, "max_position_embeddings": 256, "head_dim": 16}),
                ..TinyLlama::new(model_type)
            }
            .write(dir);
            super::write_tokenizer(dir, false);
        }
        other => panic!("no tiny {other}"),
    }
    let path = dir.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["tokenizer_class"] = "PreTrainedTokenizerFast".into();
    std::fs::write(&path, st_mmap::json::sorted(&config).to_string()).unwrap();
}

/// `src` converted by mlx_lm into `dst`: cast to `dtype` (bfloat16,
/// float16, float32) and quantized as `quantize` says.
pub fn convert(python: &str, src: &Path, dst: &Path, dtype: &str, quantize: Quantize) {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/parity/mlx_lm_convert.py"
    );
    let mut command = Command::new(python);
    command.arg(script).arg(src).arg(dst).arg(dtype);
    if let Some((bits, group)) = quantize {
        command.args([bits.to_string(), group.to_string()]);
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "mlx_lm convert: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The tiny `family` model in `dtype`, quantized as `quantize` says, as
/// mlx_lm's `convert` writes it into `dir` — but for the tokenizer, which
/// stays the word-level one written here: transformers saves it again as
/// the family's own class (Qwen2Tokenizer, with an unknown token the
/// vocabulary lacks), which reads the test's words otherwise.
pub fn write_converted(python: &str, family: &str, dir: &Path, dtype: &str, quantize: Quantize) {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("f32");
    write_f32(family, &src);
    convert(python, &src, dir, dtype, quantize);
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(file), dir.join(file)).unwrap();
    }
    let template = dir.join("chat_template.jinja");
    if template.is_file() && !src.join("chat_template.jinja").is_file() {
        std::fs::remove_file(template).unwrap();
    }
}

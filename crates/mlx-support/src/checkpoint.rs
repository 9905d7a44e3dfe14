//! Which tensors of a checkpoint mlx_lm leaves out when it loads one: its
//! `sanitize` steps (0.32.2) and what a non-strict load (0.31.3) ignores.
//! A tool that rewrites a checkpoint the way Python does (adapter-fuse)
//! drops the same ones, so that its output has Python's tensor set.

/// Tower prefixes (after an optional `model.`) of Gemma 4's multimodal
/// checkpoints, none of which the text model loads.
const GEMMA4_TOWERS: &[&str] = &[
    "vision_tower",
    "multi_modal_projector",
    "audio_tower",
    "embed_audio",
    "embed_vision",
    "vision_embedder",
];

/// Gemma 4 tensors that are never parameters of mlx_lm's model.
const GEMMA4_NEVER_LOADED: &[&str] = &[
    "self_attn.rotary_emb",
    "input_max",
    "input_min",
    "output_max",
    "output_min",
];

/// Whether mlx_lm leaves tensor `key` out when it loads a checkpoint whose
/// `config.json` is `config`: Gemma 3's and Gemma 4's vision and audio
/// towers, and the key/value weights that checkpoints made with mlx_lm
/// 0.31.3 still carry for Gemma 4's KV-shared layers. Other architectures
/// keep everything.
pub fn unused_by_mlx_lm(config: &serde_json::Value, key: &str) -> bool {
    let model_type = config.get("model_type").and_then(|t| t.as_str());
    match model_type {
        Some("gemma3") => ["vision_tower.", "multi_modal_projector."]
            .iter()
            .any(|p| key.starts_with(p)),
        Some("gemma4") | Some("gemma4_text") => {
            let bare = key.strip_prefix("model.").unwrap_or(key);
            if model_type == Some("gemma4") && GEMMA4_TOWERS.iter().any(|t| bare.starts_with(t)) {
                return true;
            }
            if GEMMA4_NEVER_LOADED.iter().any(|s| key.contains(s)) {
                return true;
            }
            kv_shared_layer_kv(config, key)
        }
        _ => false,
    }
}

/// A k/v projection or k norm of a Gemma 4 layer that reuses an earlier
/// layer's keys and values.
fn kv_shared_layer_kv(config: &serde_json::Value, key: &str) -> bool {
    let text = config.get("text_config").unwrap_or(config);
    let count = |field: &str| text.get(field).and_then(|v| v.as_u64());
    let (Some(layers), shared) = (
        count("num_hidden_layers"),
        count("num_kv_shared_layers").unwrap_or(20),
    ) else {
        return false;
    };
    let is_kv = [
        ".self_attn.k_proj",
        ".self_attn.v_proj",
        ".self_attn.k_norm",
    ]
    .iter()
    .any(|s| key.contains(s));
    let layer = key
        .split_once("layers.")
        .and_then(|(_, rest)| rest.split('.').next())
        .and_then(|n| n.parse::<u64>().ok());
    is_kv && layer.is_some_and(|i| i >= layers.saturating_sub(shared))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn gemma4_towers_and_shared_layer_kv_are_unused() {
        let config = json!({"model_type": "gemma4", "text_config": {"num_hidden_layers": 35, "num_kv_shared_layers": 20}});
        for key in [
            "vision_tower.encoder.patch.weight",
            "model.audio_tower.conv.weight",
            "embed_vision.embedding_projection.weight",
            "language_model.model.layers.15.self_attn.k_proj.weight",
            "language_model.model.layers.34.self_attn.v_proj.scales",
            "language_model.model.layers.20.self_attn.k_norm.weight",
        ] {
            assert!(unused_by_mlx_lm(&config, key), "{key}");
        }
        for key in [
            "language_model.model.layers.14.self_attn.k_proj.weight",
            "language_model.model.layers.34.self_attn.q_proj.weight",
            "language_model.model.embed_tokens.weight",
            "language_model.model.embed_tokens_per_layer.scales",
        ] {
            assert!(!unused_by_mlx_lm(&config, key), "{key}");
        }
        let llama = json!({"model_type": "llama"});
        assert!(!unused_by_mlx_lm(&llama, "vision_tower.x"));
        let gemma3 = json!({"model_type": "gemma3"});
        assert!(unused_by_mlx_lm(&gemma3, "multi_modal_projector.w"));
        assert!(!unused_by_mlx_lm(
            &gemma3,
            "language_model.model.norm.weight"
        ));
    }
}

//! What every converter writes into the new folder: the weights, the
//! configs, JSON files; and how weights are stored.

use std::path::Path;

use mlx_rs::Array;

use crate::error::{Error, Result};

/// How to store the imported weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportWeights {
    /// Keep GGUF's 4-bit blocks as MLX affine 4-bit, group 32 (Q4_1 maps
    /// onto it exactly), with f32 scales and biases.
    Quantized,
    /// Dequantize every weight to f32 (exact for Q4_1).
    F32,
}

/// Writes `config.json` (with the folder-wide `quantization`, group size
/// and bits, when there is one) and `generation_config.json`.
pub(crate) fn write_configs(
    out: &Path,
    mut config: serde_json::Value,
    quantization: Option<(i32, i32)>,
    bos: usize,
    eos: usize,
) -> Result<()> {
    if let Some((group_size, bits)) = quantization {
        config["quantization"] = serde_json::json!({"group_size": group_size, "bits": bits});
        config["quantization_config"] = config["quantization"].clone();
    }
    write_json(&out.join("config.json"), &config)?;
    write_json(
        &out.join("generation_config.json"),
        &serde_json::json!({"bos_token_id": bos, "eos_token_id": eos}),
    )
}

/// Writes `arrays` as the folder's `model.safetensors`.
pub(crate) fn save_weights(
    checked: &crate::check::Checked,
    out: &Path,
    arrays: &[(String, Array)],
) -> Result<()> {
    let path = out.join("model.safetensors");
    Array::save_safetensors(arrays.iter().map(|(k, v)| (k.as_str(), v)), None, &path)
        .map_err(|e| checked.bad(format!("writing {}: {e}", path.display())))
}

pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_vec_pretty(&st_mmap::json::sorted(value)).expect("json");
    std::fs::write(path, text).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

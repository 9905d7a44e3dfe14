//! An mlx_lm LoRA adapter: `adapter_config.json` + `adapters.safetensors`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use st_mmap::SafetensorsFile;

use crate::error::{io, Error, Result};

/// A decoded mlx_lm LoRA adapter.
#[derive(Debug)]
pub(crate) struct LoraAdapter {
    /// `lora_parameters.scale`.
    pub scale: f32,
    /// Module path → (key of `lora_a` (in, rank), key of `lora_b` (rank, out)).
    pub pairs: BTreeMap<String, (String, String)>,
    pub file: SafetensorsFile,
}

/// What errors call the adapter's two files: the shipped files a user
/// knows, not the decoded copies in a work folder that is gone by the time
/// the error is read.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    /// The `adapter_config.json` as shipped.
    pub config: PathBuf,
    /// The compressed adapter as shipped.
    pub weights: PathBuf,
}

impl LoraAdapter {
    /// Reads `dir/adapter_config.json` and maps `dir/adapters.safetensors`;
    /// errors name the files as `names` gives them.
    pub fn open(dir: &Path, names: &Names) -> Result<LoraAdapter> {
        let config_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&config_path).map_err(io(&names.config))?;
        let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: names.config.clone(),
            message: e.to_string(),
        })?;
        let bad = |message: String| Error::Adapter {
            path: names.config.clone(),
            message,
        };
        match config.get("fine_tune_type").and_then(|v| v.as_str()) {
            None | Some("lora") => {}
            Some(other) => {
                return Err(bad(format!(
                    "fine_tune_type {other:?} is not supported; only \"lora\" is"
                )))
            }
        }
        let scale = config
            .pointer("/lora_parameters/scale")
            .ok_or_else(|| bad("lora_parameters.scale is missing".to_owned()))?
            .as_f64()
            .ok_or_else(|| bad("lora_parameters.scale is not a number".to_owned()))?
            as f32;
        if !scale.is_finite() {
            return Err(bad(format!(
                "lora_parameters.scale {scale} is not a finite 32-bit float"
            )));
        }

        let file = SafetensorsFile::open(dir.join("adapters.safetensors"))?;
        let weights = names.weights.clone();
        let mut halves: BTreeMap<String, (Option<String>, Option<String>)> = BTreeMap::new();
        for info in file.header().tensors() {
            if let Some(module) = info.name.strip_suffix(".lora_a") {
                halves.entry(module.to_owned()).or_default().0 = Some(info.name.clone());
            } else if let Some(module) = info.name.strip_suffix(".lora_b") {
                halves.entry(module.to_owned()).or_default().1 = Some(info.name.clone());
            } else {
                return Err(Error::Adapter {
                    path: weights.clone(),
                    message: format!("key {:?} is neither a .lora_a nor a .lora_b", info.name),
                });
            }
        }
        let mut pairs = BTreeMap::new();
        for (module, (a, b)) in halves {
            match (a, b) {
                (Some(a), Some(b)) => {
                    pairs.insert(module, (a, b));
                }
                (a, _) => {
                    let missing = if a.is_none() { "lora_a" } else { "lora_b" };
                    return Err(Error::Adapter {
                        path: weights.clone(),
                        message: format!("{module:?} has no {missing}"),
                    });
                }
            }
        }
        if pairs.is_empty() {
            return Err(Error::Adapter {
                path: weights,
                message: "no LoRA pairs".to_owned(),
            });
        }
        Ok(LoraAdapter { scale, pairs, file })
    }
}

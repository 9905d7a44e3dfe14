//! An mlx_lm LoRA adapter folder — `adapter_config.json` (its scale) and
//! `adapters.safetensors` (its `lora_a` / `lora_b` pairs) — read once, with
//! strict pairing, for everyone who applies it: adapter-fuse writing a fused
//! model, and block streaming fusing it into each layer as it is read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use st_mmap::{BlockPrefix, SafetensorsFile};

use crate::error::{Error, Result};
use crate::lora::BlockLoraSource;

/// A decoded mlx_lm LoRA adapter.
#[derive(Debug)]
pub struct MlxLmAdapter {
    scale: f32,
    /// Module path → (key of `lora_a` (in, rank), key of `lora_b` (rank, out)).
    pairs: BTreeMap<String, (String, String)>,
    file: SafetensorsFile,
    weights_path: PathBuf,
    /// What errors call the weights file (the file itself, or what the
    /// caller shipped it as).
    weights_name: PathBuf,
}

impl MlxLmAdapter {
    /// Reads `dir/adapter_config.json` and maps `dir/adapters.safetensors`.
    ///
    /// # Errors
    /// [`Error::Adapter`] for a config without a finite
    /// `lora_parameters.scale`, another `fine_tune_type` than `lora`, a key
    /// that is not a `.lora_a` / `.lora_b`, a half without its pair, or no
    /// pair at all; [`Error::Io`] and [`Error::Safetensors`] for the files.
    pub fn open(dir: &Path) -> Result<MlxLmAdapter> {
        let config = dir.join("adapter_config.json");
        let weights = dir.join("adapters.safetensors");
        MlxLmAdapter::open_named(dir, &config, &weights)
    }

    /// [`open`](Self::open), errors naming the config `config_name` and the
    /// weights `weights_name` (e.g. the compressed files a program ships,
    /// rather than their decoded copies in a folder gone by the time the
    /// error is read).
    pub fn open_named(dir: &Path, config_name: &Path, weights_name: &Path) -> Result<MlxLmAdapter> {
        let config_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|source| Error::Io {
            path: config_name.to_path_buf(),
            source,
        })?;
        let bad = |message: String| Error::Adapter {
            path: config_name.to_path_buf(),
            message,
        };
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
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
        let weights_path = dir.join("adapters.safetensors");
        let file = SafetensorsFile::open(&weights_path)?;
        let bad = |message: String| Error::Adapter {
            path: weights_name.to_path_buf(),
            message,
        };
        let mut halves: BTreeMap<String, (Option<String>, Option<String>)> = BTreeMap::new();
        for info in file.header().tensors() {
            if let Some(module) = info.name.strip_suffix(".lora_a") {
                halves.entry(module.to_owned()).or_default().0 = Some(info.name.clone());
            } else if let Some(module) = info.name.strip_suffix(".lora_b") {
                halves.entry(module.to_owned()).or_default().1 = Some(info.name.clone());
            } else {
                return Err(bad(format!(
                    "key {:?} is neither a .lora_a nor a .lora_b",
                    info.name
                )));
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
                    return Err(bad(format!("{module:?} has no {missing}")));
                }
            }
        }
        if pairs.is_empty() {
            return Err(bad("no LoRA pairs".to_owned()));
        }
        Ok(MlxLmAdapter {
            scale,
            pairs,
            file,
            weights_path,
            weights_name: weights_name.to_path_buf(),
        })
    }

    /// `lora_parameters.scale`.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Module path → (key of `lora_a` `(in, rank)`, key of `lora_b` `(rank,
    /// out)`), every module strictly paired.
    pub fn pairs(&self) -> &BTreeMap<String, (String, String)> {
        &self.pairs
    }

    /// The mapped `adapters.safetensors`.
    pub fn file(&self) -> &SafetensorsFile {
        &self.file
    }

    /// The adapter as a [`BlockLoraSource`] for blocks under `block_prefix`
    /// (a model's decoder layers, e.g. `model.layers.`), fused with mlx_lm's
    /// arithmetic at its scale; the source keeps the file this adapter
    /// mapped (it is not mapped again). Every pair must lie under the
    /// prefix: a module elsewhere is [`Error::Adapter`], not silently left
    /// out.
    pub fn into_block_source(self, block_prefix: &str) -> Result<BlockLoraSource> {
        let prefix = BlockPrefix::new(block_prefix);
        for module in self.pairs.keys() {
            if prefix.parse(&format!("{module}.lora_a"))?.is_none() {
                return Err(Error::Adapter {
                    path: self.weights_name.clone(),
                    message: format!(
                        "module {module:?} is not under the model's layers ({block_prefix}N.…)"
                    ),
                });
            }
        }
        BlockLoraSource::from_mlx_lm_file(self.file, self.weights_path, block_prefix, self.scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::Array;

    /// An adapter folder with `keys` (each a `(4, 2)` or `(2, 4)` f32
    /// matrix) and `config`.
    fn folder(keys: &[&str], config: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let tensors: Vec<(String, Array)> = keys
            .iter()
            .map(|k| {
                let shape = if k.ends_with("lora_a") {
                    [4, 2]
                } else {
                    [2, 4]
                };
                (k.to_string(), Array::ones::<f32>(&shape).unwrap())
            })
            .collect();
        Array::save_safetensors(
            tensors.iter().map(|(k, v)| (k.as_str(), v)),
            None,
            dir.path().join("adapters.safetensors"),
        )
        .unwrap();
        std::fs::write(dir.path().join("adapter_config.json"), config).unwrap();
        dir
    }

    const CONFIG: &str =
        r#"{"fine_tune_type": "lora", "lora_parameters": {"rank": 2, "scale": 8.0}}"#;

    #[test]
    fn a_paired_adapter_opens_with_its_scale_and_becomes_a_block_source() {
        let keys = [
            "model.layers.1.mlp.up_proj.lora_a",
            "model.layers.1.mlp.up_proj.lora_b",
        ];
        let dir = folder(&keys, CONFIG);
        let adapter = MlxLmAdapter::open(dir.path()).unwrap();
        assert_eq!(adapter.scale(), 8.0);
        assert_eq!(adapter.pairs().len(), 1);
        let source = adapter.into_block_source("model.layers.").unwrap();
        assert_eq!(source.strength(), 8.0);
        assert!(source.has_block(1) && !source.has_block(0));
        // Under another prefix, the module is outside the layers.
        let err = MlxLmAdapter::open(dir.path())
            .unwrap()
            .into_block_source("language_model.model.layers.")
            .unwrap_err();
        assert!(
            err.to_string().contains("not under the model's layers"),
            "{err}"
        );
    }

    #[test]
    fn unpaired_halves_stray_keys_and_bad_configs_are_refused_by_name() {
        let half = folder(&["model.layers.0.q.lora_a"], CONFIG);
        let err = MlxLmAdapter::open(half.path()).unwrap_err().to_string();
        assert!(err.contains("\"model.layers.0.q\" has no lora_b"), "{err}");
        let stray = folder(
            &[
                "model.layers.0.q.lora_a",
                "model.layers.0.q.lora_b",
                "x.alpha",
            ],
            CONFIG,
        );
        let err = MlxLmAdapter::open(stray.path()).unwrap_err().to_string();
        assert!(err.contains("neither a .lora_a nor a .lora_b"), "{err}");
        for (config, says) in [
            (r#"{"lora_parameters": {"rank": 2}}"#, "scale is missing"),
            (
                r#"{"fine_tune_type": "dora", "lora_parameters": {"scale": 1.0}}"#,
                "\"dora\"",
            ),
            (r#"{"lora_parameters": {"scale": 1e308}}"#, "finite"),
            ("not json", "not JSON"),
        ] {
            let dir = folder(&["m.layers.0.q.lora_a", "m.layers.0.q.lora_b"], config);
            let err = MlxLmAdapter::open(dir.path()).unwrap_err();
            assert!(
                matches!(&err, Error::Adapter { path, .. } if path.ends_with("adapter_config.json")),
                "{err}"
            );
            assert!(err.to_string().contains(says), "{config}: {err}");
        }
    }
}

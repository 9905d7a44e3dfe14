//! mlx_lm's quantization config: how each module of a model is quantized.

use std::collections::HashMap;

use crate::error::{Error, Result};

/// MLX quantization of one weight: `group_size` elements share a scale
/// (and, affine, a bias); each element takes `bits` bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantization {
    /// Elements per group (32, 64 or 128 in practice).
    pub group_size: i32,
    /// Bits per element (2, 3, 4, 5, 6 or 8).
    pub bits: i32,
    /// How a group's elements map to numbers.
    pub mode: QuantMode,
}

/// MLX's quantization modes the toolkit reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuantMode {
    /// `scale · q + bias` per group (`scales` and `biases` tensors).
    #[default]
    Affine,
    /// OCP's MXFP4: 4-bit floats (E2M1) in groups of 32 sharing a
    /// power-of-two scale (E8M0 bytes in `scales`); no biases. gpt-oss's
    /// experts as published.
    Mxfp4,
}

impl QuantMode {
    /// The name MLX's operations and mlx_lm's `config.json` use.
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine => "affine",
            QuantMode::Mxfp4 => "mxfp4",
        }
    }

    /// Whether the mode has a bias per group beside each scale.
    pub fn has_biases(self) -> bool {
        self == QuantMode::Affine
    }
}

impl Quantization {
    /// Affine quantization in groups of `group_size`, `bits` bits each.
    pub const fn affine(group_size: i32, bits: i32) -> Quantization {
        Quantization {
            group_size,
            bits,
            mode: QuantMode::Affine,
        }
    }

    /// An entry of mlx_lm's `quantization` (`{group_size, bits, mode}`;
    /// no mode: affine, as mlx's `to_quantized` defaults); `of` names it in
    /// errors.
    fn from_json(q: &serde_json::Value, of: &str) -> Result<Quantization> {
        let bad = |m: String| Error::Quantization(format!("{of}: {m}"));
        let number = |name: &str| {
            q.get(name)
                .and_then(|v| v.as_i64())
                .and_then(|v| i32::try_from(v).ok())
        };
        let (Some(group_size), Some(bits)) = (number("group_size"), number("bits")) else {
            return Err(bad(
                "needs a positive group_size and bits from 1 to 8".into()
            ));
        };
        if group_size <= 0 || !(1..=8).contains(&bits) {
            return Err(bad(
                "needs a positive group_size and bits from 1 to 8".into()
            ));
        }
        let mode = match q.get("mode").and_then(|m| m.as_str()) {
            None | Some("affine") => QuantMode::Affine,
            Some("mxfp4") if (group_size, bits) == (32, 4) => QuantMode::Mxfp4,
            Some("mxfp4") => {
                return Err(bad(format!(
                    "mxfp4 takes groups of 32 and 4 bits, not {group_size} and {bits}"
                )))
            }
            Some(mode) => {
                return Err(bad(format!(
                    "mode {mode:?} is not supported; \"affine\" and \"mxfp4\" are"
                )))
            }
        };
        Ok(Quantization {
            group_size,
            bits,
            mode,
        })
    }
}

/// A model's quantization as mlx_lm writes it in `config.json`: a default
/// `{group_size, bits}`, and entries keyed by a module's path that override
/// it with their own `{group_size, bits}`, or with `false` for a module left
/// unquantized. Mixed-precision checkpoints (e.g. "UD" 4-bit models with
/// 8-bit or float layers) depend on the overrides.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuantizationConfig {
    default: Option<Quantization>,
    modules: HashMap<String, Option<Quantization>>,
}

impl QuantizationConfig {
    /// No quantization at all.
    pub fn none() -> QuantizationConfig {
        QuantizationConfig::default()
    }

    /// Every module quantized the same way.
    pub fn uniform(q: Quantization) -> QuantizationConfig {
        QuantizationConfig {
            default: Some(q),
            modules: HashMap::new(),
        }
    }

    /// Reads the `quantization` entry of a parsed `config.json` (none: not
    /// quantized).
    ///
    /// # Errors
    /// [`Error::Quantization`] for a mode other than `affine` and `mxfp4`
    /// (or an mxfp4 entry not in groups of 32 at 4 bits), or an entry
    /// without a usable group size and bit width.
    pub fn from_model_config(config: &serde_json::Value) -> Result<QuantizationConfig> {
        match config.get("quantization") {
            None | Some(serde_json::Value::Null) => Ok(QuantizationConfig::none()),
            Some(q) => QuantizationConfig::from_entry(q),
        }
    }

    /// Reads a `quantization` entry itself.
    pub fn from_entry(q: &serde_json::Value) -> Result<QuantizationConfig> {
        let mut modules = HashMap::new();
        for (key, value) in q.as_object().into_iter().flatten() {
            match value {
                serde_json::Value::Bool(false) => {
                    modules.insert(key.clone(), None);
                }
                serde_json::Value::Object(_) => {
                    modules.insert(key.clone(), Some(Quantization::from_json(value, key)?));
                }
                _ => {}
            }
        }
        let default = match (q.get("group_size"), q.get("bits")) {
            (None, None) => None,
            _ => Some(Quantization::from_json(q, "the default")?),
        };
        Ok(QuantizationConfig { default, modules })
    }

    /// How the module at `path` (e.g. `model.layers.3.mlp.up_proj`) is
    /// quantized, if it is: its own entry, else the default.
    pub fn of(&self, path: &str) -> Option<Quantization> {
        self.modules.get(path).copied().unwrap_or(self.default)
    }

    /// The default for modules without an entry of their own.
    pub fn default_quantization(&self) -> Option<Quantization> {
        self.default
    }

    /// Whether anything at all is quantized.
    pub fn is_quantized(&self) -> bool {
        self.default.is_some() || self.modules.values().any(Option::is_some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<QuantizationConfig> {
        QuantizationConfig::from_model_config(&serde_json::from_str(text).unwrap())
    }

    #[test]
    fn per_module_entries_override_the_default() {
        let q = parse(
            r#"{"quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                "a.b": {"group_size": 32, "bits": 8}, "c": false, "d": true}}"#,
        )
        .unwrap();
        let q4 = Quantization::affine(64, 4);
        assert_eq!(q.of("x"), Some(q4));
        assert_eq!(q.of("a.b"), Some(Quantization::affine(32, 8)));
        assert_eq!(q.of("c"), None);
        assert_eq!(q.of("d"), Some(q4), "true keeps the default");
        assert!(q.is_quantized());
        assert_eq!(parse("{}").unwrap(), QuantizationConfig::none());
        assert!(!parse("{}").unwrap().is_quantized());
    }

    /// gpt-oss's published layout: MXFP4 experts beside affine layers; a
    /// module entry without a mode is affine whatever the default's.
    #[test]
    fn modules_keep_their_own_mode() {
        let q = parse(
            r#"{"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4",
                "r": {"group_size": 64, "bits": 8},
                "e": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}}"#,
        )
        .unwrap();
        let mxfp4 = Quantization {
            group_size: 32,
            bits: 4,
            mode: QuantMode::Mxfp4,
        };
        assert_eq!(q.of("x"), Some(mxfp4));
        assert_eq!(q.of("e"), Some(mxfp4));
        assert_eq!(q.of("r"), Some(Quantization::affine(64, 8)));
    }

    #[test]
    fn unusable_entries_are_errors() {
        for bad in [
            r#"{"quantization": {"group_size": 64, "bits": 4, "mode": "mxfp4"}}"#,
            r#"{"quantization": {"group_size": 32, "bits": 4, "mode": "nvfp4"}}"#,
            r#"{"quantization": {"group_size": 64, "bits": 8,
                "e": {"group_size": 32, "bits": 4, "mode": "mxfp8"}}}"#,
            r#"{"quantization": {"group_size": 64, "bits": 4, "m": {"bits": 4}}}"#,
            r#"{"quantization": {"group_size": 0, "bits": 4}}"#,
            r#"{"quantization": {"group_size": 64, "bits": 99}}"#,
            r#"{"quantization": {"group_size": 64}}"#,
        ] {
            assert!(matches!(parse(bad), Err(Error::Quantization(_))), "{bad}");
        }
    }
}

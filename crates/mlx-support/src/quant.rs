//! mlx_lm's quantization config: how each module of a model is quantized.

use std::collections::HashMap;

use crate::error::{Error, Result};

/// MLX affine quantization of one weight: `group_size` elements share a
/// scale and a bias; each element takes `bits` bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantization {
    /// Elements per group (32, 64 or 128 in practice).
    pub group_size: i32,
    /// Bits per element (2, 3, 4, 5, 6 or 8).
    pub bits: i32,
}

impl Quantization {
    fn from_json(q: &serde_json::Value) -> Option<Quantization> {
        let group_size = i32::try_from(q.get("group_size")?.as_i64()?).ok()?;
        let bits = i32::try_from(q.get("bits")?.as_i64()?).ok()?;
        (group_size > 0 && (1..=8).contains(&bits)).then_some(Quantization { group_size, bits })
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
    /// [`Error::Quantization`] for a mode other than `affine`, or a
    /// module entry without a usable group size and bit width.
    pub fn from_model_config(config: &serde_json::Value) -> Result<QuantizationConfig> {
        match config.get("quantization") {
            None | Some(serde_json::Value::Null) => Ok(QuantizationConfig::none()),
            Some(q) => QuantizationConfig::from_entry(q),
        }
    }

    /// Reads a `quantization` entry itself.
    pub fn from_entry(q: &serde_json::Value) -> Result<QuantizationConfig> {
        let bad = |m: String| Error::Quantization(m);
        // A module's own entry may name its own mode (gpt-oss's MXFP4
        // experts beside 8-bit affine layers): read as affine, its packed
        // bits would be misread, not refused.
        let affine = |entry: &serde_json::Value, of: &str| match entry
            .get("mode")
            .and_then(|m| m.as_str())
        {
            None | Some("affine") => Ok(()),
            Some(mode) => Err(bad(format!(
                "{of}: mode {mode:?} is not supported; only \"affine\" is"
            ))),
        };
        affine(q, "the default")?;
        let mut modules = HashMap::new();
        for (key, value) in q.as_object().into_iter().flatten() {
            match value {
                serde_json::Value::Bool(false) => {
                    modules.insert(key.clone(), None);
                }
                serde_json::Value::Object(_) => {
                    affine(value, key)?;
                    let own = Quantization::from_json(value).ok_or_else(|| {
                        bad(format!(
                            "{key:?} needs a positive group_size and bits from 1 to 8"
                        ))
                    })?;
                    modules.insert(key.clone(), Some(own));
                }
                _ => {}
            }
        }
        let default = match (q.get("group_size"), q.get("bits")) {
            (None, None) => None,
            _ => Some(Quantization::from_json(q).ok_or_else(|| {
                bad("the default needs a positive group_size and bits from 1 to 8".into())
            })?),
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
        let q4 = Quantization {
            group_size: 64,
            bits: 4,
        };
        assert_eq!(q.of("x"), Some(q4));
        assert_eq!(
            q.of("a.b"),
            Some(Quantization {
                group_size: 32,
                bits: 8
            })
        );
        assert_eq!(q.of("c"), None);
        assert_eq!(q.of("d"), Some(q4), "true keeps the default");
        assert!(q.is_quantized());
        assert_eq!(parse("{}").unwrap(), QuantizationConfig::none());
        assert!(!parse("{}").unwrap().is_quantized());
    }

    #[test]
    fn unusable_entries_are_errors() {
        for bad in [
            r#"{"quantization": {"group_size": 64, "bits": 4, "mode": "mxfp4"}}"#,
            r#"{"quantization": {"group_size": 64, "bits": 8,
                "e": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}}"#,
            r#"{"quantization": {"group_size": 64, "bits": 4, "m": {"bits": 4}}}"#,
            r#"{"quantization": {"group_size": 0, "bits": 4}}"#,
            r#"{"quantization": {"group_size": 64, "bits": 99}}"#,
            r#"{"quantization": {"group_size": 64}}"#,
        ] {
            assert!(matches!(parse(bad), Err(Error::Quantization(_))), "{bad}");
        }
    }
}

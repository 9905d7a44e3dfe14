//! Weight names as values: a key path is built part by part and turned
//! into a string once, where the files are asked for it.

use std::fmt;

/// A path in a checkpoint's key space: `model` → `model.layers` →
/// `model.layers.3` → `model.layers.3.self_attn.q_proj` → its `weight`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct KeyPath(String);

impl KeyPath {
    /// The path written `path` (a trailing dot is dropped: `model.` is
    /// `model`).
    pub(crate) fn new(path: &str) -> KeyPath {
        KeyPath(path.trim_end_matches('.').to_owned())
    }

    /// The child `part` of this path: `model.layers` → `model.layers.3`.
    pub(crate) fn join(&self, part: impl fmt::Display) -> KeyPath {
        if self.0.is_empty() {
            KeyPath(part.to_string())
        } else {
            KeyPath(format!("{}.{part}", self.0))
        }
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }

    /// The prefix of every child's key (`model.layers.`), as a block index
    /// parses it.
    pub(crate) fn children(&self) -> st_mmap::BlockPrefix {
        st_mmap::BlockPrefix::new(format!("{}.", self.0))
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::KeyPath;

    #[test]
    fn paths_join_with_dots_and_parse_back_as_blocks() {
        let layers = KeyPath::new("language_model.model.").join("layers");
        assert_eq!(layers.as_str(), "language_model.model.layers");
        let q = layers
            .join(3)
            .join("self_attn")
            .join("q_proj")
            .join("weight");
        assert_eq!(
            q.to_string(),
            "language_model.model.layers.3.self_attn.q_proj.weight"
        );
        let prefix = layers.children();
        assert_eq!(prefix.as_str(), "language_model.model.layers.");
        assert_eq!(
            prefix.parse(q.as_str()).unwrap(),
            Some((3, "self_attn.q_proj.weight"))
        );
        assert_eq!(KeyPath::new("").join("lm_head").as_str(), "lm_head");
    }
}

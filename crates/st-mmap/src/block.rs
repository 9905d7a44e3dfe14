//! Keys of the form `{prefix}{i}.{param}`, indexed by block number `i`.

use std::collections::BTreeMap;

use crate::error::{Error, Result};

/// A block key prefix such as `model.layers.`: builds `{prefix}{i}.{param}`
/// and parses it back.
///
/// The block number is strict: `0` or a decimal without leading zeros, with
/// no sign, underscore or whitespace, that fits in `usize`, followed by `.`
/// and a non-empty parameter name. (Python's `int()` would also accept `05`,
/// `+1` and `1_0`; such a key is reported as malformed instead of quietly
/// becoming block 5, 1 or 10.)
///
/// ```
/// use st_mmap::BlockPrefix;
/// let p = BlockPrefix::new("model.layers.");
/// assert_eq!(p.key(3, "mlp.up_proj.weight"), "model.layers.3.mlp.up_proj.weight");
/// assert_eq!(p.parse("model.layers.3.mlp.up_proj.weight").unwrap(), Some((3, "mlp.up_proj.weight")));
/// assert_eq!(p.parse("model.norm.weight").unwrap(), None);
/// assert!(p.parse("model.layers.03.mlp.weight").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlockPrefix(String);

impl BlockPrefix {
    /// A prefix, usually ending in `.`.
    pub fn new(prefix: impl Into<String>) -> BlockPrefix {
        BlockPrefix(prefix.into())
    }

    /// The prefix text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `{prefix}{block}.{param}`.
    pub fn key(&self, block: usize, param: &str) -> String {
        format!("{}{block}.{param}", self.0)
    }

    /// `Ok(Some((block, param)))` for a block key, `Ok(None)` for a key that
    /// does not start with the prefix.
    ///
    /// # Errors
    /// [`Error::MalformedBlockKey`] for a key that starts with the prefix but
    /// breaks the rule above.
    pub fn parse<'k>(&self, key: &'k str) -> Result<Option<(usize, &'k str)>> {
        let Some(rest) = key.strip_prefix(self.0.as_str()) else {
            return Ok(None);
        };
        let malformed = |reason| Error::MalformedBlockKey {
            key: key.to_owned(),
            prefix: self.0.clone(),
            reason,
        };
        let (number, param) = rest
            .split_once('.')
            .ok_or_else(|| malformed("has no '.' after the block number"))?;
        if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
            return Err(malformed("the block number is not plain decimal digits"));
        }
        if number.len() > 1 && number.starts_with('0') {
            return Err(malformed("the block number has a leading zero"));
        }
        let block = number
            .parse()
            .map_err(|_| malformed("the block number is too large"))?;
        if param.is_empty() {
            return Err(malformed(
                "the parameter name after the block number is empty",
            ));
        }
        Ok(Some((block, param)))
    }
}

/// For each block number, its parameters (relative names) and full keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockIndex {
    blocks: BTreeMap<usize, BTreeMap<String, String>>,
}

impl BlockIndex {
    /// Indexes the block keys among `keys`; other keys are ignored.
    ///
    /// # Errors
    /// [`Error::MalformedBlockKey`] as in [`BlockPrefix::parse`].
    pub fn build<'k>(
        prefix: &BlockPrefix,
        keys: impl IntoIterator<Item = &'k str>,
    ) -> Result<Self> {
        let mut blocks: BTreeMap<usize, BTreeMap<String, String>> = BTreeMap::new();
        for key in keys {
            if let Some((block, param)) = prefix.parse(key)? {
                blocks
                    .entry(block)
                    .or_default()
                    .insert(param.to_owned(), key.to_owned());
            }
        }
        Ok(BlockIndex { blocks })
    }

    /// Number of distinct blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no key matched the prefix.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The block numbers, ascending.
    pub fn blocks(&self) -> impl Iterator<Item = usize> + '_ {
        self.blocks.keys().copied()
    }

    /// Block `i`'s parameters: relative name → full key.
    pub fn params(&self, block: usize) -> Option<&BTreeMap<String, String>> {
        self.blocks.get(&block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_block_numbers() {
        let p = BlockPrefix::new("blocks.");
        assert_eq!(p.parse("blocks.0.w").unwrap(), Some((0, "w")));
        assert_eq!(
            p.parse("blocks.17.attn.q.weight").unwrap(),
            Some((17, "attn.q.weight"))
        );
        assert_eq!(p.parse("other.1.w").unwrap(), None);
        for bad in [
            "blocks.05.w",
            "blocks.+1.w",
            "blocks.1_0.w",
            "blocks..w",
            "blocks.1",
            "blocks.1.",
            "blocks. 1.w",
            "blocks.99999999999999999999999.w",
        ] {
            assert!(
                matches!(p.parse(bad), Err(Error::MalformedBlockKey { .. })),
                "{bad} should be malformed"
            );
        }
    }

    #[test]
    fn index_groups_params_by_block() {
        let p = BlockPrefix::new("t.blocks.");
        let keys = ["t.blocks.1.a", "t.blocks.0.a", "t.blocks.1.b.c", "t.head.w"];
        let index = BlockIndex::build(&p, keys).unwrap();
        assert_eq!(index.blocks().collect::<Vec<_>>(), vec![0, 1]);
        let one = index.params(1).unwrap();
        assert_eq!(one.get("b.c").map(String::as_str), Some("t.blocks.1.b.c"));
        assert_eq!(one.len(), 2);
        assert!(index.params(2).is_none());
        assert_eq!(p.key(1, "b.c"), "t.blocks.1.b.c");
    }
}

//! The element types a safetensors header may name.

use std::fmt;
use std::str::FromStr;

/// A safetensors dtype, spelled in headers as e.g. `"BF16"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(clippy::upper_case_acronyms, non_camel_case_types)] // The header spellings.
pub enum Dtype {
    BOOL,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

const ALL: [(Dtype, &str, usize); 15] = [
    (Dtype::BOOL, "BOOL", 1),
    (Dtype::U8, "U8", 1),
    (Dtype::I8, "I8", 1),
    (Dtype::F8_E5M2, "F8_E5M2", 1),
    (Dtype::F8_E4M3, "F8_E4M3", 1),
    (Dtype::I16, "I16", 2),
    (Dtype::U16, "U16", 2),
    (Dtype::F16, "F16", 2),
    (Dtype::BF16, "BF16", 2),
    (Dtype::I32, "I32", 4),
    (Dtype::U32, "U32", 4),
    (Dtype::F32, "F32", 4),
    (Dtype::F64, "F64", 8),
    (Dtype::I64, "I64", 8),
    (Dtype::U64, "U64", 8),
];

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        ALL.iter().find(|(d, _, _)| *d == self).map_or(1, |e| e.2)
    }

    /// The header spelling, e.g. `"BF16"`.
    pub fn as_str(self) -> &'static str {
        ALL.iter().find(|(d, _, _)| *d == self).map_or("?", |e| e.1)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A dtype name no safetensors reader here understands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownDtype(pub String);

impl FromStr for Dtype {
    type Err = UnknownDtype;

    fn from_str(s: &str) -> Result<Dtype, UnknownDtype> {
        ALL.iter()
            .find(|(_, name, _)| *name == s)
            .map(|e| e.0)
            .ok_or_else(|| UnknownDtype(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes_are_right() {
        for (dtype, name, size) in ALL {
            assert_eq!(name.parse::<Dtype>(), Ok(dtype));
            assert_eq!(dtype.to_string(), name);
            assert_eq!(dtype.size(), size);
        }
        assert_eq!("f32".parse::<Dtype>(), Err(UnknownDtype("f32".into())));
    }
}

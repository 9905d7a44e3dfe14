//! Header parsing: agreement with the `safetensors` crate on valid files, and
//! one typed error per kind of hostile header.

use std::collections::HashMap;

use proptest::prelude::*;
use st_mmap::{parse_header, Dtype, Error, HeaderError, SafetensorsFile, MAX_HEADER_LEN};

/// A file from a raw JSON header and a body of `body_len` bytes.
fn file(json: &str, body_len: usize) -> Vec<u8> {
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.extend((0..body_len).map(|i| i as u8));
    bytes
}

fn parse(bytes: &[u8]) -> Result<st_mmap::Header, HeaderError> {
    parse_header(bytes, bytes.len() as u64)
}

#[test]
fn shorter_than_eight_bytes() {
    assert_eq!(
        parse(&[1, 2, 3]),
        Err(HeaderError::TooShort { file_len: 3 })
    );
}

#[test]
fn header_length_past_end_of_file() {
    let mut bytes = file("{}", 0);
    bytes[..8].copy_from_slice(&1000u64.to_le_bytes());
    assert!(matches!(
        parse(&bytes),
        Err(HeaderError::HeaderPastEnd { declared: 1000, .. })
    ));
}

#[test]
fn absurdly_large_header_length() {
    let mut bytes = file("{}", 0);
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        parse(&bytes),
        Err(HeaderError::HeaderTooLarge {
            limit: MAX_HEADER_LEN,
            ..
        })
    ));
}

#[test]
fn invalid_json() {
    assert!(matches!(
        parse(&file("{\"a\":", 0)),
        Err(HeaderError::InvalidJson { .. })
    ));
    assert!(matches!(
        parse(&file("[1,2]", 0)),
        Err(HeaderError::InvalidJson { .. })
    ));
}

#[test]
fn non_utf8_key() {
    let mut bytes = file("{\"\u{e9}\":1}", 0);
    bytes[10] = 0xff; // break the UTF-8 encoding of the key
    assert!(matches!(parse(&bytes), Err(HeaderError::NotUtf8 { .. })));
}

#[test]
fn unknown_dtype() {
    let json = r#"{"w":{"dtype":"F17","shape":[1],"data_offsets":[0,4]}}"#;
    assert_eq!(
        parse(&file(json, 4)),
        Err(HeaderError::UnknownDtype {
            tensor: "w".into(),
            dtype: "F17".into()
        })
    );
}

#[test]
fn entry_that_is_not_a_tensor() {
    let json = r#"{"w":{"dtype":"F32","shape":[1]}}"#;
    assert!(
        matches!(parse(&file(json, 0)), Err(HeaderError::InvalidEntry { key, .. }) if key == "w")
    );
}

#[test]
fn metadata_that_is_not_a_string_map() {
    let json = r#"{"__metadata__":{"a":1}}"#;
    assert!(matches!(
        parse(&file(json, 0)),
        Err(HeaderError::InvalidMetadata { .. })
    ));
}

#[test]
fn duplicate_key_in_one_header() {
    let json = r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
    assert_eq!(
        parse(&file(json, 2)),
        Err(HeaderError::DuplicateKey { key: "w".into() })
    );
}

#[test]
fn offsets_out_of_range() {
    let json = r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    assert_eq!(
        parse(&file(json, 8)),
        Err(HeaderError::OutOfRange {
            tensor: "w".into(),
            end: 16,
            body_len: 8
        })
    );
}

#[test]
fn reversed_offsets() {
    let json = r#"{"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#;
    assert!(matches!(
        parse(&file(json, 4)),
        Err(HeaderError::ReversedOffsets { .. })
    ));
}

#[test]
fn overlapping_tensors() {
    let json = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
    assert_eq!(
        parse(&file(json, 6)),
        Err(HeaderError::Overlap {
            tensor: "b".into(),
            previous: "a".into()
        })
    );
}

#[test]
fn gap_between_tensors() {
    let json = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#;
    assert_eq!(
        parse(&file(json, 6)),
        Err(HeaderError::Gap {
            tensor: "b".into(),
            expected: 2,
            start: 4
        })
    );
}

#[test]
fn trailing_bytes() {
    let json = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
    assert_eq!(
        parse(&file(json, 5)),
        Err(HeaderError::TrailingBytes { count: 3 })
    );
}

#[test]
fn size_disagrees_with_shape_and_dtype() {
    let json = r#"{"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,5]}}"#;
    assert!(matches!(
        parse(&file(json, 5)),
        Err(HeaderError::SizeMismatch {
            expected: 6,
            actual: 5,
            ..
        })
    ));
}

#[test]
fn shape_that_overflows() {
    let json = format!(
        r#"{{"w":{{"dtype":"F32","shape":[{},{}],"data_offsets":[0,0]}}}}"#,
        usize::MAX,
        4
    );
    assert!(matches!(
        parse(&file(&json, 0)),
        Err(HeaderError::ShapeOverflow { .. })
    ));
}

#[test]
fn open_names_the_file_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    std::fs::write(&path, file("{oops", 0)).unwrap();
    let err = SafetensorsFile::open(&path).unwrap_err();
    assert!(matches!(&err, Error::Header { path: p, .. } if p == &path));
    assert!(err.to_string().contains("bad.safetensors"), "{err}");

    let missing = dir.path().join("missing.safetensors");
    let err = SafetensorsFile::open(&missing).unwrap_err();
    assert!(matches!(&err, Error::Io { path, .. } if path == &missing));
}

/// Name, their dtype, our dtype, shape, bytes.
type Generated = (String, safetensors::Dtype, Dtype, Vec<usize>, Vec<u8>);

fn dtype_strategy() -> impl Strategy<Value = (safetensors::Dtype, Dtype)> {
    prop_oneof![
        Just((safetensors::Dtype::F32, Dtype::F32)),
        Just((safetensors::Dtype::BF16, Dtype::BF16)),
        Just((safetensors::Dtype::F16, Dtype::F16)),
        Just((safetensors::Dtype::U8, Dtype::U8)),
        Just((safetensors::Dtype::I64, Dtype::I64)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    /// Files written by the `safetensors` crate parse here with the same
    /// tensors, shapes, dtypes, bytes and metadata.
    #[test]
    fn agrees_with_the_safetensors_crate(
        tensors in prop::collection::vec(
            (dtype_strategy(), prop::collection::vec(0usize..5, 0..4)),
            // At least one tensor: safetensors 0.7 writes invalid JSON
            // (`{},"__metadata__":…`) for metadata without tensors.
            1..6,
        ),
        meta in prop::option::of(prop::collection::hash_map("[a-z]{1,6}", "[ -~]{0,8}", 0..3)),
    ) {
        let data: Vec<Generated> = tensors
            .into_iter()
            .enumerate()
            .map(|(i, ((theirs, ours), shape))| {
                let len = shape.iter().product::<usize>() * ours.size();
                (format!("t{i}"), theirs, ours, shape, (0..len).map(|b| (b * 7 + i) as u8).collect())
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(n, d, _, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let bytes = safetensors::serialize(views, meta.clone()).unwrap();

        let header = parse(&bytes).unwrap();
        prop_assert_eq!(header.tensors().len(), data.len());
        prop_assert_eq!(header.file_len(), bytes.len());
        for (name, _, dtype, shape, payload) in &data {
            let info = header.tensor(name).unwrap();
            prop_assert_eq!(info.dtype, *dtype);
            prop_assert_eq!(&info.shape, shape);
            let start = header.data_start() + info.data_offsets.0;
            prop_assert_eq!(&bytes[start..start + info.byte_len()], &payload[..]);
        }
        let meta: Option<std::collections::BTreeMap<String, String>> =
            meta.map(|m: HashMap<String, String>| m.into_iter().collect());
        prop_assert_eq!(header.metadata(), meta.as_ref());
    }

    /// Arbitrary bytes never panic the parser.
    #[test]
    fn arbitrary_bytes_are_an_error_or_a_header(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = parse(&bytes);
    }
}

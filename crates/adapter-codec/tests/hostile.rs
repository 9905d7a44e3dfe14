//! Bad input: one test per kind, each asserting the typed error, that the
//! error names the file, and that no partial output is left behind.

mod common;

use adapter_codec::{AdapterCodec, Error};
use common::{adapter, fixture, listing, raw_file, Fixture};
use safetensors::Dtype as St;
use st_mmap::HeaderError;

/// Encodes `bytes` and returns the error, checking that the folder holds
/// only the input files afterwards (no `.zst`, no temporary file).
fn encode_err(bytes: &[u8]) -> Error {
    let f = fixture(bytes);
    let err = f.codec.encode(&f.src).unwrap_err();
    assert_eq!(
        listing(f.dir.path()),
        ["adapter_config.json", "adapters.safetensors"],
        "leftovers after {err}"
    );
    err
}

/// Writes `zst` as the codec's `.zst`, decodes, and returns the error,
/// checking that no output or temporary file is left behind.
fn decode_err(zst: &[u8]) -> (Fixture, Error) {
    let f = fixture(b"");
    std::fs::write(f.codec.zst_path(), zst).unwrap();
    let err = f
        .codec
        .decode(f.dir.path().join("out.safetensors"))
        .unwrap_err();
    assert!(!f.dir.path().join("out.safetensors").exists());
    assert_eq!(
        listing(f.dir.path()),
        [
            "adapter_config.json",
            "adapters.safetensors",
            "adapters.safetensors.zst"
        ],
        "leftovers after {err}"
    );
    assert!(
        err.to_string().contains("adapters.safetensors.zst"),
        "error does not name the file: {err}"
    );
    (f, err)
}

fn header_err(err: &Error) -> &HeaderError {
    match err {
        Error::Header { source, .. } => source,
        other => panic!("expected a header error, got {other:?}"),
    }
}

fn valid_zst() -> Vec<u8> {
    let f = fixture(&adapter(&[("a", St::BF16, 5000), ("b", St::BF16, 5000)]));
    f.codec.encode(&f.src).unwrap();
    std::fs::read(f.codec.zst_path()).unwrap()
}

#[test]
fn truncated_zstd() {
    let zst = valid_zst();
    let (_, err) = decode_err(&zst[..zst.len() / 2]);
    assert!(matches!(err, Error::Zstd { .. }), "{err:?}");
}

#[test]
fn corrupt_zstd_with_checksum() {
    // A frame with a checksum (valid zstd from another encoder), then corrupted.
    let f = fixture(&adapter(&[("a", St::F32, 3000)]));
    f.codec.encode(&f.src).unwrap();
    let transformed = zstd::decode_all(&std::fs::read(f.codec.zst_path()).unwrap()[..]).unwrap();
    let mut enc = zstd::stream::Encoder::new(Vec::new(), 1).unwrap();
    enc.include_checksum(true).unwrap();
    std::io::Write::write_all(&mut enc, &transformed).unwrap();
    let mut zst = enc.finish().unwrap();
    let last = zst.len() - 1;
    zst[last] ^= 0xff; // the checksum itself
    let (_, err) = decode_err(&zst);
    assert!(matches!(err, Error::Zstd { .. }), "{err:?}");
}

#[test]
fn corrupt_frame_header() {
    let mut zst = valid_zst();
    zst[0] ^= 0x55; // the magic number
    let (_, err) = decode_err(&zst);
    assert!(matches!(err, Error::Zstd { .. }), "{err:?}");
}

#[test]
fn not_zstd_at_all() {
    let (_, err) = decode_err(&adapter(&[("a", St::F32, 10)]));
    assert!(matches!(err, Error::Zstd { .. }), "{err:?}");
}

#[test]
fn empty_zst() {
    let (_, err) = decode_err(b"");
    assert!(matches!(err, Error::Zstd { .. }), "{err:?}");
}

#[test]
fn header_length_past_end() {
    let mut bytes = raw_file("{}", &[]);
    bytes[..8].copy_from_slice(&4096u64.to_le_bytes());
    let err = encode_err(&bytes);
    assert!(
        matches!(
            header_err(&err),
            HeaderError::HeaderPastEnd { declared: 4096, .. }
        ),
        "{err:?}"
    );
    // Compressed, the length is unknown until the data runs out.
    let (_, err) = decode_err(&zstd::bulk::compress(&bytes, 3).unwrap());
    assert!(
        matches!(err, Error::Truncated { tensor: None, .. }),
        "{err:?}"
    );
}

#[test]
fn absurd_header_length() {
    let mut bytes = raw_file("{}", &[]);
    bytes[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let err = encode_err(&bytes);
    assert!(
        matches!(header_err(&err), HeaderError::HeaderTooLarge { .. }),
        "{err:?}"
    );
    let (_, err) = decode_err(&zstd::bulk::compress(&bytes, 3).unwrap());
    assert!(
        matches!(header_err(&err), HeaderError::HeaderTooLarge { .. }),
        "{err:?}"
    );
}

#[test]
fn invalid_header_json() {
    let bytes = raw_file(r#"{"a": {"dtype": "F32""#, &[]);
    let err = encode_err(&bytes);
    assert!(
        matches!(header_err(&err), HeaderError::InvalidJson { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("adapters.safetensors"), "{err}");
    let (_, err) = decode_err(&zstd::bulk::compress(&bytes, 3).unwrap());
    assert!(
        matches!(header_err(&err), HeaderError::InvalidJson { .. }),
        "{err:?}"
    );
}

#[test]
fn offsets_out_of_range() {
    let bytes = raw_file(
        r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
        &[0; 8],
    );
    let err = encode_err(&bytes);
    assert!(
        matches!(header_err(&err), HeaderError::OutOfRange { tensor, .. } if tensor == "a"),
        "{err:?}"
    );
    let (_, err) = decode_err(&zstd::bulk::compress(&bytes, 3).unwrap());
    assert!(
        matches!(&err, Error::Truncated { tensor: Some(t), expected: 8, .. } if t == "a"),
        "{err:?}"
    );
}

#[test]
fn overlapping_offsets() {
    let json = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    let err = encode_err(&raw_file(json, &[0; 12]));
    assert!(
        matches!(header_err(&err), HeaderError::Overlap { tensor, .. } if tensor == "b"),
        "{err:?}"
    );
}

#[test]
fn gap_between_tensors() {
    let json = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
    let err = encode_err(&raw_file(json, &[0; 12]));
    assert!(
        matches!(header_err(&err), HeaderError::Gap { tensor, .. } if tensor == "b"),
        "{err:?}"
    );
}

#[test]
fn trailing_bytes() {
    let bytes = raw_file(
        r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
        &[0; 7],
    );
    let err = encode_err(&bytes);
    assert!(
        matches!(header_err(&err), HeaderError::TrailingBytes { count: 3 }),
        "{err:?}"
    );
    let (_, err) = decode_err(&zstd::bulk::compress(&bytes, 3).unwrap());
    assert!(matches!(err, Error::TrailingBytes { .. }), "{err:?}");
}

#[test]
fn length_not_a_multiple_of_the_typesize() {
    let err = encode_err(&raw_file(
        r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,3]}}"#,
        &[0; 3],
    ));
    assert!(
        matches!(header_err(&err), HeaderError::SizeMismatch { tensor, expected: 4, actual: 3, .. } if tensor == "a"),
        "{err:?}"
    );
}

#[test]
fn length_disagrees_with_shape() {
    let bytes = raw_file(
        r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
        &[0; 8],
    );
    let err = encode_err(&bytes);
    assert!(
        matches!(
            header_err(&err),
            HeaderError::SizeMismatch {
                expected: 12,
                actual: 8,
                ..
            }
        ),
        "{err:?}"
    );
    let (_, err) = decode_err(&zstd::bulk::compress(&bytes, 3).unwrap());
    assert!(
        matches!(header_err(&err), HeaderError::SizeMismatch { .. }),
        "{err:?}"
    );
}

#[test]
fn mixed_dtypes() {
    let err = encode_err(&adapter(&[("a", St::BF16, 4), ("b", St::F32, 4)]));
    // Which tensor is "first" depends on the writer's layout order.
    assert!(
        matches!(&err, Error::MixedDtypes { dtype, expected, .. } if dtype != expected),
        "{err:?}"
    );
}

#[test]
fn unsupported_dtype() {
    let err = encode_err(&adapter(&[("a", St::I32, 4)]));
    assert!(
        matches!(&err, Error::UnsupportedDtype { tensor, .. } if tensor == "a"),
        "{err:?}"
    );
    let err = encode_err(&adapter(&[("a", St::F64, 4)]));
    assert!(matches!(&err, Error::UnsupportedDtype { .. }), "{err:?}");
}

#[test]
fn no_tensors() {
    let err = encode_err(&raw_file(r#"{"__metadata__":{"format":"pt"}}"#, &[]));
    assert!(matches!(err, Error::NoTensors { .. }), "{err:?}");
}

#[test]
fn missing_zst_and_missing_config() {
    let dir = tempfile::tempdir().unwrap();
    let codec = AdapterCodec::new(dir.path().join("nope.zst"), dir.path().join("nope.json"));
    for err in [
        codec.digest().unwrap_err(),
        codec.dtype().unwrap_err(),
        codec.decode(dir.path().join("o")).unwrap_err(),
    ] {
        assert!(
            matches!(&err, Error::Missing { path, .. } if path.ends_with("nope.zst")),
            "{err:?}"
        );
    }
    assert!(
        matches!(codec.config_bytes().unwrap_err(), Error::Missing { path, .. } if path.ends_with("nope.json"))
    );
    assert!(matches!(
        codec
            .encode(dir.path().join("missing.safetensors"))
            .unwrap_err(),
        Error::Missing { .. }
    ));
    assert!(listing(dir.path()).is_empty());
}

#[test]
fn failed_encode_keeps_the_previous_zst() {
    let f = fixture(&adapter(&[("a", St::BF16, 100)]));
    f.codec.encode(&f.src).unwrap();
    let before = std::fs::read(f.codec.zst_path()).unwrap();
    std::fs::write(&f.src, raw_file("{broken", &[])).unwrap();
    assert!(f.codec.encode(&f.src).is_err());
    assert_eq!(std::fs::read(f.codec.zst_path()).unwrap(), before);
}

#[test]
fn failed_decode_keeps_an_existing_destination() {
    let (f, _) = decode_err(b"definitely not zstd");
    let dst = f.dir.path().join("keep.safetensors");
    std::fs::write(&dst, b"old").unwrap();
    assert!(f.codec.decode(&dst).is_err());
    assert_eq!(std::fs::read(&dst).unwrap(), b"old");
}

/// A `.zst` of a header alone: one F32 tensor that claims `elements`
/// elements, and no data. A hundred bytes that promise terabytes.
fn bomb(elements: u64) -> Vec<u8> {
    let json = format!(
        r#"{{"w":{{"dtype":"F32","shape":[{elements}],"data_offsets":[0,{}]}}}}"#,
        elements * 4
    );
    zstd::bulk::compress(&raw_file(&json, b""), 19).unwrap()
}

/// The process's peak resident set so far, in bytes (Linux; `None` elsewhere).
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[test]
fn a_header_claiming_exabytes_is_truncated_not_a_crash() {
    // 2^61 F32 elements: 2^63 bytes. Allocating the claim overflows.
    let zst = bomb(1 << 61);
    assert!(zst.len() < 200, "{} bytes", zst.len());
    let (_, err) = decode_err(&zst);
    assert!(
        matches!(&err, Error::Truncated { tensor: Some(t), .. } if t == "w"),
        "{err:?}"
    );
}

#[test]
fn a_header_claiming_terabytes_is_truncated_not_an_abort() {
    // 2^40 elements: 4 TiB, which the allocator refuses by aborting.
    let (_, err) = decode_err(&bomb(1 << 40));
    assert!(matches!(&err, Error::Truncated { .. }), "{err:?}");
}

#[test]
fn memory_follows_the_decoded_bytes_not_the_header() {
    // 3 GiB claimed, nothing sent: decoding may not touch gigabytes. (The
    // peak is process-wide; the other tests here use a few MB at most.)
    let before = peak_rss();
    let (_, err) = decode_err(&bomb(3 << 28));
    assert!(matches!(&err, Error::Truncated { .. }), "{err:?}");
    if let (Some(before), Some(after)) = (before, peak_rss()) {
        let grew = after.saturating_sub(before);
        assert!(grew < 256 << 20, "peak RSS grew by {} MB", grew >> 20);
    }
}

#[test]
fn encoding_a_stream_of_unknown_length_does_not_trust_its_header() {
    // From a reader with no known length the header cannot be checked
    // against the input first; memory must still follow the bytes read.
    let json = r#"{"w":{"dtype":"F32","shape":[1099511627776],"data_offsets":[0,4398046511104]}}"#;
    let input = raw_file(json, &[0u8; 64]);
    let mut out = Vec::new();
    let err = adapter_codec::encode_stream(
        &mut &input[..],
        None,
        &mut out,
        3,
        adapter_codec::Ends {
            source: std::path::Path::new("stream.safetensors"),
            sink: std::path::Path::new("out.zst"),
        },
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Truncated { tensor: Some(t), expected, .. } if t == "w" && *expected == (1 << 42) - 64),
        "{err:?}"
    );
    assert!(
        out.is_empty(),
        "nothing is written before the input is read whole"
    );
}

#[test]
fn partial_files_of_dead_writers_are_removed_by_the_next_write() {
    let f = fixture(&adapter(&[("a", St::F32, 100)]));
    f.codec.encode(&f.src).unwrap();
    let out = f.dir.path().join("out.safetensors");
    // A writer killed mid-decode leaves its temporary file, unlocked; a
    // live writer holds its file locked.
    let dead = f.dir.path().join(".out.safetensors.partial-dead01");
    let live = f.dir.path().join(".out.safetensors.partial-live01");
    std::fs::write(&dead, vec![7u8; 4096]).unwrap();
    std::fs::write(&live, b"still being written").unwrap();
    let holder = std::fs::OpenOptions::new().write(true).open(&live).unwrap();
    holder.lock().unwrap();
    let other = f.dir.path().join(".adapters.safetensors.partial-other1");
    std::fs::write(&other, b"another file's").unwrap();

    f.codec.decode(&out).unwrap();
    assert!(!dead.exists(), "the dead writer's file stays");
    assert!(live.exists(), "a live writer's file was removed");
    assert!(other.exists(), "a file for another output was removed");
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&f.src).unwrap());
    drop(holder);
}

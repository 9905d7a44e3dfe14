//! Encode → decode gives back the exact input; the frame is the reference's.

mod common;

use std::process::Command;

use adapter_codec::{AdapterCodec, Dtype};
use common::{adapter, fixture, python_with_zstandard};
use proptest::prelude::*;
use safetensors::Dtype as St;

#[test]
fn round_trip_is_byte_exact_and_reports_dtype_and_digest() {
    let bytes = adapter(&[
        ("a.lora_a", St::BF16, 300),
        ("a.lora_b", St::BF16, 77),
        ("b.lora_a", St::BF16, 0),
    ]);
    let f = fixture(&bytes);
    let stats = f.codec.encode(&f.src).unwrap();
    assert_eq!(
        (stats.dtype, stats.tensors, stats.raw_bytes),
        (Dtype::BF16, 3, bytes.len() as u64)
    );
    let zst = std::fs::read(f.codec.zst_path()).unwrap();
    assert_eq!(stats.compressed_bytes, zst.len() as u64);
    assert_eq!(f.codec.dtype().unwrap(), Dtype::BF16);

    // The digest is the first 16 hex digits of the .zst's SHA-256, computed
    // here independently with sha256sum where available.
    let digest = f.codec.digest().unwrap();
    assert_eq!(digest.len(), 16);
    if let Ok(out) = Command::new("sha256sum").arg(f.codec.zst_path()).output() {
        assert_eq!(&String::from_utf8_lossy(&out.stdout)[..16], digest);
    }

    let dst = f.dir.path().join("restored.safetensors");
    let decoded = f.codec.decode(&dst).unwrap();
    assert_eq!(
        (decoded.dtype, decoded.tensors, decoded.bytes),
        (Dtype::BF16, 3, bytes.len() as u64)
    );
    assert_eq!(std::fs::read(&dst).unwrap(), bytes);

    let mut sink = Vec::new();
    f.codec.decode_to_writer(&mut sink).unwrap();
    assert_eq!(sink, bytes);

    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        for path in [dst.as_path(), f.codec.zst_path()] {
            let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
            assert_eq!(
                mode,
                0o644,
                "{} is not an ordinary readable file",
                path.display()
            );
        }
    }
}

#[test]
fn same_input_and_level_give_the_same_frame_as_one_shot_zstd() {
    let bytes = adapter(&[("x", St::F32, 5000), ("y", St::F32, 3000)]);
    let f = fixture(&bytes);
    f.codec.encode(&f.src).unwrap();
    let ours = std::fs::read(f.codec.zst_path()).unwrap();
    // Independently: decompress, then recompress the transformed file in one shot.
    let transformed = zstd::decode_all(&ours[..]).unwrap();
    assert_eq!(zstd::bulk::compress(&transformed, 19).unwrap(), ours);
    // The frame header carries the content size and no checksum.
    assert_eq!(
        zstd::zstd_safe::get_frame_content_size(&ours).ok(),
        Some(Some(transformed.len() as u64))
    );
    assert_eq!(ours[4] & 0x04, 0, "checksum flag must be off");
}

#[test]
fn embedded_codec_decodes_from_bytes() {
    let bytes = adapter(&[("w", St::F16, 123)]);
    let f = fixture(&bytes);
    f.codec.encode(&f.src).unwrap();
    let zst: &'static [u8] = Box::leak(
        std::fs::read(f.codec.zst_path())
            .unwrap()
            .into_boxed_slice(),
    );
    let codec = AdapterCodec::embedded("shipped/adapters.safetensors.zst", zst, br#"{"a":1}"#);
    assert_eq!(codec.digest().unwrap(), f.codec.digest().unwrap());
    assert_eq!(codec.dtype().unwrap(), Dtype::F16);
    assert_eq!(&codec.config_bytes().unwrap()[..], br#"{"a":1}"#);
    let dst = f.dir.path().join("from-embedded.safetensors");
    codec.decode(&dst).unwrap();
    assert_eq!(std::fs::read(&dst).unwrap(), bytes);
    assert!(matches!(
        codec.encode(&f.src),
        Err(adapter_codec::Error::Embedded { .. })
    ));
}

#[test]
fn decoding_accepts_any_valid_zstd_framing() {
    let bytes = adapter(&[("w", St::F32, 4096)]);
    let f = fixture(&bytes);
    f.codec.encode(&f.src).unwrap();
    let transformed = zstd::decode_all(&std::fs::read(f.codec.zst_path()).unwrap()[..]).unwrap();
    let half = transformed.len() / 2;

    let mut with_checksum = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
    with_checksum.include_checksum(true).unwrap();
    with_checksum.include_contentsize(false).unwrap();
    std::io::Write::write_all(&mut with_checksum, &transformed).unwrap();
    let with_checksum = with_checksum.finish().unwrap();

    let mut two_frames = zstd::bulk::compress(&transformed[..half], 1).unwrap();
    two_frames.extend(zstd::bulk::compress(&transformed[half..], 1).unwrap());

    for (what, zst) in [
        ("checksum, no content size", with_checksum),
        ("two frames", two_frames),
    ] {
        std::fs::write(f.codec.zst_path(), &zst).unwrap();
        let dst = f.dir.path().join("out.safetensors");
        f.codec
            .decode(&dst)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(std::fs::read(&dst).unwrap(), bytes, "{what}");
    }
}

#[test]
fn levels_are_configurable_and_checked() {
    let bytes = adapter(&[("w", St::BF16, 2000)]);
    let f = fixture(&bytes);
    let fast = f.codec.clone().with_level(3).unwrap();
    assert_eq!(fast.level(), 3);
    fast.encode(&f.src).unwrap();
    let transformed = zstd::decode_all(&std::fs::read(fast.zst_path()).unwrap()[..]).unwrap();
    assert_eq!(
        zstd::bulk::compress(&transformed, 3).unwrap(),
        std::fs::read(fast.zst_path()).unwrap()
    );
    assert!(matches!(
        f.codec.clone().with_level(99),
        Err(adapter_codec::Error::InvalidLevel { level: 99, .. })
    ));
}

/// Cross-check with Python's `zstandard` (the library the original uses):
/// it must compress our transformed stream at level 19 to our exact bytes.
#[test]
fn python_zstandard_produces_the_same_frame() {
    // `cargo xtask test` provides a venv with the reference's zstandard.
    let Some(python) = python_with_zstandard("python_zstandard_produces_the_same_frame") else {
        return;
    };
    let bytes = adapter(&[("a", St::BF16, 70_000), ("b", St::BF16, 1234)]);
    let f = fixture(&bytes);
    f.codec.encode(&f.src).unwrap();
    let ours = std::fs::read(f.codec.zst_path()).unwrap();
    let transformed = f.dir.path().join("transformed.bin");
    std::fs::write(&transformed, zstd::decode_all(&ours[..]).unwrap()).unwrap();
    let script = "import sys, zstandard; d = open(sys.argv[1], 'rb').read(); sys.stdout.buffer.write(zstandard.ZstdCompressor(level=19).compress(d))";
    let out = Command::new(&python)
        .args(["-c", script])
        .arg(&transformed)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stdout == ours,
        "python zstandard's frame differs from ours"
    );
}

/// Trained-looking adapter values: small, roughly normal, every bit of the
/// mantissa busy, so zstd works as hard as on a real adapter.
fn adapter_values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            // Sum of uniforms: close enough to a bell curve.
            let s: f64 = (0..4).map(|_| uniform()).sum::<f64>() - 2.0;
            (s * 0.02) as f32
        })
        .collect()
}

/// An adapter of `tensors` × `elements` values of `dtype`, as a file.
fn big_adapter(dtype: St, tensors: usize, elements: usize) -> Vec<u8> {
    let data: Vec<Vec<u8>> = (0..tensors)
        .map(|k| {
            let values = adapter_values(elements, k as u64 + 1);
            match dtype {
                St::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                _ => values
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
            }
        })
        .collect();
    let names: Vec<String> = (0..tensors)
        .map(|k| {
            format!(
                "model.layers.{}.mlp.down_proj.lora_{}",
                k / 2,
                ["a", "b"][k % 2]
            )
        })
        .collect();
    let views: Vec<_> = names
        .iter()
        .zip(&data)
        .map(|(n, d)| {
            (
                n.as_str(),
                safetensors::tensor::TensorView::new(dtype, vec![elements], d).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// Our `.zst` of a real-size adapter (past zstd's 8 MiB window at level
/// 19) must be the reference encoder's, byte for byte: the committed
/// `tests/reference/encode.py` does what the Python original does, with
/// its zstd binding.
fn reference_encoder_agrees_past_the_window(dtype: St, name: &str) {
    let Some(python) = python_with_zstandard(name) else {
        return;
    };
    // 34 MB of tensors: four zstd windows and more.
    let bytes_per = if dtype == St::F32 { 4 } else { 2 };
    let bytes = big_adapter(dtype, 16, (34 << 20) / 16 / bytes_per);
    let f = fixture(&bytes);
    f.codec.encode(&f.src).unwrap();
    let ours = std::fs::read(f.codec.zst_path()).unwrap();
    let theirs = f.dir.path().join("reference.zst");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/encode.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(&f.src)
        .arg(&theirs)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs = std::fs::read(&theirs).unwrap();
    let first_difference = ours.iter().zip(&theirs).position(|(a, b)| a != b);
    assert!(
        ours == theirs,
        "{name}: ours {} bytes, the reference's {}, first difference at {first_difference:?}",
        ours.len(),
        theirs.len()
    );
}

#[test]
fn reference_encoder_agrees_on_a_34_mb_f32_adapter() {
    reference_encoder_agrees_past_the_window(
        St::F32,
        "reference_encoder_agrees_on_a_34_mb_f32_adapter",
    );
}

#[test]
fn reference_encoder_agrees_on_a_34_mb_bf16_adapter() {
    reference_encoder_agrees_past_the_window(
        St::BF16,
        "reference_encoder_agrees_on_a_34_mb_bf16_adapter",
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random adapters of every supported dtype, tensor count and size survive
    /// the round trip exactly.
    #[test]
    fn random_adapters_round_trip(
        dtype in prop::sample::select(vec![St::F32, St::BF16, St::F16]),
        sizes in prop::collection::vec(0usize..400, 1..6),
        level in prop::sample::select(vec![1, 3, 19]),
    ) {
        let names: Vec<String> = (0..sizes.len()).map(|i| format!("model.layers.{i}.q.lora_a")).collect();
        let spec: Vec<(&str, St, usize)> = names.iter().zip(&sizes).map(|(n, s)| (n.as_str(), dtype, *s)).collect();
        let bytes = adapter(&spec);
        let f = fixture(&bytes);
        let codec = f.codec.clone().with_level(level).unwrap();
        codec.encode(&f.src).unwrap();
        let dst = f.dir.path().join("back.safetensors");
        codec.decode(&dst).unwrap();
        prop_assert_eq!(std::fs::read(&dst).unwrap(), bytes);
    }
}

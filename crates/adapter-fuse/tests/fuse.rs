//! ensure_fused against a hub cache laid out as Python leaves it, with the
//! fused weights checked against values computed here.

use std::path::PathBuf;
use std::process::Command;

use adapter_fuse::{Error, Fuse, FuseProgress};
use half::bf16;
use mlx_rs::Array;
use st_mmap::SafetensorsFile;

mod common;

use common::*;

#[test]
fn dense_f32_fuse_then_hit() {
    let s = setup();
    let (w, bias) = dense_base(&s.root);
    let (codec, a, b) = adapter(&s.adapter_dir, CONFIG);
    let digest = codec.digest().unwrap();

    let mut events = Vec::new();
    let path = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .progress(|e| events.push(e))
        .run()
        .unwrap();
    let entry = s.root.join(format!("models--{NS}-{digest}"));
    assert_eq!(path, entry.join("snapshots").join(&digest));
    assert_eq!(
        std::fs::read_to_string(entry.join("refs/main")).unwrap(),
        digest
    );
    assert!(
        events.contains(&FuseProgress::Fusing { done: 1, total: 1 })
            && events.contains(&FuseProgress::Published)
    );

    let fused = SafetensorsFile::open(path.join("model.safetensors")).unwrap();
    let d = delta(&a, &b);
    for (k, (got, base)) in read_f32(&fused, &format!("{Q}.weight"))
        .iter()
        .zip(&w)
        .enumerate()
    {
        let want = f64::from(*base) + d[k];
        assert!(
            (f64::from(*got) - want).abs() < 1e-5,
            "element {k}: {got} vs {want}"
        );
    }
    assert_eq!(
        read_f32(&fused, &format!("{Q}.bias")),
        bias,
        "the bias is kept"
    );
    for file in [
        "tokenizer.json",
        "generation_config.json",
        "config.json",
        "model.safetensors.index.json",
    ] {
        assert!(
            path.join(file).is_file(),
            "{file} missing from the fused model"
        );
    }
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(
        index["weight_map"][format!("{Q}.weight")],
        "model.safetensors"
    );

    let mut events = Vec::new();
    assert_eq!(
        Fuse::new(REPO, &codec, NS)
            .options(&s.options)
            .progress(|e| events.push(e))
            .run()
            .unwrap(),
        path
    );
    assert_eq!(events, [FuseProgress::Hit]);
}

#[test]
fn bf16_base_is_fused_in_its_dtype() {
    let s = setup();
    let w: Vec<bf16> = values(1, OUT * IN, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let wb: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    let weights = safetensors_bytes(&[(
        &format!("{Q}.weight"),
        safetensors::Dtype::BF16,
        vec![OUT, IN],
        wb,
    )]);
    put_in_hub_cache(
        &s.root,
        REPO,
        &[
            ("config.json", b"{}".to_vec()),
            ("model.safetensors", weights),
        ],
    );
    let (codec, a, b) = adapter(&s.adapter_dir, CONFIG);
    let path = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .run()
        .unwrap();
    let fused = SafetensorsFile::open(path.join("model.safetensors")).unwrap();
    let view = fused.tensor(&format!("{Q}.weight")).unwrap();
    assert_eq!(view.dtype, st_mmap::Dtype::BF16);
    let got: Vec<f32> = view
        .data
        .chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    let d = delta(&a, &b);
    for (k, g) in got.iter().enumerate() {
        let want = f64::from(w[k].to_f32()) + d[k];
        // bf16 keeps 8 significant bits; the delta is also formed in bf16.
        assert!(
            (f64::from(*g) - want).abs() <= 0.02 * want.abs().max(1.0),
            "element {k}: {g} vs {want}"
        );
    }
}

fn quantized_case(bits: i32) {
    let s = setup();
    let group = 32;
    let w = values(5, OUT * IN, 1.0);
    let (qw, qs, qb) =
        mlx_rs::ops::quantize(Array::from_slice(&w, &[OUT as i32, IN as i32]), group, bits)
            .unwrap();
    let file = s.root.join("q.safetensors");
    let arrays = [
        (format!("{Q}.weight"), &qw),
        (format!("{Q}.scales"), &qs),
        (format!("{Q}.biases"), &qb),
    ];
    Array::save_safetensors(arrays.iter().map(|(k, v)| (k.as_str(), *v)), None, &file).unwrap();
    let config = format!(
        r#"{{"model_type": "llama", "quantization": {{"group_size": {group}, "bits": {bits}}}}}"#
    );
    put_in_hub_cache(
        &s.root,
        REPO,
        &[
            ("config.json", config.into_bytes()),
            ("model.safetensors", std::fs::read(&file).unwrap()),
        ],
    );
    let (codec, a, b) = adapter(&s.adapter_dir, CONFIG);
    let path = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .run()
        .unwrap();

    let fused = SafetensorsFile::open(path.join("model.safetensors")).unwrap();
    let load = |key: &str| {
        let v = fused.tensor(key).unwrap();
        mlx_support::array_from_bytes(key, v.dtype, v.shape, v.data).unwrap()
    };
    let (fw, fs, fb) = (
        load(&format!("{Q}.weight")),
        load(&format!("{Q}.scales")),
        load(&format!("{Q}.biases")),
    );
    assert_eq!(fw.shape(), qw.shape());
    let deq = |w: &Array, s: &Array, b: &Array| {
        let d = mlx_rs::ops::dequantize(w, s, b, group, bits).unwrap();
        d.eval().unwrap();
        d.as_slice::<f32>().to_vec()
    };
    let before = deq(&qw, &qs, &qb);
    let after = deq(&fw, &fs, &fb);
    fs.eval().unwrap();
    let steps = fs.as_slice::<f32>().to_vec();
    let d = delta(&a, &b);
    for k in 0..OUT * IN {
        let want = f64::from(before[k]) + d[k];
        let step = f64::from(steps[k / group as usize].abs());
        assert!(
            (f64::from(after[k]) - want).abs() <= step + 1e-6,
            "{bits}-bit element {k}: {} vs {want}",
            after[k]
        );
    }
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization_config"], config["quantization"]);
}

#[test]
fn quantized_4bit_base_is_dequantized_fused_and_requantized() {
    quantized_case(4);
}

#[test]
fn quantized_8bit_base_is_dequantized_fused_and_requantized() {
    quantized_case(8);
}

/// mlx_lm's mixed quantization: a default `{group_size, bits}` and
/// per-module entries, `{...}` of their own or `false` for a dense module.
#[test]
fn per_module_quantization_overrides_are_honoured() {
    let s = setup();
    let module = |p: &str| format!("model.layers.0.self_attn.{p}_proj");
    // q: the default 4-bit, group 32; v: 8-bit, group 64; k: dense f32.
    let plan = [("q", Some((32, 4))), ("v", Some((64, 8))), ("k", None)];
    let mut arrays: Vec<(String, Array)> = Vec::new();
    let mut lora = Vec::new();
    let mut originals = Vec::new();
    for (i, (p, quant)) in plan.iter().enumerate() {
        let seed = 100 + 10 * i as u32;
        let w = Array::from_slice(&values(seed, OUT * IN, 1.0), &[OUT as i32, IN as i32]);
        match quant {
            Some((group, bits)) => {
                let (qw, qs, qb) = mlx_rs::ops::quantize(&w, *group, *bits).unwrap();
                arrays.push((format!("{}.weight", module(p)), qw));
                arrays.push((format!("{}.scales", module(p)), qs));
                arrays.push((format!("{}.biases", module(p)), qb));
            }
            None => arrays.push((format!("{}.weight", module(p)), w)),
        }
        let (a, b) = (
            values(seed + 1, IN * RANK, 0.5),
            values(seed + 2, RANK * OUT, 0.5),
        );
        lora.push((
            format!("{}.lora_a", module(p)),
            vec![IN, RANK],
            f32_bytes(&a),
        ));
        lora.push((
            format!("{}.lora_b", module(p)),
            vec![RANK, OUT],
            f32_bytes(&b),
        ));
        originals.push((a, b));
    }
    let file = s.root.join("mixed.safetensors");
    Array::save_safetensors(arrays.iter().map(|(k, v)| (k.as_str(), v)), None, &file).unwrap();
    let config = format!(
        r#"{{"model_type": "llama", "quantization": {{"group_size": 32, "bits": 4, "{}": {{"group_size": 64, "bits": 8}}, "{}": false}}}}"#,
        module("v"),
        module("k")
    );
    put_in_hub_cache(
        &s.root,
        REPO,
        &[
            ("config.json", config.into_bytes()),
            ("model.safetensors", std::fs::read(&file).unwrap()),
        ],
    );
    let lora: Vec<_> = lora
        .iter()
        .map(|(k, shape, b)| {
            (
                k.as_str(),
                safetensors::Dtype::F32,
                shape.clone(),
                b.clone(),
            )
        })
        .collect();
    let codec = encode_adapter(&s.adapter_dir, safetensors_bytes(&lora), CONFIG);
    let path = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .run()
        .unwrap();

    let fused = SafetensorsFile::open(path.join("model.safetensors")).unwrap();
    let load = |key: String| {
        let v = fused.tensor(&key).unwrap();
        mlx_support::array_from_bytes(&key, v.dtype, v.shape, v.data).unwrap()
    };
    let dense = |key: String| -> Vec<f32> {
        let w = arrays.iter().find(|(k, _)| *k == key).unwrap().1.clone();
        w.eval().unwrap();
        w.as_slice::<f32>().to_vec()
    };
    for ((p, quant), (a, b)) in plan.iter().zip(&originals) {
        let d = delta(a, b);
        let m = module(p);
        match quant {
            Some((group, bits)) => {
                let deq = |w: &Array, sc: &Array, bi: &Array| {
                    let x = mlx_rs::ops::dequantize(w, sc, bi, *group, *bits).unwrap();
                    x.eval().unwrap();
                    x.as_slice::<f32>().to_vec()
                };
                let original = |t: &str| {
                    arrays
                        .iter()
                        .find(|(k, _)| *k == format!("{m}.{t}"))
                        .unwrap()
                        .1
                        .clone()
                };
                let before = deq(
                    &original("weight"),
                    &original("scales"),
                    &original("biases"),
                );
                let scales = load(format!("{m}.scales"));
                let after = deq(
                    &load(format!("{m}.weight")),
                    &scales,
                    &load(format!("{m}.biases")),
                );
                scales.eval().unwrap();
                let steps = scales.as_slice::<f32>().to_vec();
                for k in 0..OUT * IN {
                    let want = f64::from(before[k]) + d[k];
                    let step = f64::from(steps[k / *group as usize].abs());
                    assert!(
                        (f64::from(after[k]) - want).abs() <= step + 1e-6,
                        "{m} ({bits}-bit) element {k}: {} vs {want}",
                        after[k]
                    );
                }
            }
            None => {
                assert!(fused.tensor(&format!("{m}.scales")).is_none());
                let before = dense(format!("{m}.weight"));
                let after = read_f32(&fused, &format!("{m}.weight"));
                for k in 0..OUT * IN {
                    let want = f64::from(before[k]) + d[k];
                    assert!(
                        (f64::from(after[k]) - want).abs() <= 1e-5,
                        "{m} element {k}"
                    );
                }
            }
        }
    }
}

#[test]
fn half_written_entry_is_not_a_hit() {
    let s = setup();
    dense_base(&s.root);
    let (codec, _, _) = adapter(&s.adapter_dir, CONFIG);
    let digest = codec.digest().unwrap();
    // What a crash between the snapshot rename and refs/main would leave.
    let snapshot = s
        .root
        .join(format!("models--{NS}-{digest}/snapshots/{digest}"));
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::write(snapshot.join("config.json"), "{}").unwrap();
    let mut events = Vec::new();
    let path = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .progress(|e| events.push(e))
        .run()
        .unwrap();
    assert!(events.contains(&FuseProgress::Published), "{events:?}");
    assert!(path.join("model.safetensors").is_file());
    // No temporary folders remain in the cache root.
    let leftovers: Vec<_> = std::fs::read_dir(&s.root)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".fuse-"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn leftovers_of_a_killed_fuse_are_cleared() {
    let s = setup();
    dense_base(&s.root);
    let (codec, _, _) = adapter(&s.adapter_dir, CONFIG);
    let digest = codec.digest().unwrap();
    // What a fuse killed mid-way leaves: its work folder, and no entry.
    let stale = s.root.join(format!(".fuse-{digest}-killed"));
    std::fs::create_dir_all(stale.join("snapshot")).unwrap();
    std::fs::write(stale.join("snapshot/model.safetensors"), b"half").unwrap();
    let path = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .run()
        .unwrap();
    assert!(!stale.exists(), "the stale work folder is removed");
    assert!(SafetensorsFile::open(path.join("model.safetensors")).is_ok());
}

/// An I/O error in the middle of writing a shard (here: the base file cut
/// short under the fuse, once its header has been read) is a typed error
/// naming the file, and leaves neither an entry nor a work folder.
#[test]
fn a_base_cut_short_while_fusing_is_an_io_error_and_leaves_nothing() {
    let s = setup();
    dense_base(&s.root);
    let (codec, _, _) = adapter(&s.adapter_dir, CONFIG);
    let blob = s.root.join("models--org--base/blobs/blob0001"); // model.safetensors
    let bytes = std::fs::read(&blob).unwrap();
    let data_start = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let mut cut = false;
    let err = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .progress(|e: FuseProgress| {
            if matches!(e, FuseProgress::Fusing { .. }) && !cut {
                // Keep the header (it is read through the map); drop the data.
                let file = std::fs::OpenOptions::new().write(true).open(&blob).unwrap();
                file.set_len(data_start).unwrap();
                cut = true;
            }
        })
        .run()
        .unwrap_err();
    assert!(cut, "no Fusing event came");
    match &err {
        Error::Io { path, source } => {
            assert!(path.ends_with("model.safetensors"), "{err}");
            assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
        }
        other => panic!("expected an I/O error, got {other}"),
    }
    let left: Vec<_> = std::fs::read_dir(&s.root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("models--org--fused") || n.starts_with(".fuse-"))
        .collect();
    let entry_complete = left
        .iter()
        .any(|n| s.root.join(n).join("refs/main").exists());
    assert!(
        !entry_complete && !left.iter().any(|n| n.starts_with(".fuse-")),
        "{left:?}"
    );
}

#[test]
fn corrupt_adapter_is_a_codec_error_and_leaves_no_entry() {
    let s = setup();
    dense_base(&s.root);
    let (codec, _, _) = adapter(&s.adapter_dir, CONFIG);
    let zst = codec.zst_path().to_path_buf();
    let mut bytes = std::fs::read(&zst).unwrap();
    let cut = bytes.len() / 2;
    bytes.truncate(cut);
    std::fs::write(&zst, bytes).unwrap();
    let err = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .run()
        .unwrap_err();
    assert!(matches!(err, Error::Codec(_)), "{err}");
    let entries: Vec<_> = std::fs::read_dir(&s.root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("models--org--fused") || n.starts_with(".fuse-"))
        .collect();
    assert!(entries.is_empty(), "left behind: {entries:?}");
}

#[test]
fn adapter_key_without_base_weight_is_named() {
    let s = setup();
    let weights = safetensors_bytes(&[(
        "model.other.weight",
        safetensors::Dtype::F32,
        vec![2],
        f32_bytes(&[1.0, 2.0]),
    )]);
    put_in_hub_cache(
        &s.root,
        REPO,
        &[
            ("config.json", b"{}".to_vec()),
            ("model.safetensors", weights),
        ],
    );
    let (codec, _, _) = adapter(&s.adapter_dir, CONFIG);
    let err = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .run()
        .unwrap_err();
    assert!(
        matches!(&err, Error::NoBaseWeight { weight, .. } if weight == &format!("{Q}.weight")),
        "{err}"
    );
}

#[test]
fn shape_mismatch_names_both_shapes() {
    let s = setup();
    let weights = safetensors_bytes(&[(
        &format!("{Q}.weight"),
        safetensors::Dtype::F32,
        vec![OUT, IN + 1],
        f32_bytes(&vec![0.0; OUT * (IN + 1)]),
    )]);
    put_in_hub_cache(
        &s.root,
        REPO,
        &[
            ("config.json", b"{}".to_vec()),
            ("model.safetensors", weights),
        ],
    );
    let (codec, _, _) = adapter(&s.adapter_dir, CONFIG);
    let err = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .run()
        .unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { a, b, base, .. } if a == &[IN as i32, RANK as i32] && b == &[RANK as i32, OUT as i32] && base == &[OUT as i32, IN as i32 + 1]),
        "{err}"
    );
}

#[test]
fn missing_scale_is_an_error() {
    let s = setup();
    dense_base(&s.root);
    let (codec, _, _) = adapter(
        &s.adapter_dir,
        r#"{"fine_tune_type": "lora", "lora_parameters": {"rank": 4}}"#,
    );
    let err = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .run()
        .unwrap_err();
    assert!(
        matches!(&err, Error::Adapter { message, .. } if message.contains("scale")),
        "{err}"
    );
    // The error names the config the application shipped, not the decoded
    // copy in the fuse's work folder (gone by the time the error is read).
    assert!(
        matches!(&err, Error::Adapter { path, .. } if path == codec.config_path()),
        "{err:?}"
    );
    assert!(!err.to_string().contains(".fuse-"), "{err}");
}

#[test]
fn non_finite_adapters_are_errors_and_publish_nothing() {
    for (value, config) in [
        // A NaN in the adapter.
        (f32::NAN, CONFIG),
        // Values whose product overflows f32.
        (3e38, CONFIG),
    ] {
        let s = setup();
        dense_base(&s.root);
        let (codec, _, _) = adapter_with_b(&s.adapter_dir, vec![value; RANK * OUT], config);
        let err = Fuse::new(REPO, &codec, NS)
            .options(&s.options)
            .run()
            .unwrap_err();
        assert!(
            matches!(&err, Error::NotFinite { module, .. } if module == Q),
            "{value}: {err}"
        );
        let entry = s
            .root
            .join(format!("models--{NS}-{}", codec.digest().unwrap()));
        assert!(
            !entry.join("refs/main").exists(),
            "{value}: an entry was published"
        );
    }
    // A scale that is not a finite f32 (1e308 overflows it).
    let s = setup();
    dense_base(&s.root);
    let (codec, _, _) = adapter_with_b(
        &s.adapter_dir,
        vec![0.5; RANK * OUT],
        r#"{"fine_tune_type": "lora", "lora_parameters": {"rank": 4, "scale": 1e308}}"#,
    );
    let err = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .run()
        .unwrap_err();
    assert!(
        matches!(&err, Error::Adapter { message, .. } if message.contains("finite")),
        "{err}"
    );
}

#[test]
fn offline_miss_is_an_error_not_a_download() {
    let s = setup();
    let (codec, _, _) = adapter(&s.adapter_dir, CONFIG);
    let err = Fuse::new("org/not-cached", &codec, NS)
        .options(&s.options.clone().with_offline(true))
        .run()
        .unwrap_err();
    assert!(
        matches!(&err, Error::Offline { repo, .. } if repo == "org/not-cached"),
        "{err}"
    );
}

/// Python's huggingface_hub resolves our entry as repo `org/fused-{digest}`
/// without network: the layout is the same contract.
#[test]
fn huggingface_hub_resolves_the_fused_entry() {
    let python = std::env::var("MLX_LOWMEM_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python)
        .args(["-c", "import huggingface_hub"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!("SKIP huggingface_hub_resolves_the_fused_entry: {python} lacks huggingface_hub");
        return;
    }
    let s = setup();
    dense_base(&s.root);
    let (codec, _, _) = adapter(&s.adapter_dir, CONFIG);
    let path = Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .run()
        .unwrap();
    let digest = codec.digest().unwrap();
    let script = "import sys; from huggingface_hub import snapshot_download; \
                  print(snapshot_download(sys.argv[1], cache_dir=sys.argv[2], local_files_only=True))";
    let out = Command::new(&python)
        .args(["-c", script, &format!("org/fused-{digest}")])
        .arg(&s.root)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resolved = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert_eq!(
        resolved.canonicalize().unwrap(),
        path.canonicalize().unwrap()
    );
}

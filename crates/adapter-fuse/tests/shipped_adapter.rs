//! The adapter cc-sentiment ships (PyPI `cc-sentiment` 0.2.135, fetched by
//! `cargo xtask fixtures` into `MLX_LOWMEM_CC_SENTIMENT`) fused into a Gemma 4
//! checkpoint with E2B's real shapes (random weights, UD-like mixed 4/8-bit,
//! vision/audio towers, the unused k/v of 0.31.3-era checkpoints): the
//! result equals, tensor by tensor, what the Python original's fuse
//! (`tests/parity/python_fuse.py`: mlx_lm load, LoRA, fuse, save) makes with
//! mlx_lm 0.31.3 and with 0.32.2, leaves out what they leave out, and loads
//! in both. Skips, saying so, without the adapter or the Python.

mod common;
use test_support::gemma4_e2b;
use test_support::python::mlx_lm_python;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use adapter_codec::AdapterCodec;
use adapter_fuse::{Error, Fuse, FuseOptions};

fn shipped(test: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("MLX_LOWMEM_CC_SENTIMENT").map(PathBuf::from);
    if dir.is_none() {
        eprintln!("SKIP {test}: MLX_LOWMEM_CC_SENTIMENT is not set (cargo xtask fixtures fetches the adapter)");
    }
    dir
}

fn codec(shipped: &Path) -> AdapterCodec {
    AdapterCodec::new(
        shipped.join("adapters.safetensors.zst"),
        shipped.join("adapter_config.json"),
    )
}

/// The E2B-shaped base with the files a loader needs beside the weights.
fn write_base(dir: &Path, base: &gemma4_e2b::E2bBase) {
    gemma4_e2b::write(dir, base);
    let mut vocab = serde_json::Map::new();
    for (i, word) in ["<pad>", "<eos>", "<bos>", "<unk>", "1", "2", "3", "4", "5"]
        .iter()
        .enumerate()
    {
        vocab.insert((*word).into(), i.into());
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>"}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [1, 106]}"#,
    )
    .unwrap();
}

/// The shipped adapter decoded into `dir`.
fn decoded(shipped: &Path, dir: &Path) -> PathBuf {
    let path = dir.join("adapters.safetensors");
    codec(shipped).decode(&path).unwrap();
    path
}

fn file_names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// The Python original's fuse into `out` with the given mlx_lm; returns
/// its version and peak RSS.
fn python_fuse(
    python: &str,
    base: &Path,
    adapter: &Path,
    out: &Path,
    newer: bool,
) -> (String, u64) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/python_fuse.py");
    let mut command = Command::new(python);
    command.arg(&script).arg(base).arg(adapter).arg(out);
    if newer {
        command.arg("--mlx-lm-0.32.2");
    }
    let run = command.output().unwrap();
    assert!(
        run.status.success(),
        "python fuse: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    (
        report["version"].as_str().unwrap().to_owned(),
        report["peak_rss_bytes"].as_u64().unwrap(),
    )
}

#[test]
fn the_shipped_adapter_fuses_into_gemma4_as_the_python_original_does() {
    let test = "the_shipped_adapter_fuses_into_gemma4_as_the_python_original_does";
    let Some(shipped) = shipped(test) else { return };
    let Some(python) = mlx_lm_python(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (base, hub, adapter) = (
        dir.path().join("base"),
        dir.path().join("hub"),
        dir.path().join("adapter"),
    );
    let clock = std::time::Instant::now();
    write_base(&base, &gemma4_e2b::E2bBase::default());
    eprintln!("E2B-shaped base written in {:.1?}", clock.elapsed());
    let codec = codec(&shipped);
    // spawnllm names the entry by the first 16 hex digits of the .zst's
    // sha256: the same name here, so either side's entry is a hit for both.
    assert_eq!(codec.digest().unwrap(), "2bce2896b3194b3f");
    let ours = Fuse::new(base.to_str().unwrap(), &codec, "cc-sentiment--fused")
        .options(&FuseOptions::from_env().with_cache_root(&hub))
        .run()
        .unwrap();
    eprintln!("fused here by {:.1?}", clock.elapsed());
    assert!(
        ours.ends_with("models--cc-sentiment--fused-2bce2896b3194b3f/snapshots/2bce2896b3194b3f")
    );

    std::fs::create_dir_all(&adapter).unwrap();
    codec.decode(adapter.join("adapters.safetensors")).unwrap();
    std::fs::copy(
        shipped.join("adapter_config.json"),
        adapter.join("adapter_config.json"),
    )
    .unwrap();
    let our_tensors = test_support::tensors::in_folder(&ours);
    let base_tensors = test_support::tensors::in_folder(&base);
    for (newer, version) in [(false, "0.31.3"), (true, "0.32.2")] {
        let theirs = dir.path().join(format!("python-{version}"));
        let (got, peak) = python_fuse(&python, &base, &adapter, &theirs, newer);
        assert_eq!(got, version);
        eprintln!(
            "python fuse with mlx_lm {version}: peak RSS {} MB",
            peak >> 20
        );
        let their_tensors = test_support::tensors::in_folder(&theirs);
        let ours_only: Vec<_> = our_tensors
            .keys()
            .filter(|k| !their_tensors.contains_key(*k))
            .collect();
        let theirs_only: Vec<_> = their_tensors
            .keys()
            .filter(|k| !our_tensors.contains_key(*k))
            .collect();
        assert!(
            ours_only.is_empty() && theirs_only.is_empty(),
            "mlx_lm {version}: only ours {ours_only:?}, only theirs {theirs_only:?}"
        );
        let differing: Vec<_> = our_tensors
            .iter()
            .filter(|(k, v)| their_tensors[*k] != **v)
            .map(|(k, _)| k)
            .collect();
        assert!(
            differing.is_empty(),
            "mlx_lm {version}: {differing:?} differ"
        );
        // What both leave out of the base: towers and the unused k/v.
        let left_out: BTreeSet<_> = base_tensors
            .keys()
            .filter(|k| !our_tensors.contains_key(*k))
            .collect();
        assert!(left_out.iter().any(|k| k.starts_with("vision_tower.")));
        assert!(
            left_out.contains(&"language_model.model.layers.34.self_attn.k_proj.weight".to_owned())
        );
        assert!(left_out.iter().all(|k| mlx_support::unused_by_mlx_lm(
            &gemma4_e2b::config(&gemma4_e2b::E2bBase::default()),
            k
        )));
        // The files a loader needs are on both sides.
        let (mine, python_files) = (file_names(&ours), file_names(&theirs));
        for needed in [
            "config.json",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            assert!(
                mine.contains(needed) && python_files.contains(needed),
                "{needed}: ours {mine:?}, python {python_files:?}"
            );
        }
        // Both configs describe the same model.
        let config = |d: &Path| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(d.join("config.json")).unwrap()).unwrap()
        };
        let (a, b) = (config(&ours), config(&theirs));
        for key in [
            "model_type",
            "text_config",
            "quantization",
            "quantization_config",
        ] {
            assert_eq!(a[key], b[key], "config.json {key}");
        }
        // The fused folder loads, strictly, in this mlx_lm.
        let prelude = if newer {
            "import sys, pathlib; sys.path.insert(0, str(pathlib.Path(sys.prefix) / 'mlx-lm-0.32.2')); "
        } else {
            ""
        };
        let loaded = Command::new(&python)
            .arg("-c")
            .arg(format!(
                "{prelude}import sys, pathlib; from mlx_lm.utils import load_model; load_model(pathlib.Path(sys.argv[1]))"
            ))
            .arg(&ours)
            .output()
            .unwrap();
        assert!(
            loaded.status.success(),
            "mlx_lm {version} loads ours: {}",
            String::from_utf8_lossy(&loaded.stderr)
        );
    }
}

/// The adapter against a base of other shapes: an error naming the first
/// key and both shapes; nothing in the cache; the cache still works.
#[test]
fn the_shipped_adapter_on_a_base_of_other_shapes_is_a_typed_error() {
    let test = "the_shipped_adapter_on_a_base_of_other_shapes_is_a_typed_error";
    let Some(shipped) = shipped(test) else { return };
    let dir = tempfile::tempdir().unwrap();
    let (base, hub) = (dir.path().join("base"), dir.path().join("hub"));
    std::fs::create_dir_all(&hub).unwrap();
    // Every module the adapter names, at the shapes of a much smaller
    // model (as another architecture's checkpoint would be).
    std::fs::create_dir_all(&base).unwrap();
    let file = st_mmap::SafetensorsFile::open(decoded(&shipped, dir.path())).unwrap();
    let mut weights = Vec::new();
    for info in file.header().tensors() {
        if let Some(module) = info.name.strip_suffix(".lora_a") {
            weights.push((
                format!("{module}.weight"),
                mlx_rs::Array::zeros::<f32>(&[64, 32]).unwrap(),
            ));
        }
    }
    mlx_rs::Array::save_safetensors(
        weights.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        base.join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(base.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();

    let err = Fuse::new(
        base.to_str().unwrap(),
        &codec(&shipped),
        "cc-sentiment--fused",
    )
    .options(&FuseOptions::from_env().with_cache_root(&hub))
    .run()
    .unwrap_err();
    match &err {
        Error::ShapeMismatch {
            key,
            a,
            b,
            base: shape,
            ..
        } => {
            // The first module in the base file's order, with its shapes.
            let written = st_mmap::SafetensorsFile::open(base.join("model.safetensors")).unwrap();
            let first = written.header().tensors()[0]
                .name
                .replace(".weight", ".lora_a");
            assert_eq!(key, &first);
            let view = file.tensor(&first).unwrap();
            assert_eq!(a, &view.shape.iter().map(|&d| d as i32).collect::<Vec<_>>());
            assert_eq!(b[0], 8);
            assert_eq!(shape, &vec![64, 32]);
        }
        other => panic!("{other}"),
    }
    // Nothing left in the cache but its lock folder.
    let entries: Vec<_> = std::fs::read_dir(&hub)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".locks")
        .collect();
    assert!(entries.is_empty(), "{entries:?}");
    // The cache still works: another adapter fuses into it.
    common::dense_base(&hub);
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let (codec, _, _) = common::adapter(&other, common::CONFIG);
    let fused = Fuse::new(common::REPO, &codec, common::NS)
        .options(
            &FuseOptions::from_env()
                .with_cache_root(&hub)
                .with_offline(true),
        )
        .run()
        .unwrap();
    assert!(fused.join("config.json").is_file());
}

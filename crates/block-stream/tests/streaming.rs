//! BlockStreamer and LoRA against values computed here from the same inputs.

use std::path::{Path, PathBuf};

use block_stream::{BlockLoraSource, BlockStreamer, DenseLoraFuser, Error, QuantizedLoraFuser};
use mlx_rs::macros::ModuleParameters;
use mlx_rs::module::Param;
use mlx_rs::nn::Linear;
use mlx_rs::{Array, Dtype};

const PREFIX: &str = "transformer.blocks.";

/// The block every test binds into: `attn` (6 → 4, with bias) and `norm` (6).
#[derive(Debug, ModuleParameters)]
struct Block {
    #[param]
    attn: Linear,
    #[param]
    norm: Param<Array>,
}

fn block() -> Block {
    Block {
        attn: Linear::new(6, 4).unwrap(),
        norm: Param::new(Array::zeros::<f32>(&[6]).unwrap()),
    }
}

/// Distinct values per block and parameter: `block * 1000 + param * 100 + k`.
fn values(block: usize, param: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|k| (block * 1000 + param * 100 + k) as f32)
        .collect()
}

type Tensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

fn f32_tensor(key: String, shape: Vec<usize>, data: &[f32]) -> Tensor {
    (
        key,
        safetensors::Dtype::F32,
        shape,
        data.iter().flat_map(|v| v.to_le_bytes()).collect(),
    )
}

fn write(path: &Path, tensors: &[Tensor]) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(k, d, s, b)| {
            (
                k.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// A three-block model plus a head, split over two files.
fn model(dir: &Path) -> Vec<PathBuf> {
    let mut first = Vec::new();
    let mut second = Vec::new();
    for b in 0..3 {
        let target = if b < 2 { &mut first } else { &mut second };
        target.push(f32_tensor(
            format!("{PREFIX}{b}.attn.weight"),
            vec![4, 6],
            &values(b, 0, 24),
        ));
        target.push(f32_tensor(
            format!("{PREFIX}{b}.attn.bias"),
            vec![4],
            &values(b, 1, 4),
        ));
        target.push(f32_tensor(
            format!("{PREFIX}{b}.norm"),
            vec![6],
            &values(b, 2, 6),
        ));
    }
    second.push(f32_tensor(
        "transformer.head.weight".into(),
        vec![2, 2],
        &[1.0, 2.0, 3.0, 4.0],
    ));
    let paths = vec![dir.join("a.safetensors"), dir.join("b.safetensors")];
    write(&paths[0], &first);
    write(&paths[1], &second);
    paths
}

fn read(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(Dtype::Float32).unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

#[test]
fn binds_the_right_values_block_after_block() {
    let dir = tempfile::tempdir().unwrap();
    let mut streamer = BlockStreamer::new(model(dir.path()), PREFIX).unwrap();
    assert_eq!(streamer.block_count(), 3);
    assert_eq!(streamer.block_prefix(), PREFIX);
    assert_eq!(
        streamer.block_keys(2).unwrap(),
        ["attn.bias", "attn.weight", "norm"]
    );
    assert_eq!(streamer.other_keys(), ["transformer.head.weight"]);

    let mut m = block();
    for b in [1, 0, 2] {
        streamer.bind(&mut m, b, &[]).unwrap();
        assert_eq!(read(&m.attn.weight), values(b, 0, 24));
        assert_eq!(read((*m.attn.bias).as_ref().unwrap()), values(b, 1, 4));
        assert_eq!(read(&m.norm), values(b, 2, 6));
    }
    assert_eq!(
        read(&streamer.tensor("transformer.head.weight").unwrap()),
        [1.0, 2.0, 3.0, 4.0]
    );
}

#[test]
fn prefetching_binds_the_same_values() {
    let dir = tempfile::tempdir().unwrap();
    let mut streamer = BlockStreamer::new(model(dir.path()), PREFIX)
        .unwrap()
        .with_prefetch(true);
    let mut m = block();
    for b in 0..3 {
        streamer.bind(&mut m, b, &[]).unwrap();
        assert_eq!(read(&m.attn.weight), values(b, 0, 24));
    }
}

#[test]
fn unknown_block_lists_the_known_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut streamer = BlockStreamer::new(model(dir.path()), PREFIX).unwrap();
    let err = streamer.bind(&mut block(), 7, &[]).unwrap_err();
    assert!(
        matches!(&err, Error::UnknownBlock { block: 7, known } if known == &[0, 1, 2]),
        "{err}"
    );
    assert!(matches!(
        streamer.block_keys(9),
        Err(Error::UnknownBlock { block: 9, .. })
    ));
}

/// A streamer on a set its caller opened reads the same values and shares
/// the set (the caller's maps are the streamer's).
#[test]
fn a_streamer_on_an_open_set_binds_the_same_values() {
    let dir = tempfile::tempdir().unwrap();
    let paths = model(dir.path());
    let set = std::sync::Arc::new(st_mmap::SafetensorsSet::open_files(&paths).unwrap());
    let mut streamer = BlockStreamer::from_set(set.clone(), PREFIX).unwrap();
    assert_eq!(std::sync::Arc::strong_count(&set), 2);
    assert_eq!(streamer.block_count(), 3);
    let mut m = block();
    for b in [2, 0, 1] {
        streamer.bind(&mut m, b, &[]).unwrap();
        assert_eq!(read(&m.attn.weight), values(b, 0, 24));
        assert_eq!(read(&m.norm), values(b, 2, 6));
    }
    let err = BlockStreamer::from_set(set, "decoder.layers.").unwrap_err();
    assert!(
        matches!(&err, Error::NoBlocks { paths: named, .. } if named == &paths),
        "{err}"
    );
}

#[test]
fn no_block_keys_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = BlockStreamer::new(model(dir.path()), "decoder.layers.").unwrap_err();
    assert!(matches!(err, Error::NoBlocks { .. }), "{err}");
}

#[test]
fn strict_binding_names_block_and_parameter_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut streamer = BlockStreamer::new(model(dir.path()), PREFIX).unwrap();
    let mut m = block();
    streamer.bind(&mut m, 0, &[]).unwrap();

    // A module with a parameter the weights lack.
    #[derive(Debug, ModuleParameters)]
    struct Wider {
        #[param]
        attn: Linear,
        #[param]
        norm: Param<Array>,
        #[param]
        extra: Param<Array>,
    }
    let mut wider = Wider {
        attn: Linear::new(6, 4).unwrap(),
        norm: Param::new(Array::zeros::<f32>(&[6]).unwrap()),
        extra: Param::new(Array::zeros::<f32>(&[1]).unwrap()),
    };
    let err = streamer.bind(&mut wider, 1, &[]).unwrap_err();
    assert!(
        matches!(&err, Error::MissingParam { block: 1, param } if param == "extra"),
        "{err}"
    );
    assert_eq!(
        read(&wider.norm),
        vec![0.0; 6],
        "a failed bind must not change the module"
    );

    // A module without a parameter the weights have.
    #[derive(Debug, ModuleParameters)]
    struct Narrower {
        #[param]
        attn: Linear,
    }
    let err = streamer
        .bind(
            &mut Narrower {
                attn: Linear::new(6, 4).unwrap(),
            },
            1,
            &[],
        )
        .unwrap_err();
    assert!(
        matches!(&err, Error::UnexpectedParam { block: 1, param } if param == "norm"),
        "{err}"
    );

    // Wrong shape.
    let mut wrong = Block {
        attn: Linear::new(5, 4).unwrap(),
        norm: Param::new(Array::zeros::<f32>(&[6]).unwrap()),
    };
    let err = streamer.bind(&mut wrong, 2, &[]).unwrap_err();
    assert!(
        matches!(&err, Error::ShapeMismatch { block: 2, param, expected, actual } if param == "attn.weight" && expected == &[4, 5] && actual == &[4, 6]),
        "{err}"
    );

    // Wrong dtype.
    let mut half = block();
    *half.norm = Array::zeros::<f32>(&[6])
        .unwrap()
        .as_dtype(Dtype::Bfloat16)
        .unwrap();
    let err = streamer.bind(&mut half, 1, &[]).unwrap_err();
    assert!(
        matches!(&err, Error::DtypeMismatch { block: 1, param, .. } if param == "norm"),
        "{err}"
    );

    // The module bound before is still block 0.
    assert_eq!(read(&m.attn.weight), values(0, 0, 24));
}

/// The original's `close()` is dropping the streamer: the files and
/// mappings go, and arrays already bound stay valid.
#[test]
fn dropped_streamer_leaves_bound_arrays_valid() {
    let dir = tempfile::tempdir().unwrap();
    let mut streamer = BlockStreamer::new(model(dir.path()), PREFIX).unwrap();
    let mut m = block();
    streamer.bind(&mut m, 2, &[]).unwrap();
    drop(streamer);
    assert_eq!(read(&m.attn.weight), values(2, 0, 24));
}

#[test]
fn a_weights_file_gone_mid_stream_is_a_typed_error_that_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let paths = model(dir.path());
    let mut streamer = BlockStreamer::new(&paths, PREFIX).unwrap();
    let mut m = block();
    streamer.bind(&mut m, 0, &[]).unwrap();
    assert_eq!(read(&m.attn.weight), values(0, 0, 24));
    std::fs::remove_file(&paths[0]).unwrap();
    // Block 1's loads were made with block 0's, from the open file.
    streamer.bind(&mut m, 1, &[]).unwrap();
    assert_eq!(read(&m.attn.weight), values(1, 0, 24));
    // Block 0 again needs the file's header anew.
    let err = streamer.bind(&mut m, 0, &[]).unwrap_err();
    match &err {
        block_stream::Error::Load { path, key, .. } => {
            assert_eq!(path, &paths[0]);
            assert!(key.starts_with(&format!("{PREFIX}0.")), "{key}");
        }
        other => panic!("expected a load error, got {other:?}"),
    }
    assert_eq!(
        read(&m.attn.weight),
        values(1, 0, 24),
        "block 1 stays bound"
    );
    assert_eq!(read(&m.norm), values(1, 2, 6));
}

/// LoRA for block 1's `attn`: A (2, 6), B (4, 2), stored under `prefix`.
fn lora_file(dir: &Path, prefix: &str) -> (PathBuf, Vec<f32>, Vec<f32>) {
    let a: Vec<f32> = (0..12).map(|k| (k as f32 - 6.0) / 4.0).collect();
    let b: Vec<f32> = (0..8).map(|k| (k as f32 + 1.0) / 8.0).collect();
    let path = dir.join("lora.safetensors");
    write(
        &path,
        &[
            f32_tensor(format!("{prefix}1.attn.lora_A.weight"), vec![2, 6], &a),
            f32_tensor(format!("{prefix}1.attn.lora_B.weight"), vec![4, 2], &b),
            // Outside the prefix: another model's part, ignored.
            f32_tensor("text_encoder.0.lora_A.weight".into(), vec![1], &[0.0]),
            f32_tensor("text_encoder.0.lora_B.weight".into(), vec![1], &[0.0]),
        ],
    );
    (path, a, b)
}

/// `w + strength · B @ A`, naively.
fn fused(w: &[f32], a: &[f32], b: &[f32], strength: f32) -> Vec<f32> {
    let mut out = w.to_vec();
    for o in 0..4 {
        for i in 0..6 {
            let d: f32 = (0..2).map(|r| b[o * 2 + r] * a[r * 6 + i]).sum();
            out[o * 6 + i] += strength * d;
        }
    }
    out
}

#[test]
fn dense_lora_is_fused_into_the_right_block() {
    let dir = tempfile::tempdir().unwrap();
    let (lora_path, a, b) = lora_file(dir.path(), PREFIX);
    let source = BlockLoraSource::open(&lora_path, PREFIX, 0.5).unwrap();
    assert!(source.has_block(1) && !source.has_block(0));
    assert_eq!(
        source.block_lora(1).unwrap().keys().collect::<Vec<_>>(),
        ["attn.lora_A.weight", "attn.lora_B.weight"]
    );

    let mut streamer = BlockStreamer::new(model(dir.path()), PREFIX)
        .unwrap()
        .with_fuser(DenseLoraFuser);
    let mut m = block();
    streamer.bind(&mut m, 1, &[&source]).unwrap();
    let got = read(&m.attn.weight);
    let want = fused(&values(1, 0, 24), &a, &b, 0.5);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-3 * w.abs().max(1.0), "{g} vs {w}");
    }
    assert_ne!(got, values(1, 0, 24));
    // Bias and norm are untouched; a block without LoRA is bound as stored.
    assert_eq!(read((*m.attn.bias).as_ref().unwrap()), values(1, 1, 4));
    streamer.bind(&mut m, 0, &[&source]).unwrap();
    assert_eq!(read(&m.attn.weight), values(0, 0, 24));
}

#[test]
fn lora_without_a_fuser_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (lora_path, _, _) = lora_file(dir.path(), PREFIX);
    let source = BlockLoraSource::open(&lora_path, PREFIX, 1.0).unwrap();
    let mut streamer = BlockStreamer::new(model(dir.path()), PREFIX).unwrap();
    assert!(matches!(
        streamer.bind(&mut block(), 1, &[&source]),
        Err(Error::NoFuser)
    ));
}

#[test]
fn key_mapper_renames_and_drops_keys() {
    let dir = tempfile::tempdir().unwrap();
    let (lora_path, _, _) = lora_file(dir.path(), "diffusion_model.blocks.");
    let source = BlockLoraSource::open_with_mapper(&lora_path, PREFIX, 1.0, |k| {
        if k.contains("norm") {
            return None;
        }
        Some(k.replace("diffusion_model.", "transformer."))
    })
    .unwrap();
    assert!(source.has_block(1));
    assert_eq!(source.pairs(1).unwrap().len(), 1);
    // Without the mapper no pair matches the prefix: an error that names
    // the file and shows where its pairs are.
    let err = BlockLoraSource::open(&lora_path, PREFIX, 1.0).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(&err, Error::NoPairs { path, outside, .. }
            if path == &lora_path && outside.iter().any(|k| k.starts_with("diffusion_model.blocks.1.attn"))),
        "{text}"
    );
    assert!(
        text.contains("lora.safetensors") && text.contains(PREFIX),
        "{text}"
    );
}

#[test]
fn an_adapter_that_adapts_nothing_is_an_error_naming_its_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let a = [0.5f32; 12];
    let b = [0.25f32; 8];
    let file = |name: &str, tensors: &[Tensor]| {
        let path = dir.path().join(name);
        write(&path, tensors);
        path
    };
    // An empty file.
    let empty = file("empty.safetensors", &[]);
    let err = BlockLoraSource::open(&empty, PREFIX, 1.0).unwrap_err();
    assert!(
        matches!(&err, Error::NoPairs { path, .. } if path == &empty),
        "{err}"
    );
    // Half a pair beside a whole one.
    let half = file(
        "half.safetensors",
        &[
            f32_tensor(format!("{PREFIX}1.attn.lora_A.weight"), vec![2, 6], &a),
            f32_tensor(format!("{PREFIX}1.attn.lora_B.weight"), vec![4, 2], &b),
            f32_tensor(format!("{PREFIX}1.norm.lora_A.weight"), vec![2, 6], &a),
        ],
    );
    let err = BlockLoraSource::open(&half, PREFIX, 1.0).unwrap_err();
    assert!(
        matches!(&err, Error::HalfPair { path, key, missing }
            if path == &half && key == &format!("{PREFIX}1.norm.lora_A.weight") && missing == ".lora_B.weight"),
        "{err}"
    );
    let mut streamer = BlockStreamer::new(model(dir.path()), PREFIX)
        .unwrap()
        .with_fuser(DenseLoraFuser);
    // A pair for a weight the block does not have (`mlp`), and one for a
    // block the model does not have (7): errors when applied, naming the
    // adapter and the key, not a block left as it was.
    for (name, key, says) in [
        (
            "no-weight.safetensors",
            format!("{PREFIX}0.mlp"),
            "has no \"mlp.weight\"",
        ),
        (
            "no-block.safetensors",
            format!("{PREFIX}7.attn"),
            "no block 7",
        ),
    ] {
        let path = file(
            name,
            &[
                f32_tensor(format!("{key}.lora_A.weight"), vec![2, 6], &a),
                f32_tensor(format!("{key}.lora_B.weight"), vec![4, 2], &b),
            ],
        );
        let source = BlockLoraSource::open(&path, PREFIX, 1.0).unwrap();
        let err = streamer.bind(&mut block(), 0, &[&source]).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(&err, Error::Lora { adapter, key: k, .. }
                if adapter == &path && k == &format!("{key}.lora_A.weight")),
            "{text}"
        );
        assert!(text.contains(name) && text.contains(says), "{text}");
    }
}

#[test]
fn mismatched_lora_shapes_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad-lora.safetensors");
    write(
        &path,
        &[
            f32_tensor(
                format!("{PREFIX}0.attn.lora_A.weight"),
                vec![2, 5],
                &[0.0; 10],
            ),
            f32_tensor(
                format!("{PREFIX}0.attn.lora_B.weight"),
                vec![4, 2],
                &[0.0; 8],
            ),
        ],
    );
    let source = BlockLoraSource::open(&path, PREFIX, 1.0).unwrap();
    let mut streamer = BlockStreamer::new(model(dir.path()), PREFIX)
        .unwrap()
        .with_fuser(DenseLoraFuser);
    let err = streamer.bind(&mut block(), 0, &[&source]).unwrap_err();
    assert!(
        matches!(&err, Error::Lora { block: 0, param, adapter, key, .. }
            if param == "attn" && adapter == &path && key == &format!("{PREFIX}0.attn.lora_A.weight")),
        "{err}"
    );
}

#[test]
fn quantized_lora_dequantizes_adds_and_requantizes() {
    let dir = tempfile::tempdir().unwrap();
    let (group, bits) = (32, 8);
    // One block whose `attn` weight (4 × 64) is stored 8-bit quantized.
    let w: Vec<f32> = (0..256)
        .map(|k| ((k * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let (qw, qs, qb) = mlx_rs::ops::quantize(Array::from_slice(&w, &[4, 64]), group, bits).unwrap();
    let model_path = dir.path().join("q.safetensors");
    let arrays = [
        (format!("{PREFIX}0.attn.weight"), qw.clone()),
        (format!("{PREFIX}0.attn.scales"), qs.clone()),
        (format!("{PREFIX}0.attn.biases"), qb.clone()),
    ];
    Array::save_safetensors(
        arrays.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        &model_path,
    )
    .unwrap();
    let a: Vec<f32> = (0..128).map(|k| ((k % 7) as f32 - 3.0) / 10.0).collect();
    let b: Vec<f32> = (0..8).map(|k| (k as f32 - 4.0) / 10.0).collect();
    let lora_path = dir.path().join("lora.safetensors");
    write(
        &lora_path,
        &[
            f32_tensor(format!("{PREFIX}0.attn.lora_A.weight"), vec![2, 64], &a),
            f32_tensor(format!("{PREFIX}0.attn.lora_B.weight"), vec![4, 2], &b),
        ],
    );

    #[derive(Debug, ModuleParameters)]
    struct QAttn {
        #[param]
        weight: Param<Array>,
        #[param]
        scales: Param<Array>,
        #[param]
        biases: Param<Array>,
    }
    #[derive(Debug, ModuleParameters)]
    struct QBlock {
        #[param]
        attn: QAttn,
    }
    let mut m = QBlock {
        attn: QAttn {
            weight: Param::new(qw.clone()),
            scales: Param::new(qs.clone()),
            biases: Param::new(qb.clone()),
        },
    };
    let source = BlockLoraSource::open(&lora_path, PREFIX, 1.0).unwrap();
    let mut streamer = BlockStreamer::new([&model_path], PREFIX)
        .unwrap()
        .with_fuser(QuantizedLoraFuser {
            group_size: group,
            bits,
        });
    streamer.bind(&mut m, 0, &[&source]).unwrap();
    assert_eq!(m.attn.weight.dtype(), Dtype::Uint32);

    // Reference: the stored weight dequantized, plus B @ A, computed here.
    let base = read(&mlx_rs::ops::dequantize(&qw, &qs, &qb, group, bits).unwrap());
    let mut want = base.clone();
    for o in 0..4 {
        for i in 0..64 {
            want[o * 64 + i] += (0..2).map(|r| b[o * 2 + r] * a[r * 64 + i]).sum::<f32>();
        }
    }
    let got = read(
        &mlx_rs::ops::dequantize(
            &*m.attn.weight,
            &*m.attn.scales,
            &*m.attn.biases,
            group,
            bits,
        )
        .unwrap(),
    );
    let steps = read(&m.attn.scales);
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        let step = steps[k / group as usize].abs();
        assert!(
            (g - w).abs() <= step + 1e-6,
            "element {k}: {g} vs {w} (step {step})"
        );
    }
    assert!(
        got.iter().zip(&base).any(|(g, b)| (g - b).abs() > 1e-3),
        "the delta must show"
    );
}

//! An mlx_lm adapter applied on the fly to streamed layers
//! (`MemoryMode::Streamed` + `EngineConfig::lora`) gives what the model
//! fused by adapter-fuse (bit-equal to `mlx_lm fuse`, tested there) gives
//! resident, on SmolLM2 f32 and 4-bit. Skips, saying so, without the
//! fixture (`cargo xtask fixtures`).

mod common;

use std::path::{Path, PathBuf};

use adapter_codec::AdapterCodec;
use common::adapter::{write_smollm2_adapter, PREFIX, RANK};
use common::normal;
use mlx_engine::{
    BlockLoraSource, EngineConfig, EngineError, GenerateOptions, KvCache, MemoryMode, Message,
    MlxEngine, Model, QuantizedWeights,
};
use mlx_rs::Array;

const SCALE: f32 = 4.0;

fn fixture(variant: &str) -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("MLX_LOWMEM_SMOLLM2")?).join(variant);
    dir.join("config.json").is_file().then_some(dir)
}

fn write_adapter(dir: &Path) -> PathBuf {
    write_smollm2_adapter(dir, 0, SCALE)
}

/// The logits of a prompt and of one token after it.
fn logits(model: &Model) -> Vec<u32> {
    let prompt = Array::from_slice(&[1, 504, 3458, 282, 4649, 314, 5465, 47], &[1, 8]);
    let next = Array::from_slice(&[30], &[1, 1]);
    let mut cache = KvCache::new();
    let mut bits = Vec::new();
    for input in [&prompt, &next] {
        let logits = model.forward(input, &mut cache).unwrap();
        logits.eval().unwrap();
        bits.extend(logits.as_slice::<f32>().iter().map(|v| v.to_bits()));
    }
    bits
}

#[test]
fn lora_on_streamed_layers_equals_the_fused_model() {
    let (Some(f32_dir), Some(q4_dir)) = (fixture("f32"), fixture("q4")) else {
        eprintln!("SKIP lora_on_streamed_layers_equals_the_fused_model: no SmolLM2 fixture (run cargo xtask fixtures)");
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let adapter = write_adapter(work.path());
    let codec = AdapterCodec::new(
        work.path().join("adapters.safetensors.zst"),
        work.path().join("adapter_config.json"),
    );
    codec.encode(&adapter).unwrap();
    let source = || BlockLoraSource::open_mlx_lm(&adapter, PREFIX, SCALE).unwrap();
    for (base, modes) in [
        (&f32_dir, &[QuantizedWeights::DequantizeF32][..]),
        (
            &q4_dir,
            &[QuantizedWeights::Keep, QuantizedWeights::DequantizeOnUse][..],
        ),
    ] {
        let fused =
            adapter_fuse::Fuse::new(base.to_str().unwrap(), &codec, "lora-on-the-fly--fused")
                .options(
                    &adapter_fuse::FuseOptions::from_env().with_cache_root(work.path().join("hub")),
                )
                .run()
                .unwrap();
        for &q in modes {
            let reference = logits(&Model::loader(&fused).quantized(q).load().unwrap());
            let plain = logits(&Model::loader(base).quantized(q).load().unwrap());
            assert!(reference != plain, "the adapter changes nothing");
            let on_the_fly = Model::loader(base)
                .quantized(q)
                .memory(MemoryMode::Streamed)
                .lora(vec![source()])
                .load()
                .unwrap();
            assert!(
                reference == logits(&on_the_fly),
                "{} {q:?}: LoRA on the fly differs from the fused model",
                base.display()
            );
        }
        let texts = |config: EngineConfig| {
            let prompt = vec![Message::new("user", "What is the capital of France?")];
            MlxEngine::new(config.batch_size(2))
                .unwrap()
                .generate(vec![prompt], GenerateOptions::new().max_tokens(8))
                .unwrap()
                .texts
        };
        let from_fused = texts(EngineConfig::new(&fused));
        assert_eq!(
            from_fused,
            texts(EngineConfig::new(base).lora(source())),
            "{}",
            base.display()
        );
        // The folder as shipped, its scale and layer prefix found by the
        // engine, not copied by hand.
        assert_eq!(
            from_fused,
            texts(EngineConfig::new(base).adapter(work.path())),
            "{}",
            base.display()
        );
        // The cache entry is named by the adapter's digest alone: the next
        // base needs an empty cache.
        std::fs::remove_dir_all(work.path().join("hub")).unwrap();
    }
}

#[test]
fn lora_needs_streamed_layers() {
    let Some(dir) = fixture("q4") else {
        eprintln!("SKIP lora_needs_streamed_layers: no SmolLM2 fixture (run cargo xtask fixtures)");
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let adapter = write_adapter(work.path());
    let source = || BlockLoraSource::open_mlx_lm(&adapter, PREFIX, SCALE).unwrap();
    let engine = MlxEngine::new(
        EngineConfig::new(&dir)
            .memory(MemoryMode::Resident)
            .lora(source()),
    )
    .unwrap();
    match engine.ensure_loaded() {
        Err(EngineError::InvalidConfig(message)) => {
            assert!(message.contains("Streamed"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(Model::loader(&dir)
        .quantized(QuantizedWeights::Keep)
        .memory(MemoryMode::MappedTables)
        .lora(vec![source()])
        .load()
        .is_err());
}

/// An adapter whose module has no `lora_b`, or lies outside the model's
/// layers, is refused at load with the module named: block streaming used
/// to drop such halves silently.
#[test]
fn an_unpaired_or_misplaced_adapter_module_is_an_error_at_load() {
    let Some(dir) = fixture("q4") else {
        eprintln!("SKIP an_unpaired_or_misplaced_adapter_module_is_an_error_at_load: no SmolLM2 fixture (run cargo xtask fixtures)");
        return;
    };
    for (key, says) in [
        ("model.layers.3.self_attn.q_proj.lora_a", "has no lora_b"),
        ("lm_head.lora_a", "not under the model's layers"),
    ] {
        let (source, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        write_adapter(source.path());
        std::fs::copy(
            source.path().join("adapter_config.json"),
            work.path().join("adapter_config.json"),
        )
        .unwrap();
        let file = work.path().join("adapters.safetensors");
        let extra = normal(&[576, RANK as i32], 9, 0.03);
        let mut tensors: Vec<(String, Array)> =
            Array::load_safetensors(source.path().join("adapters.safetensors"))
                .unwrap()
                .into_iter()
                .collect();
        tensors.push((key.to_owned(), extra.clone()));
        if key.starts_with("lm_head") {
            tensors.push((
                "lm_head.lora_b".to_owned(),
                normal(&[RANK as i32, 49152], 10, 0.03),
            ));
        }
        Array::save_safetensors(tensors.iter().map(|(k, v)| (k.as_str(), v)), None, &file).unwrap();
        let engine = MlxEngine::new(EngineConfig::new(&dir).adapter(work.path())).unwrap();
        let err = engine.ensure_loaded().unwrap_err().to_string();
        assert!(err.contains(says), "{key}: {err}");
    }
}

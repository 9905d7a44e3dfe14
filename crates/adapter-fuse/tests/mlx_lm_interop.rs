//! A llama model fused here loads in mlx_lm and equals the one `mlx_lm fuse`
//! makes from the same base and adapter: every weight, and the logits.
//! Needs the Python `cargo xtask test` provides; skips, saying so, without.

use std::path::Path;
use std::process::Command;

use adapter_codec::AdapterCodec;
use mlx_rs::Array;
use test_support::python::mlx_lm_python;

fn normal(shape: &[i32], seed: u64, std: f32) -> Array {
    let key = mlx_rs::random::key(seed).unwrap();
    mlx_rs::random::normal::<f32>(shape, None, std, &key).unwrap()
}

/// A two-layer llama in mlx_lm's format, with a word-level tokenizer (mlx_lm's
/// fuse loads one) and a LoRA adapter on q and v.
fn write_model(base: &Path, adapter: &Path) {
    std::fs::create_dir_all(base).unwrap();
    std::fs::create_dir_all(adapter).unwrap();
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 100,
        "rope_theta": 10000.0, "tie_word_embeddings": true
    });
    std::fs::write(base.join("config.json"), config.to_string()).unwrap();
    let mut seed = 0;
    let mut next = || {
        seed += 1;
        seed
    };
    let mut weights = vec![
        (
            "model.embed_tokens.weight".to_owned(),
            normal(&[100, 64], next(), 0.02),
        ),
        (
            "model.norm.weight".to_owned(),
            Array::ones::<f32>(&[64]).unwrap(),
        ),
    ];
    let mut lora = Vec::new();
    for layer in 0..2 {
        let p = format!("model.layers.{layer}.");
        for (name, out, inp) in [
            ("self_attn.q_proj", 64, 64),
            ("self_attn.k_proj", 32, 64),
            ("self_attn.v_proj", 32, 64),
            ("self_attn.o_proj", 64, 64),
            ("mlp.gate_proj", 128, 64),
            ("mlp.up_proj", 128, 64),
            ("mlp.down_proj", 64, 128),
        ] {
            weights.push((
                format!("{p}{name}.weight"),
                normal(&[out, inp], next(), 0.05),
            ));
            if name.ends_with("q_proj") || name.ends_with("v_proj") {
                lora.push((format!("{p}{name}.lora_a"), normal(&[inp, 4], next(), 0.1)));
                lora.push((format!("{p}{name}.lora_b"), normal(&[4, out], next(), 0.1)));
            }
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            weights.push((
                format!("{p}{norm}.weight"),
                Array::ones::<f32>(&[64]).unwrap(),
            ));
        }
    }
    Array::save_safetensors(
        weights.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        base.join("model.safetensors"),
    )
    .unwrap();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hello": 1}, "unk_token": "<unk>"}
    });
    std::fs::write(base.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(
        base.join("tokenizer_config.json"),
        r#"{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<unk>"}"#,
    )
    .unwrap();
    Array::save_safetensors(
        lora.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        adapter.join("adapters.safetensors"),
    )
    .unwrap();
    let adapter_config = serde_json::json!({
        "fine_tune_type": "lora", "num_layers": 2,
        "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}
    });
    std::fs::write(
        adapter.join("adapter_config.json"),
        adapter_config.to_string(),
    )
    .unwrap();
}

#[test]
fn mlx_lm_loads_our_fused_model_and_it_equals_mlx_lm_fuse() {
    let Some(python) = mlx_lm_python("mlx_lm_loads_our_fused_model_and_it_equals_mlx_lm_fuse")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (base, adapter, hub, theirs) = (
        dir.path().join("base"),
        dir.path().join("adapter"),
        dir.path().join("hub"),
        dir.path().join("theirs"),
    );
    write_model(&base, &adapter);
    std::fs::create_dir_all(&hub).unwrap();
    let codec = AdapterCodec::new(
        adapter.join("adapters.safetensors.zst"),
        adapter.join("adapter_config.json"),
    );
    codec.encode(adapter.join("adapters.safetensors")).unwrap();
    let ours = adapter_fuse::Fuse::new(base.to_str().unwrap(), &codec, "interop--fused")
        .options(&adapter_fuse::FuseOptions::from_env().with_cache_root(&hub))
        .run()
        .unwrap();

    let fuse = Command::new(&python)
        .args(["-m", "mlx_lm", "fuse", "--model"])
        .arg(&base)
        .arg("--adapter-path")
        .arg(&adapter)
        .arg("--save-path")
        .arg(&theirs)
        .output()
        .unwrap();
    assert!(
        fuse.status.success(),
        "mlx_lm fuse: {}",
        String::from_utf8_lossy(&fuse.stderr)
    );

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/mlx_lm_compare.py");
    let out = Command::new(&python)
        .arg(script)
        .arg(&ours)
        .arg(&theirs)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut fields = text.split_whitespace();
    let differing: usize = fields.next().unwrap().parse().unwrap();
    let logit_diff: f64 = fields.next().unwrap().parse().unwrap();
    assert_eq!(differing, 0, "weights differ from mlx_lm fuse's");
    assert_eq!(logit_diff, 0.0, "logits differ from mlx_lm fuse's model");
}

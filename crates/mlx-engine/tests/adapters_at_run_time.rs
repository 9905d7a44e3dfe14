//! Adapters loaded and unloaded while the engine serves
//! (`MlxEngine::load_adapter`, `unload_adapter`): an adapter loaded beside
//! a running request answers as the same adapter given at the start, and
//! the running request as without it; unloading one adapter leaves the
//! others' answers bit for bit; an adapter that requests use is not
//! unloaded; an adapter that adapts nothing, a name served already or a
//! name the server could not route are refused, naming them, and change
//! nothing. On SmolLM2; skips, saying so, without the fixture (`cargo
//! xtask fixtures`).

mod common;

use std::path::{Path, PathBuf};

use common::adapter::{with_extra_pair, write_smollm2_adapter};
use mlx_engine::{
    Completion, CompletionStream, CompletionText, EngineConfig, EngineError, MemoryMode, Message,
    MlxEngine, Sampling, StreamEvent, Tokenizer,
};

/// Strong enough to change greedy answers.
const SCALE: f32 = 64.0;

fn fixture(test: &str) -> Option<PathBuf> {
    let Some(root) = std::env::var_os("MLX_LOWMEM_SMOLLM2") else {
        eprintln!("SKIP {test}: MLX_LOWMEM_SMOLLM2 is not set (cargo xtask fixtures)");
        return None;
    };
    Some(PathBuf::from(root).join("f32"))
}

fn ask(text: &str) -> Completion {
    Completion::new(vec![Message::new("user", text)]).max_tokens(8)
}

fn answer(engine: &MlxEngine, completion: Completion) -> CompletionText {
    engine
        .complete(completion.logprobs(1))
        .unwrap()
        .collect()
        .unwrap()
}

/// A base request that runs until it is dropped: the end of sequence
/// biased away, many tokens allowed. Returned once its first token came,
/// so that it is running.
fn running(engine: &MlxEngine, base: &Path) -> CompletionStream {
    let tokenizer = Tokenizer::load(base).unwrap();
    let bias = tokenizer.eos_ids().iter().map(|&id| (id, -1e9)).collect();
    let long = ask("Tell me a story about a dragon.")
        .max_tokens(4000)
        .sampling(Sampling::greedy().logit_bias(bias));
    let mut stream = engine.complete(long).unwrap();
    match stream.blocking_next() {
        Some(StreamEvent::Token { .. } | StreamEvent::Text(_)) => stream,
        other => panic!("{other:?}"),
    }
}

#[test]
fn adapters_loaded_and_unloaded_while_serving_answer_as_adapters_given_at_the_start() {
    let test = "adapters_loaded_and_unloaded_while_serving";
    let Some(base) = fixture(test) else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let (x_dir, y_dir) = (work.path().join("x"), work.path().join("y"));
    write_smollm2_adapter(&x_dir, 0, SCALE);
    // Another rank (8) and other modules: the stacks are padded and grow.
    test_support::smollm2_adapter::write_smollm2_default_adapter(&y_dir, 500);
    let prompts = ["Name three colours.", "What is the capital of France?"];
    for memory in [MemoryMode::Resident, MemoryMode::Streamed] {
        let config = || EngineConfig::new(&base).batch_size(3).memory(memory);
        let at_start = MlxEngine::new(
            config()
                .named_adapter("x", &x_dir)
                .named_adapter("y", &y_dir),
        )
        .unwrap();
        let expected_x = answer(&at_start, ask(prompts[0]).adapter("x"));
        let expected_y = answer(&at_start, ask(prompts[1]).adapter("y"));
        drop(at_start);

        let engine = MlxEngine::new(config()).unwrap();
        let base_alone = answer(&engine, ask(prompts[0]));
        assert_ne!(base_alone.tokens, expected_x.tokens, "x changes nothing");
        // Loaded while a request runs, which goes on as it was.
        let long = running(&engine, &base);
        engine.load_adapter("x", &x_dir).unwrap();
        engine.load_adapter("y", &y_dir).unwrap();
        assert_eq!(engine.adapters().unwrap(), ["x", "y"]);
        // Beside the running row, in one batch: greedy, the same tokens
        // (a batch of other rows rounds otherwise than a row alone).
        let x = engine.complete(ask(prompts[0]).adapter("x")).unwrap();
        let y = engine.complete(ask(prompts[1]).adapter("y")).unwrap();
        let (x, y) = (x.collect().unwrap(), y.collect().unwrap());
        assert_eq!(x.tokens, expected_x.tokens, "{memory:?}: x beside others");
        assert_eq!(y.tokens, expected_y.tokens, "{memory:?}: y beside others");
        drop(long);
        // Alone, as at the start: bit for bit.
        let x = answer(&engine, ask(prompts[0]).adapter("x"));
        assert_eq!(x, expected_x, "{memory:?}: x loaded while serving");
        let y = answer(&engine, ask(prompts[1]).adapter("y"));
        assert_eq!(y, expected_y, "{memory:?}: y loaded while serving");
        assert_eq!(
            answer(&engine, ask(prompts[0])),
            base_alone,
            "{memory:?}: the base"
        );

        // Unloading x restacks y's pairs without x's: y answers the same.
        engine.unload_adapter("x").unwrap();
        assert_eq!(engine.adapters().unwrap(), ["y"]);
        let y_after = answer(&engine, ask(prompts[1]).adapter("y"));
        assert_eq!(y_after, expected_y, "{memory:?}: y after x's unload");
        match engine
            .complete(ask(prompts[0]).adapter("x"))
            .unwrap()
            .collect()
        {
            Err(EngineError::UnknownAdapter(name)) => assert_eq!(name, "x"),
            other => panic!("{other:?}"),
        }
        // Loaded again (a new slot): as before.
        engine.load_adapter("x", &x_dir).unwrap();
        assert_eq!(answer(&engine, ask(prompts[0]).adapter("x")), expected_x);
    }
}

#[test]
fn adapters_in_use_stay_and_adapters_that_do_not_fit_are_refused() {
    let test = "adapters_in_use_stay";
    let Some(base) = fixture(test) else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let x_dir = work.path().join("x");
    write_smollm2_adapter(&x_dir, 0, SCALE);
    // One row at a time: a request naming x waits behind a running one.
    let engine = MlxEngine::new(EngineConfig::new(&base).batch_size(1)).unwrap();
    engine.load_adapter("x", &x_dir).unwrap();
    let long = running(&engine, &base);
    let waiting = engine
        .complete(ask("Name three colours.").adapter("x"))
        .unwrap();
    match engine.unload_adapter("x") {
        Err(EngineError::AdapterInUse { name, requests }) => {
            assert_eq!((name.as_str(), requests), ("x", 1));
        }
        other => panic!("{other:?}"),
    }
    // Cancelled, it uses x no more.
    drop(waiting);
    engine.unload_adapter("x").unwrap();
    drop(long);

    match engine.unload_adapter("x") {
        Err(EngineError::UnknownAdapter(name)) => assert_eq!(name, "x"),
        other => panic!("{other:?}"),
    }
    engine.load_adapter("x", &x_dir).unwrap();
    let x_answer = answer(&engine, ask("Name three colours.").adapter("x"));
    // A pair for a module the model lacks, or one that does not fit its
    // layer: refused, naming the adapter and the key; nothing changes.
    let cases = [
        (
            "model.layers.3.self_attn.q_norm",
            576,
            "adapts no linear layer",
        ),
        ("model.layers.3.mlp.up_proj", 100, "the layer 576 to 1536"),
    ];
    for (i, (module, outputs, says)) in cases.into_iter().enumerate() {
        let bad = work.path().join(format!("bad-{i}"));
        with_extra_pair(&x_dir, &bad, module, outputs);
        match engine.load_adapter("bad", &bad) {
            Err(EngineError::AdapterLoad(e)) => {
                let message = e.to_string();
                let names = message.contains("\"bad\"") && message.contains(module);
                assert!(names && message.contains(says), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
    match engine.load_adapter("x", &x_dir) {
        Err(EngineError::AdapterLoad(e)) => {
            assert!(e.to_string().contains("served already"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    for name in ["", "a:b"] {
        match engine.load_adapter(name, &x_dir) {
            Err(EngineError::InvalidRequest(message)) => assert!(message.contains("':'")),
            other => panic!("{name:?}: {other:?}"),
        }
    }
    match engine.load_adapter("missing", work.path().join("missing")) {
        Err(EngineError::AdapterLoad(e)) => assert!(e.to_string().contains("missing"), "{e}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(engine.adapters().unwrap(), ["x"]);
    assert_eq!(
        answer(&engine, ask("Name three colours.").adapter("x")),
        x_answer
    );
}

#[test]
fn an_adapter_as_the_codec_ships_it_answers_as_its_folder() {
    let test = "an_adapter_as_the_codec_ships_it";
    let Some(base) = fixture(test) else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let x_dir = work.path().join("x");
    write_smollm2_adapter(&x_dir, 0, SCALE);
    let shipped = work.path().join("shipped");
    std::fs::create_dir_all(&shipped).unwrap();
    let config = shipped.join("adapter_config.json");
    std::fs::copy(x_dir.join("adapter_config.json"), &config).unwrap();
    let zst = shipped.join("adapters.safetensors.zst");
    adapter_codec::AdapterCodec::new(&zst, &config)
        .encode(x_dir.join("adapters.safetensors"))
        .unwrap();

    // The folder holding the `.zst`, given at the start, and the `.zst`
    // itself, loaded later: both as the mlx_lm folder.
    let engine = MlxEngine::new(
        EngineConfig::new(&base)
            .named_adapter("folder", &x_dir)
            .named_adapter("shipped", &shipped),
    )
    .unwrap();
    engine.load_adapter("zst", &zst).unwrap();
    let expected = answer(&engine, ask("Name three colours.").adapter("folder"));
    for name in ["shipped", "zst"] {
        let got = answer(&engine, ask("Name three colours.").adapter(name));
        assert_eq!(got, expected, "{name}");
    }

    // A damaged file: refused, naming it.
    let broken = work.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::copy(&config, broken.join("adapter_config.json")).unwrap();
    let bytes = std::fs::read(&zst).unwrap();
    std::fs::write(
        broken.join("adapters.safetensors.zst"),
        &bytes[..bytes.len() / 2],
    )
    .unwrap();
    match engine.load_adapter("broken", &broken) {
        Err(EngineError::AdapterLoad(e)) => {
            let message = e.to_string();
            assert!(
                message.contains("broken/adapters.safetensors.zst"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(engine.adapters().unwrap(), ["folder", "shipped", "zst"]);
}

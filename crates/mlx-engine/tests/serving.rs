//! Continuous batching on the real model (the SmolLM2 fixture): rows join
//! a running batch and leave it, prefixes are shared, and every bad call
//! is a typed error.

mod common;

use std::path::{Path, PathBuf};

use common::tiny_gemma::{conversations, write_gemma3, write_gemma4, Layout};

use mlx_engine::{
    Completion, EngineConfig, EngineError, FinishReason, Message, MlxEngine, StreamEvent,
};

fn smollm2(test: &str) -> Option<PathBuf> {
    match std::env::var_os("MLX_LOWMEM_SMOLLM2") {
        Some(dir) => Some(PathBuf::from(dir).join("f32")),
        None => {
            eprintln!("SKIP {test}: MLX_LOWMEM_SMOLLM2 is not set (cargo xtask fixtures)");
            None
        }
    }
}

fn user(text: &str) -> Vec<Message> {
    vec![Message::new("user", text)]
}

const PROMPTS: [&str; 5] = [
    "Tell me a story about a dragon.",
    "What is two plus two?",
    "Name three colours.",
    "Why is the sky blue? Explain at length, with examples from daily life.",
    "Say hello.",
];

#[test]
fn rows_that_join_and_leave_a_running_batch_answer_as_they_do_alone() {
    let Some(model) = smollm2("rows_that_join_and_leave") else {
        return;
    };
    let engine = MlxEngine::new(EngineConfig::new(&model).batch_size(3)).unwrap();
    let lengths = [24, 4, 9, 16, 6];
    let alone: Vec<Vec<u32>> = PROMPTS
        .iter()
        .zip(lengths)
        .map(|(p, n)| {
            let stream = engine
                .complete(Completion::new(user(p)).max_tokens(n))
                .unwrap();
            stream.collect().unwrap().tokens
        })
        .collect();
    // The first starts alone; the second and third join it after its
    // third token; the last two wait for free slots (batch 3) and take
    // them as the short ones finish.
    let mut first = engine
        .complete(Completion::new(user(PROMPTS[0])).max_tokens(lengths[0]))
        .unwrap();
    let mut tokens = Vec::new();
    while tokens.len() < 3 {
        match first.blocking_next() {
            Some(StreamEvent::Token { id, .. }) => tokens.push(id),
            other => panic!("{other:?}"),
        }
    }
    let others: Vec<_> = (1..5)
        .map(|i| {
            engine
                .complete(Completion::new(user(PROMPTS[i])).max_tokens(lengths[i]))
                .unwrap()
        })
        .collect();
    let rest = first.collect().unwrap();
    tokens.extend(rest.tokens);
    let mut together = vec![tokens];
    together.extend(others.into_iter().map(|s| s.collect().unwrap().tokens));
    assert_eq!(together, alone);
    assert_eq!(engine.serving_metrics().requests, 10);
}

#[test]
fn a_request_within_the_admission_window_is_prefilled_with_the_first() {
    let Some(model) = smollm2("a_request_within_the_admission_window") else {
        return;
    };
    let first_tokens = |engine: &MlxEngine| {
        let ask = |i: usize| {
            engine
                .complete(Completion::new(user(PROMPTS[i])).max_tokens(1))
                .unwrap()
        };
        // The second a moment after the first, as a second client's
        // request comes: long after the worker woke for the first.
        let a = ask(1);
        std::thread::sleep(std::time::Duration::from_millis(200));
        let b = ask(2);
        [a.collect().unwrap().tokens, b.collect().unwrap().tokens]
    };
    // A window no second call misses; two waiting fill the batch of two,
    // which ends the wait at once.
    let window = std::time::Duration::from_secs(60);
    let config = || EngineConfig::new(&model).batch_size(2);
    let engine = MlxEngine::new(config().admission_window(window)).unwrap();
    engine.ensure_loaded().unwrap();
    let together = first_tokens(&engine);
    assert_eq!(engine.serving_metrics().steps, 1, "one step for both");
    // Without a window each starts as it comes; the answers are the same.
    let engine = MlxEngine::new(config().admission_window(std::time::Duration::ZERO)).unwrap();
    assert_eq!(first_tokens(&engine), together);
}

#[test]
fn a_dropped_stream_frees_its_slot_and_the_next_request_runs() {
    let Some(model) = smollm2("a_dropped_stream_frees_its_slot") else {
        return;
    };
    let engine = MlxEngine::new(EngineConfig::new(&model).batch_size(1)).unwrap();
    let mut long = engine
        .complete(Completion::new(user(PROMPTS[0])).max_tokens(500))
        .unwrap();
    assert!(matches!(
        long.blocking_next(),
        Some(StreamEvent::Token { .. })
    ));
    drop(long);
    let answer = engine
        .complete(Completion::new(user(PROMPTS[1])).max_tokens(3))
        .unwrap()
        .collect()
        .unwrap();
    let finish = answer.finish.unwrap();
    assert_eq!(finish.completion_tokens, answer.tokens.len());
    assert!(
        engine.serving_metrics().generated_tokens < 100,
        "the dropped row stopped"
    );
    // The counters are published at the end of the step that finished it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while engine.serving_metrics().running != 0 {
        assert!(std::time::Instant::now() < deadline, "a row still runs");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn the_prefix_messages_are_a_pinned_entry_of_the_prefix_store() {
    let Some(model) = smollm2("the_prefix_messages_are_a_pinned_entry") else {
        return;
    };
    let system = Message::new("system", "You answer in one short sentence.");
    let engine =
        MlxEngine::new(EngineConfig::new(&model).prefix_messages(vec![system.clone()])).unwrap();
    let prefix_len = engine
        .submit(|worker| worker.prefix_tokens().len())
        .wait()
        .unwrap();
    let conversation = vec![
        system,
        Message::new("user", "What is the capital of France?"),
    ];
    let answer = engine
        .complete(Completion::new(conversation.clone()).max_tokens(8))
        .unwrap()
        .collect()
        .unwrap();
    let finish = answer.finish.unwrap();
    assert_eq!(finish.cached_tokens, prefix_len);
    let metrics = engine.serving_metrics();
    assert_eq!((metrics.prefix_hits, metrics.prefix_misses), (1, 0));
    // Greedy, the same text as `generate` on the same conversation.
    let generated = engine
        .generate(
            vec![conversation],
            mlx_engine::GenerateOptions::new().max_tokens(8),
        )
        .unwrap();
    assert_eq!(answer.text, generated.texts[0]);
    assert!(matches!(
        finish.reason,
        FinishReason::Length | FinishReason::Stop
    ));
}

#[test]
fn bad_requests_overload_and_a_closed_engine_are_typed_errors() {
    let Some(model) = smollm2("bad_requests_overload_and_a_closed_engine") else {
        return;
    };
    let engine = MlxEngine::new(EngineConfig::new(&model).max_prompt_tokens(64)).unwrap();
    let err = engine.complete(Completion::new(Vec::new())).unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest(_)), "{err}");
    let err = engine
        .complete(Completion::new(user("hi")).max_tokens(0))
        .unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest(_)), "{err}");
    let long = "word ".repeat(200);
    match engine
        .complete(Completion::new(user(&long)))
        .unwrap()
        .collect()
    {
        Err(EngineError::PromptTooLong { limit: 64, .. }) => {}
        other => panic!("{other:?}"),
    }
    let past = std::time::Instant::now();
    match engine
        .complete(Completion::new(user("hi")).deadline(past))
        .unwrap()
        .collect()
    {
        Err(EngineError::DeadlineExceeded) => {}
        other => panic!("{other:?}"),
    }
    engine.close();
    let err = engine.complete(Completion::new(user("hi"))).unwrap_err();
    assert!(matches!(err, EngineError::Closed), "{err}");

    let full = MlxEngine::new(EngineConfig::new(&model).max_queue(0)).unwrap();
    let err = full.complete(Completion::new(user("hi"))).unwrap_err();
    assert!(matches!(err, EngineError::QueueFull { limit: 0 }), "{err}");
}

/// Gemma's sliding layers (a window of 5, far shorter than the prompts)
/// and Gemma 4's KV-shared layers keep their positions right as rows join
/// a running batch at different lengths and leave it: every row's tokens
/// equal its tokens alone, and the shared system prompt is computed once.
#[test]
fn gemma_rows_joining_and_leaving_answer_as_alone_past_the_window() {
    type Writer = fn(&Path);
    let writers: [(&str, Writer); 2] = [
        ("Gemma 3", |dir| write_gemma3(dir, Layout::Text)),
        ("Gemma 4", |dir| write_gemma4(dir, Layout::Text, false)),
    ];
    for (what, write) in writers {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path());
        let engine = MlxEngine::new(EngineConfig::new(dir.path()).batch_size(3)).unwrap();
        let conversations = conversations();
        let lengths: Vec<usize> = (0..conversations.len()).map(|i| 4 + 3 * i).collect();
        let request = |i: usize| Completion::new(conversations[i].clone()).max_tokens(lengths[i]);
        let alone: Vec<Vec<u32>> = (0..conversations.len())
            .map(|i| {
                engine
                    .complete(request(i))
                    .unwrap()
                    .collect()
                    .unwrap()
                    .tokens
            })
            .collect();
        let streams: Vec<_> = (0..conversations.len())
            .map(|i| engine.complete(request(i)).unwrap())
            .collect();
        let together: Vec<Vec<u32>> = streams
            .into_iter()
            .map(|s| s.collect().unwrap().tokens)
            .collect();
        assert_eq!(together, alone, "{what}");
        assert!(alone.iter().any(|t| t.len() > 5), "{what}: past the window");
        let metrics = engine.serving_metrics();
        assert_eq!(metrics.prefix_misses, 1, "{what}");
        assert_eq!(
            metrics.prefix_hits as usize,
            2 * conversations.len() - 1,
            "{what}"
        );
    }
}

/// Structured outputs hold whatever the model: a random llama (nothing it
/// would say is JSON) with SmolLM2's byte-level tokenizer, answering under
/// a schema greedily and at temperature 1 with several seeds, each answer
/// cut at a budget: every one parses and meets the schema.
#[test]
fn a_random_model_under_a_schema_always_answers_valid_json() {
    let Some(smollm2) = smollm2("a_random_model_under_a_schema") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut tiny = test_support::tiny_llama::TinyLlama::new("llama");
    tiny.vocab = 49152;
    tiny.write(dir.path());
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(smollm2.join(file), dir.path().join(file)).unwrap();
    }
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "label": {"type": "integer", "minimum": 1, "maximum": 5},
            "reason": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["bug", "feature", "docs"]}, "maxItems": 3},
            "urgent": {"type": "boolean"}
        },
        "required": ["label", "reason", "tags", "urgent"],
        "additionalProperties": false
    });
    let engine = MlxEngine::new(EngineConfig::new(dir.path()).batch_size(4)).unwrap();
    let samplings: Vec<mlx_engine::Sampling> = std::iter::once(mlx_engine::Sampling::greedy())
        .chain((0..7).map(|seed| mlx_engine::Sampling::greedy().temperature(1.0).seed(seed)))
        .collect();
    let streams: Vec<_> = samplings
        .into_iter()
        .enumerate()
        .map(|(i, sampling)| {
            let completion = Completion::new(user(PROMPTS[i % PROMPTS.len()]))
                .max_tokens(40 + 3 * i)
                .sampling(sampling)
                .constraint(mlx_engine::Constraint::JsonSchema(schema.clone()));
            engine.complete(completion).unwrap()
        })
        .collect();
    for stream in streams {
        let answer = stream.collect().unwrap();
        let value: serde_json::Value = serde_json::from_str(&answer.text)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", answer.text));
        let object = value.as_object().unwrap();
        let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["label", "reason", "tags", "urgent"], "{value}");
        let label = value["label"].as_i64().unwrap();
        assert!((1..=5).contains(&label), "{value}");
        assert!(
            value["reason"].as_str().unwrap().chars().count() <= 24,
            "{value}"
        );
        let tags = value["tags"].as_array().unwrap();
        assert!(tags.len() <= 3, "{value}");
        assert!(
            tags.iter()
                .all(|t| ["bug", "feature", "docs"].contains(&t.as_str().unwrap())),
            "{value}"
        );
        assert!(value["urgent"].is_boolean(), "{value}");
    }
}

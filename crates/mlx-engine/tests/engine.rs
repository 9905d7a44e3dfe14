//! MlxEngine on a tiny random model with a word-level tokenizer: batched
//! results equal one-at-a-time and a plain full-prompt greedy loop, and the
//! failure policy holds (nobody waits forever).

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use mlx_engine::{
    EngineConfig, EngineError, KvCache, Message, MlxEngine, Model, QuantizedWeights, Tokenizer,
};
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::Array;

const VOCAB: i32 = 48;

fn normal(shape: &[i32], seed: u64, std: f32) -> Array {
    let key = mlx_rs::random::key(seed).unwrap();
    mlx_rs::random::normal::<f32>(shape, None, std, &key).unwrap()
}

/// A tiny llama with a word-level tokenizer (`w0`…`w39` and chat markers)
/// and a chat template.
fn write_model(dir: &Path) {
    let (hidden, heads, kv, inter) = (64, 4, 2, 128);
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": 2, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
        "rope_theta": 10000.0, "tie_word_embeddings": true, "eos_token_id": 44
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut seed = 7;
    let mut w = |shape: &[i32], std: f32| {
        seed += 1;
        normal(shape, seed, std)
    };
    let hd = hidden / heads;
    let mut weights = vec![
        (
            "model.embed_tokens.weight".to_owned(),
            w(&[VOCAB, hidden], 1.0),
        ),
        (
            "model.norm.weight".into(),
            Array::ones::<f32>(&[hidden]).unwrap(),
        ),
    ];
    for i in 0..2 {
        let p = format!("model.layers.{i}.");
        for (name, out, inp) in [
            ("self_attn.q_proj", heads * hd, hidden),
            ("self_attn.k_proj", kv * hd, hidden),
            ("self_attn.v_proj", kv * hd, hidden),
            ("self_attn.o_proj", hidden, heads * hd),
            ("mlp.gate_proj", inter, hidden),
            ("mlp.up_proj", inter, hidden),
            ("mlp.down_proj", hidden, inter),
        ] {
            weights.push((format!("{p}{name}.weight"), w(&[out, inp], 0.2)));
        }
        weights.push((
            format!("{p}input_layernorm.weight"),
            Array::ones::<f32>(&[hidden]).unwrap(),
        ));
        weights.push((
            format!("{p}post_attention_layernorm.weight"),
            Array::ones::<f32>(&[hidden]).unwrap(),
        ));
    }
    Array::save_safetensors(
        weights.iter().map(|(k, v)| (k.as_str(), v)),
        None,
        dir.join("model.safetensors"),
    )
    .unwrap();
    let mut vocab = serde_json::Map::new();
    vocab.insert("<unk>".into(), 40.into());
    for i in 0..40 {
        vocab.insert(format!("w{i}"), i.into());
    }
    for (token, id) in [("<s>", 41), ("<u>", 42), ("<a>", 43), ("<eos>", 44)] {
        vocab.insert(token.into(), id.into());
    }
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = "{% for m in messages %}{% if m.role == 'system' %}<s> {% elif m.role == 'user' %}<u> {% else %}<a> {% endif %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}<a> {% endif %}";
    let tokenizer_config = serde_json::json!({"chat_template": template, "eos_token": "<eos>"});
    std::fs::write(
        dir.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .unwrap();
}

fn system() -> Message {
    Message::new("system", "w1 w2 w3 w4 w5")
}

fn conversations() -> Vec<Vec<Message>> {
    [
        "w7",
        "w8 w9 w10 w11 w12 w13",
        "w3",
        "w20 w21 w22",
        "w30 w31 w32 w33 w34 w35 w36 w37",
        "w5 w6",
    ]
    .iter()
    .map(|u| vec![system(), Message::new("user", *u)])
    .collect()
}

fn engine(dir: &Path, batch_size: usize) -> MlxEngine {
    MlxEngine::new(EngineConfig {
        model_dir: dir.to_path_buf(),
        logits_processor_factory: None,
        prefix_messages: vec![system()],
        batch_size,
        worker_name: "mlx-test".into(),
        quantized: Some(QuantizedWeights::Keep),
    })
    .unwrap()
}

/// Greedy decoding of one conversation over its full prompt, no cache tricks.
fn reference(dir: &Path, conversation: &[Message], max_tokens: usize) -> String {
    let model = Model::load(dir, QuantizedWeights::Keep).unwrap();
    let tokenizer = Tokenizer::load(dir).unwrap();
    let mut ids: Vec<i32> = tokenizer
        .chat_tokens(conversation, true)
        .unwrap()
        .iter()
        .map(|&t| t as i32)
        .collect();
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let logits = model
            .forward(
                &Array::from_slice(&ids, &[1, ids.len() as i32]),
                &mut KvCache::new(),
                None,
            )
            .unwrap();
        let next = argmax_axis(logits.index((0, -1)), -1, None).unwrap();
        next.eval().unwrap();
        let id = next.item_exact::<u32>() as i32;
        if tokenizer.eos_ids().contains(&(id as u32)) {
            break;
        }
        out.push(id as u32);
        ids.push(id);
    }
    tokenizer.decode(&out).unwrap()
}

#[test]
fn batched_generation_equals_one_at_a_time_and_the_full_prompt() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    let convs = conversations();
    let progress = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&progress);
    let batched = engine(dir.path(), 4)
        .generate(
            convs.clone(),
            move |n| {
                seen.fetch_add(n, Ordering::SeqCst);
            },
            5,
        )
        .unwrap();
    assert_eq!(
        progress.load(Ordering::SeqCst),
        convs.len(),
        "progress covers every conversation"
    );
    let single = engine(dir.path(), 1)
        .generate(convs.clone(), |_| {}, 5)
        .unwrap();
    assert_eq!(batched, single);
    for (conv, text) in convs.iter().zip(&batched) {
        assert_eq!(
            text,
            &reference(dir.path(), conv, 5),
            "conversation {:?}",
            conv[1].content
        );
    }
    assert!(
        batched.iter().any(|t| !t.is_empty()),
        "something was generated: {batched:?}"
    );
}

#[test]
fn logits_processor_restricts_the_output() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    let engine = MlxEngine::new(EngineConfig {
        model_dir: dir.path().to_path_buf(),
        logits_processor_factory: Some(Box::new(|tokenizer: &Tokenizer| {
            let allowed = tokenizer.token_id("w9").unwrap() as i32;
            Box::new(move |logits: &Array| {
                // Everything but the allowed token to -inf.
                let ids = mlx_rs::ops::arange::<_, i32>(None, VOCAB, None)?;
                let keep = ids.eq(Array::from_int(allowed))?;
                mlx_rs::ops::select(&keep, logits, Array::from_f32(f32::NEG_INFINITY))
            })
        })),
        prefix_messages: vec![system()],
        batch_size: 3,
        worker_name: "mlx-test".into(),
        quantized: None,
    })
    .unwrap();
    let texts = engine.generate(conversations(), |_| {}, 1).unwrap();
    assert!(texts.iter().all(|t| t == "w9"), "{texts:?}");
}

#[test]
fn conversations_must_start_with_the_prefix() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    let engine = engine(dir.path(), 2);
    let mut convs = conversations();
    convs[3][0] = Message::new("system", "w9");
    assert!(matches!(
        engine.generate(convs, |_| {}, 1),
        Err(EngineError::PrefixMismatch { index: 3 })
    ));
    // The engine keeps serving after a failed request.
    assert_eq!(
        engine.generate(conversations(), |_| {}, 1).unwrap().len(),
        6
    );
}

#[test]
fn batch_size_zero_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = MlxEngine::new(EngineConfig {
        model_dir: dir.path().to_path_buf(),
        logits_processor_factory: None,
        prefix_messages: vec![],
        batch_size: 0,
        worker_name: "mlx-test".into(),
        quantized: None,
    })
    .unwrap_err();
    assert!(matches!(err, EngineError::InvalidConfig(_)));
}

#[test]
fn a_failed_load_is_reported_to_every_call() {
    let dir = tempfile::tempdir().unwrap(); // no model here
    let engine = engine(dir.path(), 2);
    assert!(matches!(engine.ensure_loaded(), Err(EngineError::Load(_))));
    assert!(matches!(engine.ensure_loaded(), Err(EngineError::Load(_))));
    assert!(matches!(
        engine.generate(conversations(), |_| {}, 1),
        Err(EngineError::Load(_))
    ));
    assert!(matches!(
        engine.submit(|_| 1).wait(),
        Err(EngineError::Load(_))
    ));
}

#[test]
fn close_finishes_queued_jobs_then_refuses_new_ones() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    let engine = engine(dir.path(), 2);
    engine.ensure_loaded().unwrap();
    let queued = engine.submit(|_| {
        std::thread::sleep(std::time::Duration::from_millis(200));
        41 + 1
    });
    engine.close();
    assert_eq!(queued.wait().unwrap(), 42);
    assert!(matches!(
        engine.submit(|_| 0).wait(),
        Err(EngineError::Closed)
    ));
    assert!(matches!(
        engine.generate(conversations(), |_| {}, 1),
        Err(EngineError::Closed)
    ));
}

#[test]
fn a_panicking_job_is_an_error_and_the_worker_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    let engine = engine(dir.path(), 2);
    let err = engine
        .submit(|_| -> u32 { panic!("boom") })
        .wait()
        .unwrap_err();
    assert!(
        matches!(&err, EngineError::Panicked(m) if m.contains("boom")),
        "{err}"
    );
    let vocab = engine
        .submit(|w| w.model.config().vocab_size)
        .wait()
        .unwrap();
    assert_eq!(vocab, VOCAB as usize);
}

#[test]
fn replies_are_futures_too() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    let engine = engine(dir.path(), 2);
    let mut reply = std::pin::pin!(engine.generate_async(conversations(), |_| {}, 2));
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let texts = loop {
        if let std::task::Poll::Ready(r) = std::future::Future::poll(reply.as_mut(), &mut cx) {
            break r.unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert_eq!(texts, engine.generate(conversations(), |_| {}, 2).unwrap());
}

/// Replies are plain futures: a tokio runtime drives them through their
/// wakers (a reply that never woke its task would run into the timeout).
#[test]
fn replies_resolve_under_tokio() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    let empty = tempfile::tempdir().unwrap();
    let broken = engine(empty.path(), 2);
    let engine = engine(dir.path(), 2);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    fn within<F: std::future::Future>(reply: F) -> tokio::time::Timeout<F> {
        tokio::time::timeout(std::time::Duration::from_secs(120), reply)
    }
    let (texts, count, failed_load, failed_generate) = runtime.block_on(async {
        within(engine.ensure_loaded_async())
            .await
            .expect("woken")
            .unwrap();
        let texts = within(engine.generate_async(conversations(), |_| {}, 2));
        let count = within(engine.submit(|w| w.model.config().num_hidden_layers));
        let failed_load = within(broken.ensure_loaded_async());
        let failed_generate = within(broken.generate_async(conversations(), |_| {}, 1));
        (
            texts.await.expect("woken"),
            count.await.expect("woken"),
            failed_load.await.expect("woken"),
            failed_generate.await.expect("woken"),
        )
    });
    assert_eq!(
        texts.unwrap(),
        engine.generate(conversations(), |_| {}, 2).unwrap()
    );
    assert_eq!(count.unwrap(), 2);
    assert!(
        matches!(failed_load, Err(EngineError::Load(_))),
        "{failed_load:?}"
    );
    assert!(
        matches!(failed_generate, Err(EngineError::Load(_))),
        "{failed_generate:?}"
    );
    engine.close();
    let closed = runtime
        .block_on(async { within(engine.submit(|_| ())).await })
        .expect("woken");
    assert!(matches!(closed, Err(EngineError::Closed)));
}

#[test]
fn statistics_and_memory_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    let engine = engine(dir.path(), 4);
    let (texts, stats) = engine
        .generate_with_stats_async(conversations(), |_| {}, 3)
        .wait()
        .unwrap();
    assert_eq!((texts.len(), stats.conversations), (6, 6));
    let words: usize = texts.iter().map(|t| t.split_whitespace().count()).sum();
    // Each visible word is one token; at most 3 tokens per conversation.
    assert!(
        stats.generated_tokens >= words && stats.generated_tokens <= 6 * 3,
        "{stats:?} for {texts:?}"
    );
    assert!(stats.prompt_tokens >= 6 * 3 && stats.seconds > 0.0);
    assert!(stats.conversations_per_s() > 0.0 && stats.conversations_per_s().is_finite());
    assert_eq!(
        mlx_engine::GenerationStats::default().conversations_per_s(),
        0.0,
        "no division by zero"
    );
    assert!(engine.peak_memory_bytes().unwrap() > 1 << 20);
    assert!(engine.mlx_peak_memory_bytes().wait().unwrap() > 0);
}

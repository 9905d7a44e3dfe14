//! MlxEngine on a tiny random model with a word-level tokenizer: batched
//! results equal one-at-a-time and a plain full-prompt greedy loop, and the
//! failure policy holds (nobody waits forever).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use mlx_engine::{EngineConfig, EngineError, GenerateOptions, Message, MlxEngine, Tokenizer};
use mlx_rs::Array;

mod common;

use common::*;

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
            GenerateOptions::new().max_tokens(5).on_progress(move |n| {
                seen.fetch_add(n, Ordering::SeqCst);
            }),
        )
        .map(|g| g.texts)
        .unwrap();
    assert_eq!(
        progress.load(Ordering::SeqCst),
        convs.len(),
        "progress covers every conversation"
    );
    let single = engine(dir.path(), 1)
        .generate(convs.clone(), GenerateOptions::new().max_tokens(5))
        .map(|g| g.texts)
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
    let engine = MlxEngine::new(
        EngineConfig::new(dir.path())
            .prefix_messages(vec![system()])
            .batch_size(3)
            .logits_processor(|tokenizer: &Tokenizer| {
                let allowed = tokenizer.token_id("w9").unwrap() as i32;
                Box::new(move |logits: &Array| {
                    // Everything but the allowed token to -inf.
                    let ids = mlx_rs::ops::arange::<_, i32>(None, VOCAB, None)?;
                    let keep = ids.eq(Array::from_int(allowed))?;
                    mlx_rs::ops::select(&keep, logits, Array::from_f32(f32::NEG_INFINITY))
                })
            })
            .worker_name("mlx-test"),
    )
    .unwrap();
    let texts = engine
        .generate(conversations(), GenerateOptions::new().max_tokens(1))
        .map(|g| g.texts)
        .unwrap();
    assert!(texts.iter().all(|t| t == "w9"), "{texts:?}");
}

/// Texts from an engine with `lanes` lanes, batches of 2, with or without a
/// processor that bans one token (so that picking goes through the caller's
/// thread), and the progress it reported.
fn texts_with_lanes(dir: &std::path::Path, lanes: usize, ban: bool) -> (Vec<String>, usize) {
    let mut config = EngineConfig::new(dir)
        .prefix_messages(vec![system()])
        .batch_size(2)
        .lanes(lanes)
        .worker_name("mlx-test");
    if ban {
        config = config.logits_processor(|tokenizer: &Tokenizer| {
            let banned = tokenizer.token_id("w9").unwrap() as i32;
            Box::new(move |logits: &Array| {
                let ids = mlx_rs::ops::arange::<_, i32>(None, VOCAB, None)?;
                let hit = ids.eq(Array::from_int(banned))?;
                mlx_rs::ops::select(&hit, Array::from_f32(f32::NEG_INFINITY), logits)
            })
        });
    }
    let progress = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&progress);
    let generation = MlxEngine::new(config)
        .unwrap()
        .generate(
            conversations(),
            GenerateOptions::new().max_tokens(6).on_progress(move |n| {
                seen.fetch_add(n, Ordering::SeqCst);
            }),
        )
        .unwrap();
    assert_eq!(generation.stats.conversations, 6);
    (generation.texts, progress.load(Ordering::SeqCst))
}

#[test]
fn lanes_change_nothing_in_the_results() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    for ban in [false, true] {
        let (one, progress) = texts_with_lanes(dir.path(), 1, ban);
        assert_eq!(progress, 6);
        assert!(one.iter().any(|t| !t.is_empty()), "{one:?}");
        if ban {
            assert!(
                one.iter().all(|t| !t.split(' ').any(|w| w == "w9")),
                "{one:?}"
            );
        }
        // Three chunks of two: two lanes share them, three take one each,
        // and eight are more lanes than chunks.
        for lanes in [2, 3, 8] {
            let (texts, progress) = texts_with_lanes(dir.path(), lanes, ban);
            assert_eq!(texts, one, "{lanes} lanes, processor: {ban}");
            assert_eq!(progress, 6, "{lanes} lanes");
        }
    }
}

#[test]
fn conversations_must_start_with_the_prefix() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    let engine = engine(dir.path(), 2);
    let mut convs = conversations();
    convs[3][0] = Message::new("system", "w9");
    assert!(matches!(
        engine
            .generate(convs, GenerateOptions::new().max_tokens(1))
            .map(|g| g.texts),
        Err(EngineError::PrefixMismatch { index: 3 })
    ));
    // The engine keeps serving after a failed request.
    assert_eq!(
        engine
            .generate(conversations(), GenerateOptions::new().max_tokens(1))
            .map(|g| g.texts)
            .unwrap()
            .len(),
        6
    );
}

#[test]
fn batch_size_zero_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = MlxEngine::new(
        EngineConfig::new(dir.path())
            .batch_size(0)
            .worker_name("mlx-test"),
    )
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
        engine
            .generate(conversations(), GenerateOptions::new().max_tokens(1))
            .map(|g| g.texts),
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
        engine
            .generate(conversations(), GenerateOptions::new().max_tokens(1))
            .map(|g| g.texts),
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
        .submit(|w| w.model().config().vocab_size)
        .wait()
        .unwrap();
    assert_eq!(vocab, VOCAB as usize);
}

#[test]
fn replies_are_futures_too() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    let engine = engine(dir.path(), 2);
    let mut reply = std::pin::pin!(
        engine.generate_async(conversations(), GenerateOptions::new().max_tokens(2))
    );
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let texts = loop {
        if let std::task::Poll::Ready(r) = std::future::Future::poll(reply.as_mut(), &mut cx) {
            break r.unwrap().texts;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert_eq!(
        texts,
        engine
            .generate(conversations(), GenerateOptions::new().max_tokens(2))
            .map(|g| g.texts)
            .unwrap()
    );
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
        let texts =
            within(engine.generate_async(conversations(), GenerateOptions::new().max_tokens(2)));
        let count = within(engine.submit(|w| w.model().config().num_hidden_layers));
        let failed_load = within(broken.ensure_loaded_async());
        let failed_generate =
            within(broken.generate_async(conversations(), GenerateOptions::new().max_tokens(1)));
        (
            texts.await.expect("woken"),
            count.await.expect("woken"),
            failed_load.await.expect("woken"),
            failed_generate.await.expect("woken"),
        )
    });
    assert_eq!(
        texts.unwrap().texts,
        engine
            .generate(conversations(), GenerateOptions::new().max_tokens(2))
            .map(|g| g.texts)
            .unwrap()
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
    let mlx_engine::Generation { texts, stats, .. } = engine
        .generate_async(conversations(), GenerateOptions::new().max_tokens(3))
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

/// With the tables left in the files, every weight the model holds is a
/// copy and the tables are read with positioned reads, so none of the
/// file's pages stays mapped into the process (they would count in its
/// resident memory): the pages that the kernel mapped around the copied
/// tensors' (its fault-around, its large folios) reached into the table.
#[cfg(target_os = "linux")]
#[test]
fn with_the_tables_mapped_no_page_of_the_files_stays_resident() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path());
    let file = dir.path().join("model.safetensors");
    let model = mlx_engine::Model::loader(dir.path())
        .quantized(mlx_engine::QuantizedWeights::DequantizeOnUse)
        .memory(mlx_engine::MemoryMode::MappedTables)
        .load()
        .unwrap();
    // Rss of every mapping of the file, from /proc/self/smaps: a header
    // line names the file, the `Rss:` line after it says how much of it is
    // resident.
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut in_file = false;
    let mut resident_kib = 0u64;
    let mut mappings = 0;
    for line in smaps.lines() {
        let header = line.split_whitespace().count() >= 5
            && line
                .split_whitespace()
                .next()
                .is_some_and(|r| r.contains('-'));
        if header {
            in_file = line.ends_with(file.to_str().unwrap());
            mappings += usize::from(in_file);
        } else if let Some(kib) = line.strip_prefix("Rss:").filter(|_| in_file) {
            resident_kib += kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .unwrap();
        }
    }
    assert_eq!(mappings, 1, "the model keeps its file mapped for the table");
    assert_eq!(resident_kib, 0, "KiB of {} resident", file.display());
    drop(model);
}

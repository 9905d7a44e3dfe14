//! The server as a client sees it: started as a child process on
//! 127.0.0.1 with SmolLM2 (the fixture), reached with curl.

mod common;

use std::time::{Duration, Instant};

use common::{chat, smollm2, sse_data, system_prompt, Server, MODEL};
use mlx_engine::{EngineConfig, GenerateOptions, Message, MlxEngine};
use serde_json::{json, Value};

fn parse(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// A 400 with OpenAI's error object whose `param` is `param`.
fn assert_bad(server: &Server, body: &str, param: &str) {
    let (status, text) = server.post("/v1/chat/completions", body);
    assert_eq!(status, 400, "{body} → {text}");
    let error = &parse(&text)["error"];
    assert_eq!(error["param"], param, "{body} → {text}");
    assert_eq!(error["type"], "invalid_request_error");
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
}

#[test]
fn the_server_answers_as_openai_documents_and_names_bad_fields() {
    let Some(model) = smollm2("the_server_answers_as_openai_documents") else {
        return;
    };
    let server = Server::start(&model, &["--batch-size", "4"]);
    let (status, body) = server.get("/health");
    assert_eq!((status, parse(&body)["status"].clone()), (200, json!("ok")));
    let (status, body) = server.get("/v1/models");
    assert_eq!(status, 200);
    assert_eq!(parse(&body)["data"][0]["id"], MODEL);

    let question = [("user", "What is the capital of France?")];
    let (status, body) = server.post(
        "/v1/chat/completions",
        &chat(&question, json!({"max_tokens": 8, "temperature": 0})),
    );
    assert_eq!(status, 200, "{body}");
    let whole = parse(&body);
    assert_eq!(whole["object"], "chat.completion");
    let choice = &whole["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let text = choice["message"]["content"].as_str().unwrap().to_owned();
    assert!(text.contains("Paris"), "{text}");
    let usage = &whole["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(
            usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
        )
    );
    assert!(matches!(
        choice["finish_reason"].as_str(),
        Some("stop" | "length")
    ));

    // Streamed, with usage: the same text, chunk by chunk.
    let (status, body) = server.post(
        "/v1/chat/completions",
        &chat(
            &question,
            json!({"max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    assert_eq!(status, 200);
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| parse(d)).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"]["completion_tokens"],
        usage["completion_tokens"]
    );
    let finishes: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes, vec![&choice["finish_reason"]]);
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["usage"].is_null()));

    // Logprobs name the tokens generated: they spell the text, and greedy
    // picks the most likely.
    let (status, body) = server.post(
        "/v1/chat/completions",
        &chat(
            &question,
            json!({"max_tokens": 8, "logprobs": true, "top_logprobs": 3}),
        ),
    );
    assert_eq!(status, 200, "{body}");
    let whole = parse(&body);
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    let spelled: String = content
        .iter()
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert_eq!(
        spelled,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    for token in content {
        let top = token["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], token["token"]);
        assert_eq!(top[0]["logprob"], token["logprob"]);
        assert!(token["logprob"].as_f64().unwrap() <= 0.0);
    }

    // A stop string ends the text before it.
    let (_, body) = server.post(
        "/v1/chat/completions",
        &chat(&question, json!({"max_tokens": 12, "stop": ["Paris"]})),
    );
    let stopped = parse(&body);
    let stopped_text = stopped["choices"][0]["message"]["content"]
        .as_str()
        .unwrap();
    assert_eq!(Some(stopped_text), text.split("Paris").next(), "{body}");
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");

    // Bad requests name the field.
    assert_bad(&server, "{\"model\": ", "body");
    assert_bad(
        &server,
        r#"{"model": "smollm2", "messages": "hi"}"#,
        "messages",
    );
    assert_bad(
        &server,
        &chat(&question, json!({"temperature": "hot"})),
        "temperature",
    );
    assert_bad(
        &server,
        r#"{"model": "smollm2", "messages": [{"role": "user", "content": 5}]}"#,
        "messages[0].content",
    );
    assert_bad(
        &server,
        &chat(&question, json!({"model": "gpt-4o"})),
        "model",
    );
    assert_bad(&server, &chat(&question, json!({"n": 2})), "n");
    assert_bad(&server, &chat(&[], json!({})), "messages");
    assert_bad(
        &server,
        &chat(&question, json!({"max_tokens": 0})),
        "max_tokens",
    );
    assert_bad(&server, &chat(&question, json!({"top_p": 0})), "top_p");
    assert_bad(
        &server,
        &chat(&question, json!({"logit_bias": {"999999999": 5}})),
        "logit_bias",
    );
    assert_bad(
        &server,
        &chat(&question, json!({"top_logprobs": 50, "logprobs": true})),
        "top_logprobs",
    );
    let long = "word ".repeat(9000);
    let (status, body) = server.post(
        "/v1/chat/completions",
        &chat(&[("user", &long)], json!({"max_tokens": 1})),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(parse(&body)["error"]["code"], "context_length_exceeded");
    let (status, body) = server.get("/v1/nothing");
    assert_eq!(status, 404);
    assert_eq!(parse(&body)["error"]["code"], "not_found");
    // A body past the server's limit (2 MB) is an error object too.
    let huge = chat(&[("user", &"x".repeat(3 << 20))], json!({}));
    let (status, body) = server.post("/v1/chat/completions", &huge);
    assert_eq!(status, 413, "{body}");
    assert_eq!(parse(&body)["error"]["param"], "body");
    // Unknown fields are ignored, as OpenAI does.
    let (status, _) = server.post(
        "/v1/chat/completions",
        &chat(
            &question,
            json!({"max_tokens": 1, "user": "x", "frequency_penalty": 0}),
        ),
    );
    assert_eq!(status, 200);
}

#[test]
fn seeded_sampling_repeats_and_logit_bias_forces_a_token() {
    let Some(model) = smollm2("seeded_sampling_repeats") else {
        return;
    };
    let server = Server::start(&model, &[]);
    let question = [("user", "Write a word.")];
    let sampled = |seed: u64| {
        let body = chat(
            &question,
            json!({"max_tokens": 8, "temperature": 1.0, "top_p": 0.95, "seed": seed}),
        );
        let (status, body) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{body}");
        parse(&body)["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let a = sampled(11);
    assert_eq!(a, sampled(11), "the same seed, the same tokens");
    let others: Vec<String> = (12..16).map(sampled).collect();
    assert!(others.iter().any(|o| o != &a), "{a:?} {others:?}");
    // +100 on one token: greedy takes it every time.
    let body = chat(
        &question,
        json!({"max_tokens": 3, "logit_bias": {"28": 100}, "logprobs": true}),
    );
    let (_, body) = server.post("/v1/chat/completions", &body);
    let whole = parse(&body);
    let tokens = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(tokens.len(), 3, "{body}");
    let first = &tokens[0]["token"];
    assert!(tokens.iter().all(|t| &t["token"] == first), "{body}");
}

#[test]
fn greedy_answers_equal_generate_and_the_shared_prefix_is_computed_once() {
    let Some(model) = smollm2("greedy_answers_equal_generate") else {
        return;
    };
    let system = system_prompt();
    let reviews = [
        "Great blender, crushed ice in seconds.",
        "Broke after two days. Never again.",
        "It is fine, nothing special.",
        "The best purchase I made this year, my kids love it and so do I.",
        "Arrived late but works.",
        "Terrible customer service and the lid leaks.",
    ];
    let max_tokens = 10;
    let server = Server::start(&model, &["--batch-size", "4"]);
    let answers: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = reviews
            .iter()
            .map(|review| {
                let (server, system) = (&server, &system);
                scope.spawn(move || {
                    let body = chat(
                        &[("system", system), ("user", review)],
                        json!({"max_tokens": max_tokens, "temperature": 0}),
                    );
                    let (status, body) = server.post("/v1/chat/completions", &body);
                    assert_eq!(status, 200, "{body}");
                    parse(&body)["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap()
                        .to_owned()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Every request after the first found the system prompt's cache.
    assert_eq!(server.metric("mlx_serve_prefix_cache_misses_total"), 1.0);
    assert_eq!(server.metric("mlx_serve_prefix_cache_hits_total"), 5.0);
    assert!(server.metric("mlx_serve_cached_prompt_tokens_total") > 6.0 * 100.0);
    drop(server);

    let engine = MlxEngine::new(
        EngineConfig::new(&model)
            .prefix_messages(vec![Message::new("system", &system)])
            .batch_size(4),
    )
    .unwrap();
    let conversations: Vec<Vec<Message>> = reviews
        .iter()
        .map(|r| vec![Message::new("system", &system), Message::new("user", *r)])
        .collect();
    let expected = engine
        .generate(conversations, GenerateOptions::new().max_tokens(max_tokens))
        .unwrap()
        .texts;
    assert_eq!(answers, expected);
}

#[test]
fn sixty_four_clients_lose_no_request_and_leak_no_slot() {
    let Some(model) = smollm2("sixty_four_clients") else {
        return;
    };
    let server = Server::start(&model, &["--batch-size", "8"]);
    let system = system_prompt();
    let start = Instant::now();
    let outcomes: Vec<(usize, u16, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..64)
            .map(|i| {
                let (server, system) = (&server, &system);
                scope.spawn(move || {
                    let user = "Tell me about the weather. ".repeat(1 + i % 5);
                    let cancelled = i % 8 == 7;
                    let stream = i % 4 == 1;
                    let messages: Vec<(&str, &str)> = if i % 2 == 0 {
                        vec![("system", system), ("user", &user)]
                    } else {
                        vec![("user", &user)]
                    };
                    let max_tokens = if cancelled { 400 } else { 1 + i % 6 };
                    let body = chat(
                        &messages,
                        json!({"max_tokens": max_tokens, "stream": stream}),
                    );
                    let (status, body) = if cancelled {
                        // The client goes away after a second.
                        server.curl(
                            "/v1/chat/completions",
                            &[
                                "-N",
                                "--max-time",
                                "1",
                                "-X",
                                "POST",
                                "-H",
                                "Content-Type: application/json",
                                "--data-binary",
                                "@-",
                            ],
                            Some(&body),
                        )
                    } else {
                        server.post("/v1/chat/completions", &body)
                    };
                    (i, status, body)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, status, body) in &outcomes {
        if i % 8 == 7 {
            continue;
        }
        assert_eq!(*status, 200, "request {i}: {body}");
        let finished = if i % 4 == 1 {
            let data = sse_data(body);
            data.last().map(String::as_str) == Some("[DONE]")
                && data.iter().any(|d| {
                    d.contains("\"finish_reason\":\"length\"")
                        || d.contains("\"finish_reason\":\"stop\"")
                })
        } else {
            parse(body)["choices"][0]["finish_reason"].is_string()
        };
        assert!(finished, "request {i}: {body}");
    }
    // The cancelled rows leave at the next step: nothing runs or waits.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (running, waiting) = (
            server.metric("mlx_serve_running_rows"),
            server.metric("mlx_serve_queue_depth"),
        );
        if running == 0.0 && waiting == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{running} rows still run, {waiting} wait"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "64 clients served in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    // And the server still answers.
    let (status, _) = server.post(
        "/v1/chat/completions",
        &chat(&[("user", "Hi")], json!({"max_tokens": 2})),
    );
    assert_eq!(status, 200);
}

#[test]
fn a_full_queue_is_a_429_with_retry_after() {
    let Some(model) = smollm2("a_full_queue_is_a_429") else {
        return;
    };
    let server = Server::start(&model, &["--batch-size", "1", "--max-queue", "1"]);
    let long = chat(
        &[("user", "Count to a thousand.")],
        json!({"max_tokens": 300}),
    );
    let statuses: Vec<(u16, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let (server, long) = (&server, &long);
                scope.spawn(move || {
                    std::thread::sleep(Duration::from_millis(300 * i));
                    server.curl(
                        "/v1/chat/completions",
                        &[
                            "-D",
                            "-",
                            "--max-time",
                            "3",
                            "-X",
                            "POST",
                            "-H",
                            "Content-Type: application/json",
                            "--data-binary",
                            "@-",
                        ],
                        Some(long),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let refused: Vec<&(u16, String)> = statuses.iter().filter(|(s, _)| *s == 429).collect();
    assert!(!refused.is_empty(), "{statuses:?}");
    for (_, response) in refused {
        let lower = response.to_ascii_lowercase();
        assert!(lower.contains("retry-after: 1"), "{response}");
        assert!(response.contains("\"code\":\"queue_full\""), "{response}");
    }
}

#[cfg(unix)]
#[test]
fn sigterm_lets_a_running_request_finish_then_the_server_exits() {
    let Some(model) = smollm2("sigterm_lets_a_running_request_finish") else {
        return;
    };
    let mut server = Server::start(&model, &["--shutdown-grace", "60"]);
    let body = chat(
        &[("user", "Tell me a story.")],
        json!({"max_tokens": 40, "stream": true}),
    );
    let answer = std::thread::scope(|scope| {
        let request = scope.spawn(|| server.post("/v1/chat/completions", &body));
        // Once the row runs, ask the server to stop.
        let deadline = Instant::now() + Duration::from_secs(60);
        while server.metric("mlx_serve_running_rows") < 1.0 {
            assert!(Instant::now() < deadline, "the request never ran");
            std::thread::sleep(Duration::from_millis(50));
        }
        let pid = server.child.id().to_string();
        let killed = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert!(killed.success());
        request.join().unwrap()
    });
    let (status, body) = answer;
    assert_eq!(status, 200);
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    assert!(body.contains("\"finish_reason\":\"length\""), "{body}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            assert!(status.success(), "{status}");
            break;
        }
        assert!(Instant::now() < deadline, "the server did not exit");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn structured_outputs_always_parse_and_unsupported_schemas_are_named() {
    let Some(model) = smollm2("structured_outputs_always_parse") else {
        return;
    };
    let server = Server::start(&model, &["--batch-size", "4"]);
    let schema = json!({
        "type": "object",
        "properties": {
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "sentiment": {"enum": ["positive", "negative", "mixed"]},
            "summary": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}}
        },
        "required": ["rating", "sentiment", "summary", "tags"],
        "additionalProperties": false
    });
    let format = json!({"type": "json_schema", "json_schema": {"name": "review", "strict": true, "schema": schema}});
    let reviews = [
        "Great blender, crushed ice in seconds.",
        "Broke after two days. Never again.",
        "It is fine, nothing special.",
        "The lid leaks but the motor is strong.",
    ];
    // Budgets too small for what the model would write: the answer is
    // closed in time, and parses, greedy and sampled.
    let answers: Vec<(u32, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = reviews
            .iter()
            .enumerate()
            .map(|(i, review)| {
                let (server, format) = (&server, &format);
                scope.spawn(move || {
                    let max_tokens = [31u32, 34, 40, 60][i];
                    let body = chat(
                        &[("user", &format!("Rate this review as JSON: {review}"))],
                        json!({"max_tokens": max_tokens, "response_format": format,
                               "temperature": if i % 2 == 0 { 0.0 } else { 1.0 }, "seed": i}),
                    );
                    let (status, body) = server.post("/v1/chat/completions", &body);
                    assert_eq!(status, 200, "{body}");
                    (max_tokens, parse(&body))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (max_tokens, whole) in answers {
        let content = whole["choices"][0]["message"]["content"].as_str().unwrap();
        let answer: Value = serde_json::from_str(content)
            .unwrap_or_else(|e| panic!("{content:?} does not parse: {e}"));
        let rating = answer["rating"].as_i64().unwrap();
        assert!((1..=5).contains(&rating), "{answer}");
        assert!(["positive", "negative", "mixed"].contains(&answer["sentiment"].as_str().unwrap()));
        assert!(
            answer["summary"].is_string() && answer["tags"].is_array(),
            "{answer}"
        );
        assert_eq!(answer.as_object().unwrap().len(), 4, "{answer}");
        let used = whole["usage"]["completion_tokens"].as_u64().unwrap();
        assert!(used <= u64::from(max_tokens), "{used} > {max_tokens}");
        assert_eq!(whole["choices"][0]["finish_reason"], "stop", "{whole}");
    }
    // A budget below the shortest answer is refused, naming max_tokens.
    let (status, body) = server.post(
        "/v1/chat/completions",
        &chat(
            &[("user", "x")],
            json!({"max_tokens": 8, "response_format": format}),
        ),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(parse(&body)["error"]["param"], "max_tokens", "{body}");
    // Any JSON object.
    let (status, body) = server.post(
        "/v1/chat/completions",
        &chat(
            &[("user", "Describe Paris.")],
            json!({"max_tokens": 16, "response_format": {"type": "json_object"}}),
        ),
    );
    assert_eq!(status, 200, "{body}");
    let content = parse(&body)["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(parse(&content).is_object(), "{content}");
    // What the grammar engine cannot enforce is refused by name.
    let unsupported = json!({"type": "json_schema", "json_schema": {"schema": {"type": "object", "not": {"required": ["a"]}}}});
    let (status, body) = server.post(
        "/v1/chat/completions",
        &chat(&[("user", "x")], json!({"response_format": unsupported})),
    );
    assert_eq!(status, 400, "{body}");
    let error = &parse(&body)["error"];
    assert_eq!(error["param"], "response_format");
    assert!(error["message"].as_str().unwrap().contains("not"), "{body}");
    assert_bad(
        &server,
        &chat(
            &[("user", "x")],
            json!({"response_format": {"type": "json_schema"}}),
        ),
        "response_format.json_schema.schema",
    );
    assert_bad(
        &server,
        &chat(
            &[("user", "x")],
            json!({"response_format": {"type": "yaml"}}),
        ),
        "response_format.type",
    );
}

#[test]
fn a_request_past_its_deadline_is_a_504() {
    let Some(model) = smollm2("a_request_past_its_deadline_is_a_504") else {
        return;
    };
    let server = Server::start(&model, &["--request-timeout", "0.3"]);
    let body = chat(
        &[("user", "Count to a thousand.")],
        json!({"max_tokens": 400}),
    );
    let (status, body) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 504, "{body}");
    assert_eq!(parse(&body)["error"]["code"], "deadline_exceeded");
    // Streamed: the error object in the stream, then [DONE].
    let body = chat(
        &[("user", "Count to a thousand.")],
        json!({"max_tokens": 400, "stream": true}),
    );
    let (status, body) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200);
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    assert!(body.contains("deadline_exceeded"), "{body}");
    // The rows are gone: nothing runs (the counters are published at the
    // end of the step that took them out).
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.metric("mlx_serve_running_rows") != 0.0 {
        assert!(Instant::now() < deadline, "a row still runs");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_restarted_server_reads_its_shared_prefix_from_the_folder() {
    let Some(model) = smollm2("a_restarted_server_reads_its_shared_prefix") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let folder = work.path().join("prefixes");
    let args = ["--prefix-cache-dir", folder.to_str().unwrap()];
    let system = system_prompt();
    let body = chat(
        &[
            ("system", &system),
            ("user", "The lid leaks, the motor is loud."),
        ],
        json!({"max_tokens": 8, "temperature": 0, "logprobs": true}),
    );
    let ask = |server: &Server| {
        let (status, body) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{body}");
        let answer = parse(&body);
        (
            answer["choices"][0]["message"]["content"].clone(),
            answer["choices"][0]["logprobs"].clone(),
        )
    };
    let first = {
        let server = Server::start(&model, &args);
        let first = ask(&server);
        assert_eq!(server.metric("mlx_serve_prefix_cache_misses_total"), 1.0);
        assert_eq!(
            server.metric("mlx_serve_prefix_cache_folder_reads_total"),
            0.0
        );
        first
    };
    let stored: Vec<_> = std::fs::read_dir(&folder).unwrap().collect();
    assert_eq!(stored.len(), 1, "one prefix written: {stored:?}");

    let server = Server::start(&model, &args);
    assert_eq!(
        ask(&server),
        first,
        "the same text and logprobs after the restart"
    );
    assert_eq!(
        server.metric("mlx_serve_prefix_cache_folder_reads_total"),
        1.0
    );
    // The store holds it now: the next request does not go to the folder.
    assert_eq!(ask(&server), first);
    assert_eq!(server.metric("mlx_serve_prefix_cache_hits_total"), 1.0);
    assert_eq!(
        server.metric("mlx_serve_prefix_cache_folder_reads_total"),
        1.0
    );
}

#[test]
fn requests_name_an_adapter_by_model_id_and_decode_together_with_the_base() {
    let Some(model) = smollm2("requests_name_an_adapter_by_model_id") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let (x, y) = (work.path().join("x"), work.path().join("y"));
    test_support::smollm2_adapter::write_smollm2_adapter(&x, 0, 64.0);
    test_support::smollm2_adapter::write_smollm2_adapter(&y, 500, 64.0);
    let (x_arg, y_arg) = (format!("x={}", x.display()), format!("y={}", y.display()));
    let server = Server::start(
        &model,
        &[
            "--batch-size",
            "3",
            "--adapter",
            &x_arg,
            "--adapter",
            &y_arg,
        ],
    );
    let (status, models) = server.get("/v1/models");
    assert_eq!(status, 200);
    let listed: Vec<Value> = parse(&models)["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].clone())
        .collect();
    assert_eq!(
        listed,
        [json!(MODEL), json!("smollm2:x"), json!("smollm2:y")]
    );

    let question = "What is the capital of France?";
    let ids = [MODEL.to_owned(), format!("{MODEL}:x"), format!("{MODEL}:y")];
    let answers: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = ids
            .iter()
            .map(|id| {
                let server = &server;
                scope.spawn(move || {
                    let mut body = parse(&chat(
                        &[("user", question)],
                        json!({"max_tokens": 8, "temperature": 0}),
                    ));
                    body["model"] = json!(id);
                    let (status, text) = server.post("/v1/chat/completions", &body.to_string());
                    assert_eq!(status, 200, "{text}");
                    let answer = parse(&text);
                    assert_eq!(answer["model"], json!(id), "the id asked for is echoed");
                    answer["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap()
                        .to_owned()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut unknown = parse(&chat(&[("user", question)], json!({})));
    unknown["model"] = json!("smollm2:z");
    let (status, text) = server.post("/v1/chat/completions", &unknown.to_string());
    assert_eq!(status, 400, "{text}");
    assert_eq!(parse(&text)["error"]["code"], "model_not_found", "{text}");
    drop(server);

    let engine = MlxEngine::new(
        EngineConfig::new(&model)
            .named_adapter("x", &x)
            .named_adapter("y", &y),
    )
    .unwrap();
    let alone = |adapter: Option<&str>| {
        let mut completion =
            mlx_engine::Completion::new(vec![Message::new("user", question)]).max_tokens(8);
        if let Some(name) = adapter {
            completion = completion.adapter(name);
        }
        engine.complete(completion).unwrap().collect().unwrap().text
    };
    let expected = [alone(None), alone(Some("x")), alone(Some("y"))];
    assert_eq!(answers, expected);
    assert!(
        expected[0] != expected[1] && expected[1] != expected[2],
        "the adapters change the answers: {expected:?}"
    );
}

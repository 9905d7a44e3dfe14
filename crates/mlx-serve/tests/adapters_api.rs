//! Adapters loaded and unloaded while the server runs
//! (`--allow-adapter-loading`, `POST /v1/adapters`, `DELETE
//! /v1/adapters/{name}`), as a client sees them: started as a child
//! process on 127.0.0.1 with SmolLM2 (the fixture), reached with curl.

mod common;

use std::time::{Duration, Instant};

use common::{chat, smollm2, Server, MODEL};
use mlx_engine::{Completion, EngineConfig, Message, MlxEngine, Tokenizer};
use serde_json::{json, Value};

fn parse(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

fn listed(server: &Server) -> Vec<Value> {
    let (status, models) = server.get("/v1/models");
    assert_eq!(status, 200, "{models}");
    let data = parse(&models)["data"].as_array().unwrap().clone();
    data.iter().map(|m| m["id"].clone()).collect()
}

/// A chat request to `model`; the status and the body.
fn ask(server: &Server, model: &str, extra: Value) -> (u16, Value) {
    let mut body = parse(&chat(&[("user", "Name three colours.")], extra));
    body["model"] = json!(model);
    let (status, text) = server.post("/v1/chat/completions", &body.to_string());
    (status, parse(&text))
}

fn load(server: &Server, body: &Value) -> (u16, Value) {
    let (status, text) = server.post("/v1/adapters", &body.to_string());
    (status, parse(&text))
}

fn unload(server: &Server, name: &str) -> (u16, Value) {
    let (status, text) = server.curl(&format!("/v1/adapters/{name}"), &["-X", "DELETE"], None);
    (status, parse(&text))
}

#[test]
fn clients_load_and_unload_adapters_while_the_server_runs() {
    let Some(model) = smollm2("clients_load_and_unload_adapters") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let x = work.path().join("x");
    test_support::smollm2_adapter::write_smollm2_adapter(&x, 0, 64.0);
    let load_x = json!({"name": "x", "path": x});

    // Off unless the flag says so.
    let closed = Server::start(&model, &[]);
    let (status, error) = load(&closed, &load_x);
    assert_eq!(
        (status, &error["error"]["code"]),
        (403, &json!("adapter_loading_off"))
    );
    drop(closed);

    let server = Server::start(&model, &["--batch-size", "2", "--allow-adapter-loading"]);
    assert_eq!(listed(&server), [json!(MODEL)]);
    let (status, card) = load(&server, &load_x);
    assert_eq!((status, &card["id"]), (200, &json!("smollm2:x")), "{card}");
    assert_eq!(listed(&server), [json!(MODEL), json!("smollm2:x")]);

    // Answers as an engine given the adapter at its start.
    let engine = MlxEngine::new(EngineConfig::new(&model).named_adapter("x", &x)).unwrap();
    let alone = |adapter: Option<&str>| {
        let messages = vec![Message::new("user", "Name three colours.")];
        let mut completion = Completion::new(messages).max_tokens(8);
        if let Some(name) = adapter {
            completion = completion.adapter(name);
        }
        engine.complete(completion).unwrap().collect().unwrap().text
    };
    let expected = [alone(None), alone(Some("x"))];
    drop(engine);
    assert_ne!(expected[0], expected[1], "x changes nothing");
    let extra = json!({"max_tokens": 8, "temperature": 0});
    for (id, expected) in [(MODEL, &expected[0]), ("smollm2:x", &expected[1])] {
        let (status, answer) = ask(&server, id, extra.clone());
        assert_eq!(status, 200, "{answer}");
        assert_eq!(
            answer["choices"][0]["message"]["content"],
            json!(expected),
            "{id}"
        );
    }

    // Refused, naming what is wrong; nothing changes.
    let bad = [
        (
            json!({"name": "x", "path": x}),
            "path",
            json!("adapter_invalid"),
        ),
        (
            json!({"name": "a:b", "path": x}),
            "name",
            json!("invalid_name"),
        ),
        (
            json!({"name": "z", "path": work.path().join("none")}),
            "path",
            json!("adapter_invalid"),
        ),
        (json!({"name": 3, "path": x}), "name", Value::Null),
        (
            json!({"name": "z", "path": x, "scale": 2}),
            "scale",
            Value::Null,
        ),
    ];
    for (body, param, code) in bad {
        let (status, error) = load(&server, &body);
        let error = &error["error"];
        assert_eq!(
            (status, &error["param"]),
            (400, &json!(param)),
            "{body}: {error}"
        );
        assert_eq!(error["code"], code, "{body}: {error}");
    }
    assert_eq!(listed(&server), [json!(MODEL), json!("smollm2:x")]);

    // In use by a running request: 409, and still served.
    let eos = Tokenizer::load(&model).unwrap().eos_ids().clone();
    let bias: serde_json::Map<String, Value> =
        eos.iter().map(|id| (id.to_string(), json!(-100))).collect();
    std::thread::scope(|scope| {
        let long = scope.spawn(|| {
            ask(
                &server,
                "smollm2:x",
                json!({"max_tokens": 48, "temperature": 0, "logit_bias": bias}),
            )
        });
        let start = Instant::now();
        while server.metric("mlx_serve_running_rows") < 1.0 {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the request never ran"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let (status, error) = unload(&server, "x");
        assert_eq!(
            (status, &error["error"]["code"]),
            (409, &json!("adapter_in_use")),
            "{error}"
        );
        assert_eq!(listed(&server), [json!(MODEL), json!("smollm2:x")]);
        let (status, answer) = long.join().unwrap();
        assert_eq!(status, 200, "{answer}");
    });

    let (status, gone) = unload(&server, "x");
    assert_eq!((status, &gone["deleted"]), (200, &json!(true)), "{gone}");
    assert_eq!(listed(&server), [json!(MODEL)]);
    let (status, error) = ask(&server, "smollm2:x", extra.clone());
    assert_eq!(
        (status, &error["error"]["code"]),
        (400, &json!("model_not_found"))
    );
    let (status, error) = unload(&server, "x");
    assert_eq!(
        (status, &error["error"]["code"]),
        (404, &json!("adapter_not_found"))
    );
    // The base answers as before.
    let (_, answer) = ask(&server, MODEL, extra);
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        json!(&expected[0])
    );
}

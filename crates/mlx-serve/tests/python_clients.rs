//! Clients no one here wrote, against the server as a child process.

mod common;

use common::{smollm2, Server, MODEL};

#[test]
fn the_openai_package_reads_whole_answers_streams_logprobs_and_errors() {
    let Some(model) = smollm2("the_openai_package_reads") else {
        return;
    };
    let Some(python) = test_support::python::face_python_with("the_openai_package_reads", "openai")
    else {
        return;
    };
    let server = Server::start(&model, &[]);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/clients/openai_client.py"
    );
    let out = std::process::Command::new(python)
        .args([script, &server.url, MODEL])
        .output()
        .expect("running the openai client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "ok");
}

#[test]
fn spawnllms_openai_endpoint_backend_gets_a_valid_pydantic_instance_every_time() {
    let test = "spawnllms_openai_endpoint_backend";
    let Some(model) = smollm2(test) else {
        return;
    };
    let Some(python) = test_support::python::face_python_with(test, "spawnllm, pydantic") else {
        return;
    };
    // spawnllm sends no max_tokens: the server's default bounds the
    // answers (SmolLM2 repeats words inside a string until closed).
    let server = Server::start(&model, &["--default-max-tokens", "40"]);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/clients/spawnllm_structured.py"
    );
    let out = std::process::Command::new(python)
        .args([script, &server.url, MODEL])
        .output()
        .expect("running spawnllm");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "ok 4", "{stderr}");
}

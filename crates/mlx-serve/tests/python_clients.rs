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

//! The server as a child process on 127.0.0.1, and curl as its client.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The SmolLM2 fixture's f32 folder (`cargo xtask fixtures`), or `None`
/// after saying the test skips.
pub fn smollm2(test: &str) -> Option<PathBuf> {
    match std::env::var_os("MLX_LOWMEM_SMOLLM2") {
        Some(dir) => Some(Path::new(&dir).join("f32")),
        None => {
            eprintln!("SKIP {test}: MLX_LOWMEM_SMOLLM2 is not set (cargo xtask fixtures)");
            None
        }
    }
}

/// `mlx-serve` running; killed when dropped.
pub struct Server {
    pub child: Child,
    pub url: String,
}

/// The model id the tests serve under.
pub const MODEL: &str = "smollm2";

impl Server {
    /// Starts the server on a free port and waits for its address line.
    pub fn start(model_dir: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mlx-serve"))
            .arg("--model-dir")
            .arg(model_dir)
            .args(["--model-id", MODEL, "--port", "0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting mlx-serve");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            // Keep reading so the child never blocks on a full pipe.
            for _ in lines {}
        });
        let line = match rx.recv_timeout(Duration::from_secs(180)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                panic!("mlx-serve printed no address within 180 s");
            }
        };
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .trim_end_matches("/v1")
            .to_owned();
        Server { child, url }
    }

    /// `curl` with `args` against `path`; the status and the body.
    pub fn curl(&self, path: &str, args: &[&str], body: Option<&str>) -> (u16, String) {
        let mut curl = Command::new("curl")
            .args(["-sS", "--max-time", "120", "-w", "\n%{http_code}"])
            .args(args)
            .arg(format!("{}{}", self.url, path))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("running curl");
        {
            let mut stdin = curl.stdin.take().expect("piped");
            if let Some(body) = body {
                stdin.write_all(body.as_bytes()).expect("writing the body");
            }
        }
        let out = curl.wait_with_output().expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        self.curl(path, &[], None)
    }

    /// POSTs `body` as JSON.
    pub fn post(&self, path: &str, body: &str) -> (u16, String) {
        self.curl(
            path,
            &[
                "-N",
                "-X",
                "POST",
                "-H",
                "Content-Type: application/json",
                "--data-binary",
                "@-",
            ],
            Some(body),
        )
    }

    /// One value of `/metrics`.
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `data:` payloads of a server-sent-events body.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_owned)
        .collect()
}

/// A chat request body.
pub fn chat(messages: &[(&str, &str)], extra: serde_json::Value) -> String {
    let mut body = serde_json::json!({
        "model": MODEL,
        "messages": messages
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect::<Vec<_>>(),
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body.to_string()
}

/// A system prompt of a few hundred tokens, the classification shape.
pub fn system_prompt() -> String {
    let mut text = String::from(
        "You rate customer reviews. Answer with one digit from 1 (very bad) to 5 (very good). ",
    );
    for i in 0..12 {
        text.push_str(&format!(
            "Guideline {i}: read the whole review, weigh praise against complaints, and ignore shipping delays. "
        ));
    }
    text
}

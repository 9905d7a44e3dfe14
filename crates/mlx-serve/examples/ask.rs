//! Serves a model on a free port in this process, asks it one question over
//! HTTP as any client would, prints the answer, and shuts down.
//!
//! `cargo run -p mlx-serve --example ask -- ~/.cache/mlx-lowmem/smollm2/f32`

use std::io::{Read, Write};
use std::sync::Arc;

use mlx_engine::{EngineConfig, MlxEngine};

fn main() -> anyhow::Result<()> {
    let model_dir = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: ask MODEL_DIR"))?;
    let engine = Arc::new(MlxEngine::new(EngineConfig::new(&model_dir))?);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let settings = mlx_serve::Settings::new("local");
        let server = tokio::spawn(mlx_serve::serve(listener, engine, settings, async {
            let _ = stopped.await;
        }));
        // A plain HTTP/1.1 request from a blocking thread, as a client.
        let answer = tokio::task::spawn_blocking(move || -> anyhow::Result<String> {
            let body = r#"{"model": "local", "max_tokens": 12,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}"#;
            // The server listens once the engine has loaded.
            let mut stream = loop {
                match std::net::TcpStream::connect(addr) {
                    Ok(stream) => break stream,
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
                }
            };
            write!(
                stream,
                "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )?;
            let mut response = String::new();
            stream.read_to_string(&mut response)?;
            let json = response.split("\r\n\r\n").nth(1).unwrap_or_default();
            let value: serde_json::Value = serde_json::from_str(json)?;
            Ok(value["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned())
        })
        .await??;
        let _ = stop.send(());
        server.await??;
        println!("the server answered: {answer}");
        anyhow::Ok(())
    })
}

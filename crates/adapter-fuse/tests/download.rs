//! Downloading a base model through hf-hub from a hub lookalike on loopback
//! (the options' endpoint), then reusing it from the cache offline; hubs
//! that stall. Each test passes its cache and endpoint in `FuseOptions`:
//! nothing here touches the process environment.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use adapter_codec::AdapterCodec;
use adapter_fuse::{Error, Fuse, FuseOptions};

const REPO: &str = "org/remote-base";
const SHA: &str = "feedfacefeedfacefeedfacefeedfacefeedface";
const MODULE: &str = "model.layers.0.self_attn.v_proj";

/// Serves `files` for `REPO` the way the hub's HTTP API does, for the two
/// endpoints hf-hub uses: repo info, and ranged file downloads. Counts the
/// requests it answers. Loopback only; it stops with the test process.
fn serve(files: HashMap<String, Vec<u8>>) -> (String, Arc<AtomicUsize>) {
    serve_cutting(files, None)
}

/// How the first download of a file (more than a probe) goes wrong.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// Announce the whole length, send this many bytes, close.
    Cut(&'static str, usize),
    /// Announce the whole length, send this many bytes, then hold the
    /// connection open, silent, for three seconds before closing it.
    Stall(&'static str, usize),
}

/// [`serve`], with `fault` on the first download of its file that is more
/// than a probe.
fn serve_cutting(
    files: HashMap<String, Vec<u8>>,
    fault: Option<Fault>,
) -> (String, Arc<AtomicUsize>) {
    let mut fault = fault;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&hits);
    std::thread::spawn(move || {
        for stream in listener.incoming().take(200) {
            let Ok(mut stream) = stream else { continue };
            counter.fetch_add(1, Ordering::SeqCst);
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            reader.read_line(&mut request).unwrap();
            let mut range = None;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("range: bytes=") {
                    let (a, b) = v.trim().split_once('-').unwrap();
                    range = Some((a.parse::<usize>().unwrap(), b.parse::<usize>().ok()));
                }
            }
            let path = request.split_whitespace().nth(1).unwrap_or("/").to_owned();
            let info_path = format!("/api/models/{REPO}/revision/main");
            let file_prefix = format!("/{REPO}/resolve/main/");
            let (status, headers, body): (&str, Vec<String>, Vec<u8>) = if path == info_path {
                let siblings: Vec<_> = files
                    .keys()
                    .map(|f| serde_json::json!({"rfilename": f}))
                    .collect();
                let body = serde_json::json!({"sha": SHA, "siblings": siblings})
                    .to_string()
                    .into_bytes();
                (
                    "200 OK",
                    vec!["Content-Type: application/json".into()],
                    body,
                )
            } else if let Some(bytes) = path.strip_prefix(&file_prefix).and_then(|f| files.get(f)) {
                let (a, b) = range.unwrap_or((0, None));
                let b = b.unwrap_or(bytes.len() - 1).min(bytes.len() - 1);
                let headers = vec![
                    format!("ETag: \"{:x}\"", bytes.len() * 7919 + a),
                    format!("X-Repo-Commit: {SHA}"),
                    format!("Content-Range: bytes {a}-{b}/{}", bytes.len()),
                ];
                ("206 Partial Content", headers, bytes[a..=b].to_vec())
            } else {
                ("404 Not Found", vec![], b"not found".to_vec())
            };
            let mut response = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
                body.len()
            );
            for h in headers {
                response.push_str(&h);
                response.push_str("\r\n");
            }
            response.push_str("\r\n");
            let file = path.strip_prefix(&file_prefix).unwrap_or_default();
            let (body, stall) = match fault {
                Some(Fault::Cut(name, keep)) if name == file && body.len() > 1 => {
                    fault = None;
                    (body[..keep].to_vec(), false)
                }
                Some(Fault::Stall(name, keep)) if name == file && body.len() > 1 => {
                    fault = None;
                    (body[..keep].to_vec(), true)
                }
                _ => (body, false),
            };
            let _ = stream.write_all(response.as_bytes());
            let _ = stream.write_all(&body);
            if stall {
                // Silent but open, on a thread of its own so that the hub
                // goes on serving others: only the client's own clock ends
                // this. The close afterwards frees hf-hub's blocked reader.
                let _ = stream.flush();
                std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_secs(3));
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                });
                continue;
            }
            // Closing (not just dropping one handle) is what tells the
            // client that no more bytes are coming.
            let _ = stream.shutdown(std::net::Shutdown::Both);
            let _ = reader.read(&mut [0u8; 0]);
        }
    });
    (endpoint, hits)
}

/// A temp dir with an empty hub cache in `hub/`, and options that use it
/// and `endpoint`, online.
fn hub_at(endpoint: &str) -> (tempfile::TempDir, std::path::PathBuf, FuseOptions) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("hub");
    std::fs::create_dir_all(&root).unwrap();
    let options = FuseOptions::from_env()
        .with_cache_root(&root)
        .with_endpoint(endpoint)
        .with_offline(false);
    (dir, root, options)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn tensors(list: &[(&str, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = list.iter().map(|(_, _, v)| f32_bytes(v)).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = list
        .iter()
        .zip(&bytes)
        .map(|((k, s, _), b)| {
            (
                k.to_string(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

fn codec(dir: &std::path::Path, scale: f32) -> AdapterCodec {
    std::fs::create_dir_all(dir).unwrap();
    let bytes = tensors(&[
        (&format!("{MODULE}.lora_a"), vec![4, 2], vec![0.5; 8]),
        (&format!("{MODULE}.lora_b"), vec![2, 3], vec![0.25; 6]),
    ]);
    std::fs::write(dir.join("adapters.safetensors"), bytes).unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        format!(r#"{{"lora_parameters": {{"rank": 2, "scale": {scale}}}}}"#),
    )
    .unwrap();
    let codec = AdapterCodec::new(dir.join("a.zst"), dir.join("adapter_config.json"));
    codec.encode(dir.join("adapters.safetensors")).unwrap();
    codec
}

#[test]
fn base_is_downloaded_once_then_used_offline() {
    let weights = tensors(&[(&format!("{MODULE}.weight"), vec![3, 4], vec![1.0; 12])]);
    let files: HashMap<String, Vec<u8>> = [
        (
            "config.json".to_owned(),
            br#"{"model_type": "llama"}"#.to_vec(),
        ),
        ("model.safetensors".to_owned(), weights),
        ("tokenizer.json".to_owned(), b"{}".to_vec()),
        ("pytorch_model.bin".to_owned(), b"not needed".to_vec()),
    ]
    .into_iter()
    .collect();
    let weights_len = files["model.safetensors"].len() as u64;
    let (endpoint, hits) = serve(files);
    let (dir, root, options) = hub_at(&endpoint);

    let mut bytes: HashMap<String, (u64, u64)> = HashMap::new();
    let fused = Fuse::new(REPO, &codec(&dir.path().join("a1"), 1.0), "org--fused")
        .options(&options)
        .progress(|event| {
            if let adapter_fuse::FuseProgress::Downloaded { file, done, total } = event {
                bytes.insert(file, (done, total));
            }
        })
        .run()
        .unwrap();
    assert!(hits.load(Ordering::SeqCst) > 0, "nothing was downloaded");
    assert_eq!(
        bytes.get("model.safetensors"),
        Some(&(weights_len, weights_len)),
        "byte progress reaches the file's size"
    );
    let base = root.join("models--org--remote-base");
    assert_eq!(
        std::fs::read_to_string(base.join("refs/main"))
            .unwrap()
            .trim(),
        SHA
    );
    let snapshot = base.join("snapshots").join(SHA);
    assert!(
        snapshot.join("model.safetensors").is_file() && snapshot.join("tokenizer.json").is_file()
    );
    assert!(
        !snapshot.join("pytorch_model.bin").exists(),
        "only loader files are fetched"
    );
    // W = 1 everywhere; delta = scale · Bᵀ @ Aᵀ = 1 · (rank 2 × 0.25 × 0.5) = 0.25.
    let out = st_mmap::SafetensorsFile::open(fused.join("model.safetensors")).unwrap();
    let w = out.tensor(&format!("{MODULE}.weight")).unwrap();
    assert!(w
        .data
        .chunks_exact(4)
        .all(|c| f32::from_le_bytes(c.try_into().unwrap()) == 1.25));

    // A second adapter: the base comes from the cache, with the hub forbidden.
    let offline = options.with_offline(true);
    let before = hits.load(Ordering::SeqCst);
    Fuse::new(REPO, &codec(&dir.path().join("a2"), 3.0), "org--fused")
        .options(&offline)
        .run()
        .unwrap();
    assert_eq!(
        hits.load(Ordering::SeqCst),
        before,
        "offline must not touch the network"
    );
}

#[test]
fn unknown_repo_is_a_download_error() {
    let (endpoint, _) = serve(HashMap::new());
    let (dir, _root, options) = hub_at(&endpoint);
    let err = Fuse::new(
        "org/missing",
        &codec(&dir.path().join("a"), 1.0),
        "org--fused",
    )
    .options(&options)
    .run()
    .unwrap_err();
    assert!(
        matches!(&err, Error::Download { repo, .. } if repo == "org/missing"),
        "{err}"
    );
}

#[test]
fn interrupted_download_is_an_error_then_resumes() {
    let values: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let weights = tensors(&[
        (&format!("{MODULE}.weight"), vec![3, 4], vec![1.0; 12]),
        ("model.embed.weight", vec![256], values.clone()),
    ]);
    let half = weights.len() / 2;
    let files: HashMap<String, Vec<u8>> = [
        (
            "config.json".to_owned(),
            br#"{"model_type": "llama"}"#.to_vec(),
        ),
        ("model.safetensors".to_owned(), weights.clone()),
    ]
    .into_iter()
    .collect();
    let (endpoint, _) = serve_cutting(files, Some(Fault::Cut("model.safetensors", half)));
    let (dir, root, options) = hub_at(&endpoint);
    let codec = codec(&dir.path().join("a"), 1.0);

    let err = Fuse::new(REPO, &codec, "org--fused")
        .options(&options)
        .run()
        .unwrap_err();
    assert!(
        matches!(&err, Error::Download { repo, .. } if repo == REPO),
        "{err}"
    );
    // Nothing that looks like a result: no fused entry, no base snapshot
    // with the weights, no fuse folder left behind.
    let names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names
            .iter()
            .any(|n| n.starts_with("models--org--fused") || n.starts_with(".fuse-")),
        "{names:?}"
    );
    let snapshot = root.join("models--org--remote-base/snapshots").join(SHA);
    assert!(!snapshot.join("model.safetensors").exists());

    // The hub answers in full now: the next call completes the download
    // (hf-hub resumes from its partial file) and fuses the whole weights.
    let fused = Fuse::new(REPO, &codec, "org--fused")
        .options(&options)
        .run()
        .unwrap();
    assert_eq!(
        std::fs::read(snapshot.join("model.safetensors")).unwrap(),
        weights
    );
    let out = st_mmap::SafetensorsFile::open(fused.join("model.safetensors")).unwrap();
    let embed = out.tensor("model.embed.weight").unwrap();
    let got: Vec<f32> = embed
        .data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got, values);
}

/// A listener that accepts connections and never answers: a hub that is
/// up but stuck.
fn silent_hub() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().take(20) {
            held.push(stream);
        }
    });
    endpoint
}

/// `options.ensure_fused` must fail with `Stalled` naming `file`, well
/// within a bound of its stall timeout.
fn assert_stalls(options: &FuseOptions, codec: &AdapterCodec, file: &str) {
    let start = std::time::Instant::now();
    let err = Fuse::new(REPO, codec, "org--fused")
        .options(options)
        .run()
        .unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(&err, Error::Stalled { repo, file: f, .. } if repo == REPO && f == file),
        "{err}"
    );
    assert!(err.to_string().contains(file), "{err}");
    assert!(took < std::time::Duration::from_secs(20), "took {took:?}");
}

#[test]
fn a_hub_that_accepts_and_says_nothing_is_a_stall_error() {
    let endpoint = silent_hub();
    let (dir, root, options) = hub_at(&endpoint);
    let options = options.with_stall_timeout(std::time::Duration::from_millis(500));
    let codec = codec(&dir.path().join("a"), 1.0);
    assert_stalls(&options, &codec, "repo info");
    let names: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        !names
            .iter()
            .any(|n| n.to_string_lossy().starts_with("models--org--fused")),
        "{names:?}"
    );
}

#[test]
fn a_download_that_stops_mid_body_is_a_stall_error_then_resumes() {
    let weights = tensors(&[
        (&format!("{MODULE}.weight"), vec![3, 4], vec![1.0; 12]),
        ("model.embed.weight", vec![4096], vec![0.5; 4096]),
    ]);
    let files: HashMap<String, Vec<u8>> = [
        (
            "config.json".to_owned(),
            br#"{"model_type": "llama"}"#.to_vec(),
        ),
        ("model.safetensors".to_owned(), weights.clone()),
    ]
    .into_iter()
    .collect();
    let (endpoint, _) = serve_cutting(files, Some(Fault::Stall("model.safetensors", 1000)));
    let (dir, root, options) = hub_at(&endpoint);
    let options = options.with_stall_timeout(std::time::Duration::from_millis(800));
    let codec = codec(&dir.path().join("a"), 1.0);
    assert_stalls(&options, &codec, "model.safetensors");

    // The next call finds the hub healthy and the same cache: hf-hub waits
    // (up to 5 s, so this call allows more than a second of silence) for
    // the abandoned reader to let go of the file when the hub closes that
    // connection, resumes the download and the fuse completes.
    let fused = Fuse::new(REPO, &codec, "org--fused")
        .options(&options.with_stall_timeout(std::time::Duration::from_secs(10)))
        .run()
        .unwrap();
    let snapshot = root.join("models--org--remote-base/snapshots").join(SHA);
    assert_eq!(
        std::fs::read(snapshot.join("model.safetensors")).unwrap(),
        weights
    );
    assert!(fused.join("model.safetensors").is_file());
}

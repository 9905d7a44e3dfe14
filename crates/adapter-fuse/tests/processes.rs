//! ensure_fused across processes: concurrent callers, a lock left by a
//! killed process, and processes killed at each step of a fuse.

mod common;

use std::collections::HashMap;
use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use adapter_codec::AdapterCodec;
use common::*;

/// The `fuse_child` example (built by `cargo test` beside this test), in
/// the same profile folder as this test binary.
fn child_program() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/{profile}/deps/processes-HASH -> target/{profile}/examples/
    let profile = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = profile
        .join("examples")
        .join(format!("fuse_child{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "{} is missing: `cargo test` builds it (cargo build --examples -p adapter-fuse)",
        path.display()
    );
    path
}

/// A child process fusing `s`'s adapter into `s`'s cache.
fn child_fuse(s: &Setup) -> Command {
    let mut child = Command::new(child_program());
    child
        .arg("fuse")
        .arg(&s.root)
        .arg(&s.adapter_dir)
        .args([REPO, NS]);
    child
}

#[test]
fn concurrent_processes_fuse_once_and_share_the_result() {
    let s = setup();
    dense_base(&s.root);
    adapter(&s.adapter_dir, CONFIG);
    let spawn = || child_fuse(&s).output().unwrap();
    let (first, second) = std::thread::scope(|scope| {
        let a = scope.spawn(spawn);
        let b = scope.spawn(spawn);
        (a.join().unwrap(), b.join().unwrap())
    });
    let report = |o: &std::process::Output| {
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "{text}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let field = |name: &str| {
            let line = text
                .lines()
                .find_map(|l| l.split_once(name).map(|(_, rest)| rest));
            line.unwrap_or_else(|| panic!("no {name} line in the child's output:\n{text}"))
                .trim()
                .to_owned()
        };
        (field("PATH "), field("PUBLISHED "))
    };
    let (p1, pub1) = report(&first);
    let (p2, pub2) = report(&second);
    assert_eq!(p1, p2);
    let published: HashMap<&str, usize> =
        [pub1.as_str(), pub2.as_str()]
            .iter()
            .fold(HashMap::new(), |mut m, p| {
                *m.entry(*p).or_default() += 1;
                m
            });
    assert_eq!(
        published.get("true"),
        Some(&1),
        "exactly one process fuses: {pub1} {pub2}"
    );
}

#[test]
fn a_lock_left_by_a_killed_process_does_not_block() {
    use std::io::BufRead;
    let s = setup();
    dense_base(&s.root);
    let (codec, _, _) = adapter(&s.adapter_dir, CONFIG);
    let digest = codec.digest().unwrap();
    let lock = s
        .root
        .join(".locks")
        .join(format!("models--{NS}-{digest}.lock"));
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    std::fs::write(&lock, b"").unwrap();
    let mut holder = Command::new(child_program())
        .arg("hold-lock")
        .arg(&lock)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = holder.stdout.take().unwrap();
    let locked = std::io::BufReader::new(stdout)
        .lines()
        .any(|l| l.unwrap().contains("LOCKED"));
    assert!(locked, "the holder never took the lock");
    // The holder dies without releasing anything itself.
    holder.kill().unwrap();
    holder.wait().unwrap();
    let path = adapter_fuse::Fuse::new(REPO, &codec, NS)
        .options(&s.options)
        .run()
        .unwrap();
    assert!(path.join("model.safetensors").is_file());
}

/// Four adapted modules (layers 0 to 3), so that a fuse has several steps.
fn four_module_base_and_adapter(s: &Setup) -> AdapterCodec {
    let module = |l: usize| format!("model.layers.{l}.self_attn.q_proj");
    let mut base = Vec::new();
    let mut lora = Vec::new();
    for l in 0..4 {
        let seed = l as u32 * 10;
        base.push((
            format!("{}.weight", module(l)),
            vec![OUT, IN],
            values(seed, OUT * IN, 1.0),
        ));
        lora.push((
            format!("{}.lora_a", module(l)),
            vec![IN, RANK],
            values(seed + 1, IN * RANK, 0.5),
        ));
        lora.push((
            format!("{}.lora_b", module(l)),
            vec![RANK, OUT],
            values(seed + 2, RANK * OUT, 0.5),
        ));
    }
    let bytes = |list: &[(String, Vec<usize>, Vec<f32>)]| {
        let list: Vec<_> = list
            .iter()
            .map(|(k, shape, v)| {
                (
                    k.as_str(),
                    safetensors::Dtype::F32,
                    shape.clone(),
                    f32_bytes(v),
                )
            })
            .collect();
        safetensors_bytes(&list)
    };
    put_in_hub_cache(
        &s.root,
        REPO,
        &[
            ("config.json", br#"{"model_type": "llama"}"#.to_vec()),
            ("model.safetensors", bytes(&base)),
        ],
    );
    encode_adapter(&s.adapter_dir, bytes(&lora), CONFIG)
}

/// Kills a fusing process right after each of its progress events (and once
/// before any), each time in a fresh cache; every time, the killed process
/// leaves no entry, and the next call builds one equal to an uninterrupted
/// fuse's.
#[test]
fn a_process_killed_at_any_step_leaves_no_entry_and_the_next_call_fuses() {
    let clean = {
        let s = setup();
        let codec = four_module_base_and_adapter(&s);
        std::fs::read(
            adapter_fuse::Fuse::new(REPO, &codec, NS)
                .options(&s.options)
                .run()
                .unwrap()
                .join("model.safetensors"),
        )
        .unwrap()
    };
    // Events: Fusing 1/4 .. 4/4, then Published; killing after Published
    // kills a process that has finished its work.
    for kill_after in 0..=4 {
        let s = setup();
        let codec = four_module_base_and_adapter(&s);
        let mut child = child_fuse(&s)
            .arg(kill_after.max(1).to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut seen = Vec::new();
        if kill_after > 0 {
            let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
            for line in lines {
                let line = line.unwrap();
                if let Some(event) = line.strip_prefix("EVENT ") {
                    seen.push(event.to_owned());
                    if seen.len() == kill_after {
                        break;
                    }
                }
            }
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(seen.len(), kill_after, "events before the kill: {seen:?}");
        if let Some(last) = seen.last() {
            assert_eq!(last, &format!("Fusing {{ done: {kill_after}, total: 4 }}"));
        }
        let entry = s
            .root
            .join(format!("models--{NS}-{}", codec.digest().unwrap()));
        assert!(
            !entry.join("refs/main").exists(),
            "killed after {kill_after} events, yet an entry is complete"
        );
        let path = adapter_fuse::Fuse::new(REPO, &codec, NS)
            .options(&s.options)
            .run()
            .unwrap();
        let fused = std::fs::read(path.join("model.safetensors")).unwrap();
        assert!(
            fused == clean,
            "killed after {kill_after} events: the retry differs"
        );
        let leftovers: Vec<_> = std::fs::read_dir(&s.root)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".fuse-"))
            .collect();
        assert!(
            leftovers.is_empty(),
            "killed after {kill_after} events: {leftovers:?}"
        );
    }
}

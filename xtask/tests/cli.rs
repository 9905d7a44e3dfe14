//! The xtask commands as a user runs them: help, paths relative to the
//! directory the command is started in, errors that say each cause once.

use std::path::Path;
use std::process::{Command, Output};

fn xtask(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("running xtask")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A one-tensor F32 adapter file.
fn adapter_bytes() -> Vec<u8> {
    let json = br#"{"m.lora_a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}"#;
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json);
    bytes.extend((0u8..32).collect::<Vec<_>>());
    bytes
}

#[test]
fn every_command_has_help() {
    let dir = tempfile::tempdir().unwrap();
    let out = xtask(dir.path(), &["--help"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for command in [
        "demo",
        "test",
        "bench",
        "encode-adapter",
        "decode-adapter",
        "adapter-info",
    ] {
        assert!(
            text(&out.stdout).contains(command),
            "{command} missing from --help"
        );
    }
    let out = xtask(dir.path(), &["encode-adapter", "--help"]);
    assert!(out.status.success());
    assert!(text(&out.stdout).contains("--level"));
    let out = xtask(dir.path(), &["encode-adapter", "--level", "many", "x"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("invalid value 'many'"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn relative_paths_are_the_callers() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.safetensors"), adapter_bytes()).unwrap();
    let out = xtask(
        dir.path(),
        &["encode-adapter", "a.safetensors", "--level", "3"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(dir.path().join("a.safetensors.zst").is_file());
    let out = xtask(
        dir.path(),
        &["decode-adapter", "a.safetensors.zst", "back.safetensors"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        std::fs::read(dir.path().join("back.safetensors")).unwrap(),
        adapter_bytes()
    );
    let out = xtask(dir.path(), &["adapter-info", "a.safetensors.zst"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("digest"));
}

#[test]
fn errors_say_each_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    // A header that is not JSON: the codec's error wraps the header's.
    let mut bad = 7u64.to_le_bytes().to_vec();
    bad.extend_from_slice(b"{nope!}");
    std::fs::write(dir.path().join("bad.safetensors"), bad).unwrap();
    let out = xtask(dir.path(), &["encode-adapter", "bad.safetensors"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("bad.safetensors"), "{err}");
    assert_eq!(err.matches("not valid JSON").count(), 1, "{err}");
    assert_eq!(err.matches("bad.safetensors:").count(), 1, "{err}");
    let out = xtask(dir.path(), &["adapter-info", "missing.zst"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert_eq!(err.matches("missing.zst").count(), 1, "{err}");
    assert!(err.contains(&dir.path().display().to_string()), "{err}");
}

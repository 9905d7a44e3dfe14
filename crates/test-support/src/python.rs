//! The interop Python the reference checks run in.

use std::process::Command;

/// The interop Python if it imports mlx_lm; otherwise `None`, said on
/// stderr as `test`'s reason to skip.
pub fn mlx_lm_python(test: &str) -> Option<String> {
    python_with(test, "mlx_lm")
}

/// The interop Python (`MLX_LOWMEM_PYTHON`, else `python3`) if it imports
/// `modules` (comma-separated, as an `import` statement takes them);
/// otherwise `None`, said on stderr as `test`'s reason to skip.
pub fn python_with(test: &str, modules: &str) -> Option<String> {
    let python = std::env::var("MLX_LOWMEM_PYTHON").unwrap_or_else(|_| "python3".into());
    imports(test, python, modules)
}

/// `python` if it imports `modules`; otherwise `None`, said on stderr as
/// `test`'s reason to skip.
fn imports(test: &str, python: String, modules: &str) -> Option<String> {
    let has = Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        eprintln!("SKIP {test}: {python} lacks {modules} (cargo xtask test provides it)");
    }
    has.then_some(python)
}

/// The Python 3.13 of the Python face (`MLX_LOWMEM_FACE_PYTHON`: spawnllm,
/// the `openai` package, cc-sentiment) if it imports `modules`; otherwise
/// `None`, said on stderr as `test`'s reason to skip.
pub fn face_python_with(test: &str, modules: &str) -> Option<String> {
    let Some(python) = std::env::var_os("MLX_LOWMEM_FACE_PYTHON") else {
        eprintln!("SKIP {test}: MLX_LOWMEM_FACE_PYTHON is not set (cargo xtask test sets it)");
        return None;
    };
    imports(test, python.to_string_lossy().into_owned(), modules)
}

/// Runs the reference script `script` under `python` with `args` and
/// returns what it printed, parsed as JSON. A script that fails panics
/// with its stderr: the reference could not answer.
pub fn run_json<T: serde::de::DeserializeOwned>(
    python: &str,
    script: &std::path::Path,
    args: &[&std::ffi::OsStr],
) -> T {
    let out = Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

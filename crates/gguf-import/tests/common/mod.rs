//! The interop Python the reference checks run with.

#![allow(dead_code)]

use std::process::Command;

/// The interop Python, or `None`, said on stderr, when it lacks mlx_lm.
pub fn mlx_lm_python(test: &str) -> Option<String> {
    python_with(test, "mlx_lm")
}

/// The interop Python (`MLX_LOWMEM_PYTHON`, else `python3`) if it imports
/// `modules` (comma-separated); otherwise says why `test` skips.
pub fn python_with(test: &str, modules: &str) -> Option<String> {
    let python = std::env::var("MLX_LOWMEM_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has {
        eprintln!("SKIP {test}: {python} lacks {modules} (cargo xtask test provides it)");
    }
    has.then_some(python)
}

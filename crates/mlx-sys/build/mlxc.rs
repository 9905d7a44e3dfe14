//! Locating mlx-c, compiling it, and generating the bindings.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::plan::Platform;

/// The mlx-c sources ship only inside the registry crate `mlx-sys` 0.7.0. We
/// read them from cargo's registry at build time (never copying them into the
/// repository): first where cargo unpacks crates, else by asking
/// `cargo metadata` about a throwaway manifest that depends on it, which also
/// downloads it when missing.
pub fn locate_registry_copy(out_dir: &Path) -> Result<PathBuf, String> {
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    if let Some(home) = &cargo_home {
        if let Ok(registries) = fs::read_dir(home.join("registry/src")) {
            let mut found: Vec<PathBuf> = registries
                .flatten()
                .map(|r| r.path().join("mlx-sys-0.7.0/src/mlx-c"))
                .filter(|p| p.join("mlx/c/mlx.h").is_file())
                .collect();
            found.sort();
            if let Some(dir) = found.into_iter().next() {
                return Ok(dir);
            }
        }
    }
    locate_with_cargo_metadata(out_dir)
}

fn locate_with_cargo_metadata(out_dir: &Path) -> Result<PathBuf, String> {
    let probe = out_dir.join("locate-mlx-c");
    fs::create_dir_all(probe.join("src")).map_err(|e| e.to_string())?;
    // `[workspace]` keeps this manifest out of the project's own workspace.
    fs::write(
        probe.join("Cargo.toml"),
        "[package]\nname = \"locate-mlx-c\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
         [dependencies]\nmlx-sys = { version = \"=0.7.0\", default-features = false }\n\
         [workspace]\n",
    )
    .map_err(|e| e.to_string())?;
    fs::write(probe.join("src/lib.rs"), "").map_err(|e| e.to_string())?;

    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut last_error = String::new();
    for offline in [true, false] {
        let mut command = Command::new(&cargo);
        command
            .args(["metadata", "--format-version", "1", "--manifest-path"])
            .arg(probe.join("Cargo.toml"));
        if offline {
            command.arg("--offline");
        }
        let output = command
            .output()
            .map_err(|e| format!("running cargo metadata: {e}"))?;
        if !output.status.success() {
            last_error = String::from_utf8_lossy(&output.stderr).into_owned();
            continue;
        }
        let metadata: serde_json::Value =
            serde_json::from_slice(&output.stdout).map_err(|e| e.to_string())?;
        let manifest = metadata["packages"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == "mlx-sys" && p["version"] == "0.7.0")
            .and_then(|p| p["manifest_path"].as_str());
        if let Some(manifest) = manifest {
            let dir = Path::new(manifest).with_file_name("src").join("mlx-c");
            if dir.join("mlx/c/mlx.h").is_file() {
                return Ok(dir);
            }
        }
    }
    Err(format!(
        "could not find the mlx-c sources of the registry crate mlx-sys 0.7.0 \
         (cargo metadata said: {}). Set MLX_C_DIR to a folder that holds mlx/c/mlx.h",
        last_error.trim()
    ))
}

pub fn check_layout(mlx_c_dir: &Path) -> Result<(), String> {
    if mlx_c_dir.join("mlx/c/mlx.h").is_file() {
        Ok(())
    } else {
        Err(format!(
            "{} does not look like mlx-c: mlx/c/mlx.h is missing",
            mlx_c_dir.display()
        ))
    }
}

fn files_with_extension(dir: &Path, extension: &str) -> Result<Vec<PathBuf>, String> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|e| format!("reading {}: {e}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == extension))
        .collect();
    files.sort();
    Ok(files)
}

/// Compiles every `mlx/c/*.cpp` as one translation unit: each file re-parses
/// MLX's large headers, so one unit builds several times faster than ~26.
pub fn compile(
    mlx_c_dir: &Path,
    mlx_include: &Path,
    out_dir: &Path,
    platform: Platform,
) -> Result<(), String> {
    let sources = files_with_extension(&mlx_c_dir.join("mlx/c"), "cpp")?;
    let unit: String = sources
        .iter()
        .map(|s| format!("#include \"{}\"\n", s.display()))
        .collect();
    let unit_path = out_dir.join("mlxc_all.cpp");
    fs::write(&unit_path, unit).map_err(|e| e.to_string())?;
    for source in &sources {
        println!("cargo:rerun-if-changed={}", source.display());
    }

    let shim =
        Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap_or_default()).join("build/format_shim.h");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .file(&unit_path)
        .include(mlx_c_dir)
        .include(mlx_include)
        .flag("-include")
        .flag(shim.to_string_lossy().as_ref())
        .debug(false)
        .pic(true)
        .warnings(false)
        .cargo_metadata(true)
        // cc would also emit a link line for its own idea of the C++ stdlib;
        // plan.rs decides that instead.
        .cpp_link_stdlib(None);
    if platform == Platform::MacosAarch64 {
        build.flag("-mmacosx-version-min=14.0");
    }
    build.try_compile("mlxc").map_err(|e| {
        if !has_cxx(&build) {
            format!(
                "no C++ compiler: mlx-c is C++20 and is compiled here. Install one: \
                 `sudo apt-get install g++` (Debian/Ubuntu), `xcode-select --install` (macOS); \
                 or set CXX ({e})"
            )
        } else {
            format!("compiling mlx-c: {e}")
        }
    })
}

/// Whether the C++ compiler `build` would run starts at all.
fn has_cxx(build: &cc::Build) -> bool {
    build.try_get_compiler().is_ok_and(|c| {
        c.to_command()
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Generates bindings for every public mlx-c header, configured like upstream
/// mlx-sys so that mlx-rs sees the same items.
pub fn generate_bindings(mlx_c_dir: &Path, out_dir: &Path) -> Result<(), String> {
    let headers = files_with_extension(&mlx_c_dir.join("mlx/c"), "h")?;
    let mut builder = bindgen::Builder::default()
        .rust_target(
            "1.73.0"
                .parse()
                .map_err(|e| format!("bindgen rust target: {e}"))?,
        )
        .clang_arg(format!("-I{}", mlx_c_dir.display()))
        .blocklist_function("malloc")
        .blocklist_function("realloc")
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for header in &headers {
        builder = builder.header(header.to_string_lossy());
    }
    let no_libclang = "bindgen needs libclang to read mlx-c's headers. Install it: \
        `sudo apt-get install libclang-dev` (Debian/Ubuntu), `xcode-select --install` (macOS); \
        or set LIBCLANG_PATH to the folder holding libclang";
    // bindgen panics, with a backtrace, when it cannot load libclang: that
    // is the one message a user needs here, so it becomes this error.
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    // The builder is moved in and nothing it touched is looked at after a
    // panic, so no broken state can be observed.
    let generated =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || builder.generate()));
    std::panic::set_hook(quiet);
    let bindings = match generated {
        Ok(Ok(bindings)) => bindings,
        Ok(Err(e)) => return Err(format!("generating bindings: {e}. {no_libclang}")),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("bindgen panicked");
            return Err(format!(
                "{no_libclang} ({})",
                what.lines().next().unwrap_or(what)
            ));
        }
    };
    bindings
        .write_to_file(out_dir.join("bindings.rs"))
        .map_err(|e| format!("writing bindings: {e}"))
}

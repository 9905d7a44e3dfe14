//! Repository tidiness: every crate's `lib.rs` opens with a `//!` doc, and no
//! Rust source file grows past 800 lines.

use std::fs;
use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | "corpus" | "artifacts") {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_crate_lib_starts_with_a_crate_doc() {
    let crates = workspace_root().join("crates");
    let mut checked = 0;
    for entry in fs::read_dir(&crates).expect("crates/ exists").flatten() {
        let lib = entry.path().join("src/lib.rs");
        if lib.exists() {
            let text = fs::read_to_string(&lib).unwrap();
            assert!(
                text.starts_with("//!"),
                "{} must start with a //! crate doc",
                lib.display()
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 6,
        "expected at least six crates, found {checked}"
    );
}

#[test]
fn no_source_file_is_over_800_lines() {
    let mut files = Vec::new();
    rust_files(&workspace_root(), &mut files);
    assert!(files.len() > 10, "found only {} Rust files", files.len());
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = fs::read_to_string(f).ok()?.lines().count();
            (lines > 800).then(|| format!("{} ({lines} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "split these files: {long:?}");
}

/// Library sources stay under the house style's ~600 lines.
#[test]
fn no_library_source_file_is_over_600_lines() {
    let mut files = Vec::new();
    for entry in fs::read_dir(workspace_root().join("crates"))
        .unwrap()
        .flatten()
    {
        rust_files(&entry.path().join("src"), &mut files);
    }
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = fs::read_to_string(f).ok()?.lines().count();
            (lines > 600).then(|| format!("{} ({lines} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "split these files by concern: {long:?}");
}

/// Code one crate's tests share with another's is a crate
/// (`crates/test-support`, a dev-dependency), not a file included by a
/// path that climbs out of the crate.
#[test]
fn no_file_is_included_from_another_crate() {
    let mut files = Vec::new();
    rust_files(&workspace_root(), &mut files);
    let climbing: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let text = fs::read_to_string(f).ok()?;
            let hit = text
                .lines()
                .any(|l| l.trim_start().starts_with("#[path") && l.contains("\"../../"));
            hit.then(|| f.display().to_string())
        })
        .collect();
    assert!(
        climbing.is_empty(),
        "these include files of other crates with #[path]; use test-support instead: {climbing:?}"
    );
}

/// One dependency between workspace crates: (crate, dependency, dev?).
type Edge = (String, String, bool);

/// The edges `cargo metadata` reports between workspace crates.
fn manifest_edges() -> std::collections::BTreeSet<Edge> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(workspace_root())
        .output()
        .expect("running cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let packages = metadata["packages"].as_array().unwrap();
    let members: std::collections::BTreeSet<&str> =
        packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut edges = std::collections::BTreeSet::new();
    for package in packages {
        let from = package["name"].as_str().unwrap();
        for dep in package["dependencies"].as_array().unwrap() {
            let to = dep["name"].as_str().unwrap();
            if members.contains(to) {
                let dev = dep["kind"].as_str() == Some("dev");
                edges.insert((from.to_owned(), to.to_owned(), dev));
            }
        }
    }
    edges
}

/// The edges docs/ARCHITECTURE.md's `crate-graph` block lists.
fn documented_edges() -> std::collections::BTreeSet<Edge> {
    let doc = fs::read_to_string(workspace_root().join("docs/ARCHITECTURE.md")).unwrap();
    let block = doc
        .split("```text crate-graph\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/ARCHITECTURE.md has a ```text crate-graph block");
    block
        .lines()
        .filter_map(|line| line.split_once(" -> "))
        .map(|(from, to)| {
            let (to, dev) = match to.strip_suffix(" (dev)") {
                Some(to) => (to, true),
                None => (to, false),
            };
            (from.trim().to_owned(), to.trim().to_owned(), dev)
        })
        .collect()
}

#[test]
fn the_crate_graph_is_the_documented_one() {
    let actual = manifest_edges();
    let documented = documented_edges();
    assert!(actual.len() > 10, "found only {} edges", actual.len());
    let undocumented: Vec<_> = actual.difference(&documented).collect();
    let gone: Vec<_> = documented.difference(&actual).collect();
    assert!(
        undocumented.is_empty() && gone.is_empty(),
        "docs/ARCHITECTURE.md's crate graph and the manifests disagree.\n\
         in the manifests only (document them, or remove the dependency): {undocumented:?}\n\
         in the document only (remove them from the list): {gone:?}"
    );
}

#[test]
fn libraries_depend_only_on_libraries_below_them() {
    const ORDER: [&str; 8] = [
        "st-mmap",
        "cpu-kernels",
        "mlx-support",
        "block-stream",
        "adapter-codec",
        "adapter-fuse",
        "mlx-engine",
        "gguf-import",
    ];
    let rank = |name: &str| ORDER.iter().position(|c| *c == name);
    let mut checked = 0;
    for (from, to, dev) in manifest_edges() {
        if let (Some(a), Some(b), false) = (rank(&from), rank(&to), dev) {
            assert!(
                b < a,
                "{from} depends on {to}, which comes after it in the layering"
            );
            checked += 1;
        }
    }
    assert!(checked >= 6, "checked only {checked} library edges");
}

/// The module a source file is, as a path under its crate (`""` for the
/// crate root; `None` for binaries, examples and tests).
fn module_of(src: &Path, file: &Path) -> Option<Vec<String>> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.first().is_some_and(|p| p == "bin") {
        return None;
    }
    let last = parts.pop()?;
    match last.as_str() {
        "lib.rs" | "mod.rs" => {}
        other => parts.push(other.trim_end_matches(".rs").to_owned()),
    }
    Some(parts)
}

/// The `crate::…` paths a file names (`use` lines and inline paths, with
/// one level of `{…}` groups), each as its segments.
fn crate_paths(text: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    for (at, _) in text.match_indices("crate::") {
        // Not part of a longer name (`mlx_crate::`) or a doc link's text.
        if text[..at].ends_with(|c: char| ident(c) || c == '$') {
            continue;
        }
        let rest = &text[at + "crate::".len()..];
        let mut prefix = Vec::new();
        let mut chars = rest;
        loop {
            let end = chars.find(|c: char| !ident(c)).unwrap_or(chars.len());
            if end == 0 {
                break;
            }
            prefix.push(chars[..end].to_owned());
            chars = &chars[end..];
            if let Some(next) = chars.strip_prefix("::") {
                chars = next;
            } else {
                break;
            }
        }
        if let Some(group) = chars.strip_prefix('{') {
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            for item in inner.split(',') {
                let mut path = prefix.clone();
                path.extend(
                    item.trim()
                        .split("::")
                        .map(|s| s.trim().to_owned())
                        .filter(|s| !s.is_empty() && s.chars().all(ident)),
                );
                paths.push(path);
            }
        } else {
            paths.push(prefix);
        }
    }
    paths
}

/// Inside each crate, no module imports one that imports it back (the
/// house style: folders by concept, one direction between them).
#[test]
fn no_module_imports_one_that_imports_it_back() {
    let crates = workspace_root().join("crates");
    let mut circles = Vec::new();
    for entry in fs::read_dir(&crates).expect("crates/ exists").flatten() {
        let src = entry.path().join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let modules: Vec<(Vec<String>, PathBuf)> = files
            .iter()
            .filter_map(|f| Some((module_of(&src, f)?, f.clone())))
            .collect();
        let known: std::collections::BTreeSet<&Vec<String>> =
            modules.iter().map(|(m, _)| m).collect();
        let mut edges = std::collections::BTreeSet::new();
        for (module, file) in &modules {
            for path in crate_paths(&library_code(file)) {
                // The longest prefix of the path that is a module.
                let target = (0..=path.len())
                    .rev()
                    .map(|n| path[..n].to_vec())
                    .find(|p| known.contains(p));
                if let Some(target) = target {
                    if &target != module {
                        edges.insert((module.join("::"), target.join("::")));
                    }
                }
            }
        }
        for (a, b) in &edges {
            if a < b && edges.contains(&(b.clone(), a.clone())) {
                circles.push(format!(
                    "{}: {a} <-> {b}",
                    entry.file_name().to_string_lossy()
                ));
            }
        }
    }
    assert!(
        circles.is_empty(),
        "modules that import each other: {circles:#?}"
    );
}

/// The engine's library code forces MLX's evaluation in one place,
/// `evaluation.rs`, each call with its reason: no `eval()` elsewhere, and
/// no read of an array's elements on the host (which evaluates it too:
/// `as_slice::<T>`, `try_as_slice`, `item`), unit tests, `tests.rs` files
/// and the binaries aside. A read whose element type is inferred
/// (`a.as_slice()`) looks like a `Vec`'s and is not caught: the engine
/// names the type.
#[test]
fn the_engine_evaluates_only_through_its_evaluation_module() {
    let src = workspace_root().join("crates/mlx-engine/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut found = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).unwrap();
        let name = relative.to_string_lossy();
        if name == "evaluation.rs"
            || name.starts_with("bin")
            || name.ends_with("tests.rs")
            || name.starts_with("test_support")
        {
            continue;
        }
        let text = fs::read_to_string(file).unwrap();
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
        for (i, line) in code.lines().enumerate() {
            let line = line.trim_start();
            if line.starts_with("//") {
                continue;
            }
            let reads = [
                "as_slice::<",
                "try_as_slice",
                ".item::<",
                ".item()",
                "item_exact",
            ];
            if line.contains(".eval()")
                || line.contains("transforms::eval")
                || reads.iter().any(|r| line.contains(r))
            {
                found.push(format!("{name}:{}: {line}", i + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "evaluate and read on the host through mlx_engine's evaluation module, with a reason: \
         {found:#?}"
    );
}

/// The crates that need no MLX stay so: they build and test anywhere, in
/// seconds (the file formats, the codec and the CPU kernels).
#[test]
fn the_mlx_free_crates_depend_on_no_mlx() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline"])
        .current_dir(workspace_root())
        .output()
        .expect("running cargo metadata");
    assert!(out.status.success());
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let nodes = metadata["resolve"]["nodes"].as_array().unwrap();
    let name_of = |id: &str| {
        let package = metadata["packages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["id"] == id)
            .unwrap();
        package["name"].as_str().unwrap().to_owned()
    };
    for krate in ["st-mmap", "adapter-codec", "cpu-kernels"] {
        // Every package the crate's normal dependencies reach.
        let start = nodes
            .iter()
            .find(|n| name_of(n["id"].as_str().unwrap()) == krate)
            .unwrap_or_else(|| panic!("{krate} is a workspace member"));
        let mut seen = std::collections::BTreeSet::new();
        let mut todo = vec![start["id"].as_str().unwrap().to_owned()];
        while let Some(id) = todo.pop() {
            if !seen.insert(id.clone()) {
                continue;
            }
            let node = nodes.iter().find(|n| n["id"] == id.as_str()).unwrap();
            for dep in node["deps"].as_array().unwrap() {
                let normal = dep["dep_kinds"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|k| k["kind"].is_null());
                if normal {
                    todo.push(dep["pkg"].as_str().unwrap().to_owned());
                }
            }
        }
        let mlx: Vec<String> = seen
            .iter()
            .map(|id| name_of(id))
            .filter(|n| n.starts_with("mlx"))
            .collect();
        assert!(mlx.is_empty(), "{krate} reaches {mlx:?}");
    }
}

/// The CPU kernels share work out only over the pool their caller owns
/// (`cpu_kernels::Pool`): rayon is named in `pool.rs` alone, so no kernel
/// reaches rayon's global pool.
#[test]
fn the_kernels_use_no_global_pool() {
    let src = workspace_root().join("crates/cpu-kernels/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() >= 4, "found only {} kernel files", files.len());
    let global: Vec<String> = files
        .iter()
        .filter(|f| !f.ends_with("pool.rs") && !f.ends_with("error.rs"))
        .filter(|f| {
            let text = fs::read_to_string(f).unwrap();
            text.lines().any(|l| {
                !l.trim_start().starts_with("//") && (l.contains("rayon") || l.contains("par_iter"))
            })
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        global.is_empty(),
        "use cpu_kernels::Workers, not rayon, in: {global:?}"
    );
}

/// The imports between a crate's top-level folders (a file directly under
/// `src/` is a folder of its own; the crate root, which re-exports, is
/// left out): `(from, to)`, each with a file that makes it.
fn folder_imports(src: &Path) -> std::collections::BTreeMap<(String, String), String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: Vec<(Vec<String>, PathBuf)> = files
        .iter()
        .filter_map(|f| Some((module_of(src, f)?, f.clone())))
        .collect();
    let known: std::collections::BTreeSet<&Vec<String>> = modules.iter().map(|(m, _)| m).collect();
    let mut edges = std::collections::BTreeMap::new();
    for (module, file) in &modules {
        // Unit tests in a file of their own (`tests.rs`) may reach anywhere.
        let Some(from) = module
            .first()
            .filter(|_| module.last().is_some_and(|m| m != "tests"))
        else {
            continue;
        };
        for path in crate_paths(&library_code(file)) {
            let target = (0..=path.len())
                .rev()
                .map(|n| path[..n].to_vec())
                .find(|p| known.contains(p));
            if let Some(to) = target.as_ref().and_then(|t| t.first()) {
                if to != from {
                    let rel = file.strip_prefix(src).unwrap_or(file).display().to_string();
                    edges.entry((from.clone(), to.clone())).or_insert(rel);
                }
            }
        }
    }
    edges
}

/// A file's code without comments (a doc link is not an import) and
/// without its unit tests (which may reach anywhere in the crate).
fn library_code(file: &Path) -> String {
    let text = fs::read_to_string(file).unwrap();
    let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
    code.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// No crate's folders import each other round a circle of any length:
/// each crate's folders form a strict order.
#[test]
fn no_folder_imports_reach_back_round_a_circle() {
    let mut circles = Vec::new();
    for entry in fs::read_dir(workspace_root().join("crates"))
        .unwrap()
        .flatten()
    {
        let edges = folder_imports(&entry.path().join("src"));
        let folders: std::collections::BTreeSet<&String> =
            edges.keys().flat_map(|(a, b)| [a, b]).collect();
        // Depth-first from each folder: a path back to it is a circle.
        for &start in &folders {
            let mut stack = vec![vec![start.clone()]];
            let mut seen = std::collections::BTreeSet::new();
            while let Some(path) = stack.pop() {
                let last = path.last().unwrap();
                for ((from, to), _) in edges.range((last.clone(), String::new())..) {
                    if from != last {
                        break;
                    }
                    if to == start {
                        let hops: Vec<String> = path
                            .windows(2)
                            .chain(std::iter::once(&[last.clone(), to.clone()][..]))
                            .map(|w| {
                                format!(
                                    "{} -> {} ({})",
                                    w[0],
                                    w[1],
                                    edges[&(w[0].clone(), w[1].clone())]
                                )
                            })
                            .collect();
                        circles.push(format!("{}: {hops:?}", entry.file_name().to_string_lossy()));
                    } else if seen.insert(to.clone()) {
                        let mut longer = path.clone();
                        longer.push(to.clone());
                        stack.push(longer);
                    }
                }
            }
        }
    }
    circles.sort();
    circles.dedup();
    assert!(
        circles.is_empty(),
        "folders that import each other round a circle: {circles:#?}"
    );
}

/// The engine's folders in their order, bottom first: a folder imports only
/// folders before it (docs/ARCHITECTURE.md, "Invariants").
#[test]
fn the_engine_folders_import_only_downwards() {
    const ORDER: [&str; 10] = [
        "error",
        "evaluation",
        "ops",
        "tokenizer",
        "weights",
        "nn",
        "distributed",
        "models",
        "runtime",
        "test_support",
    ];
    let edges = folder_imports(&workspace_root().join("crates/mlx-engine/src"));
    assert!(
        edges.len() > 10,
        "found only {} folder imports",
        edges.len()
    );
    let rank = |f: &str| {
        ORDER
            .iter()
            .position(|o| *o == f)
            .unwrap_or_else(|| panic!("the engine folder {f} is not in the order: place it"))
    };
    let upward: Vec<String> = edges
        .iter()
        .filter(|((from, to), _)| rank(to) >= rank(from))
        .map(|((from, to), file)| format!("{from} -> {to} ({file})"))
        .collect();
    assert!(
        upward.is_empty(),
        "imports that run up the engine's order: {upward:#?}"
    );
}

/// A checkpoint's tensor names belong to its family (`models/llama/`,
/// `models/gemma/`): neutral code asks the family what a tensor is part of
/// (`Family::part_of`), so that a new family's names cannot give a wrong
/// memory default or pipeline split without an error.
#[test]
fn checkpoint_names_live_in_the_families() {
    const NAMES: [&str; 5] = ["embed_tokens", "switch_mlp", "lm_head", "layers", "experts"];
    let src = workspace_root().join("crates/mlx-engine/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut found = Vec::new();
    for file in &files {
        let name = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let family = name.starts_with("models/llama/") || name.starts_with("models/gemma/");
        if family || name.starts_with("bin") || name.ends_with("tests.rs") {
            continue;
        }
        for line in library_code(file).lines() {
            // The parts of the line between quotes: its string literals.
            let literals = line.split('"').skip(1).step_by(2);
            if literals
                .flat_map(|l| l.split('.'))
                .any(|part| NAMES.contains(&part))
            {
                found.push(format!("{name}: {}", line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "tensor names outside their family: {found:#?}"
    );
}

use super::*;

fn dep(name: &str, kind: Option<&str>, req: &str) -> Dependency {
    Dependency {
        name: name.to_owned(),
        req: req.to_owned(),
        kind: kind.map(str::to_owned),
        path: Some(PathBuf::from(format!("/ws/crates/{name}"))),
    }
}

fn pkg(name: &str, version: &str, deps: Vec<Dependency>) -> Package {
    Package {
        name: name.to_owned(),
        version: version.to_owned(),
        manifest_path: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"),
        description: Some(format!("the {name} crate")),
        license: Some("MIT OR Apache-2.0".to_owned()),
        repository: Some("https://example.org/repo".to_owned()),
        readme: None,
        keywords: vec!["mlx".to_owned()],
        categories: vec!["science".to_owned()],
        publish: None,
        dependencies: deps,
    }
}

#[test]
fn crates_come_after_what_they_need_and_dev_dependencies_do_not_order() {
    let mut private = pkg("demo", "0.0.0", vec![dep("top", None, "^0.1.0")]);
    private.publish = Some(vec![]);
    let packages = vec![
        private,
        pkg("top", "0.1.0", vec![dep("mid", None, "^0.1.0")]),
        // A dev-dependency back up the stack is not a cycle.
        pkg("base", "0.1.0", vec![dep("top", Some("dev"), "^0.1.0")]),
        pkg("mid", "0.1.0", vec![dep("base", Some("build"), "^0.1.0")]),
    ];
    assert_eq!(publish_order(&packages).unwrap(), ["base", "mid", "top"]);
}

#[test]
fn a_cycle_is_an_error() {
    let packages = vec![
        pkg("a", "0.1.0", vec![dep("b", None, "^0.1.0")]),
        pkg("b", "0.1.0", vec![dep("a", None, "^0.1.0")]),
    ];
    let err = publish_order(&packages).unwrap_err().to_string();
    assert!(err.contains("cycle"), "{err}");
}

#[test]
fn missing_fields_a_missing_readme_and_bad_keywords_block() {
    let mut p = pkg("x", "0.1.0", vec![]);
    p.description = Some("  ".to_owned());
    p.readme = Some("NO-SUCH-README.md".to_owned());
    p.keywords = ["a", "b", "c", "d", "e", "f"].map(str::to_owned).to_vec();
    p.keywords[0] = "has space".to_owned();
    p.categories.clear();
    let found = check_metadata(&p);
    let blocking: Vec<&str> = found
        .iter()
        .filter(|f| f.blocking)
        .map(|f| f.what.as_str())
        .collect();
    assert_eq!(blocking.len(), 4, "{found:?}");
    assert!(blocking[0].contains("description"));
    assert!(blocking[1].contains("NO-SUCH-README.md does not exist"));
    assert!(blocking[2].contains("6 keywords"));
    assert!(blocking[3].contains("\"has space\""));
    assert!(found
        .iter()
        .any(|f| !f.blocking && f.what.contains("categories")));
}

#[test]
fn complete_metadata_has_no_findings() {
    let mut p = pkg("x", "0.1.0", vec![]);
    p.readme = Some("Cargo.toml".to_owned());
    assert_eq!(check_metadata(&p), vec![]);
}

#[test]
fn a_requirement_the_workspace_version_fails_blocks() {
    let packages = vec![
        pkg("base", "0.2.0", vec![]),
        pkg("top", "0.2.0", vec![dep("base", None, "^0.1.0")]),
    ];
    let found = check_dependencies(&packages[1], &packages);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].blocking);
    assert!(found[0]
        .what
        .contains("requires base ^0.1.0 but the workspace has 0.2.0"));

    let fine = pkg("top", "0.2.0", vec![dep("base", None, "^0.2.0")]);
    assert_eq!(check_dependencies(&fine, &packages), vec![]);
}

#[test]
fn sparse_index_paths_follow_the_registry_layout() {
    // The layout documented for crates.io's index: by name length, then
    // the first two and next two characters.
    assert_eq!(index_path("a"), "1/a");
    assert_eq!(index_path("ab"), "2/ab");
    assert_eq!(index_path("abc"), "3/a/abc");
    assert_eq!(index_path("st-mmap"), "st/-m/st-mmap");
}

const LOG: &str = "# Changelog\n\nIntro.\n\n## [Unreleased]\n\n### Added\n- a thing\n\n## [0.1.0] - 2026-01-02\n\n- first\n";

#[test]
fn the_changelog_needs_a_section_for_the_version() {
    assert_eq!(check_changelog(LOG, "0.1.0"), vec![]);
    let missing = check_changelog(LOG, "0.2.0");
    assert_eq!(missing.len(), 1);
    assert!(missing[0].blocking);
    assert!(missing[0].what.contains("cargo xtask release 0.2.0"));
    let nothing = check_changelog("# Changelog\n\n## [Unreleased]\n\n", "0.2.0");
    assert!(nothing[0].what.contains("nothing under Unreleased"));
    assert!(check_changelog("", "0.1.0")[0].what.contains("missing"));
}

#[test]
fn release_moves_unreleased_under_the_version() {
    let released = release_changelog(LOG, "0.2.0", "2026-11-30").unwrap();
    let expected = "# Changelog\n\nIntro.\n\n## [Unreleased]\n\n## [0.2.0] - 2026-11-30\n\n### Added\n- a thing\n\n## [0.1.0] - 2026-01-02\n\n- first\n";
    assert_eq!(released, expected);
    // Releasing again: nothing is pending, and the version exists.
    assert!(release_changelog(&released, "0.3.0", "2026-12-01").is_err());
    assert!(release_changelog(LOG, "0.1.0", "2026-12-01").is_err());
}

#[test]
fn bump_sets_the_shared_version_and_requirements_but_not_the_stand_in() {
    let manifest = r#"[workspace]
members = ["crates/*"]

[workspace.package]
version = "0.1.0" # shared
edition = "2021"

[workspace.dependencies]
# ours
mlx-sys = { path = "crates/mlx-sys", version = "=0.7.0" }
st-mmap = { path = "crates/st-mmap", version = "0.1.0" }
serde = { version = "1", features = ["derive"] }
"#;
    let bumped = bump_manifest(manifest, "0.2.0").unwrap();
    let expected = r#"[workspace]
members = ["crates/*"]

[workspace.package]
version = "0.2.0" # shared
edition = "2021"

[workspace.dependencies]
# ours
mlx-sys = { path = "crates/mlx-sys", version = "=0.7.0" }
st-mmap = { path = "crates/st-mmap", version = "0.2.0" }
serde = { version = "1", features = ["derive"] }
"#;
    assert_eq!(bumped, expected);
}

#[test]
fn this_workspace_has_complete_metadata_and_a_changelog() {
    // The parts of the dry run that need neither network nor packaging.
    let metadata = metadata().unwrap();
    let version = shared_version(&metadata).unwrap();
    let order = publish_order(&metadata.packages).unwrap();
    assert_eq!(
        order,
        [
            // The MLX-free kernels the engine hands its rows to.
            "cpu-kernels",
            "st-mmap",
            "adapter-codec",
            "gguf-import",
            "mlx-support",
            // adapter-fuse reads its adapter with block-stream's type.
            "block-stream",
            "adapter-fuse",
            "mlx-engine",
            // The server on the engine, published last.
            "mlx-serve"
        ]
        .map(str::to_owned)
    );
    let mut findings = Vec::new();
    for name in &order {
        let p = package(&metadata, name).unwrap();
        findings.extend(check_metadata(p));
        findings.extend(check_dependencies(p, &metadata.packages));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let changelog = std::fs::read_to_string(root.join(CHANGELOG)).unwrap();
    assert!(section(&changelog, UNRELEASED).is_some());
    let blocking: Vec<&Finding> = findings.iter().filter(|f| f.blocking).collect();
    assert!(blocking.is_empty(), "{blocking:#?} (version {version})");
}

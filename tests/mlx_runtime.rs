//! MLX as a runtime on this platform: device policy, memory statistics, and
//! binaries that find libmlx without cargo's help.

use std::process::Command;

use anyhow::Result;
use mlx_rs::{Array, Dtype};
use mlx_support::{
    best_device, current_device, is_available, use_device, ComputeDevice, DeviceError,
};

#[test]
fn device_policy_per_platform() {
    assert!(is_available(ComputeDevice::Cpu));
    if cfg!(target_os = "macos") {
        assert_eq!(
            best_device(),
            ComputeDevice::Gpu,
            "Apple Silicon has a Metal GPU"
        );
    } else {
        assert_eq!(best_device(), ComputeDevice::Cpu);
        assert!(!is_available(ComputeDevice::Gpu));
        match use_device(ComputeDevice::Gpu) {
            Err(DeviceError::Unavailable {
                requested,
                available,
            }) => {
                assert_eq!(requested, ComputeDevice::Gpu);
                assert_eq!(available, vec![ComputeDevice::Cpu]);
            }
            other => panic!("asking for a GPU here must be a typed error, got {other:?}"),
        }
    }
    assert_eq!(use_device(best_device()).unwrap(), best_device());
    assert_eq!(current_device(), best_device());
}

/// MLX's memory counters are process-wide: the check runs in a process of
/// its own, so that tests running beside it cannot move them.
#[test]
fn memory_statistics_follow_allocations() -> Result<()> {
    let output = Command::new(env!("CARGO_BIN_EXE_mlx-memory-probe")).output()?;
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

#[test]
fn the_loaded_mlx_is_the_pinned_release() {
    assert_eq!(mlx_support::mlx_version(), mlx_sys::MLX_VERSION);
}

#[test]
fn arithmetic_runs_in_this_process() -> Result<()> {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
    let b = a.multiply(&a)?.as_dtype(Dtype::Float32)?;
    b.eval()?;
    assert_eq!(b.as_slice::<f32>(), &[1.0, 4.0, 9.0]);
    Ok(())
}

/// A test binary started from an empty environment (no LD_LIBRARY_PATH, no
/// cargo variables) still finds libmlx, through the rpath our build scripts set.
#[test]
fn test_binary_runs_from_a_fresh_environment() -> Result<()> {
    let exe = std::env::current_exe()?;
    let output = Command::new(&exe)
        .env_clear()
        .args([
            "--exact",
            "arithmetic_runs_in_this_process",
            "--test-threads=1",
        ])
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{} failed:\n{stdout}\n{stderr}",
        exe.display()
    );
    assert!(stdout.contains("1 passed"), "unexpected output:\n{stdout}");
    Ok(())
}

/// Runs the BLAS probe with `coretype` (or the environment's choice) and
/// returns the kernels it reports and its checksum.
fn blas_probe(coretype: Option<&str>) -> Result<(String, f32)> {
    let mut probe = Command::new(env!("CARGO_BIN_EXE_blas-probe"));
    match coretype {
        Some(core) => probe.env("OPENBLAS_CORETYPE", core),
        None => probe.env_remove("OPENBLAS_CORETYPE"),
    };
    let out = probe.output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (kernels, sum) = text.trim().split_once(' ').expect("two fields");
    Ok((kernels.to_owned(), sum.parse()?))
}

/// The kernels OpenBLAS runs are visible to the program, and setting
/// `OPENBLAS_CORETYPE` to the best this CPU has (what `cargo xtask` and
/// `reexec_with_best_kernels` do when OpenBLAS falls back to generic ones)
/// selects those kernels, with the same results.
#[test]
fn openblas_kernels_are_reported_and_follow_the_coretype() -> Result<()> {
    let (default, sum) = blas_probe(None)?;
    if mlx_sys::BLAS != "openblas" {
        assert_eq!(default, "none");
        return Ok(());
    }
    assert_ne!(default, "none", "libmlx runs OpenBLAS here");
    let Some(best) = mlx_support::best_coretype() else {
        eprintln!("SKIP the coretype half: this CPU has no kernels beyond the generic ones");
        return Ok(());
    };
    let (chosen, best_sum) = blas_probe(Some(best))?;
    assert!(
        chosen.eq_ignore_ascii_case(best),
        "OPENBLAS_CORETYPE={best} ran {chosen}"
    );
    assert!(
        (sum - best_sum).abs() <= 1e-3 * sum.abs(),
        "{sum} vs {best_sum}"
    );
    Ok(())
}

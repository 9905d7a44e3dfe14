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

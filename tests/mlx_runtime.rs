//! MLX as a runtime on this platform: device policy, memory statistics, and
//! binaries that find libmlx without cargo's help.

use std::process::Command;

use anyhow::Result;
use block_stream::{
    best_device, current_device, is_available, use_device, ComputeDevice, DeviceError,
};
use mlx_rs::{memory, Array, Dtype};

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

#[test]
fn memory_statistics_follow_allocations() -> Result<()> {
    use_device(best_device())?;
    memory::clear_cache()?;
    memory::reset_peak_memory()?;
    let before = memory::active_memory()?;
    let bytes = 64 << 20;
    let big = Array::zeros::<f32>(&[(bytes / 4) as i32])?;
    big.eval()?;
    let during = memory::active_memory()?;
    assert!(
        during >= before + bytes,
        "active {before} -> {during} after a {bytes}-byte array"
    );
    assert!(memory::peak_memory()? >= during);
    drop(big);
    let after = memory::active_memory()?;
    assert!(
        after + bytes <= during,
        "active memory did not drop: {during} -> {after}"
    );
    // Freed buffers go to MLX's cache until it is cleared.
    memory::clear_cache()?;
    assert_eq!(memory::cache_memory()?, 0);
    assert!(
        memory::peak_memory()? >= before + bytes,
        "peak forgets the freed array"
    );
    Ok(())
}

#[test]
fn the_loaded_mlx_is_the_pinned_release() {
    assert_eq!(block_stream::mlx_version(), mlx_sys::MLX_VERSION);
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

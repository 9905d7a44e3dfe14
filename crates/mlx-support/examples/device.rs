//! Prints what MLX computes on here and the process's memory:
//! `cargo run -p mlx-support --example device`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = mlx_support::use_device(mlx_support::best_device())?;
    println!("MLX {} on {device}", mlx_support::mlx_version());
    for d in [
        mlx_support::ComputeDevice::Cpu,
        mlx_support::ComputeDevice::Gpu,
    ] {
        println!(
            "  {d}: {}",
            if mlx_support::is_available(d) {
                "available"
            } else {
                "not available"
            }
        );
    }
    println!("{:?}", mlx_support::ProcessMemory::read());
    Ok(())
}

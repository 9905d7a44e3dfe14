//! Prints what MLX computes on here and the process's memory:
//! `cargo run -p block-stream --example device`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = block_stream::use_device(block_stream::best_device())?;
    println!("MLX {} on {device}", block_stream::mlx_version());
    for d in [
        block_stream::ComputeDevice::Cpu,
        block_stream::ComputeDevice::Gpu,
    ] {
        println!(
            "  {d}: {}",
            if block_stream::is_available(d) {
                "available"
            } else {
                "not available"
            }
        );
    }
    println!("{:?}", block_stream::ProcessMemory::read());
    Ok(())
}

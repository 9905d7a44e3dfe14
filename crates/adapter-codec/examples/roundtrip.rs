//! Compresses an adapter and restores it: `cargo run -p adapter-codec
//! --example roundtrip -- ADAPTER.safetensors`.

use adapter_codec::AdapterCodec;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let src = std::env::args()
        .nth(1)
        .ok_or("usage: roundtrip ADAPTER.safetensors")?;
    let dir = tempfile::tempdir()?;
    let codec = AdapterCodec::new(
        dir.path().join("adapter.zst"),
        dir.path().join("adapter_config.json"),
    );
    let stats = codec.encode(&src)?;
    println!(
        "{} tensors of {}: ratio {:.3}, digest {}",
        stats.tensors,
        stats.dtype,
        stats.ratio(),
        codec.digest()?
    );
    codec.decode(dir.path().join("restored.safetensors"))?;
    let same = std::fs::read(&src)? == std::fs::read(dir.path().join("restored.safetensors"))?;
    println!("restored byte for byte: {same}");
    Ok(())
}

//! Compresses an adapter and restores it:
//! `cargo run -p adapter-codec --example roundtrip [-- ADAPTER.safetensors]`.
//!
//! Without an argument it makes a small rank-8 BF16 adapter of pseudo-random
//! values of LoRA-like magnitude: their low bytes are noise, their high
//! (sign and exponent) bytes repeat, which is what the byte shuffle groups.

use std::path::PathBuf;

use adapter_codec::AdapterCodec;
use safetensors::{serialize_to_file, tensor::TensorView, Dtype};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let src = match std::env::args().nth(1) {
        Some(path) => PathBuf::from(path),
        None => made_up_adapter(&dir.path().join("adapters.safetensors"))?,
    };
    let codec = AdapterCodec::new(
        dir.path().join("adapter.zst"),
        dir.path().join("adapter_config.json"),
    );
    let stats = codec.encode(&src)?;
    println!(
        "{} tensors of {}: {} → {} bytes, ratio {:.3}, digest {}",
        stats.tensors,
        stats.dtype,
        stats.raw_bytes,
        stats.compressed_bytes,
        stats.ratio(),
        codec.digest()?
    );
    codec.decode(dir.path().join("restored.safetensors"))?;
    let same = std::fs::read(&src)? == std::fs::read(dir.path().join("restored.safetensors"))?;
    println!("restored byte for byte: {same}");
    if !same {
        return Err("the restored adapter differs".into());
    }
    Ok(())
}

/// `lora_a` (576, 8) and `lora_b` (8, 576) for four projections, in BF16.
fn made_up_adapter(path: &std::path::Path) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let mut tensors = Vec::new();
    for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
        let module = format!("model.layers.0.self_attn.{proj}");
        for (half, shape) in [("lora_a", vec![576, 8]), ("lora_b", vec![8, 576])] {
            let bytes: Vec<u8> = (0..576 * 8)
                .flat_map(|_| half::bf16::from_f32(0.04 * uniform()).to_le_bytes())
                .collect();
            tensors.push((format!("{module}.{half}"), Dtype::BF16, shape, bytes));
        }
    }
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            Ok((name.clone(), TensorView::new(*dtype, shape.clone(), bytes)?))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    serialize_to_file(views, None, path)?;
    Ok(path.to_path_buf())
}

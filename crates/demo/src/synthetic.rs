//! A synthetic transformer for streaming demos and benchmarks: `blocks`
//! blocks of attention-like and MLP projections plus an embedding table,
//! written as one safetensors file under `transformer.transformer_blocks.`.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use mlx_rs::error::Exception;
use mlx_rs::macros::ModuleParameters;
use mlx_rs::module::Param;
use mlx_rs::{fast, Array};

/// The key prefix of the synthetic model's blocks.
pub const PREFIX: &str = "transformer.transformer_blocks.";

/// Sizes of a synthetic model.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// Number of blocks.
    pub blocks: usize,
    /// Model width.
    pub hidden: usize,
    /// MLP width.
    pub mlp: usize,
    /// Rows of the embedding table (the non-block parameters).
    pub vocab: usize,
}

impl Spec {
    /// 48 blocks of ~50 MB (f32) and a ~100 MB embedding: 2.5 GB.
    pub const BENCH: Spec = Spec {
        blocks: 48,
        hidden: 1024,
        mlp: 4096,
        vocab: 25_000,
    };

    /// 12 blocks of ~12.6 MB and a ~16 MB embedding: 167 MB, for the demo.
    pub const DEMO: Spec = Spec {
        blocks: 12,
        hidden: 512,
        mlp: 2048,
        vocab: 8_000,
    };

    /// The parameters of one block: name and shape.
    pub fn block_params(&self) -> Vec<(&'static str, Vec<usize>)> {
        let (h, m) = (self.hidden, self.mlp);
        vec![
            ("attn.q.weight", vec![h, h]),
            ("attn.o.weight", vec![h, h]),
            ("attn.k.weight", vec![h, h]),
            ("attn.v.weight", vec![h, h]),
            ("mlp.up.weight", vec![m, h]),
            ("mlp.down.weight", vec![h, m]),
            ("norm.weight", vec![h]),
        ]
    }

    /// Bytes of one block (f32).
    pub fn block_bytes(&self) -> u64 {
        self.block_params()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64 * 4)
            .sum()
    }

    /// Bytes of the non-block parameters (f32).
    pub fn other_bytes(&self) -> u64 {
        (self.vocab * self.hidden) as u64 * 4
    }
}

/// Writes the model to `path` (temp file + rename), streaming the values so
/// that generating a multi-gigabyte file needs little memory. Values are
/// small and deterministic so that a forward pass stays finite.
pub fn generate(path: &Path, spec: Spec) -> Result<()> {
    let mut tensors: Vec<(String, Vec<usize>)> = Vec::new();
    for b in 0..spec.blocks {
        for (name, shape) in spec.block_params() {
            tensors.push((format!("{PREFIX}{b}.{name}"), shape));
        }
    }
    tensors.push((
        "transformer.embed.weight".into(),
        vec![spec.vocab, spec.hidden],
    ));
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (key, shape) in &tensors {
        let len = shape.iter().product::<usize>() as u64 * 4;
        header.insert(
            key.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut json = serde_json::Value::Object(header).to_string();
    while !json.len().is_multiple_of(8) {
        json.push(' ');
    }
    let tmp = path.with_extension("partial");
    let mut out = std::io::BufWriter::with_capacity(
        1 << 20,
        std::fs::File::create(&tmp).with_context(|| tmp.display().to_string())?,
    );
    out.write_all(&(json.len() as u64).to_le_bytes())?;
    out.write_all(json.as_bytes())?;
    let mut state = 0x2545f4914f6cdd1du64;
    let mut chunk = Vec::with_capacity(1 << 20);
    for (key, shape) in &tensors {
        let n: usize = shape.iter().product();
        let scale = if key.ends_with("norm.weight") {
            0.0
        } else {
            0.5 / (shape[shape.len() - 1] as f32).sqrt()
        };
        for i in 0..n {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            let value = if scale == 0.0 { 1.0 } else { unit * scale };
            chunk.extend_from_slice(&value.to_le_bytes());
            if chunk.len() >= 1 << 20 || i + 1 == n {
                out.write_all(&chunk)?;
                chunk.clear();
            }
        }
    }
    out.flush()?;
    drop(out);
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The module one synthetic block binds into.
#[derive(Debug, ModuleParameters)]
pub struct Block {
    #[param]
    attn: Attn,
    #[param]
    mlp: Mlp,
    #[param]
    norm: Norm,
}

#[derive(Debug, ModuleParameters)]
struct Attn {
    #[param]
    q: Weight,
    #[param]
    k: Weight,
    #[param]
    v: Weight,
    #[param]
    o: Weight,
}

#[derive(Debug, ModuleParameters)]
struct Mlp {
    #[param]
    up: Weight,
    #[param]
    down: Weight,
}

#[derive(Debug, ModuleParameters)]
struct Weight {
    #[param]
    weight: Param<Array>,
}

#[derive(Debug, ModuleParameters)]
struct Norm {
    #[param]
    weight: Param<Array>,
}

fn placeholder(shape: &[usize]) -> Result<Weight, Exception> {
    let shape: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    Ok(Weight {
        weight: Param::new(Array::zeros::<f32>(&shape)?),
    })
}

impl Block {
    /// An unbound block of the right shapes (lazy zeros, never evaluated).
    pub fn new(spec: Spec) -> Result<Block, Exception> {
        let (h, m) = (spec.hidden, spec.mlp);
        Ok(Block {
            attn: Attn {
                q: placeholder(&[h, h])?,
                k: placeholder(&[h, h])?,
                v: placeholder(&[h, h])?,
                o: placeholder(&[h, h])?,
            },
            mlp: Mlp {
                up: placeholder(&[m, h])?,
                down: placeholder(&[h, m])?,
            },
            norm: Norm {
                weight: Param::new(Array::zeros::<f32>(&[h as i32])?),
            },
        })
    }

    /// A pre-norm residual block: attention-shaped projections (without the
    /// softmax, which does not change the memory picture) and a ReLU MLP.
    pub fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let h = fast::rms_norm(x, Some(&*self.norm.weight), 1e-5)?;
        let t = |w: &Weight| w.weight.t();
        let q = h.matmul(t(&self.attn.q))?;
        let k = h.matmul(t(&self.attn.k))?;
        let v = h.matmul(t(&self.attn.v))?;
        let mixed = q.multiply(&k)?.add(&v)?;
        let x = x.add(mixed.matmul(t(&self.attn.o))?)?;
        let up = mlx_rs::ops::maximum(x.matmul(t(&self.mlp.up))?, Array::from_f32(0.0))?;
        x.add(up.matmul(t(&self.mlp.down))?)
    }
}

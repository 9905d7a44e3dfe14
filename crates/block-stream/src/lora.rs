//! Per-block LoRA sources and the fusers that apply them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx_rs::Array;
use mlx_support::{
    array_from_bytes, fuse_lora, LinearWeights, Lora, LoraLayout, Quantization, QuantizationConfig,
};
use st_mmap::{BlockPrefix, SafetensorsFile};

use crate::error::{Error, Result};

/// The key suffixes of a pair's halves in `layout`'s files.
fn suffixes(layout: LoraLayout) -> (&'static str, &'static str) {
    match layout {
        LoraLayout::Peft => (".lora_A.weight", ".lora_B.weight"),
        LoraLayout::MlxLm => (".lora_a", ".lora_b"),
    }
}

/// One LoRA pair of a block, laid out as its source's layout says: PEFT's
/// `A` (rank, in) and `B` (out, rank), or mlx_lm's `lora_a` (in, rank) and
/// `lora_b` (rank, out).
#[derive(Debug)]
pub struct LoraPair {
    /// The adapted module, relative to the block (e.g. `attn.to_q`); the
    /// weight it adapts is `{param}.weight`.
    pub param: String,
    /// Down projection.
    pub a: Array,
    /// Up projection.
    pub b: Array,
    /// The layout, and with it the arithmetic the pair is fused with.
    pub layout: LoraLayout,
    /// The down projection's key as the adapter file stores it.
    pub key: String,
}

/// LoRA A/B matrices from a safetensors file, indexed by block.
///
/// Keys (after the optional key mapper) of the form
/// `{prefix}{i}.{param}.lora_A.weight` / `….lora_B.weight` (PEFT, diffusers)
/// or, opened with [`open_mlx_lm`](Self::open_mlx_lm), mlx_lm's
/// `{prefix}{i}.{param}.lora_a` / `….lora_b` form block `i`'s pair for
/// `param`. Keys outside the prefix (e.g. a text encoder's pairs beside a
/// transformer's) and other suffixes (e.g. `.alpha`) are ignored; a half
/// without its pair ([`Error::HalfPair`]) and a file none of whose pairs
/// lies under the prefix ([`Error::NoPairs`]) are errors when opened, and a
/// pair for a block or weight the model lacks ([`Error::Lora`]) when the
/// streamer applies it: an adapter never silently changes nothing.
#[derive(Debug)]
pub struct BlockLoraSource {
    path: PathBuf,
    strength: f32,
    layout: LoraLayout,
    /// Block → param → (key of A, key of B), keys as stored in the file.
    pairs: BTreeMap<usize, BTreeMap<String, (String, String)>>,
    /// The file, mapped: LoRA matrices are small and copied into MLX
    /// arrays when a block asks for them.
    file: SafetensorsFile,
}

impl BlockLoraSource {
    /// Opens `path` with keys already in the model's naming.
    pub fn open(path: impl AsRef<Path>, block_prefix: &str, strength: f32) -> Result<Self> {
        Self::open_with_mapper(path, block_prefix, strength, |k| Some(k.to_owned()))
    }

    /// Opens `path`, renaming each key with `key_mapper` first (e.g. from
    /// diffusers/ComfyUI naming to the model's); `None` drops the key.
    pub fn open_with_mapper(
        path: impl AsRef<Path>,
        block_prefix: &str,
        strength: f32,
        key_mapper: impl Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        Self::open_layout(path, block_prefix, strength, LoraLayout::Peft, key_mapper)
    }

    /// Opens an mlx_lm adapter's `adapters.safetensors` (keys
    /// `{prefix}{i}.{param}.lora_a` / `.lora_b`); `scale` is its
    /// `adapter_config.json`'s `lora_parameters.scale`. Its pairs are fused
    /// with mlx_lm's arithmetic (`LoRALinear.fuse`), so a block gets the
    /// weights `mlx_lm fuse` (and adapter-fuse) would write.
    pub fn open_mlx_lm(path: impl AsRef<Path>, block_prefix: &str, scale: f32) -> Result<Self> {
        Self::open_layout(path, block_prefix, scale, LoraLayout::MlxLm, |k| {
            Some(k.to_owned())
        })
    }

    fn open_layout(
        path: impl AsRef<Path>,
        block_prefix: &str,
        strength: f32,
        layout: LoraLayout,
        key_mapper: impl Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = SafetensorsFile::open(&path)?;
        Self::from_file(file, path, block_prefix, strength, layout, key_mapper)
    }

    /// An mlx_lm adapter's file, already open (see [`open_mlx_lm`]), so
    /// that an adapter folder read once is not mapped again.
    ///
    /// [`open_mlx_lm`]: Self::open_mlx_lm
    pub(crate) fn from_mlx_lm_file(
        file: SafetensorsFile,
        path: PathBuf,
        block_prefix: &str,
        scale: f32,
    ) -> Result<Self> {
        Self::from_file(file, path, block_prefix, scale, LoraLayout::MlxLm, |k| {
            Some(k.to_owned())
        })
    }

    fn from_file(
        file: SafetensorsFile,
        path: PathBuf,
        block_prefix: &str,
        strength: f32,
        layout: LoraLayout,
        key_mapper: impl Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let (a_suffix, b_suffix) = suffixes(layout);
        let header = file.header();
        let prefix = BlockPrefix::new(block_prefix);
        let mut halves: BTreeMap<(usize, String), (Option<String>, Option<String>)> =
            BTreeMap::new();
        let mut outside = Vec::new();
        for info in header.tensors() {
            let Some(mapped) = key_mapper(&info.name) else {
                continue;
            };
            let Some((block, rest)) = prefix.parse(&mapped)? else {
                if mapped.ends_with(a_suffix) || mapped.ends_with(b_suffix) {
                    outside.push(mapped);
                }
                continue;
            };
            if let Some(param) = rest.strip_suffix(a_suffix) {
                halves.entry((block, param.to_owned())).or_default().0 = Some(info.name.clone());
            } else if let Some(param) = rest.strip_suffix(b_suffix) {
                halves.entry((block, param.to_owned())).or_default().1 = Some(info.name.clone());
            }
        }
        let mut pairs: BTreeMap<usize, BTreeMap<String, (String, String)>> = BTreeMap::new();
        for ((block, param), halves) in halves {
            let half = |key: String, missing: &str| Error::HalfPair {
                path: path.clone(),
                key,
                missing: missing.to_owned(),
            };
            match halves {
                (Some(a), Some(b)) => {
                    pairs.entry(block).or_default().insert(param, (a, b));
                }
                (Some(a), None) => return Err(half(a, b_suffix)),
                (None, Some(b)) => return Err(half(b, a_suffix)),
                (None, None) => {}
            }
        }
        if pairs.is_empty() {
            outside.truncate(3);
            return Err(Error::NoPairs {
                path,
                prefix: block_prefix.to_owned(),
                outside,
            });
        }
        Ok(BlockLoraSource {
            path,
            strength,
            layout,
            pairs,
            file,
        })
    }

    /// The scale applied to every delta.
    pub fn strength(&self) -> f32 {
        self.strength
    }

    /// The file this source reads.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The blocks this source has pairs for, ascending.
    pub fn blocks(&self) -> impl Iterator<Item = usize> + '_ {
        self.pairs.keys().copied()
    }

    /// The stored key of the first pair's down projection in block `idx`
    /// (what errors about the block name).
    pub(crate) fn first_key(&self, idx: usize) -> Option<&str> {
        let (a, _) = self.pairs.get(&idx)?.values().next()?;
        Some(a)
    }

    /// Whether at least one complete A/B pair exists for block `idx`.
    pub fn has_block(&self, idx: usize) -> bool {
        self.pairs.contains_key(&idx)
    }

    /// Block `idx`'s pairs, sorted by parameter.
    pub fn pairs(&self, idx: usize) -> Result<Vec<LoraPair>> {
        let Some(params) = self.pairs.get(&idx) else {
            return Ok(Vec::new());
        };
        params
            .iter()
            .map(|(param, (a, b))| {
                let load = |key: &str| -> Result<Array> {
                    let t = self.file.tensor(key).expect("indexed key");
                    Ok(array_from_bytes(key, t.dtype, t.shape, t.data)?)
                };
                Ok(LoraPair {
                    param: param.clone(),
                    a: load(a)?,
                    b: load(b)?,
                    layout: self.layout,
                    key: a.clone(),
                })
            })
            .collect()
    }

    /// Block `idx`'s LoRA as `{param}.lora_A.weight` / `{param}.lora_B.weight`
    /// (or mlx_lm's `.lora_a` / `.lora_b`) → array, keys relative to the
    /// block (the reference's dict form).
    pub fn block_lora(&self, idx: usize) -> Result<BTreeMap<String, Array>> {
        let (a_suffix, b_suffix) = suffixes(self.layout);
        let mut out = BTreeMap::new();
        for pair in self.pairs(idx)? {
            out.insert(format!("{}{a_suffix}", pair.param), pair.a);
            out.insert(format!("{}{b_suffix}", pair.param), pair.b);
        }
        Ok(out)
    }
}

/// Fuses LoRA into a block's weights as they are bound: a narrow plug-in
/// point, implemented by the two fusers here and by any closure
/// `Fn(usize, Vec<(String, Array)>, &[&BlockLoraSource]) -> Result<Vec<(String, Array)>>`.
pub trait LoraFuser {
    /// Returns `weights` (relative name → array) with the deltas of
    /// `sources` (all of which have LoRA for `block`) applied.
    fn fuse(
        &self,
        block: usize,
        weights: Vec<(String, Array)>,
        sources: &[&BlockLoraSource],
    ) -> Result<Vec<(String, Array)>>;
}

impl<F> LoraFuser for F
where
    F: Fn(usize, Vec<(String, Array)>, &[&BlockLoraSource]) -> Result<Vec<(String, Array)>>,
{
    fn fuse(
        &self,
        block: usize,
        weights: Vec<(String, Array)>,
        sources: &[&BlockLoraSource],
    ) -> Result<Vec<(String, Array)>> {
        self(block, weights, sources)
    }
}

/// One pair of one source being applied to a block: what its errors name.
struct Applying<'a> {
    source: &'a BlockLoraSource,
    block: usize,
    pair: &'a LoraPair,
}

impl Applying<'_> {
    fn error(&self, message: String) -> Error {
        Error::Lora {
            adapter: self.source.path.clone(),
            key: self.pair.key.clone(),
            block: self.block,
            param: self.pair.param.clone(),
            message,
        }
    }

    /// Fuses the pair into `weights` with the workspace's one LoRA
    /// arithmetic (of the pair's layout).
    fn fuse(&self, weights: &LinearWeights, quant: Option<Quantization>) -> Result<LinearWeights> {
        let lora = Lora {
            a: &self.pair.a,
            b: &self.pair.b,
            scale: self.source.strength,
            layout: self.pair.layout,
        };
        fuse_lora(weights, quant, lora).map_err(|e| match e {
            mlx_support::Error::Mlx(e) => Error::Mlx(e),
            other => self.error(other.to_string()),
        })
    }

    /// Takes `name` out of the block's `weights`.
    fn take(&self, weights: &mut Vec<(String, Array)>, name: &str) -> Result<Array> {
        let at = weights
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| self.error(format!("the block has no {name:?} to adapt")))?;
        Ok(weights.swap_remove(at).1)
    }

    /// Replaces `{param}.weight` in `weights` by its fused dense form.
    fn fuse_dense(&self, weights: &mut Vec<(String, Array)>) -> Result<()> {
        let name = format!("{}.weight", self.pair.param);
        let w = self.take(weights, &name)?;
        let fused = self.fuse(&LinearWeights::dense(w), None)?;
        weights.push((name, fused.weight));
        Ok(())
    }

    /// Replaces `{param}.weight`, `.scales` and `.biases` in `weights`:
    /// dequantized with `q`, adapted, requantized.
    fn fuse_quantized(&self, weights: &mut Vec<(String, Array)>, q: Quantization) -> Result<()> {
        let names = ["weight", "scales", "biases"].map(|p| format!("{}.{p}", self.pair.param));
        let stored = LinearWeights {
            weight: self.take(weights, &names[0])?,
            scales: Some(self.take(weights, &names[1])?),
            biases: Some(self.take(weights, &names[2])?),
        };
        let fused = self.fuse(&stored, Some(q))?;
        let parts = [
            fused.weight,
            fused.scales.expect("quantized"),
            fused.biases.expect("kept"),
        ];
        weights.extend(names.into_iter().zip(parts));
        Ok(())
    }
}

/// Each pair of each source for `block`, to be applied.
fn each_pair(
    block: usize,
    sources: &[&BlockLoraSource],
    mut apply: impl FnMut(&Applying<'_>) -> Result<()>,
) -> Result<()> {
    for &source in sources {
        for pair in source.pairs(block)? {
            apply(&Applying {
                source,
                block,
                pair: &pair,
            })?;
        }
    }
    Ok(())
}

/// Dense LoRA: `W' = W + strength · (B @ A)` for `A` (rank, in) and `B`
/// (out, rank), the diffusers/ComfyUI layout, computed in f32 and cast back
/// to `W`'s dtype (an mlx_lm source's pairs with mlx_lm's arithmetic).
/// Several sources add up.
#[derive(Debug, Clone, Copy, Default)]
pub struct DenseLoraFuser;

impl LoraFuser for DenseLoraFuser {
    fn fuse(
        &self,
        block: usize,
        mut weights: Vec<(String, Array)>,
        sources: &[&BlockLoraSource],
    ) -> Result<Vec<(String, Array)>> {
        each_pair(block, sources, |p| p.fuse_dense(&mut weights))?;
        Ok(weights)
    }
}

/// LoRA for blocks stored as MLX affine-quantized weights (`{param}.weight`
/// packed uint32, `{param}.scales`, `{param}.biases`): dequantize, add the
/// dense delta, requantize with the same group size and bits.
#[derive(Debug, Clone, Copy)]
pub struct QuantizedLoraFuser {
    /// Elements per quantization group (e.g. 64).
    pub group_size: i32,
    /// Bits per element (4 or 8).
    pub bits: i32,
}

impl LoraFuser for QuantizedLoraFuser {
    fn fuse(
        &self,
        block: usize,
        mut weights: Vec<(String, Array)>,
        sources: &[&BlockLoraSource],
    ) -> Result<Vec<(String, Array)>> {
        let q = Quantization::affine(self.group_size, self.bits);
        each_pair(block, sources, |p| p.fuse_quantized(&mut weights, q))?;
        Ok(weights)
    }
}

/// LoRA for an mlx_lm checkpoint's blocks, dense or affine-quantized module
/// by module as the block holds them: a module with `{param}.scales` is
/// dequantized, adapted and requantized with its own group size and bits
/// from the checkpoint's `quantization` config (mixed-precision checkpoints
/// quantize modules differently), any other is adapted dense.
#[derive(Debug, Clone)]
pub struct CheckpointLoraFuser {
    prefix: BlockPrefix,
    quantization: QuantizationConfig,
}

impl CheckpointLoraFuser {
    /// Modules are looked up in `quantization` by their path
    /// `{block_prefix}{i}.{param}` (e.g. `model.layers.3.mlp.up_proj`).
    pub fn new(block_prefix: &str, quantization: QuantizationConfig) -> CheckpointLoraFuser {
        CheckpointLoraFuser {
            prefix: BlockPrefix::new(block_prefix),
            quantization,
        }
    }
}

impl LoraFuser for CheckpointLoraFuser {
    fn fuse(
        &self,
        block: usize,
        mut weights: Vec<(String, Array)>,
        sources: &[&BlockLoraSource],
    ) -> Result<Vec<(String, Array)>> {
        each_pair(block, sources, |p| {
            let scales = format!("{}.scales", p.pair.param);
            if !weights.iter().any(|(n, _)| *n == scales) {
                return p.fuse_dense(&mut weights);
            }
            let module = self.prefix.key(block, &p.pair.param);
            let q = self.quantization.of(&module).ok_or_else(|| {
                p.error(format!(
                    "{module} is quantized in the weights but the quantization config does not cover it"
                ))
            })?;
            p.fuse_quantized(&mut weights, q)
        })?;
        Ok(weights)
    }
}

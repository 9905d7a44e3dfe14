//! A mixture-of-experts layer's stacked expert weights `(experts, out, in)`,
//! dense or packed, and where they live: in memory, whole, ready for MLX's
//! routed products; or (packed ones unpacked on use, or any left in their
//! files under `MemoryMode::MappedTables` and `Streamed`) taken at each
//! forward for the experts the batch's rows were routed to alone, each once
//! for every row that chose it. Packed 4-bit experts that the project's
//! kernel multiplies are read where they lie, in memory or in the files'
//! mapping, nothing taken ([`in_place`]); otherwise reads from the files
//! are positioned reads straight into one MLX buffer (st-mmap's
//! `read_rows_into`; no second reader), used and dropped.

use std::path::PathBuf;
use std::sync::Arc;

use mlx_rs::ops::gather_mm;
use mlx_rs::{Array, Dtype};
use mlx_support::{array_written, quantized, QuantMode, Quantization};
use st_mmap::SafetensorsSet;

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, host_slice, Why};
use crate::weights::kernels::HostKernels;
use crate::weights::memory_mode::MemoryMode;
use crate::weights::packed_routed;
use crate::weights::routing_counts::count_expert_bytes;
use crate::weights::unpack::dequantize_f32;
use crate::weights::{KeyPath, QuantizedWeights, Weights};

/// Experts' matrices ready for the routed product, experts on axis 0.
pub(crate) enum ExpertMatrices {
    /// Dense, each expert's transpose `(n, in, out)`, as `gather_mm` takes
    /// it (mlx_lm's `SwitchLinear` passes the same).
    Dense(Array),
    /// Dense bfloat16 or float16 experts widened to f32 for MLX's CPU
    /// `gather_mm`, which multiplies f32 alone: `(n, in, out)` f32, and
    /// the stored dtype the products are rounded back to where the rows
    /// have it too (as a half-precision `gather_mm` on the GPU sums in f32
    /// and rounds its outputs).
    Widened { weight: Array, stored: Dtype },
    /// Packed as stored, `(n, out, in · bits / 32)`, multiplied packed by
    /// `gather_qmm` (mlx_lm's `QuantizedSwitchLinear`); biases where the
    /// mode has them.
    Packed {
        weight: Array,
        scales: Array,
        biases: Option<Array>,
        q: Quantization,
    },
    /// Packed as stored, multiplied packed by the project's kernel
    /// ([`packed_routed`]), or unpacked where it does not take the product.
    PackedOnHost {
        weight: Array,
        scales: Array,
        biases: Array,
        q: Quantization,
        kernels: HostKernels,
    },
}

impl ExpertMatrices {
    /// Each row of `x` times the matrix of its expert in `experts` (indices
    /// into these matrices; `sorted` when they ascend).
    pub(crate) fn product(&self, x: &Array, experts: &Array, sorted: bool) -> Result<Array> {
        Ok(match self {
            ExpertMatrices::Dense(w) => gather_mm(x, w, None, Some(experts), Some(sorted))?,
            ExpertMatrices::Widened { weight, stored } => {
                let wide = x.as_dtype(Dtype::Float32)?;
                let y = gather_mm(&wide, weight, None, Some(experts), Some(sorted))?;
                if x.dtype() == *stored {
                    y.as_dtype(*stored)?
                } else {
                    y
                }
            }
            // In the stack's own mode (mlx-rs calls MLX's affine alone).
            ExpertMatrices::Packed {
                weight,
                scales,
                biases,
                q,
            } => quantized::gather_qmm(x, weight, scales, biases.as_ref(), experts, *q, sorted)?,
            ExpertMatrices::PackedOnHost {
                weight,
                scales,
                biases,
                q,
                kernels,
            } => {
                let ids = experts.as_dtype(mlx_rs::Dtype::Uint32)?.contiguous()?;
                let host = host_slice::<u32>(Why::Host, "routed experts", &ids)?;
                let product = packed_routed::routed_product(
                    x,
                    weight,
                    scales,
                    biases,
                    *q,
                    host,
                    ids.shape(),
                    kernels,
                )?;
                match product {
                    Some(y) => y,
                    None => {
                        unpacked(weight, scales, Some(biases), *q)?.product(x, experts, sorted)?
                    }
                }
            }
        })
    }
}

/// Packed experts `(n, out, in / 8)` unpacked to f32, as one matrix of
/// every expert's rows (the unpacking's fast path), ready for `gather_mm`.
fn unpacked(
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    q: Quantization,
) -> Result<ExpertMatrices> {
    let (n, out) = (weight.dim(0), weight.dim(1));
    let flat = |a: &Array| a.reshape(&[n * out, a.dim(2)]);
    let dense = match biases {
        Some(biases) if q.mode == QuantMode::Affine => {
            dequantize_f32(&flat(weight)?, &flat(scales)?, &flat(biases)?, q)?
        }
        // Another mode (MXFP4): MLX's own unpacking, in f32.
        _ => quantized::dequantize(&flat(weight)?, &flat(scales)?, None, q)?
            .as_dtype(Dtype::Float32)?,
    };
    let dense = dense.reshape(&[n, out, -1])?;
    Ok(ExpertMatrices::Dense(dense.swap_axes(-1, -2)?))
}

/// The choices a routed product multiplies, in the products' order: each
/// choice's expert by its number in the whole stack (`global`) and, where
/// the caller has read them, the distinct experts of the choices
/// (ascending) with each choice numbered among them (`taken`).
pub(crate) struct Choices<'a> {
    pub global: &'a Array,
    pub taken: Option<(&'a [usize], &'a Array)>,
}

/// What a forward asks of one projection's stacked experts, however they
/// are held.
pub(crate) trait RoutedExperts {
    /// Each row of `x` times the matrix of its choice's expert (`sorted`:
    /// the choices ascend).
    fn product(&self, x: &Array, choices: &Choices<'_>, sorted: bool) -> Result<Array>;

    /// Bytes of one expert's matrix as a forward takes it (unpacked to
    /// f32, or read dense); 0 for a stack held whole, which takes nothing.
    fn taken_bytes_per_expert(&self) -> usize;

    /// Asks storage for `experts`' bytes (distinct), about to be taken:
    /// a stack left in the files has them fetched while the stacks before
    /// it are read; others have nothing to fetch.
    fn ask(&self, _experts: &[usize]) -> Result<()> {
        Ok(())
    }

    /// Whether a forward copies the experts it chose out of the files
    /// before multiplying them: then two chunks side by side would read,
    /// and hold, an expert both chose twice.
    fn copies_from_files(&self) -> bool {
        false
    }
}

/// One projection's stacked experts as the model holds them.
pub(crate) type ExpertStack = Box<dyn RoutedExperts>;

/// Every expert in memory as the products take them: chosen experts are
/// indexed directly.
pub(crate) struct WholeStack(ExpertMatrices);

impl RoutedExperts for WholeStack {
    fn product(&self, x: &Array, choices: &Choices<'_>, sorted: bool) -> Result<Array> {
        self.0.product(x, choices.global, sorted)
    }

    fn taken_bytes_per_expert(&self) -> usize {
        0
    }
}

/// Taken for the chosen experts at each forward: packed arrays in memory
/// unpacked on use, or anything left in the files.
impl RoutedExperts for ChosenSource {
    fn product(&self, x: &Array, choices: &Choices<'_>, sorted: bool) -> Result<Array> {
        if let Some(y) = self.product_in_place(x, choices.global)? {
            return Ok(y);
        }
        match choices.taken {
            Some((distinct, local)) => self.take(distinct)?.product(x, local, sorted),
            None => {
                let (distinct, local) = renumbered(choices.global)?;
                self.take(&distinct)?.product(x, &local, sorted)
            }
        }
    }

    fn taken_bytes_per_expert(&self) -> usize {
        self.taken_bytes
    }

    fn copies_from_files(&self) -> bool {
        matches!(self.weight, StackPart::Files(_)) && !self.multiplies_in_place()
    }

    fn ask(&self, experts: &[usize]) -> Result<()> {
        self.weight.ask(experts)?;
        if let Some((scales, biases, _)) = &self.packing {
            scales.ask(experts)?;
            if let Some(biases) = biases {
                biases.ask(experts)?;
            }
        }
        Ok(())
    }
}

/// `chosen` flattened, read to the host, and its distinct experts in
/// ascending order.
pub(crate) fn chosen_ids(chosen: &Array) -> Result<(Vec<u32>, Vec<usize>)> {
    let flat = chosen.contiguous()?;
    let ids: Vec<u32> = host_slice::<u32>(Why::Host, "routed experts", &flat)?.to_vec();
    let mut distinct: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
    distinct.sort_unstable();
    distinct.dedup();
    Ok((ids, distinct))
}

/// The distinct experts of `chosen` (ascending) and the choices as places
/// among them, laid out as `chosen`.
pub(crate) fn renumbered(chosen: &Array) -> Result<(Vec<usize>, Array)> {
    let (ids, distinct) = chosen_ids(chosen)?;
    let local = renumbered_ids(&ids, &distinct, chosen.shape());
    Ok((distinct, local))
}

/// Choices `ids` as places among `distinct`, laid out as `shape`.
pub(crate) fn renumbered_ids(ids: &[u32], distinct: &[usize], shape: &[i32]) -> Array {
    let local: Vec<u32> = ids
        .iter()
        .map(|&e| distinct.partition_point(|&d| d < e as usize) as u32)
        .collect();
    Array::from_slice(&local, shape)
}

/// Where a stack taken per forward takes its experts from.
pub(crate) struct ChosenSource {
    /// Bytes of one expert's matrix as a forward takes it: packed for the
    /// kernel, else unpacked to f32.
    taken_bytes: usize,
    weight: StackPart,
    /// The scales, biases (where the mode has them) and quantization of a
    /// packed stack.
    packing: Option<(StackPart, Option<StackPart>, Quantization)>,
    /// Unpack packed experts to f32 (else `gather_qmm` multiplies them).
    unpack: bool,
    /// With `unpack`: the kernels that multiply them packed where they
    /// take the product, unpacking only where they do not.
    on_host: Option<HostKernels>,
    /// Dense half-precision experts widened to f32 as they are taken
    /// (MLX's CPU `gather_mm` multiplies f32 alone).
    widen: bool,
}

mod in_place;

/// One array of a stack, experts on axis 0.
enum StackPart {
    Memory(Array),
    Files(FileStack),
}

impl ChosenSource {
    /// A stack in memory taken per forward (unpacked when `packing` is
    /// given and `unpack`, multiplied packed by the kernel with
    /// `on_host`), for tests of how forwards take experts.
    #[cfg(test)]
    pub(crate) fn chosen_in_memory(
        weight: Array,
        packing: Option<(Array, Array, Quantization)>,
        unpack: bool,
        on_host: Option<HostKernels>,
    ) -> ExpertStack {
        let inputs = match &packing {
            Some((_, _, q)) => weight.dim(2) as usize * 32 / q.bits as usize,
            None => weight.dim(2) as usize,
        };
        Box::new(ChosenSource {
            taken_bytes: weight.dim(1) as usize * inputs * 4,
            weight: StackPart::Memory(weight),
            packing: packing.map(|(s, b, q)| (StackPart::Memory(s), Some(StackPart::Memory(b)), q)),
            unpack,
            on_host,
            widen: false,
        })
    }
}

impl ChosenSource {
    /// The matrices of `experts` (distinct, ascending), in that order.
    pub(crate) fn take(&self, experts: &[usize]) -> Result<ExpertMatrices> {
        let weight = self.weight.take(experts)?;
        let Some((scales, biases, q)) = &self.packing else {
            if self.widen && weight.dtype() != Dtype::Float32 {
                return Ok(ExpertMatrices::Widened {
                    stored: weight.dtype(),
                    weight: weight.as_dtype(Dtype::Float32)?.swap_axes(-1, -2)?,
                });
            }
            return Ok(ExpertMatrices::Dense(weight.swap_axes(-1, -2)?));
        };
        let scales = scales.take(experts)?;
        let biases = match biases {
            Some(biases) => Some(biases.take(experts)?),
            None => None,
        };
        if let (Some(kernels), Some(biases)) = (&self.on_host, &biases) {
            let biases = biases.clone();
            return Ok(ExpertMatrices::PackedOnHost {
                weight,
                scales,
                biases,
                q: *q,
                kernels: kernels.clone(),
            });
        }
        if !self.unpack {
            return Ok(ExpertMatrices::Packed {
                weight,
                scales,
                biases,
                q: *q,
            });
        }
        unpacked(&weight, &scales, biases.as_ref(), *q)
    }
}

impl StackPart {
    /// See [`RoutedExperts::ask`].
    fn ask(&self, experts: &[usize]) -> Result<()> {
        match self {
            StackPart::Memory(_) => Ok(()),
            StackPart::Files(stack) => stack.ask(experts),
        }
    }

    fn take(&self, experts: &[usize]) -> Result<Array> {
        match self {
            // Every expert, in order: the stack itself.
            StackPart::Memory(all) if experts.len() == all.dim(0) as usize => Ok(all.clone()),
            StackPart::Memory(all) => {
                let ids: Vec<u32> = experts.iter().map(|&e| e as u32).collect();
                let ids = Array::from_slice(&ids, &[ids.len() as i32]);
                Ok(all.take_axis(&ids, 0)?)
            }
            StackPart::Files(stack) => stack.read(experts),
        }
    }
}

impl Weights<'_> {
    /// Whether routed experts stay in the files, read per forward for the
    /// experts chosen (every mode but resident).
    pub(crate) fn experts_in_files(&self) -> bool {
        self.plan.memory != MemoryMode::Resident
    }

    /// A gated MLP's stacked experts under `switch` (`gate_proj`,
    /// `up_proj`, `down_proj`), `experts` of `intermediate` wide over
    /// `hidden`, each held as [`expert_stack`](Self::expert_stack) says.
    pub(crate) fn gated_expert_stacks(
        &self,
        switch: &KeyPath,
        experts: usize,
        intermediate: usize,
        hidden: usize,
    ) -> Result<[ExpertStack; 3]> {
        let stack = |name: &str, out: usize, inputs: usize| {
            self.expert_stack(&switch.join(name), experts, out, inputs)
        };
        Ok([
            stack("gate_proj", intermediate, hidden)?,
            stack("up_proj", intermediate, hidden)?,
            stack("down_proj", hidden, intermediate)?,
        ])
    }

    /// `module`'s stacked experts `(experts, out, in)`, dense or packed as
    /// the files hold them, held as the memory mode and the quantized
    /// weights' handling say: in the files unless the mode is resident;
    /// packed ones unpacked whole at load for `DequantizeF32`, kept whole
    /// for `Keep` (mlx_lm's arithmetic), taken and unpacked per forward for
    /// `DequantizeOnUse` (an f32 copy of every expert would be the memory
    /// of an f32 model).
    pub(crate) fn expert_stack(
        &self,
        module: &KeyPath,
        experts: usize,
        out: usize,
        inputs: usize,
    ) -> Result<ExpertStack> {
        let packing = self.packing(module, out, inputs)?;
        let width = packing.map_or(inputs, |q| inputs * q.bits as usize / 32);
        let in_files = self.experts_in_files();
        let part = |name: &str, cols: usize| -> Result<StackPart> {
            let key = module.join(name);
            let shape = [experts, out, cols];
            if in_files {
                Ok(StackPart::Files(FileStack::new(
                    self,
                    key.to_string(),
                    shape,
                )?))
            } else {
                Ok(StackPart::Memory(self.array(&key, &shape)?))
            }
        };
        let weight = part("weight", width)?;
        let packing = match packing {
            Some(q) => {
                let groups = inputs / q.group_size as usize;
                if q.mode == QuantMode::Mxfp4 {
                    // MXFP4's scales are bytes (E8M0); floats there are an
                    // affine checkpoint under an MXFP4 entry.
                    let key = module.join("scales").to_string();
                    let dtype = self.set.tensor(&key).map(|t| t.dtype);
                    if let Some(dtype) = dtype.filter(|&d| d != st_mmap::Dtype::U8) {
                        return Err(Error::WeightDtype {
                            path: self.file_of(&key),
                            key,
                            expected: "bytes (MXFP4's scales, U8)",
                            actual: format!("{dtype:?}"),
                        });
                    }
                }
                let biases = if q.mode.has_biases() {
                    Some(part("biases", groups)?)
                } else {
                    None
                };
                Some((part("scales", groups)?, biases, q))
            }
            None => None,
        };
        let unpack = self.plan.quantized != QuantizedWeights::Keep;
        // Only where every memory mode takes the experts per forward
        // (`DequantizeOnUse`), so that all of them multiply alike.
        let on_host = packing
            .as_ref()
            .filter(|_| self.plan.quantized == QuantizedWeights::DequantizeOnUse)
            .and_then(|(_, _, q)| self.plan.products.packed_for(*q));
        let taken_bytes = match &packing {
            // The words, and a scale and a bias per group (f32 at most).
            Some((_, _, q)) if on_host.is_some() => {
                out * inputs * q.bits as usize / 8 + out * inputs / q.group_size as usize * 8
            }
            _ => out * inputs * 4,
        };
        // Dense half-precision experts on the CPU: MLX's `gather_mm` there
        // takes f32 alone, and an f32 copy of every expert would double
        // (bfloat16: 2 → 4 bytes) what the model holds; the routed ones
        // are widened as a forward takes them.
        let widen = packing.is_none()
            && mlx_support::current_device() == mlx_support::ComputeDevice::Cpu
            && self
                .set
                .tensor(&module.join("weight").to_string())
                .is_some_and(|t| t.dtype != st_mmap::Dtype::F32);
        let source = ChosenSource {
            taken_bytes,
            weight,
            packing,
            unpack,
            on_host,
            widen,
        };
        if in_files
            || widen
            || (source.packing.is_some()
                && self.plan.quantized == QuantizedWeights::DequantizeOnUse)
        {
            return Ok(Box::new(source));
        }
        let all: Vec<usize> = (0..experts).collect();
        let whole = source.take(&all)?;
        // Computed now, on the thread that loads: lanes read the model's
        // arrays from other threads and cannot compute one.
        match &whole {
            ExpertMatrices::Dense(w) => evaluate(Why::Load, [w])?,
            ExpertMatrices::Widened { .. }
            | ExpertMatrices::Packed { .. }
            | ExpertMatrices::PackedOnHost { .. } => {}
        }
        Ok(Box::new(WholeStack(whole)))
    }
}

/// One stacked `(experts, …)` tensor left in the files.
struct FileStack {
    set: Arc<SafetensorsSet>,
    dir: PathBuf,
    key: String,
}

impl FileStack {
    /// `key` of the weights' files, checked to be `shape`.
    fn new(w: &Weights<'_>, key: String, shape: [usize; 3]) -> Result<FileStack> {
        w.view(&key, &shape)?;
        // Experts are read where the rows route, not in file order: no
        // read-ahead, which under a memory limit evicted experts the next
        // step read (twice the routed bytes came from storage).
        if let Some(file) = w.set.mapped_file_of(&key) {
            file.advise_random_reads();
        }
        Ok(FileStack {
            set: w.set.clone(),
            dir: w.dir.to_path_buf(),
            key,
        })
    }

    /// Asks storage for experts `experts`' rows, read next: one request
    /// each, all queued before the first read waits (faster from storage
    /// than reading them in turn unasked: docs/benchmarks.md).
    fn ask(&self, experts: &[usize]) -> Result<()> {
        for &e in experts {
            self.set.advise_will_read(&self.key, e..e + 1)?;
        }
        Ok(())
    }

    /// The stack as the files' mapping holds it.
    fn view(&self) -> Option<st_mmap::TensorView<'_>> {
        self.set.tensor(&self.key)
    }

    /// Lets the pages of the stack's mapping that a product touched leave
    /// this process's resident set (they stay in the page cache).
    fn release(&self) {
        self.set.release(&self.key);
    }

    /// Experts `experts` (distinct, ascending) of the stack, read now.
    fn read(&self, experts: &[usize]) -> Result<Array> {
        let missing = || Error::MissingWeight {
            dir: self.dir.clone(),
            key: self.key.clone(),
        };
        let view = self.set.tensor(&self.key).ok_or_else(missing)?;
        let mut shape = view.shape.to_vec();
        shape[0] = experts.len();
        let array = array_written(&self.key, view.dtype, &shape, |out| {
            let per_expert = out.len().checked_div(experts.len()).unwrap_or(0);
            for (j, &e) in experts.iter().enumerate() {
                let slot = &mut out[j * per_expert..(j + 1) * per_expert];
                if !self.set.read_rows_into(&self.key, e..e + 1, slot)? {
                    return Err(missing());
                }
            }
            Ok(())
        })?;
        count_expert_bytes(array.nbytes());
        Ok(array)
    }
}

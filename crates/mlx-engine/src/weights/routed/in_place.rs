//! Routed products of packed experts multiplied where they lie: the
//! project's kernel reads the chosen experts' words straight from the
//! stack — the array in memory, or the files' mapping — and nothing is
//! copied per forward.
//!
//! Taking the chosen experts first (MLX's `take` in memory, positioned
//! reads from the files into a fresh, zeroed MLX buffer) copied every
//! chosen expert at every forward: at batch 1 on Gemma 4 26B-A4B's widths,
//! 305 MB per generated token, which the kernel then read again. The
//! kernel reads each chosen expert once either way, and its sums for a
//! choice do not depend on which stack holds the expert: the bits are
//! those of the taken experts' product. From the files, the pages the
//! kernel touched are let go of after each product
//! ([`SafetensorsSet::release`]): they stay in the page cache (where the
//! reads found them too) and leave this process's resident set, as the
//! reads' buffers did once dropped. The storage is asked for the chosen
//! experts before (`RoutedExperts::ask`), as for the reads.

use cpu_kernels::packed::{PackedMatrix, Scales};
use mlx_rs::{Array, Dtype};
use st_mmap::TensorView;

use super::{ChosenSource, FileStack, StackPart};
use crate::error::Result;
use crate::evaluation::{host_slice, Why};
use crate::weights::kernels::multiplies_packed;
use crate::weights::packed_routed::{routed_on_host, routed_product};
use crate::weights::routing_counts::count_expert_bytes;

impl ChosenSource {
    /// Whether the kernel multiplies this stack's chosen experts where
    /// they lie ([`product_in_place`](Self::product_in_place)): packed in
    /// MLX's affine 4 bits with biases, unpacked on use, on a CPU the
    /// kernels run on. (A stack whose tensors the kernel then does not
    /// take is copied after all: correct, only not as fast.)
    pub(super) fn multiplies_in_place(&self) -> bool {
        matches!(
            (&self.on_host, &self.packing),
            (Some(_), Some((_, Some(_), q))) if multiplies_packed(*q)
        )
    }

    /// Each row of `x` times its choice's expert (`global`: places in the
    /// whole stack) by the kernel, reading the stack where it lies; `None`
    /// where the kernel does not take it (no kernels, not MLX's 4-bit
    /// affine packing, tensors of other dtypes or shapes), and the caller
    /// takes the experts instead.
    pub(super) fn product_in_place(&self, x: &Array, global: &Array) -> Result<Option<Array>> {
        let (Some(kernels), Some((scales, Some(biases), q))) = (&self.on_host, &self.packing)
        else {
            return Ok(None);
        };
        if !multiplies_packed(*q) {
            return Ok(None);
        }
        let ids = global.as_dtype(Dtype::Uint32)?.contiguous()?;
        let experts = host_slice::<u32>(Why::Host, "routed experts", &ids)?;
        match (&self.weight, scales, biases) {
            (StackPart::Memory(w), StackPart::Memory(s), StackPart::Memory(b)) => {
                routed_product(x, w, s, b, *q, experts, ids.shape(), kernels)
            }
            (StackPart::Files(w), StackPart::Files(s), StackPart::Files(b)) => {
                let parts = [w, s, b];
                let Some((stack, out)) = mapped(parts, q.group_size as usize) else {
                    return Ok(None);
                };
                let y = routed_on_host(x, &stack, out, experts, ids.shape(), kernels);
                for part in parts {
                    part.release();
                }
                if let Ok(Some(_)) = &y {
                    count_read(parts, experts);
                }
                y
            }
            _ => Ok(None),
        }
    }
}

/// The stack `(n, out, in / 8)` words with its scales and biases as the
/// files' mapping holds them — little-endian bytes, aligned or not (MLX
/// writes safetensors headers of any length) — one packed matrix of
/// `n · out` rows, and `out`: `None` where a tensor is missing or of
/// another dtype or rank.
fn mapped(parts: [&FileStack; 3], group_size: usize) -> Option<(PackedMatrix<'_>, usize)> {
    let [w, s, b] = parts.map(FileStack::view);
    let (w, s, b) = (w?, s?, b?);
    if w.dtype != st_mmap::Dtype::U32 || w.shape.len() != 3 {
        return None;
    }
    let (out, row_words) = (w.shape[1], w.shape[2]);
    let (scales, biases) = (scales(&s)?, scales(&b)?);
    let matrix = PackedMatrix::from_le_bytes(w.data, row_words, scales, biases, group_size).ok()?;
    Some((matrix, out))
}

/// Scales or biases as the mapping holds them.
fn scales<'a>(view: &TensorView<'a>) -> Option<Scales<'a>> {
    Some(match view.dtype {
        st_mmap::Dtype::F32 => Scales::F32Le(view.data),
        st_mmap::Dtype::BF16 => Scales::Bf16Le(view.data),
        st_mmap::Dtype::F16 => Scales::F16Le(view.data),
        _ => return None,
    })
}

/// Counts the bytes of the distinct experts among `experts` in each part,
/// as the reads they replace counted theirs.
fn count_read(parts: [&FileStack; 3], experts: &[u32]) {
    let mut distinct = experts.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    for view in parts.into_iter().filter_map(FileStack::view) {
        let n = view.shape.first().copied().unwrap_or(0);
        let per_expert = view.data.len().checked_div(n).unwrap_or(0);
        count_expert_bytes(distinct.len() * per_expert);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use mlx_rs::ops::quantize;
    use mlx_rs::random;
    use mlx_support::Quantization;
    use st_mmap::SafetensorsSet;

    use super::*;
    use crate::weights::kernels::HostKernels;
    use crate::weights::routed::{Choices, RoutedExperts};
    use crate::weights::routing_counts::expert_bytes_read;

    const Q: Quantization = Quantization::affine(32, 4);

    /// A packed stack in the files, multiplied in the mapping, equals the
    /// same stack's experts taken (read) first, bit for bit; so does the
    /// stack in memory; and the in-place product is the one that ran.
    #[test]
    fn experts_multiplied_in_the_mapping_equal_the_experts_read() {
        if !cpu_kernels::supported() {
            eprintln!("SKIPPED: this CPU has neither AVX-512F nor AVX2 with FMA");
            return;
        }
        let (n, out, inputs) = (6, 64, 128);
        let key = random::key(3).unwrap();
        let dense = random::normal::<f32>(&[n, out, inputs], None, None, &key).unwrap();
        let (w, s, b) = quantize(&dense, Q.group_size, Q.bits).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("model.safetensors");
        Array::save_safetensors(
            [("e.weight", &w), ("e.scales", &s), ("e.biases", &b)],
            None,
            &file,
        )
        .unwrap();
        let set = Arc::new(SafetensorsSet::open_dir(dir.path()).unwrap());
        let part = |name: &str| {
            StackPart::Files(FileStack {
                set: set.clone(),
                dir: dir.path().to_path_buf(),
                key: format!("e.{name}"),
            })
        };
        let kernels = HostKernels::for_tests(2);
        let mapped = ChosenSource {
            taken_bytes: out as usize * inputs as usize * 4,
            weight: part("weight"),
            packing: Some((part("scales"), Some(part("biases")), Q)),
            unpack: true,
            on_host: Some(kernels.clone()),
            widen: false,
        };
        let in_memory = ChosenSource::chosen_in_memory(w, Some((s, b, Q)), true, Some(kernels));
        // Nothing copied per forward, so chunks may run side by side; the
        // same stack without the kernels is copied out at each forward.
        assert!(!mapped.copies_from_files());
        let copied = ChosenSource {
            taken_bytes: out as usize * inputs as usize * 4,
            weight: part("weight"),
            packing: Some((part("scales"), Some(part("biases")), Q)),
            unpack: true,
            on_host: None,
            widen: false,
        };
        assert!(copied.copies_from_files());
        assert!(
            !in_memory.copies_from_files(),
            "in memory, nothing is read from the files"
        );

        // Three rows, two choices each, expert 4 chosen twice.
        let x = random::normal::<f32>(&[3, 1, 1, inputs], None, None, &key).unwrap();
        let chosen: [u32; 6] = [4, 1, 0, 4, 5, 2];
        let global = Array::from_slice(&chosen, &[3, 1, 2]);
        let distinct = [0usize, 1, 2, 4, 5];
        let local: Vec<u32> = chosen
            .iter()
            .map(|&e| distinct.iter().position(|&d| d == e as usize).unwrap() as u32)
            .collect();
        let local = Array::from_slice(&local, &[3, 1, 2]);
        let choices = Choices {
            global: &global,
            taken: Some((&distinct, &local)),
        };

        let before = expert_bytes_read();
        let y = mapped.product_in_place(&x, &global).unwrap();
        let y = y.expect("the mapped stack is aligned and 4-bit: the kernel takes it");
        let per_expert = (out * inputs / 8 * 4 + 2 * out * inputs / Q.group_size * 4) as u64;
        // At least: other tests of this binary may count reads meanwhile.
        assert!(
            expert_bytes_read() - before >= 5 * per_expert,
            "counted as read"
        );
        // The experts read from the files first, then multiplied by the
        // kernel: the path this one replaces.
        let taken = mapped
            .take(&distinct)
            .unwrap()
            .product(&x, &local, false)
            .unwrap();
        let resident = in_memory.product(&x, &choices, false).unwrap();
        assert_eq!(y.shape(), taken.shape());
        assert_eq!(
            y.as_slice::<f32>(),
            taken.as_slice::<f32>(),
            "in the mapping"
        );
        assert_eq!(
            resident.as_slice::<f32>(),
            taken.as_slice::<f32>(),
            "in memory"
        );
    }
}

//! Where a model's weights live while it runs, and the engine's default
//! for a model folder on this machine.

use std::path::Path;

use st_mmap::SafetensorsSet;

/// Where a model's weights live while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryMode {
    /// Every weight copied into memory at load (what mlx_lm does).
    Resident,
    /// Embedding tables left in their files: the rows a batch needs are
    /// read from the file at each lookup (and dequantized when packed), a
    /// tied output head is computed a slice of rows at a time, and neither
    /// table's pages count in the process's resident memory. The other
    /// weights are resident. Results are the same, bit for bit; Gemma 4
    /// E2B's per-layer table alone is over a third of its checkpoint.
    /// A mixture-of-experts model's stacked experts stay in the files too:
    /// each forward reads the experts its rows were routed to, each once
    /// for all the rows that chose it (`expert_bytes_read` counts them).
    MappedTables,
    /// Tables mapped as in [`MappedTables`](Self::MappedTables), and each
    /// decoder layer's weights read from the files only while that layer
    /// runs (through `block_stream::BlockStreamer`): a forward takes every
    /// row of its batch through layer `i`, evaluates the result, and drops
    /// the layer before reading layer `i + 1`. Resident memory holds one
    /// layer, the other non-table weights, the caches and the activations;
    /// the price is reading every layer's bytes again at every forward
    /// (each prefill group, each decoded token), so it suits
    /// classification and short outputs on models that do not fit.
    /// Results are the same, bit for bit.
    Streamed,
}

impl MemoryMode {
    /// The engine's default for a model whose weight files hold
    /// `weight_bytes`, `table_bytes` of them in embedding tables (and, in a
    /// mixture of experts, stacked experts: what `MappedTables` leaves in
    /// the files), on a
    /// machine whose memory limit (physical memory, or a lower cgroup
    /// limit) is `memory_bytes`. As many weights resident as fit in half
    /// the memory, since the page cache, the activations and the rest of
    /// the application need the other half: resident while
    /// all the weights fit that half; tables mapped while all but the
    /// tables do; layers streamed too beyond that. Unknown memory:
    /// resident.
    ///
    /// ```
    /// use mlx_engine::MemoryMode;
    /// const MB: u64 = 1_000_000;
    /// // Gemma 4 E2B at 4 bits: 2.9 GB of weights, 1.7 GB of them tables.
    /// let e2b = |memory| MemoryMode::for_model(2893 * MB, 1720 * MB, Some(memory * MB));
    /// assert_eq!(e2b(8000), MemoryMode::Resident);
    /// assert_eq!(e2b(2500), MemoryMode::MappedTables);
    /// assert_eq!(e2b(1000), MemoryMode::Streamed);
    /// ```
    pub fn for_model(weight_bytes: u64, table_bytes: u64, memory_bytes: Option<u64>) -> MemoryMode {
        let Some(half) = memory_bytes.map(|m| m / 2) else {
            return MemoryMode::Resident;
        };
        if weight_bytes <= half {
            MemoryMode::Resident
        } else if weight_bytes.saturating_sub(table_bytes) <= half {
            MemoryMode::MappedTables
        } else {
            MemoryMode::Streamed
        }
    }

    /// [`for_model`](Self::for_model) for the model folder `dir` on this
    /// machine ([`mlx_support::memory_limit`]): the engine's default. The
    /// tables' (and experts') size is read from the files' headers: a
    /// 17 GB mixture of experts whose experts are 16 GB maps them on a
    /// 16 GB machine instead of streaming its layers.
    pub fn for_model_dir(dir: &Path) -> MemoryMode {
        let (weights, tables) = weight_and_table_bytes(dir);
        MemoryMode::for_model(weights, tables, mlx_support::memory_limit())
    }

    /// Whether embedding tables stay in their files.
    pub(crate) fn maps_tables(self) -> bool {
        matches!(self, MemoryMode::MappedTables | MemoryMode::Streamed)
    }
}

/// The size of the model's weight files in `dir`, and of the tensors in
/// them that `MappedTables` leaves there (see [`is_table_key`]), both from the folder's safetensors set (the
/// files its index names, else every `.safetensors` file); (0, 0) where
/// the set does not open: the load reports why.
fn weight_and_table_bytes(dir: &Path) -> (u64, u64) {
    let Ok(set) = SafetensorsSet::open_dir(dir) else {
        return (0, 0);
    };
    let weights = set.files().iter().map(|f| f.bytes().len() as u64).sum();
    let tables = set
        .keys()
        .filter(|key| is_table_key(key))
        .filter_map(|key| set.tensor(key))
        .map(|t| t.data.len() as u64)
        .sum();
    (weights, tables)
}

/// The modules of the embedding tables that [`MemoryMode::MappedTables`]
/// leaves in the files: the token table (also a tied head) and Gemma's
/// per-layer table, under any prefix.
const TABLE_MODULES: [&str; 2] = ["embed_tokens", "embed_tokens_per_layer"];

/// The parent of a mixture of experts' stacked projections, which
/// [`MemoryMode::MappedTables`] leaves in the files as well.
const EXPERTS_MODULE: &str = "switch_mlp";

/// Whether `key` (`{prefix}{module}.{weight|scales|biases}`) is a tensor
/// that [`MemoryMode::MappedTables`] leaves in the files: an embedding
/// table's, or a stack of experts'.
fn is_table_key(key: &str) -> bool {
    let Some((module, _)) = key.rsplit_once('.') else {
        return false;
    };
    let mut names = module.rsplit('.');
    let name = names.next().unwrap_or(module);
    TABLE_MODULES.contains(&name) || names.next() == Some(EXPERTS_MODULE)
}

#[cfg(test)]
mod tests {
    use mlx_rs::Array;

    use super::*;

    #[test]
    fn the_default_mode_keeps_resident_weights_within_half_the_memory() {
        const GIB: u64 = 1 << 30;
        let mode = |weights, tables, memory| MemoryMode::for_model(weights, tables, memory);
        assert_eq!(mode(3 * GIB, GIB, Some(8 * GIB)), MemoryMode::Resident);
        assert_eq!(mode(4 * GIB, GIB, Some(8 * GIB)), MemoryMode::Resident);
        // Past half: all but the tables within half, the tables mapped.
        assert_eq!(mode(5 * GIB, GIB, Some(8 * GIB)), MemoryMode::MappedTables);
        assert_eq!(
            mode(9 * GIB, 5 * GIB, Some(8 * GIB)),
            MemoryMode::MappedTables
        );
        // The rest past half too: layers streamed, even where the weights
        // would fit in the memory.
        assert_eq!(mode(6 * GIB, GIB, Some(8 * GIB)), MemoryMode::Streamed);
        assert_eq!(mode(9 * GIB, GIB, Some(8 * GIB)), MemoryMode::Streamed);
        // Tables larger than the file sizes (impossible) do not wrap.
        assert_eq!(
            mode(5 * GIB, 6 * GIB, Some(8 * GIB)),
            MemoryMode::MappedTables
        );
        assert_eq!(mode(100 * GIB, GIB, None), MemoryMode::Resident);
    }

    #[test]
    fn table_keys_are_the_embedding_tables_under_any_prefix() {
        for key in [
            "model.embed_tokens.weight",
            "model.embed_tokens.scales",
            "language_model.model.embed_tokens.biases",
            "model.language_model.embed_tokens_per_layer.weight",
            "model.layers.3.mlp.switch_mlp.down_proj.weight",
            "model.layers.0.block_sparse_moe.switch_mlp.gate_proj.scales",
        ] {
            assert!(is_table_key(key), "{key}");
        }
        for key in [
            "lm_head.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.per_layer_model_projection.weight",
            "model.embed_tokens_norm.weight",
            "embed_tokens",
            "model.layers.0.mlp.gate.weight",
            "switch_mlp.weight",
        ] {
            assert!(!is_table_key(key), "{key}");
        }
    }

    /// The folder's sizes come from its files: the tables' tensors by
    /// their headers, the total by the files' lengths.
    #[test]
    fn a_folders_table_bytes_are_its_tables_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let table = Array::from_slice(&[0f32; 64 * 8], &[64, 8]);
        let layer = Array::from_slice(&[0f32; 8 * 8], &[8, 8]);
        Array::save_safetensors(
            [
                ("model.embed_tokens.weight", &table),
                ("model.layers.0.mlp.up_proj.weight", &layer),
            ],
            None,
            dir.path().join("model.safetensors"),
        )
        .unwrap();
        let file = std::fs::metadata(dir.path().join("model.safetensors")).unwrap();
        assert_eq!(weight_and_table_bytes(dir.path()), (file.len(), 64 * 8 * 4));
        let missing = dir.path().join("missing");
        assert_eq!(weight_and_table_bytes(&missing), (0, 0));
    }
}

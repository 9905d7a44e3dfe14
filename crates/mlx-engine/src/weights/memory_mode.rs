//! Where a model's weights live while it runs, and the engine's default
//! for a model folder on this machine.

/// Where a model's weights live while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryMode {
    /// Every weight copied into memory at load (what mlx_lm does).
    Resident,
    /// Every weight resident but a mixture of experts' stacked experts,
    /// which stay in the files: each forward reads the experts its rows
    /// were routed to, each once for all the rows that chose it, as
    /// [`MappedTables`](Self::MappedTables) reads them. The embedding
    /// tables stay in memory, so a tied output head is not read again at
    /// every forward (Gemma 4 26B-A4B's table is 0.42 GB beside 12.85 GB
    /// of experts). For a model without experts, the same as `Resident`.
    /// Results are the same, bit for bit.
    ExpertsInFiles,
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
    /// The engine's default (see `Checkpoint::default_memory`) for a model
    /// whose weight files hold
    /// `weight_bytes`, `table_bytes` of them in embedding tables (and, in a
    /// mixture of experts, stacked experts: what `MappedTables` leaves in
    /// the files), on a
    /// machine whose memory limit (physical memory, or a lower cgroup
    /// limit) is `memory_bytes`. As many weights resident as fit in half
    /// the memory, since the page cache, the activations and the rest of
    /// the application need the other half: resident while
    /// all the weights fit that half; tables mapped while all but the
    /// tables do; layers streamed too beyond that. Unknown memory:
    /// resident. [`for_parts`](Self::for_parts) tells experts apart.
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
        MemoryMode::for_parts(weight_bytes, table_bytes, 0, memory_bytes)
    }

    /// [`for_model`](Self::for_model) for a model whose `weight_bytes`
    /// hold `table_bytes` of embedding tables and `expert_bytes` of stacked
    /// experts: where all but the experts fit half the memory, the experts
    /// alone stay in the files ([`ExpertsInFiles`](Self::ExpertsInFiles));
    /// otherwise as `for_model` with the experts counted as tables.
    ///
    /// ```
    /// use mlx_engine::MemoryMode;
    /// const MB: u64 = 1_000_000;
    /// // Gemma 4 26B-A4B at 4 bits: 14.2 GB, 0.42 GB table, 12.85 GB experts.
    /// let moe = |memory| MemoryMode::for_parts(14_200 * MB, 420 * MB, 12_850 * MB, Some(memory * MB));
    /// assert_eq!(moe(32_000), MemoryMode::Resident);
    /// assert_eq!(moe(16_000), MemoryMode::ExpertsInFiles);
    /// assert_eq!(moe(2_000), MemoryMode::MappedTables);
    /// ```
    pub fn for_parts(
        weight_bytes: u64,
        table_bytes: u64,
        expert_bytes: u64,
        memory_bytes: Option<u64>,
    ) -> MemoryMode {
        let Some(half) = memory_bytes.map(|m| m / 2) else {
            return MemoryMode::Resident;
        };
        if weight_bytes <= half {
            MemoryMode::Resident
        } else if expert_bytes > 0 && weight_bytes.saturating_sub(expert_bytes) <= half {
            MemoryMode::ExpertsInFiles
        } else if weight_bytes.saturating_sub(table_bytes.saturating_add(expert_bytes)) <= half {
            MemoryMode::MappedTables
        } else {
            MemoryMode::Streamed
        }
    }

    /// Whether embedding tables stay in their files.
    pub(crate) fn maps_tables(self) -> bool {
        matches!(self, MemoryMode::MappedTables | MemoryMode::Streamed)
    }
}

#[cfg(test)]
mod tests {
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
    fn experts_alone_stay_in_the_files_where_the_rest_fits_half_the_memory() {
        const GIB: u64 = 1 << 30;
        let mode = |weights, tables, experts| {
            MemoryMode::for_parts(weights, tables, experts, Some(8 * GIB))
        };
        assert_eq!(mode(4 * GIB, GIB, 2 * GIB), MemoryMode::Resident);
        assert_eq!(mode(10 * GIB, GIB, 7 * GIB), MemoryMode::ExpertsInFiles);
        assert_eq!(mode(10 * GIB, 3 * GIB, 4 * GIB), MemoryMode::MappedTables);
        assert_eq!(mode(12 * GIB, GIB, 2 * GIB), MemoryMode::Streamed);
        // No experts: as `for_model`.
        assert_eq!(mode(5 * GIB, GIB, 0), MemoryMode::MappedTables);
    }
}

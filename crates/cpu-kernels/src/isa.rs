//! Which instructions the kernels run on this CPU.

/// The instruction sets the kernels are written for. Every one gives the
/// same sums, bit for bit (each output summed in the inputs' order with
/// fused multiply-adds): they differ in speed alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Isa {
    /// AVX-512F: a panel's 32 outputs in two registers, eight rows at once.
    Avx512F,
    /// AVX2 with FMA (x86-64 since Haswell and Zen): a panel's outputs in
    /// four registers, fewer rows at once.
    Avx2Fma,
}

impl Isa {
    /// Every instruction set the kernels have, fastest first.
    pub const ALL: [Isa; 2] = [Isa::Avx512F, Isa::Avx2Fma];

    /// Whether this CPU runs `self`.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Isa::Avx512F => std::arch::is_x86_feature_detected!("avx512f"),
                Isa::Avx2Fma => {
                    std::arch::is_x86_feature_detected!("avx2")
                        && std::arch::is_x86_feature_detected!("fma")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// The fastest instruction set this CPU runs, if it runs any.
    pub fn best() -> Option<Isa> {
        Isa::ALL.into_iter().find(|isa| isa.available())
    }

    /// Rows a packed product keeps its sums of in registers, the words
    /// unpacked as they are used; past them each panel is unpacked once
    /// into a buffer and multiplied as a dense one.
    pub(crate) fn packed_register_rows(self) -> usize {
        match self {
            Isa::Avx512F => crate::TILE_ROWS,
            // Half a panel's 16 outputs in two registers per row, beside
            // the words, scales, biases and values: three rows fill the
            // sixteen registers.
            Isa::Avx2Fma => 3,
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Isa::Avx512F => "AVX-512F",
            Isa::Avx2Fma => "AVX2+FMA",
        })
    }
}

/// The instruction sets this CPU runs, for tests that hold each to the
/// same sums; says so on stderr where there are none.
#[cfg(test)]
pub(crate) fn each_available() -> Vec<Isa> {
    let all: Vec<Isa> = Isa::ALL.into_iter().filter(|i| i.available()).collect();
    if all.is_empty() {
        eprintln!("SKIPPED: this CPU has neither AVX-512F nor AVX2 with FMA");
    }
    all
}

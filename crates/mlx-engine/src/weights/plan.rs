//! How a model's weights are held and multiplied, decided once at load
//! from the settings and the machine: a value the load logs, which every
//! weight's holding is chosen from (see `linear.rs`).

use crate::weights::kernels::Products;
use crate::weights::memory_mode::MemoryMode;
use crate::weights::quantized::QuantizedWeights;

/// The load's decisions: how packed weights are multiplied, where the
/// weights live, and which products run on the project's kernels (the
/// kernels asked for, the device, whether this CPU has them).
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub quantized: QuantizedWeights,
    pub memory: MemoryMode,
    pub products: Products,
}

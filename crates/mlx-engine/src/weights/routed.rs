//! A mixture-of-experts layer's stacked expert weights left in their files
//! (`MemoryMode::MappedTables` and `Streamed`): at each forward only the
//! experts the batch's rows were routed to are read, each once for every
//! row that chose it, with positioned reads straight into one MLX buffer
//! (st-mmap's `read_rows_into`; no second reader), used and dropped.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mlx_rs::Array;
use mlx_support::array_written;
use st_mmap::SafetensorsSet;

use crate::error::{Error, Result};

/// Bytes of expert weights read from the files by this process so far.
static EXPERT_BYTES_READ: AtomicU64 = AtomicU64::new(0);

/// Bytes of routed expert weights read from the files so far (all models
/// of the process): what a forward over experts left in their files cost.
pub fn expert_bytes_read() -> u64 {
    EXPERT_BYTES_READ.load(Ordering::Relaxed)
}

/// One stacked `(experts, out, in)` tensor left in the files.
pub(crate) struct RoutedStack {
    set: Arc<SafetensorsSet>,
    dir: PathBuf,
    key: String,
}

impl RoutedStack {
    /// `key` of `set`, checked to be `shape`.
    pub(crate) fn new(
        set: &Arc<SafetensorsSet>,
        dir: PathBuf,
        key: String,
        shape: [usize; 3],
    ) -> Result<RoutedStack> {
        let view = set.tensor(&key).ok_or_else(|| Error::MissingWeight {
            dir: dir.clone(),
            key: key.clone(),
        })?;
        if view.shape != shape {
            return Err(Error::WeightShape {
                path: dir.clone(),
                key,
                expected: shape.to_vec(),
                actual: view.shape.to_vec(),
            });
        }
        Ok(RoutedStack {
            set: set.clone(),
            dir,
            key,
        })
    }

    /// Experts `experts` (distinct, ascending) of the stack, `(n, out, in)`,
    /// read now.
    pub(crate) fn read(&self, experts: &[usize]) -> Result<Array> {
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
        EXPERT_BYTES_READ.fetch_add(array.nbytes() as u64, Ordering::Relaxed);
        Ok(array)
    }
}

//! One model over several processes, on MLX's distributed engine
//! (`mlx_support::distributed`): a [`Placement`] says whether this rank
//! holds a pipeline stage (some of the decoder layers) or the whole model
//! with a share of the conversations.
//!
//! Every rank runs the same program and calls `generate` with the same
//! conversations (SPMD, as mlx_lm's distributed generation does); each
//! `generate` starts by checking that every rank was given the same
//! request, so a rank that was not is an error on all of them.

pub(crate) mod data;
pub(crate) mod split;
pub(crate) mod stage;

use std::ops::Range;
use std::path::Path;

use mlx_rs::{Array, Dtype};
use mlx_support::distributed::Group;
use sha2::{Digest, Sha256};
use st_mmap::SafetensorsSet;

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, Why};

/// Where a model runs: in this process alone, or as one rank of a group.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum Placement {
    /// The whole model here, every conversation here.
    #[default]
    Local,
    /// This rank holds a contiguous part of the decoder layers: rank 0 the
    /// first (and the embedding), the last rank the last (and the final
    /// norm and output projection). Hidden states pass from rank to rank;
    /// every rank gets the logits. Texts and logits equal the one-process
    /// engine's bit for bit (the same arithmetic, split at layer borders).
    Pipeline {
        group: Group,
        /// One range per rank; `None`: split so that each rank holds about
        /// the same bytes.
        layers: Option<Vec<Range<usize>>>,
    },
    /// Every rank holds the whole model and answers a share of the
    /// conversations (balanced by prompt length); every rank gets every
    /// text back, in the caller's order.
    DataParallel { group: Group },
}

impl Placement {
    /// The group, when there is one of more than one rank.
    pub(crate) fn group(&self) -> Option<&Group> {
        match self {
            Placement::Local => None,
            Placement::Pipeline { group, .. } | Placement::DataParallel { group } => {
                Some(group).filter(|g| !g.is_single())
            }
        }
    }
}

/// A digest of what a rank loads: `config.json`, and every tensor's name,
/// dtype, shape and first and last bytes. Ranks started on different model
/// folders (another checkpoint, another fine-tune of the same shapes) get
/// different digests, without reading whole weights.
pub(crate) fn model_digest(dir: &Path, set: &SafetensorsSet) -> Result<[u8; 32]> {
    let path = dir.join("config.json");
    let config = std::fs::read(&path).map_err(|source| Error::Io { path, source })?;
    let mut h = Sha256::new();
    h.update(&config);
    let mut keys: Vec<&str> = set.keys().collect();
    keys.sort_unstable();
    for key in keys {
        if let Some(view) = set.tensor(key) {
            h.update(key.as_bytes());
            h.update(format!("{:?}{:?}", view.dtype, view.shape).as_bytes());
            let d = view.data;
            h.update(&d[..d.len().min(64)]);
            h.update(&d[d.len().saturating_sub(64)..]);
        }
    }
    Ok(h.finalize().into())
}

const DTYPES: [Dtype; 3] = [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16];

/// What the ranks agree on when the model is loaded.
pub(crate) struct Agreement {
    /// The hidden states' dtype, as rank 0 (the first stage) has it.
    pub hidden_dtype: Dtype,
}

/// Checks, on every rank at once, that all ranks loaded the same model and
/// (for a pipeline: `layers` is `Some`) that their layer ranges follow on
/// from each other; learns rank 0's hidden dtype. Every rank gets the same
/// error.
pub(crate) fn agree(
    group: &Group,
    digest: &[u8; 32],
    layers: Option<Range<usize>>,
    hidden_dtype: Option<Dtype>,
) -> Result<Agreement> {
    let pipeline = layers.is_some();
    let layers = layers.unwrap_or(0..0);
    let code = hidden_dtype
        .and_then(|d| DTYPES.iter().position(|&x| x == d))
        .map_or(-1, |i| i as i32);
    let mut row: Vec<i32> = digest
        .chunks(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    row.extend([code, layers.start as i32, layers.end as i32]);
    let width = row.len();
    let mine = Array::from_slice(&row, &[1, width as i32]);
    let distributed = |e: &dyn std::fmt::Display| Error::Distributed {
        rank: group.rank(),
        message: format!("the start-up handshake: {e}"),
    };
    let all = group.all_gather(&mine).map_err(|e| distributed(&e))?;
    evaluate(Why::Collective, [&all]).map_err(|e| distributed(&e))?;
    let rows: Vec<&[i32]> = all.as_slice::<i32>().chunks(width).collect();
    for (rank, other) in rows.iter().enumerate() {
        if other[..8] != rows[0][..8] {
            return Err(Error::Distributed {
                rank: group.rank(),
                message: format!(
                    "rank {rank} loaded another model than rank 0 (config.json or weights differ): \
                     start every rank on the same model folder"
                ),
            });
        }
        let start = other[width - 2];
        let expected = if rank == 0 {
            0
        } else {
            rows[rank - 1][width - 1]
        };
        if pipeline && start != expected {
            return Err(Error::Distributed {
                rank: group.rank(),
                message: format!(
                    "rank {rank} holds layers from {start}, rank {} ends at {expected}: \
                     every rank must be given the same placement",
                    rank.saturating_sub(1)
                ),
            });
        }
    }
    let hidden_dtype = usize::try_from(rows[0][width - 3])
        .ok()
        .and_then(|i| DTYPES.get(i).copied())
        .unwrap_or(Dtype::Float32);
    Ok(Agreement { hidden_dtype })
}

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
pub(crate) mod identity;
pub(crate) mod split;
pub(crate) mod stage;

use std::ops::Range;
use std::path::Path;

use mlx_rs::Array;
use mlx_support::distributed::Group;
use st_mmap::SafetensorsSet;

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, host_slice, Why};

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

/// A digest as MLX integers, for a collective.
pub(crate) fn words(digest: &[u8; 32]) -> Vec<i32> {
    digest
        .chunks(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn gathered(group: &Group, row: &[i32], rows: i32) -> Result<Vec<i32>> {
    let distributed = |e: &dyn std::fmt::Display| Error::Distributed {
        rank: group.rank(),
        message: format!("the start-up handshake: {e}"),
    };
    let width = row.len() as i32 / rows.max(1);
    let mine = Array::from_slice(row, &[rows, width]);
    let all = group.all_gather(&mine).map_err(|e| distributed(&e))?;
    evaluate(Why::Collective, [&all]).map_err(|e| distributed(&e))?;
    Ok(host_slice::<i32>(Why::Collective, "the handshake", &all)?.to_vec())
}

/// The bytes of a file's name in a table row of the handshake (longer
/// names are cut: they only name the file in an error).
const NAME_WORDS: usize = 32;

/// Checks, on every rank at once, that all ranks loaded the same model —
/// every file of [`identity::model_files`], compared whole — and (for a
/// pipeline: `layers` is `Some`) that their layer ranges follow on from
/// each other. Every rank gets the same error, naming the first file that
/// differs.
pub(crate) fn agree(
    group: &Group,
    dir: &Path,
    set: &SafetensorsSet,
    layers: Option<Range<usize>>,
) -> Result<()> {
    let files = identity::model_files(dir, set)?;
    let pipeline = layers.is_some();
    let layers = layers.unwrap_or(0..0);
    let mut row = words(&identity::combined(&files));
    row.extend([files.len() as i32, layers.start as i32, layers.end as i32]);
    let width = row.len();
    let all = gathered(group, &row, 1)?;
    let rows: Vec<&[i32]> = all.chunks(width).collect();
    if let Some(other) = rows.iter().position(|r| r[..8] != rows[0][..8]) {
        let most = rows.iter().map(|r| r[8]).max().unwrap_or(0).max(0) as usize;
        return Err(different_file(group, &files, most, other)?);
    }
    for (rank, other) in rows.iter().enumerate() {
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
    Ok(())
}

/// The error for rank `other`, whose files differ from rank 0's: the ranks
/// exchange their tables of files (`most` rows each) and every rank names
/// the same first file that differs.
fn different_file(
    group: &Group,
    files: &[identity::FileDigest],
    most: usize,
    other: usize,
) -> Result<Error> {
    let width = NAME_WORDS + 9;
    let mut table = vec![0i32; most.max(1) * width];
    for (f, row) in files.iter().zip(table.chunks_mut(width)) {
        let mut name = f.name.as_bytes().to_vec();
        name.truncate(NAME_WORDS * 4);
        name.resize(NAME_WORDS * 4, 0);
        for (w, c) in row.iter_mut().zip(name.chunks(4)) {
            *w = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        row[NAME_WORDS] = 1;
        if let Some(d) = &f.digest {
            row[NAME_WORDS] = 2;
            row[NAME_WORDS + 1..].copy_from_slice(&words(d));
        }
    }
    let all = gathered(group, &table, most.max(1) as i32)?;
    let rank_files = |rank: usize| -> std::collections::BTreeMap<String, &[i32]> {
        let per_rank = most.max(1) * width;
        all[rank * per_rank..(rank + 1) * per_rank]
            .chunks(width)
            .filter(|row| row[NAME_WORDS] != 0)
            .map(|row| {
                let bytes: Vec<u8> = row[..NAME_WORDS]
                    .iter()
                    .flat_map(|w| w.to_le_bytes())
                    .take_while(|&b| b != 0)
                    .collect();
                (
                    String::from_utf8_lossy(&bytes).into_owned(),
                    &row[NAME_WORDS..],
                )
            })
            .collect()
    };
    let (first, theirs) = (rank_files(0), rank_files(other));
    let mut names: Vec<&String> = first.keys().chain(theirs.keys()).collect();
    names.sort();
    names.dedup();
    let (file, how) = names
        .into_iter()
        .find_map(|name| {
            let present = |m: &std::collections::BTreeMap<String, &[i32]>| {
                m.get(name).is_some_and(|r| r[0] == 2)
            };
            let how = match (present(&first), present(&theirs)) {
                (true, false) => "is missing on it but present on rank 0",
                (false, true) => "is present on it but missing on rank 0",
                _ if first.get(name) != theirs.get(name) => "differs from rank 0's",
                _ => return None,
            };
            Some((name.clone(), how))
        })
        .unwrap_or_else(|| ("(a file)".to_owned(), "differs from rank 0's"));
    Ok(Error::DifferentModel {
        rank: group.rank(),
        other,
        file,
        how: how.to_owned(),
    })
}

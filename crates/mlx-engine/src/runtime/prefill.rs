//! Running prompts after a cache: rows grouped by length at the least
//! cost, left-padded into blocks, a long block a piece at a time. Batched
//! generation and serving's scheduler both prefill this way.

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use crate::evaluation::{evaluate, Why};
use crate::models::Model;
use crate::nn::cache::KvCache;

/// Prompts are prefilled at most this many positions at a time, so that the
/// attention scores of a long prompt (positions × positions per head) never
/// exist whole: memory grows with the prompt, not with its square.
pub(crate) const PREFILL_CHUNK: usize = 256;

/// Splits a chunk's rows (sorted by length) into groups of neighbours to
/// prefill together, at the least estimated cost: a group costs one pass
/// over the model's weights, worth `pass_cost` tokens of work (see
/// [`Model::pass_cost_tokens`]), plus its rows times its longest row, in
/// tokens (padding computed as if it were real). Prefilling a chunk as one
/// block pads every row to the chunk's longest (a quarter or more of the
/// work at batch 32 with suffixes of 20 to 120 tokens); prefilling each row
/// alone repeats the pass over the weights per row, which is what a large
/// model's forward mostly is. Ties go to fewer groups.
pub(crate) fn prefill_groups(lengths: &[usize], pass_cost: usize) -> Vec<std::ops::Range<usize>> {
    let n = lengths.len();
    // best[i]: the least cost of the first i rows, and where its last
    // group starts.
    let mut best: Vec<(usize, usize)> = vec![(0, 0); n + 1];
    for i in 1..=n {
        best[i] = (0..i)
            .map(|j| {
                let longest = lengths[j..i].iter().copied().max().unwrap_or(0);
                (best[j].0 + pass_cost + (i - j) * longest, j)
            })
            .min_by_key(|&(cost, j)| (cost, j))
            .unwrap_or((0, 0));
    }
    let mut groups = Vec::new();
    let mut end = n;
    while end > 0 {
        let start = best[end].1;
        groups.push(start..end);
        end = start;
    }
    groups.reverse();
    groups
}

/// Prefills `rows` as one left-padded block after the prefix; returns their
/// cache (without `keep`, possibly holding none of their positions) and the
/// hidden state of each row's last position (see [`Model::last_hidden`]).
pub(crate) fn prefill(
    model: &Model,
    prefix: &KvCache,
    rows: &[&[u32]],
    keep: bool,
) -> crate::Result<(KvCache, Array)> {
    let mut cache = prefix.fork(rows.len() as i32)?;
    // One piece and nothing to decode after it: its keys and values are
    // read by its own attention only (see `KvCache::discard_owned`).
    if !keep && rows.iter().all(|r| r.len() <= PREFILL_CHUNK) {
        cache.discard_owned();
    }
    let last = prefill_into(model, &mut cache, rows)?;
    Ok((cache, last))
}

/// `rows` left-padded to the longest, `(rows, width)`; `cache`'s pads are
/// set to match.
pub(crate) fn padded_block(cache: &mut KvCache, rows: &[&[u32]]) -> crate::Result<Array> {
    let width = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let pads: Vec<usize> = rows.iter().map(|r| width - r.len()).collect();
    let mut block = Vec::with_capacity(rows.len() * width);
    for (row, &pad) in rows.iter().zip(&pads) {
        block.extend(std::iter::repeat_n(0i32, pad));
        block.extend(row.iter().map(|&t| t as i32));
    }
    cache.set_pads(pads.iter().map(|&p| p as i32).collect())?;
    Ok(Array::from_slice(
        &block,
        &[rows.len() as i32, width as i32],
    ))
}

/// Runs `rows`, left-padded to the longest, after what `cache` holds (its
/// pads are set here), [`PREFILL_CHUNK`] positions at a time; returns the
/// hidden state of each row's last position (see [`Model::last_hidden`]).
pub(crate) fn prefill_into(
    model: &Model,
    cache: &mut KvCache,
    rows: &[&[u32]],
) -> crate::Result<Array> {
    let block = padded_block(cache, rows)?;
    let width = block.dim(1) as usize;
    let mut start = 0;
    loop {
        let end = (start + PREFILL_CHUNK).min(width);
        let piece = if start == 0 && end == width {
            block.clone()
        } else {
            block.index((.., start as i32..end as i32))
        };
        let last = model.last_hidden(&piece, cache)?;
        if end == width {
            return Ok(last);
        }
        // Else every piece's graph would be computed at once, scores and all.
        evaluate(Why::Piece, [&last])?;
        start = end;
    }
}

#[cfg(test)]
mod tests {
    use super::prefill_groups;

    #[test]
    fn rows_are_grouped_at_the_least_cost_of_passes_and_padding() {
        assert!(prefill_groups(&[], 40).is_empty());
        assert_eq!(prefill_groups(&[5], 40), vec![0..1]);
        // Padding 6 tokens is cheaper than a second pass.
        assert_eq!(prefill_groups(&[20, 21, 22, 23], 40), vec![0..4]);
        // 100 after 20 would pad 80: more than a pass of 40, not of 400.
        assert_eq!(prefill_groups(&[20, 100], 40), vec![0..1, 1..2]);
        assert_eq!(prefill_groups(&[20, 100], 400), vec![0..2]);
        // Three passes + 2·21 + 2·64 + 100 = 390, against 0..2, 2..5: 422,
        // 0..4, 4..5: 436, and one group: 540.
        assert_eq!(
            prefill_groups(&[20, 21, 60, 64, 100], 40),
            vec![0..2, 2..4, 4..5]
        );
        assert_eq!(prefill_groups(&[20, 21, 60, 64, 100], 400), vec![0..5]);
        // Free passes: every row alone.
        assert_eq!(prefill_groups(&[1, 2, 3], 0), vec![0..1, 1..2, 2..3]);
    }
}

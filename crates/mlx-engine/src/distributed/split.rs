//! Which decoder layers each rank of a pipeline holds.

use std::ops::Range;

/// Contiguous layer ranges, one per rank in rank order, covering
/// `0..layer_bytes.len()`, each as close as it can be to an equal share of
/// the bytes: the layers' own, plus `first_extra` on the first rank (the
/// embedding table) and `last_extra` on the last (final norm, output
/// projection). Every rank gets at least one layer.
pub(crate) fn by_bytes(
    layer_bytes: &[u64],
    first_extra: u64,
    last_extra: u64,
    ranks: usize,
) -> Vec<Range<usize>> {
    let n = layer_bytes.len();
    let ranks = ranks.clamp(1, n.max(1));
    let total: u64 = layer_bytes.iter().sum::<u64>() + first_extra + last_extra;
    let mut ranges = Vec::with_capacity(ranks);
    let mut start = 0;
    let mut before = first_extra;
    for rank in 0..ranks {
        if rank == ranks - 1 {
            ranges.push(start..n);
            break;
        }
        // Cut where the running total passes this rank's share, leaving at
        // least one layer for each rank after it.
        let share = total * (rank as u64 + 1) / ranks as u64;
        let mut end = start + 1;
        before += layer_bytes[start];
        while end < n - (ranks - 1 - rank) {
            let with_next = before + layer_bytes[end];
            // Take the next layer when that lands nearer the share.
            if with_next.abs_diff(share) < before.abs_diff(share) {
                before = with_next;
                end += 1;
            } else {
                break;
            }
        }
        ranges.push(start..end);
        start = end;
    }
    ranges
}

/// [`by_bytes`] where the model allows a cut only before the layers
/// `can_cut` accepts (Gemma 4's KV-shared layers read the keys of an
/// earlier layer in the same forward, so no cut may separate them): the
/// layers between two allowed cuts stay together.
pub(crate) fn by_bytes_where(
    layer_bytes: &[u64],
    first_extra: u64,
    last_extra: u64,
    ranks: usize,
    can_cut: impl Fn(usize) -> bool,
) -> Result<Vec<Range<usize>>, String> {
    let mut starts: Vec<usize> = (0..layer_bytes.len())
        .filter(|&i| i == 0 || can_cut(i))
        .collect();
    if starts.len() < ranks {
        return Err(format!(
            "this model's layers can be cut into at most {} pipeline stages, not {ranks}",
            starts.len()
        ));
    }
    starts.push(layer_bytes.len());
    let units: Vec<u64> = starts
        .windows(2)
        .map(|w| layer_bytes[w[0]..w[1]].iter().sum())
        .collect();
    Ok(by_bytes(&units, first_extra, last_extra, ranks)
        .into_iter()
        .map(|r| starts[r.start]..starts[r.end])
        .collect())
}

/// Checks ranges a user gave: one per rank, contiguous, covering every
/// layer, none empty, each cut where `can_cut` allows.
pub(crate) fn checked(
    ranges: &[Range<usize>],
    layers: usize,
    ranks: usize,
    can_cut: impl Fn(usize) -> bool,
) -> Result<(), String> {
    if ranges.len() != ranks {
        return Err(format!("{} layer ranges for {ranks} ranks", ranges.len()));
    }
    let mut next = 0;
    for (rank, r) in ranges.iter().enumerate() {
        if r.start != next || r.end <= r.start {
            return Err(format!(
                "rank {rank}'s layers {r:?} do not follow on from {next} (ranges must be contiguous, in rank order, none empty)"
            ));
        }
        if r.start != 0 && !can_cut(r.start) {
            return Err(format!(
                "the model cannot be cut before layer {}: a later layer reads the keys and values of an earlier one",
                r.start
            ));
        }
        next = r.end;
    }
    if next != layers {
        return Err(format!(
            "the ranges end at layer {next}; the model has {layers}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_layers_split_evenly_and_the_extras_shift_the_cut() {
        assert_eq!(by_bytes(&[10; 6], 0, 0, 2), vec![0..3, 3..6]);
        assert_eq!(by_bytes(&[10; 6], 0, 0, 3), vec![0..2, 2..4, 4..6]);
        // A large embedding on rank 0 moves layers to rank 1.
        assert_eq!(by_bytes(&[10; 6], 20, 0, 2), vec![0..2, 2..6]);
        assert_eq!(by_bytes(&[10; 6], 0, 20, 2), vec![0..4, 4..6]);
        // Never an empty rank, even when one layer outweighs the rest.
        assert_eq!(by_bytes(&[100, 1, 1], 0, 0, 3), vec![0..1, 1..2, 2..3]);
        assert_eq!(by_bytes(&[1, 1, 100], 0, 0, 2), vec![0..2, 2..3]);
        assert_eq!(by_bytes(&[5; 4], 0, 0, 1), vec![0..4]);
    }

    #[test]
    fn given_ranges_must_cover_the_layers_in_order() {
        let any = |_| true;
        assert!(checked(&[0..2, 2..4], 4, 2, any).is_ok());
        let gap = checked(&[0..2, 3..4], 4, 2, any).unwrap_err();
        assert!(gap.contains("follow on"), "{gap}");
        let short = checked(&[0..2, 2..3], 4, 2, any).unwrap_err();
        assert!(short.contains("end at layer 3"), "{short}");
        let few = checked(&[0..4usize; 1], 4, 2, any).unwrap_err();
        assert!(few.contains("1 layer ranges for 2"), "{few}");
        assert!(checked(&[0..0, 0..4], 4, 2, any).is_err());
        let shared = checked(&[0..2, 2..4], 4, 2, |i| i != 2).unwrap_err();
        assert!(shared.contains("before layer 2"), "{shared}");
    }

    #[test]
    fn layers_that_must_stay_together_are_not_cut() {
        // Layers 3..6 read layer 2's keys: cuts only at 1 and 2.
        let can_cut = |i: usize| i <= 2;
        let two = by_bytes_where(&[10; 6], 0, 0, 2, can_cut).unwrap();
        assert_eq!(two, vec![0..2, 2..6]);
        let three = by_bytes_where(&[10; 6], 0, 0, 3, can_cut).unwrap();
        assert_eq!(three, vec![0..1, 1..2, 2..6]);
        let four = by_bytes_where(&[10; 6], 0, 0, 4, can_cut).unwrap_err();
        assert!(four.contains("at most 3"), "{four}");
    }
}

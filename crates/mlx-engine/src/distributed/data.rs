//! Data-parallel generation: every rank holds the whole model and answers
//! a share of the conversations; the texts are exchanged afterwards.

use mlx_rs::Array;
use mlx_support::distributed::Group;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::evaluation::{evaluate, host_slice, Why};
use crate::tokenizer::Message;

fn distributed(group: &Group, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Distributed {
        rank: group.rank(),
        message: format!("{what}: {e}"),
    }
}

/// Checks that every rank was given the same request (conversations and
/// token limit): the ranks of a pipeline or data-parallel group compute
/// one generation together, and a rank with another request would make
/// them wait on each other. Every rank gets the same error.
pub(crate) fn same_request(
    group: &Group,
    conversations: &[Vec<Message>],
    max_tokens: usize,
) -> Result<()> {
    let mut h = Sha256::new();
    h.update((max_tokens as u64).to_le_bytes());
    h.update((conversations.len() as u64).to_le_bytes());
    for conversation in conversations {
        h.update((conversation.len() as u64).to_le_bytes());
        for m in conversation {
            for part in [&m.role, &m.content] {
                h.update((part.len() as u64).to_le_bytes());
                h.update(part.as_bytes());
            }
        }
    }
    let words = super::words(&h.finalize().into());
    let all = group
        .all_gather(&Array::from_slice(&words, &[1, 8]))
        .map_err(|e| distributed(group, "comparing requests", e))?;
    evaluate(Why::Collective, [&all]).map_err(|e| distributed(group, "comparing requests", e))?;
    let rows: Vec<&[i32]> = host_slice::<i32>(Why::Collective, "request digests", &all)?
        .chunks(8)
        .collect();
    if let Some(other) = rows.iter().position(|r| *r != rows[0]) {
        return Err(Error::Distributed {
            rank: group.rank(),
            message: format!(
                "rank {other} was asked for another generation than rank 0: every rank calls \
                 generate with the same conversations and options"
            ),
        });
    }
    Ok(())
}

/// Which conversations each rank answers: the longest prompts first, each
/// to the rank with the fewest prompt tokens so far (ties to the lower
/// rank). The same on every rank.
pub(crate) fn shares(lengths: &[usize], ranks: usize) -> Vec<usize> {
    let mut by_length: Vec<usize> = (0..lengths.len()).collect();
    by_length.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut load = vec![0usize; ranks.max(1)];
    let mut owner = vec![0; lengths.len()];
    for i in by_length {
        let (rank, _) = load
            .iter()
            .enumerate()
            .min_by_key(|&(r, &l)| (l, r))
            .unwrap_or((0, &0));
        owner[i] = rank;
        // A conversation costs at least one step, however short.
        load[rank] += lengths[i].max(1);
    }
    owner
}

/// Every rank's texts, in the caller's order: each rank's `texts` hold its
/// own conversations' (the others empty); also the prompt and generated
/// token counts summed over the ranks. A rank whose share `failed` still
/// takes part, so that every rank learns of it: each of the others gets an
/// error naming it (the failed rank reports its own error).
pub(crate) fn gather_texts(
    group: &Group,
    texts: Vec<String>,
    counts: (usize, usize),
    failed: bool,
) -> Result<(Vec<String>, (usize, usize))> {
    let exchange = |x: Array| -> Result<Array> {
        let all = group
            .all_sum(&x)
            .map_err(|e| distributed(group, "gathering texts", e))?;
        evaluate(Why::Collective, [&all]).map_err(|e| distributed(group, "gathering texts", e))?;
        Ok(all)
    };
    // Each conversation's byte length, then the counts: a rank adds only
    // its own, so the sums are everyone's.
    let mut header: Vec<i32> = texts.iter().map(|t| t.len() as i32).collect();
    header.extend([counts.0 as i32, counts.1 as i32]);
    // One slot per rank, set by a rank whose share failed.
    let mut failures = vec![0i32; group.size()];
    failures[group.rank()] = i32::from(failed);
    header.extend(failures);
    let n = header.len() as i32;
    let header = exchange(Array::from_slice(&header, &[n]))?;
    let header = host_slice::<i32>(Why::Collective, "the answers' header", &header)?;
    let (lengths, rest) = header.split_at(texts.len());
    let (sums, failures) = rest.split_at(2);
    if let Some(rank) = failures.iter().position(|&f| f != 0) {
        return Err(Error::Distributed {
            rank: group.rank(),
            message: format!("rank {rank} failed to answer its share of the conversations"),
        });
    }
    let total: usize = lengths.iter().map(|&l| l.max(0) as usize).sum();
    // The bytes as int32 (the ring sums any dtype; texts are small).
    let mut bytes = vec![0i32; total];
    let mut at = 0;
    for (text, &len) in texts.iter().zip(lengths) {
        for (slot, b) in bytes[at..].iter_mut().zip(text.bytes()) {
            *slot = i32::from(b);
        }
        at += len.max(0) as usize;
    }
    let bytes = exchange(Array::from_slice(&bytes, &[total as i32]))?;
    let bytes = host_slice::<i32>(Why::Collective, "the answers' bytes", &bytes)?;
    let mut out = Vec::with_capacity(texts.len());
    let mut at = 0;
    for &len in lengths {
        let len = len.max(0) as usize;
        let raw: Vec<u8> = bytes[at..at + len].iter().map(|&b| b as u8).collect();
        out.push(String::from_utf8(raw).map_err(|e| distributed(group, "gathering texts", e))?);
        at += len;
    }
    Ok((out, (sums[0] as usize, sums[1] as usize)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_balance_prompt_tokens_and_cover_every_conversation() {
        let owner = shares(&[100, 10, 90, 20, 50, 50], 2);
        let load = |r| {
            owner
                .iter()
                .zip([100, 10, 90, 20, 50, 50])
                .filter(|(&o, _)| o == r)
                .map(|(_, l)| l)
                .sum::<usize>()
        };
        assert_eq!(load(0) + load(1), 320);
        assert!(load(0).abs_diff(load(1)) <= 20, "{owner:?}");
        assert_eq!(shares(&[5, 5, 5], 1), vec![0, 0, 0]);
        // More ranks than conversations: each goes to its own rank.
        assert_eq!(shares(&[3, 2], 4), vec![0, 1]);
    }
}

//! Byte shuffling: group the bytes of `n` elements of `t` bytes by their
//! position within the element, `out[j*n + i] = in[i*t + j]`.
//!
//! Floats' exponent bytes are similar across a tensor and their low mantissa
//! bytes are noise; grouping them lets zstd find the structure.

/// Shuffles the elements `first..first + count` of a tensor of `n` elements
/// into `out` (the whole shuffled tensor, `n * t` bytes). `chunk` holds those
/// elements' bytes in their natural order. Callers feed a tensor chunk by
/// chunk, so it never needs to be in memory twice.
pub(crate) fn shuffle_chunk(chunk: &[u8], t: usize, first: usize, n: usize, out: &mut [u8]) {
    debug_assert_eq!(chunk.len() % t, 0);
    debug_assert_eq!(out.len(), n * t);
    let count = chunk.len() / t;
    for j in 0..t {
        let plane = &mut out[j * n + first..j * n + first + count];
        for (dst, element) in plane.iter_mut().zip(chunk.chunks_exact(t)) {
            *dst = element[j];
        }
    }
}

/// The inverse for a chunk: writes elements `first..first + count` of the
/// unshuffled tensor into `chunk`, reading from the whole shuffled tensor.
pub(crate) fn unshuffle_chunk(shuffled: &[u8], t: usize, first: usize, n: usize, chunk: &mut [u8]) {
    debug_assert_eq!(chunk.len() % t, 0);
    debug_assert_eq!(shuffled.len(), n * t);
    let count = chunk.len() / t;
    for j in 0..t {
        let plane = &shuffled[j * n + first..j * n + first + count];
        for (element, &byte) in chunk.chunks_exact_mut(t).zip(plane) {
            element[j] = byte;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn matches_the_definition() {
        // Two 4-byte elements: bytes 0..4 and 4..8.
        let input: Vec<u8> = (0..8).collect();
        let mut out = vec![0; 8];
        shuffle_chunk(&input, 4, 0, 2, &mut out);
        assert_eq!(out, [0, 4, 1, 5, 2, 6, 3, 7]);
    }

    proptest! {
        #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

        /// Shuffling in arbitrary chunks and unshuffling in other chunks gives
        /// back the input, and the shuffle equals the one-shot definition.
        #[test]
        fn chunked_round_trip(t in prop::sample::select(vec![1usize, 2, 4, 8]), n in 0usize..300, split in 1usize..64, seed in any::<u8>()) {
            let input: Vec<u8> = (0..n * t).map(|k| (k as u8).wrapping_mul(31).wrapping_add(seed)).collect();
            let mut shuffled = vec![0; n * t];
            let mut first = 0;
            for chunk in input.chunks(split * t) {
                shuffle_chunk(chunk, t, first, n, &mut shuffled);
                first += chunk.len() / t;
            }
            for i in 0..n {
                for j in 0..t {
                    prop_assert_eq!(shuffled[j * n + i], input[i * t + j]);
                }
            }
            let mut back = vec![0; n * t];
            let mut first = 0;
            for chunk in back.chunks_mut((split + 3) * t) {
                unshuffle_chunk(&shuffled, t, first, n, chunk);
                first += chunk.len() / t;
            }
            prop_assert_eq!(back, input);
        }
    }
}

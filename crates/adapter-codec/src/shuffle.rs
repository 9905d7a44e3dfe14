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
    // Read each element once and write it to its t planes; the fixed-size
    // cases let the compiler keep the planes in registers and vectorize.
    match t {
        2 => {
            let (p0, p1) = planes2(out, n, first, count);
            for (i, e) in chunk.chunks_exact(2).enumerate() {
                p0[i] = e[0];
                p1[i] = e[1];
            }
        }
        4 => {
            let [p0, p1, p2, p3] = planes4(out, n, first, count);
            for (i, e) in chunk.chunks_exact(4).enumerate() {
                p0[i] = e[0];
                p1[i] = e[1];
                p2[i] = e[2];
                p3[i] = e[3];
            }
        }
        _ => {
            for j in 0..t {
                let plane = &mut out[j * n + first..j * n + first + count];
                for (dst, element) in plane.iter_mut().zip(chunk.chunks_exact(t)) {
                    *dst = element[j];
                }
            }
        }
    }
}

/// The inverse for a chunk: writes elements `first..first + count` of the
/// unshuffled tensor into `chunk`, reading from the whole shuffled tensor.
pub(crate) fn unshuffle_chunk(shuffled: &[u8], t: usize, first: usize, n: usize, chunk: &mut [u8]) {
    debug_assert_eq!(chunk.len() % t, 0);
    debug_assert_eq!(shuffled.len(), n * t);
    let count = chunk.len() / t;
    let plane = |j: usize| &shuffled[j * n + first..j * n + first + count];
    match t {
        2 => {
            let (p0, p1) = (plane(0), plane(1));
            for (i, e) in chunk.chunks_exact_mut(2).enumerate() {
                e[0] = p0[i];
                e[1] = p1[i];
            }
        }
        4 => {
            let (p0, p1, p2, p3) = (plane(0), plane(1), plane(2), plane(3));
            for (i, e) in chunk.chunks_exact_mut(4).enumerate() {
                e[0] = p0[i];
                e[1] = p1[i];
                e[2] = p2[i];
                e[3] = p3[i];
            }
        }
        _ => {
            for j in 0..t {
                for (element, &byte) in chunk.chunks_exact_mut(t).zip(plane(j)) {
                    element[j] = byte;
                }
            }
        }
    }
}

/// The two planes' windows for elements `first..first + count`.
fn planes2(out: &mut [u8], n: usize, first: usize, count: usize) -> (&mut [u8], &mut [u8]) {
    let (a, b) = out.split_at_mut(n);
    (&mut a[first..first + count], &mut b[first..first + count])
}

/// The four planes' windows for elements `first..first + count`.
fn planes4(out: &mut [u8], n: usize, first: usize, count: usize) -> [&mut [u8]; 4] {
    let (a, rest) = out.split_at_mut(n);
    let (b, rest) = rest.split_at_mut(n);
    let (c, d) = rest.split_at_mut(n);
    [a, b, c, d].map(|p| &mut p[first..first + count])
}

/// Byte-shuffles a whole tensor of `typesize`-byte elements:
/// `out[j*n + i] = input[i*typesize + j]`. `out` must be as long as `input`,
/// and `input.len()` a multiple of `typesize`.
pub fn shuffle_bytes(input: &[u8], typesize: usize, out: &mut [u8]) {
    assert!(typesize > 0 && input.len().is_multiple_of(typesize) && out.len() == input.len());
    shuffle_chunk(input, typesize, 0, input.len() / typesize, out);
}

/// The inverse of [`shuffle_bytes`].
pub fn unshuffle_bytes(shuffled: &[u8], typesize: usize, out: &mut [u8]) {
    assert!(typesize > 0 && shuffled.len().is_multiple_of(typesize) && out.len() == shuffled.len());
    unshuffle_chunk(shuffled, typesize, 0, shuffled.len() / typesize, out);
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

//! The packed kernel held to the scalar loop, on every instruction set
//! this CPU runs.

use super::*;
use crate::Pool;

/// Pseudo-random words and values from a seed.
fn words(n: usize, seed: u64) -> Vec<u32> {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 32) as u32
        })
        .collect()
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    words(n, seed)
        .into_iter()
        .map(|w| (w % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// The values the kernel unpacks and sums, as a scalar loop: `scale ·
/// q + bias` (a product, then a sum), each output summed over the
/// part's columns in order with fused multiply-adds.
fn scalar(m: &PackedMatrix<'_>, outs: Range<usize>, cols: Range<usize>, x: &[f32]) -> Vec<f32> {
    let rows = x.len() / cols.len();
    let mut y = Vec::new();
    for r in 0..rows {
        for o in outs.clone() {
            let mut acc = 0f32;
            for (i, k) in cols.clone().enumerate() {
                let byte = 4 * (o * m.row_words + k / 8);
                let word = u32::from_le_bytes(m.words[byte..byte + 4].try_into().unwrap());
                let q = ((word >> (4 * (k % 8))) & 15) as f32;
                let at = o * m.row_groups + k / m.group_size;
                let v = q * m.scales.at(at) + m.biases.at(at);
                acc = x[r * cols.len() + i].mul_add(v, acc);
            }
            y.push(acc);
        }
    }
    y
}

/// Row counts around the tiles, a part of the outputs and of the
/// columns, f32 and half-width scales: the scalar loop's bits, on one
/// thread or three, and a row alone the same as in a batch.
#[test]
fn sums_equal_the_scalar_loop_bit_for_bit() {
    for isa in crate::isa::each_available() {
        sums_on(isa);
    }
}

fn sums_on(isa: Isa) {
    let pool = Pool::new(3).unwrap();
    let (outputs, inputs, gs) = (96usize, 192usize, 32usize);
    let w = words(outputs * inputs / 8, 1);
    let (s, b) = (
        values(outputs * inputs / gs, 2),
        values(outputs * inputs / gs, 3),
    );
    let (s_bf, b_bf): (Vec<bf16>, Vec<bf16>) = (
        s.iter().map(|&v| bf16::from_f32(v)).collect(),
        b.iter().map(|&v| bf16::from_f32(v)).collect(),
    );
    let (s_h, b_h): (Vec<f16>, Vec<f16>) = (
        s.iter().map(|&v| f16::from_f32(v)).collect(),
        b.iter().map(|&v| f16::from_f32(v)).collect(),
    );
    let scales = [
        (Scales::F32(&s), Scales::F32(&b)),
        (Scales::Bf16(&s_bf), Scales::Bf16(&b_bf)),
        (Scales::F16(&s_h), Scales::F16(&b_h)),
    ];
    for (scales, biases) in scales {
        let m = PackedMatrix::new(&w, inputs / 8, scales, biases, gs).unwrap();
        for (outs, cols) in [(0..96, 0..192), (32..96, 64..160)] {
            for rows in [1usize, 2, 7, 8, 9, 17, 32] {
                let x = values(rows * cols.len(), rows as u64);
                let mut one = vec![0f32; rows * outs.len()];
                let mut three = vec![0f32; rows * outs.len()];
                let call = |y: &mut [f32], w| {
                    multiply_on(isa, &m, outs.clone(), cols.clone(), &x, rows, y, w)
                };
                call(&mut one, pool.workers(1)).unwrap();
                call(&mut three, pool.workers(3)).unwrap();
                assert_eq!(
                    one,
                    scalar(&m, outs.clone(), cols.clone(), &x),
                    "{isa}, {rows} rows"
                );
                assert_eq!(one, three, "{isa}, {rows} rows: threads changed the sums");
                let mut alone = vec![0f32; outs.len()];
                let last = &x[(rows - 1) * cols.len()..];
                multiply_on(
                    isa,
                    &m,
                    outs.clone(),
                    cols.clone(),
                    last,
                    1,
                    &mut alone,
                    Workers::inline(),
                )
                .unwrap();
                assert_eq!(
                    alone[..],
                    one[(rows - 1) * outs.len()..],
                    "{isa}: a row alone"
                );
            }
        }
    }
}

/// Each choice of a routed product equals its row times its expert
/// alone, in both layouts (a row per choice; a row per two choices).
#[test]
fn routed_choices_equal_their_expert_alone() {
    for isa in crate::isa::each_available() {
        routed_on_each(isa);
    }
}

fn routed_on_each(isa: Isa) {
    let (n, out, inputs, gs) = (6usize, 64usize, 96usize, 32usize);
    let w = words(n * out * inputs / 8, 4);
    let (s, b) = (
        values(n * out * inputs / gs, 5),
        values(n * out * inputs / gs, 6),
    );
    let stack = PackedMatrix::new(&w, inputs / 8, Scales::F32(&s), Scales::F32(&b), gs).unwrap();
    let pool = Pool::new(2).unwrap();
    // 20 choices among the 6 experts, expert 3 chosen 11 times.
    let ids: [u32; 20] = [3, 0, 3, 5, 3, 3, 1, 3, 3, 2, 3, 3, 0, 3, 5, 3, 1, 3, 4, 2];
    for rows in [20usize, 10] {
        let x = values(rows * inputs, 7);
        let mut y = vec![0f32; ids.len() * out];
        routed_on(isa, &stack, out, &x, rows, &ids, &mut y, pool.workers(2)).unwrap();
        for (c, &e) in ids.iter().enumerate() {
            let r = c / (ids.len() / rows);
            let mut alone = vec![0f32; out];
            let outs = e as usize * out..(e as usize + 1) * out;
            let row = &x[r * inputs..(r + 1) * inputs];
            multiply_on(
                isa,
                &stack,
                outs,
                0..inputs,
                row,
                1,
                &mut alone,
                Workers::inline(),
            )
            .unwrap();
            assert_eq!(
                alone[..],
                y[c * out..(c + 1) * out],
                "{isa}: choice {c}, {rows} rows"
            );
        }
    }
}

/// What does not fit is a typed error naming it, and writes nothing.
#[test]
fn parts_and_slices_that_do_not_fit_are_refused() {
    let w = words(64 * 8, 8);
    let s = values(64 * 2, 9);
    let f = |s| Scales::F32(s);
    let bad = PackedMatrix::new(&w, 8, f(&s), f(&s[1..]), 32);
    assert!(matches!(bad, Err(Error::Shape { what, .. }) if what.starts_with("biases")));
    let bad = PackedMatrix::new(&w, 8, f(&s), f(&s), 12);
    assert!(matches!(
        bad,
        Err(Error::Unaligned {
            what: "the group size",
            ..
        })
    ));
    assert!(PackedMatrix::new(&[], 8, f(&[]), f(&[]), 32).is_err());
    assert!(PackedMatrix::new(&w, 0, f(&s), f(&s), 32).is_err());
    let m = PackedMatrix::new(&w, 8, f(&s), f(&s), 32).unwrap();
    assert_eq!((m.outputs(), m.inputs()), (64, 64));
    if !crate::supported() {
        let mut y = vec![0f32; 32];
        let got = multiply(&m, 0..32, 0..64, &[0.0; 64], 1, &mut y, Workers::inline());
        assert!(matches!(got, Err(Error::Unsupported)));
        return;
    }
    let x = [1f32; 64];
    let mut y = vec![7f32; 64];
    let call = |outs: Range<usize>, cols: Range<usize>, y: &mut [f32]| {
        multiply(
            &m,
            outs,
            cols.clone(),
            &x[..cols.len()],
            1,
            y,
            Workers::inline(),
        )
    };
    assert!(matches!(
        call(0..48, 0..64, &mut y[..48]),
        Err(Error::Unaligned { .. })
    ));
    assert!(matches!(
        call(32..96, 0..64, &mut y),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        call(0..32, 16..48, &mut y[..32]),
        Err(Error::Unaligned { .. })
    ));
    assert!(matches!(
        call(0..32, 0..64, &mut y[..31]),
        Err(Error::Shape { .. })
    ));
    assert!(y.iter().all(|&v| v == 7.0), "nothing written");
    let routed_call = |ids: &[u32], y: &mut [f32]| routed(&m, 32, &x, 1, ids, y, Workers::inline());
    assert!(matches!(
        routed_call(&[0, 2], &mut y),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        routed_call(&[0, 1], &mut y[..32]),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        routed(&m, 48, &x, 1, &[0], &mut y, Workers::inline()),
        Err(Error::Unaligned { .. })
    ));
    routed_call(&[1, 0], &mut y).unwrap();
}

/// Words, scales and biases given as little-endian bytes one byte past
/// an aligned address (as a file's map can hold them) give the sums the
/// aligned values give, bit for bit, on every instruction set; bytes that
/// are no whole number of values are refused.
#[test]
fn unaligned_bytes_give_the_same_sums() {
    let (outputs, inputs, gs) = (64usize, 128usize, 32usize);
    let w = words(outputs * inputs / 8, 11);
    let (s, b) = (
        values(outputs * inputs / gs, 12),
        values(outputs * inputs / gs, 13),
    );
    let (s_bf, b_bf): (Vec<bf16>, Vec<bf16>) = (
        s.iter().map(|&v| bf16::from_f32(v)).collect(),
        b.iter().map(|&v| bf16::from_f32(v)).collect(),
    );
    // Each slice's bytes after one byte of padding: unaligned for u32,
    // f32 and the half widths alike.
    let shifted = |bytes: &[u8]| {
        let mut v = vec![0u8];
        v.extend_from_slice(bytes);
        v
    };
    let w_le = shifted(bytemuck::cast_slice(&w));
    let (s_le, b_le) = (
        shifted(bytemuck::cast_slice(&s)),
        shifted(bytemuck::cast_slice(&b)),
    );
    let half_bytes = |h: &[bf16]| -> Vec<u8> { h.iter().flat_map(|v| v.to_le_bytes()).collect() };
    let (s_bf_le, b_bf_le) = (shifted(&half_bytes(&s_bf)), shifted(&half_bytes(&b_bf)));
    let pairs = [
        (
            (Scales::F32(&s), Scales::F32(&b)),
            (Scales::F32Le(&s_le[1..]), Scales::F32Le(&b_le[1..])),
        ),
        (
            (Scales::Bf16(&s_bf), Scales::Bf16(&b_bf)),
            (Scales::Bf16Le(&s_bf_le[1..]), Scales::Bf16Le(&b_bf_le[1..])),
        ),
    ];
    for isa in crate::isa::each_available() {
        for ((s, b), (s_le, b_le)) in pairs {
            let aligned = PackedMatrix::new(&w, inputs / 8, s, b, gs).unwrap();
            let bytes =
                PackedMatrix::from_le_bytes(&w_le[1..], inputs / 8, s_le, b_le, gs).unwrap();
            for rows in [1usize, 3, 9] {
                let x = values(rows * inputs, rows as u64);
                let run = |m: &PackedMatrix<'_>| {
                    let mut y = vec![0f32; rows * outputs];
                    multiply_on(
                        isa,
                        m,
                        0..outputs,
                        0..inputs,
                        &x,
                        rows,
                        &mut y,
                        Workers::inline(),
                    )
                    .unwrap();
                    y
                };
                assert_eq!(run(&bytes), run(&aligned), "{isa}, {rows} rows");
            }
        }
    }
    let ragged = PackedMatrix::from_le_bytes(
        &w_le[1..w_le.len() - 1],
        inputs / 8,
        pairs[0].1 .0,
        pairs[0].1 .1,
        gs,
    );
    assert!(matches!(ragged, Err(Error::Unaligned { .. })));
    let ragged_scales = Scales::F32Le(&s_le[1..s_le.len() - 1]);
    let bad = PackedMatrix::from_le_bytes(&w_le[1..], inputs / 8, ragged_scales, ragged_scales, gs);
    assert!(matches!(bad, Err(Error::Shape { .. })));
}

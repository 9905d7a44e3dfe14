//! Products with weights in MLX's 4-bit packing, read as packed.
//!
//! MLX packs a weight `(outputs, inputs)` as `(outputs, inputs / 8)` u32
//! words, value `e` of a word at bits `4e`, with a scale and a bias per
//! output and group of `group_size` inputs; a value is `scale · q + bias`.
//! The kernel reads the words themselves, 32 outputs at a time: for each
//! word, one gather of 16 outputs' words per register, whose eight values
//! are unpacked in registers (a product, then a sum: the f32 values MLX's
//! unpacking gives) and multiplied by up to eight rows at once. For more
//! than eight rows each panel of 32 outputs is unpacked once into a small
//! buffer in [`panels`](crate::panels)' layout and the dense kernel
//! multiplies every eight rows by it: the same values and the same sums, so
//! a row's result does not depend on its batch. No dense matrix is written.

use std::ops::Range;

use half::{bf16, f16};

use crate::error::{aligned, expect, within, Error, Result};
use crate::isa::Isa;
use crate::panels::panel_tile;
use crate::pool::Workers;
use crate::tiles::{each_tile, Tile, PANEL};

/// A matrix's scales or biases, one per output and group, in the dtype
/// the checkpoint holds them.
#[derive(Debug, Clone, Copy)]
pub enum Scales<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl Scales<'_> {
    fn len(&self) -> usize {
        match self {
            Scales::F32(s) => s.len(),
            Scales::Bf16(s) => s.len(),
            Scales::F16(s) => s.len(),
        }
    }

    /// Element `i` in f32 (exact from either half width), as the tests'
    /// scalar loop reads it.
    #[cfg(test)]
    fn at(&self, i: usize) -> f32 {
        match self {
            Scales::F32(s) => s[i],
            Scales::Bf16(s) => s[i].to_f32(),
            Scales::F16(s) => s[i].to_f32(),
        }
    }
}

/// A whole matrix in MLX's 4-bit packing: `words` `(outputs, row_words)`
/// with `scales` and `biases` `(outputs, inputs / group_size)`, all
/// row-contiguous. A stack of experts is one matrix of `experts · outputs`
/// rows.
#[derive(Debug, Clone, Copy)]
pub struct PackedMatrix<'a> {
    words: &'a [u32],
    row_words: usize,
    scales: Scales<'a>,
    biases: Scales<'a>,
    row_groups: usize,
    group_size: usize,
}

impl<'a> PackedMatrix<'a> {
    /// The matrix whose rows are `row_words` words each.
    ///
    /// # Errors
    /// [`Error::Shape`] when the slices do not fit each other (or are
    /// empty); [`Error::Unaligned`] for a group size that is not a whole
    /// number of words.
    pub fn new(
        words: &'a [u32],
        row_words: usize,
        scales: Scales<'a>,
        biases: Scales<'a>,
        group_size: usize,
    ) -> Result<PackedMatrix<'a>> {
        // A group of no inputs is aligned to anything, and divides by zero.
        if group_size == 0 {
            return Err(Error::Unaligned {
                what: "the group size",
                value: 0,
                multiple: 8,
            });
        }
        aligned("the group size", group_size, 8)?;
        let outputs = words.len().checked_div(row_words).unwrap_or(0);
        if outputs == 0 {
            return Err(Error::Shape {
                what: "words: at least one row of row_words",
                expected: row_words.max(1),
                actual: words.len(),
            });
        }
        expect(
            "words: outputs × row_words",
            outputs * row_words,
            words.len(),
        )?;
        let row_groups = row_words * 8 / group_size;
        expect(
            "scales: outputs × groups",
            outputs * row_groups,
            scales.len(),
        )?;
        expect("biases: as many as the scales", scales.len(), biases.len())?;
        aligned("a row's inputs", row_words * 8, group_size)?;
        // The gathers index words with i32 offsets from a panel's first row.
        within("a panel's words", PANEL * row_words, i32::MAX as usize)?;
        Ok(PackedMatrix {
            words,
            row_words,
            scales,
            biases,
            row_groups,
            group_size,
        })
    }

    /// Outputs (rows of the matrix).
    pub fn outputs(&self) -> usize {
        self.words.len() / self.row_words
    }

    /// Inputs (columns).
    pub fn inputs(&self) -> usize {
        self.row_words * 8
    }

    /// The part of the matrix a product reads, checked to be inside it and
    /// on the kernel's edges.
    fn part(&self, outputs: &Range<usize>, columns: &Range<usize>) -> Result<Part<'_, 'a>> {
        aligned("the first output", outputs.start, PANEL)?;
        aligned("the outputs", outputs.len(), PANEL)?;
        within("the outputs' end", outputs.end, self.outputs())?;
        aligned("the first column", columns.start, self.group_size)?;
        aligned("the columns", columns.len(), self.group_size)?;
        within("the columns' end", columns.end, self.inputs())?;
        Ok(Part {
            m: self,
            first_output: outputs.start,
            first_column: columns.start,
            inputs: columns.len(),
        })
    }
}

/// The outputs from `first_output` on (32 per panel) and `inputs` columns
/// from `first_column` of a matrix.
struct Part<'m, 'a> {
    m: &'m PackedMatrix<'a>,
    first_output: usize,
    first_column: usize,
    inputs: usize,
}

impl Part<'_, '_> {
    /// The `N` scales (or biases) of the part's outputs from `first` on
    /// for group `g` of its columns. The dtype is matched once per call,
    /// not per value: this runs once per group of every panel.
    fn group_values<const N: usize>(&self, values: Scales<'_>, first: usize, g: usize) -> [f32; N] {
        let group = self.first_column / self.m.group_size + g;
        let first = self.first_output + first;
        let at = |j: usize| (first + j) * self.m.row_groups + group;
        match values {
            Scales::F32(s) => std::array::from_fn(|j| s[at(j)]),
            Scales::Bf16(s) => std::array::from_fn(|j| s[at(j)].to_f32()),
            Scales::F16(s) => std::array::from_fn(|j| s[at(j)].to_f32()),
        }
    }
}

/// `y` `(rows, outputs.len())` = `x · W[outputs, columns]ᵀ` for `x`
/// `(rows, columns.len())`, the panels shared out over `workers`.
/// `outputs` fall on panels of [`PANEL`], `columns` on whole groups.
///
/// # Errors
/// [`Error::Unsupported`] on a CPU the kernels do not run on ([`Isa`]);
/// [`Error::Unaligned`], [`Error::OutOfRange`] or [`Error::Shape`] when
/// the ranges or slices do not fit. Nothing is written then.
pub fn multiply(
    m: &PackedMatrix<'_>,
    outputs: Range<usize>,
    columns: Range<usize>,
    x: &[f32],
    rows: usize,
    y: &mut [f32],
    workers: Workers<'_>,
) -> Result<()> {
    let isa = Isa::best().ok_or(Error::Unsupported)?;
    multiply_on(isa, m, outputs, columns, x, rows, y, workers)
}

/// [`multiply`] on `isa`.
#[expect(
    clippy::too_many_arguments,
    reason = "multiply's, and the instructions"
)]
pub(crate) fn multiply_on(
    isa: Isa,
    m: &PackedMatrix<'_>,
    outputs: Range<usize>,
    columns: Range<usize>,
    x: &[f32],
    rows: usize,
    y: &mut [f32],
    workers: Workers<'_>,
) -> Result<()> {
    if !isa.available() {
        return Err(Error::Unsupported);
    }
    let part = m.part(&outputs, &columns)?;
    expect("x: rows × columns", rows * columns.len(), x.len())?;
    expect("y: rows × outputs", rows * outputs.len(), y.len())?;
    multiply_part(isa, &part, x, rows, y, workers);
    Ok(())
}

/// [`multiply`] once its arguments are checked, on `isa` (available).
fn multiply_part(
    isa: Isa,
    part: &Part<'_, '_>,
    x: &[f32],
    rows: usize,
    y: &mut [f32],
    workers: Workers<'_>,
) {
    let count = y.len() / (rows * PANEL).max(1);
    if rows <= isa.packed_register_rows() {
        // Few rows: each word unpacked in registers as it is used.
        each_tile(rows, count, y, workers, |tile: Tile| {
            // SAFETY: the caller checked `isa` and that the part is
            // inside the matrix; `x` is `tile.rows` rows of `part.inputs`
            // (at most `isa.packed_register_rows()`); the tile's sums are
            // its own (`each_tile`).
            unsafe { packed_tile(isa, part, x, &tile) };
        });
        return;
    }
    // More rows: each panel unpacked once, to the same values, into a
    // buffer in the dense panel layout, which the dense kernel then
    // multiplies by every tile of rows (the same sums in the same order).
    each_tile(rows, count, y, workers, |tile: Tile| {
        UNPACKED.with_borrow_mut(|panel| {
            if tile.row == 0 {
                panel.resize(part.inputs * PANEL, 0.0);
                // SAFETY: the caller checked `isa` and that the part is
                // inside the matrix; `panel` holds `inputs × PANEL` floats.
                unsafe { unpack(isa, part, tile.panel, panel) };
            }
            let x = &x[tile.row * part.inputs..(tile.row + tile.rows) * part.inputs];
            // SAFETY: `isa` (checked); `x` is `tile.rows` rows, `panel`
            // this tile's panel, unpacked at its first tile (`each_tile`
            // hands a panel's tiles out in order on one thread); the
            // tile's sums are its own.
            unsafe { panel_tile(isa, x, part.inputs, panel, &tile) };
        });
    });
}

/// `y` `(choices, expert_outputs)`: for each choice `c`, row `c / (choices
/// / rows)` of `x` `(rows, inputs)` times expert `experts[c]`'s matrix of
/// the `stack` (`experts · expert_outputs` rows). The rows that chose an
/// expert are gathered and multiplied by its words together, so each
/// expert is read once; a choice's sums are the same bits whichever rows
/// share its expert.
///
/// # Errors
/// As [`multiply`]'s; [`Error::OutOfRange`] for an expert past the stack.
pub fn routed(
    stack: &PackedMatrix<'_>,
    expert_outputs: usize,
    x: &[f32],
    rows: usize,
    experts: &[u32],
    y: &mut [f32],
    workers: Workers<'_>,
) -> Result<()> {
    let isa = Isa::best().ok_or(Error::Unsupported)?;
    routed_on(isa, stack, expert_outputs, x, rows, experts, y, workers)
}

/// [`routed`] on `isa`.
#[expect(clippy::too_many_arguments, reason = "routed's, and the instructions")]
pub(crate) fn routed_on(
    isa: Isa,
    stack: &PackedMatrix<'_>,
    expert_outputs: usize,
    x: &[f32],
    rows: usize,
    experts: &[u32],
    y: &mut [f32],
    workers: Workers<'_>,
) -> Result<()> {
    if !isa.available() {
        return Err(Error::Unsupported);
    }
    aligned("an expert's outputs", expert_outputs, PANEL)?;
    aligned("the stack's outputs", stack.outputs(), expert_outputs)?;
    let count = stack.outputs() / expert_outputs;
    let inputs = stack.inputs();
    expect("x: rows × inputs", rows * inputs, x.len())?;
    let choices = experts.len();
    if rows == 0 {
        return expect("choices without rows", 0, choices);
    }
    aligned("the choices", choices, rows)?;
    expect("y: choices × outputs", choices * expert_outputs, y.len())?;
    let last = experts.iter().map(|&e| e as usize + 1).max().unwrap_or(0);
    within("an expert", last, count)?;
    let per_row = choices / rows;
    // The choices by expert (stable: a run keeps the choices' order).
    let mut order: Vec<usize> = (0..choices).collect();
    order.sort_by_key(|&c| experts[c]);
    let (mut run_x, mut run_y) = (Vec::new(), Vec::new());
    for run in order.chunk_by(|&a, &b| experts[a] == experts[b]) {
        let first = experts[run[0]] as usize * expert_outputs;
        let part = stack.part(&(first..first + expert_outputs), &(0..inputs))?;
        run_x.clear();
        for &c in run {
            let r = c / per_row;
            run_x.extend_from_slice(&x[r * inputs..(r + 1) * inputs]);
        }
        run_y.clear();
        run_y.resize(run.len() * expert_outputs, 0.0);
        multiply_part(isa, &part, &run_x, run.len(), &mut run_y, workers);
        for (j, &c) in run.iter().enumerate() {
            y[c * expert_outputs..(c + 1) * expert_outputs]
                .copy_from_slice(&run_y[j * expert_outputs..(j + 1) * expert_outputs]);
        }
    }
    Ok(())
}

thread_local! {
    /// The panel being multiplied on this thread, unpacked.
    static UNPACKED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `isa`'s register kernel for `tile.rows` rows (at most
/// `isa.packed_register_rows()`).
///
/// # Safety
/// As [`avx512::tile`]'s (or [`avx2::tile`]'s), on `isa`.
unsafe fn packed_tile(isa: Isa, part: &Part<'_, '_>, x: &[f32], tile: &Tile) {
    let x = &x[tile.row * part.inputs..(tile.row + tile.rows) * part.inputs];
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as the caller promises.
    unsafe {
        match (isa, tile.rows) {
            (Isa::Avx512F, 1) => avx512::tile::<1>(part, x, tile),
            (Isa::Avx512F, 2) => avx512::tile::<2>(part, x, tile),
            (Isa::Avx512F, 3) => avx512::tile::<3>(part, x, tile),
            (Isa::Avx512F, 4) => avx512::tile::<4>(part, x, tile),
            (Isa::Avx512F, 5) => avx512::tile::<5>(part, x, tile),
            (Isa::Avx512F, 6) => avx512::tile::<6>(part, x, tile),
            (Isa::Avx512F, 7) => avx512::tile::<7>(part, x, tile),
            (Isa::Avx512F, _) => avx512::tile::<8>(part, x, tile),
            (Isa::Avx2Fma, 1) => avx2::tile::<1>(part, x, tile),
            (Isa::Avx2Fma, 2) => avx2::tile::<2>(part, x, tile),
            (Isa::Avx2Fma, _) => avx2::tile::<3>(part, x, tile),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // Unreachable: no instruction set is available here, and callers
        // return `Unsupported` first.
        let _ = (isa, part, x, tile);
    }
}

/// Panel `panel` of the part unpacked into `out` on `isa`.
///
/// # Safety
/// As [`avx512::unpack`]'s (or [`avx2::unpack`]'s), on `isa`.
unsafe fn unpack(isa: Isa, part: &Part<'_, '_>, panel: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as the caller promises.
    unsafe {
        match isa {
            Isa::Avx512F => avx512::unpack(part, panel, out),
            Isa::Avx2Fma => avx2::unpack(part, panel, out),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // Unreachable, as in `packed_tile`.
        let _ = (isa, part, panel, out);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests {
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
                    let word = m.words[o * m.row_words + k / 8];
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
        let stack =
            PackedMatrix::new(&w, inputs / 8, Scales::F32(&s), Scales::F32(&b), gs).unwrap();
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
        let routed_call =
            |ids: &[u32], y: &mut [f32]| routed(&m, 32, &x, 1, ids, y, Workers::inline());
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
}

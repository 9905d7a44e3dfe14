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
/// the checkpoint holds them: as values, or as the little-endian bytes a
/// file holds them in, at any alignment (a memory map of a safetensors
/// file, whose header need not leave its data aligned).
#[derive(Debug, Clone, Copy)]
pub enum Scales<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
    F32Le(&'a [u8]),
    Bf16Le(&'a [u8]),
    F16Le(&'a [u8]),
}

impl Scales<'_> {
    /// How many values: for bytes that are no whole number of values,
    /// `usize::MAX`, which no shape check accepts.
    fn len(&self) -> usize {
        let values = |bytes: &[u8], size: usize| {
            if bytes.len().is_multiple_of(size) {
                bytes.len() / size
            } else {
                usize::MAX
            }
        };
        match self {
            Scales::F32(s) => s.len(),
            Scales::Bf16(s) => s.len(),
            Scales::F16(s) => s.len(),
            Scales::F32Le(b) => values(b, 4),
            Scales::Bf16Le(b) | Scales::F16Le(b) => values(b, 2),
        }
    }

    /// The `N` values at `at(0)`, …, `at(N - 1)` in f32 (exact from either
    /// half width). The dtype is matched once per call, not per value.
    fn gathered<const N: usize>(&self, at: impl Fn(usize) -> usize) -> [f32; N] {
        // Plain loops: `array::from_fn` over the byte variants was not
        // inlined (6% of a routed decode step's profile).
        fn each<const N: usize>(value: impl Fn(usize) -> f32) -> [f32; N] {
            let mut out = [0f32; N];
            for (j, v) in out.iter_mut().enumerate() {
                *v = value(j);
            }
            out
        }
        let four = |b: &[u8], i: usize| {
            let mut word = [0u8; 4];
            word.copy_from_slice(&b[4 * i..4 * i + 4]);
            f32::from_le_bytes(word)
        };
        let two = |b: &[u8], i: usize| u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
        match self {
            Scales::F32(s) => each(|j| s[at(j)]),
            Scales::Bf16(s) => each(|j| s[at(j)].to_f32()),
            Scales::F16(s) => each(|j| s[at(j)].to_f32()),
            Scales::F32Le(b) => each(|j| four(b, at(j))),
            Scales::Bf16Le(b) => each(|j| bf16::from_bits(two(b, at(j))).to_f32()),
            Scales::F16Le(b) => each(|j| f16::from_bits(two(b, at(j))).to_f32()),
        }
    }

    /// Element `i` in f32, as the tests' scalar loop reads it.
    #[cfg(test)]
    fn at(&self, i: usize) -> f32 {
        let [v] = self.gathered::<1>(|_| i);
        v
    }
}

/// A whole matrix in MLX's 4-bit packing: `words` `(outputs, row_words)`
/// with `scales` and `biases` `(outputs, inputs / group_size)`, all
/// row-contiguous. A stack of experts is one matrix of `experts · outputs`
/// rows.
#[derive(Debug, Clone, Copy)]
pub struct PackedMatrix<'a> {
    /// The words' little-endian bytes, at any alignment (the gathers read
    /// them unaligned).
    words: &'a [u8],
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
        let bytes = bytemuck::cast_slice(words);
        PackedMatrix::from_le_bytes(bytes, row_words, scales, biases, group_size)
    }

    /// [`new`](Self::new) for words given as their little-endian bytes, at
    /// any alignment: a memory map of the file that holds them.
    ///
    /// # Errors
    /// As [`new`](Self::new)'s; [`Error::Shape`] for bytes that are no
    /// whole number of words.
    pub fn from_le_bytes(
        words: &'a [u8],
        row_words: usize,
        scales: Scales<'a>,
        biases: Scales<'a>,
        group_size: usize,
    ) -> Result<PackedMatrix<'a>> {
        if !cfg!(target_endian = "little") {
            // The gathers read words in the CPU's order: little-endian on
            // every CPU the kernels run on.
            return Err(Error::Unsupported);
        }
        aligned("words: bytes", words.len(), 4)?;
        // A group of no inputs is aligned to anything, and divides by zero.
        if group_size == 0 {
            return Err(Error::Unaligned {
                what: "the group size",
                value: 0,
                multiple: 8,
            });
        }
        aligned("the group size", group_size, 8)?;
        let count = words.len() / 4;
        let outputs = count.checked_div(row_words).unwrap_or(0);
        if outputs == 0 {
            return Err(Error::Shape {
                what: "words: at least one row of row_words",
                expected: row_words.max(1),
                actual: count,
            });
        }
        expect("words: outputs × row_words", outputs * row_words, count)?;
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
        self.words.len() / 4 / self.row_words
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
        values.gathered(|j| (first + j) * self.m.row_groups + group)
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
mod tests;

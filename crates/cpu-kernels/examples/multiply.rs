//! Eight rows times a 576 → 1536 weight, both ways the kernels hold one:
//! dense in panels, and in MLX's 4-bit packing; each product checked
//! against the scalar loop it equals bit for bit.
//!
//! `cargo run -p cpu-kernels --example multiply`

use cpu_kernels::packed::{self, PackedMatrix, Scales};
use cpu_kernels::{panels, Pool, PANEL};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !cpu_kernels::supported() {
        println!(
            "this CPU has neither AVX-512F nor AVX2 with FMA: every call is Error::Unsupported"
        );
        return Ok(());
    }
    let (rows, inputs, outputs) = (8, 576, 1536);
    let value = |i: usize| ((i * 7919) % 2003) as f32 / 1001.0 - 1.0;
    let x: Vec<f32> = (0..rows * inputs).map(value).collect();
    let pool = Pool::new(std::thread::available_parallelism().map_or(1, usize::from))?;

    // Dense, in panels: `(outputs / PANEL, inputs, PANEL)`.
    let w: Vec<f32> = (0..outputs * inputs).map(|i| value(i + 1)).collect();
    let mut y = vec![0f32; rows * outputs];
    panels::multiply(&x, rows, inputs, &w, &mut y, pool.workers(pool.threads()))?;
    let scalar = |r: usize, o: usize| {
        let (p, c) = (o / PANEL, o % PANEL);
        (0..inputs).fold(0f32, |acc, k| {
            x[r * inputs + k].mul_add(w[(p * inputs + k) * PANEL + c], acc)
        })
    };
    let same = (0..rows).all(|r| (0..outputs).all(|o| y[r * outputs + o] == scalar(r, o)));
    println!("panels: {rows} rows × {inputs} → {outputs}, the scalar loop's bits: {same}");

    // Packed 4-bit, groups of 64, f32 scales and biases.
    let group = 64;
    let words: Vec<u32> = (0..outputs * inputs / 8)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761))
        .collect();
    let scales: Vec<f32> = (0..outputs * inputs / group)
        .map(|i| value(i + 7) / 8.0)
        .collect();
    let biases: Vec<f32> = (0..outputs * inputs / group)
        .map(|i| value(i + 9))
        .collect();
    let m = PackedMatrix::new(
        &words,
        inputs / 8,
        Scales::F32(&scales),
        Scales::F32(&biases),
        group,
    )?;
    let mut y = vec![0f32; rows * outputs];
    packed::multiply(
        &m,
        0..outputs,
        0..inputs,
        &x,
        rows,
        &mut y,
        pool.workers(pool.threads()),
    )?;
    let unpacked = |o: usize, k: usize| {
        let q = (words[o * inputs / 8 + k / 8] >> (4 * (k % 8))) & 15;
        let g = o * (inputs / group) + k / group;
        q as f32 * scales[g] + biases[g]
    };
    let same = (0..rows).all(|r| {
        (0..outputs).all(|o| {
            let want = (0..inputs).fold(0f32, |acc, k| {
                x[r * inputs + k].mul_add(unpacked(o, k), acc)
            });
            y[r * outputs + o] == want
        })
    });
    println!("packed 4-bit: the scalar loop's bits: {same}");
    Ok(())
}

//! Any dimensions and slices given to the CPU kernels: a result or a typed
//! error, never a panic or a write outside the output (the sanitizer's
//! part). The first bytes choose the dimensions; the rest are the words.
#![no_main]

use cpu_kernels::packed::{self, PackedMatrix, Scales};
use cpu_kernels::{panels, Workers, PANEL};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let (dims, rest) = data.split_at(8);
    let dim = |i: usize| usize::from(dims[i]);
    let (rows, inputs, count, row_words) = (dim(0), dim(1), dim(2), dim(3));
    let (group, out_start, out_len, experts) = (dim(4), dim(5), dim(6), dim(7));
    let words: Vec<u32> = rest
        .chunks(4)
        .map(|c| c.iter().fold(0u32, |w, &b| w << 8 | u32::from(b)))
        .collect();
    let floats: Vec<f32> = words.iter().map(|&w| (w % 1000) as f32 / 500.0 - 1.0).collect();
    let x: Vec<f32> = floats.iter().copied().cycle().take(rows % 16 * (inputs % 64)).collect();
    let w: Vec<f32> = floats
        .iter()
        .copied()
        .cycle()
        .take(count % 4 * (inputs % 64) * PANEL)
        .collect();
    let mut y = vec![0f32; rows % 16 * (count % 4) * PANEL + usize::from(data[0] & 1)];
    let _ = panels::multiply(&x, rows % 16, inputs % 64, &w, &mut y, Workers::inline());

    let scales: Vec<f32> = floats.iter().copied().cycle().take(words.len()).collect();
    if let Ok(m) = PackedMatrix::new(
        &words,
        row_words % 16,
        Scales::F32(&scales),
        Scales::F32(&scales),
        group % 64,
    ) {
        let outputs = out_start % 128..out_start % 128 + out_len % 128;
        let columns = 0..m.inputs();
        let mut y = vec![0f32; rows % 16 * outputs.len()];
        let x: Vec<f32> = floats.iter().copied().cycle().take(rows % 16 * columns.len()).collect();
        let _ = packed::multiply(&m, outputs, columns, &x, rows % 16, &mut y, Workers::inline());
        let ids: Vec<u32> = rest.iter().take(rows % 16).map(|&b| u32::from(b) % (experts as u32 + 1)).collect();
        let x: Vec<f32> = floats.iter().copied().cycle().take(ids.len() * m.inputs()).collect();
        let mut y = vec![0f32; ids.len() * PANEL];
        let _ = packed::routed(&m, PANEL, &x, ids.len(), &ids, &mut y, Workers::inline());
    }

    // The same as a file's bytes, one byte off alignment and of any length.
    let bytes = &rest[usize::from(data[1] & 1).min(rest.len())..];
    let half = bytes.len() / 2;
    let scales = Scales::Bf16Le(&bytes[..half]);
    if let Ok(m) = PackedMatrix::from_le_bytes(bytes, row_words % 16, scales, scales, group % 64) {
        let outputs = out_start % 128..out_start % 128 + out_len % 128;
        let columns = 0..m.inputs();
        let mut y = vec![0f32; rows % 16 * outputs.len()];
        let x: Vec<f32> = floats.iter().copied().cycle().take(rows % 16 * columns.len()).collect();
        let _ = packed::multiply(&m, outputs, columns, &x, rows % 16, &mut y, Workers::inline());
    }
});

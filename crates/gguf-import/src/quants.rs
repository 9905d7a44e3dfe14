//! ggml's tensor encodings decoded to f32, for the GGUF tensors MLX's own
//! loader cannot serve (it rejects Q5_0 and decodes Q4_K wrongly: see
//! docs/gguf-import.md). Each decoder follows ggml's block layout; the tests
//! compare them with the `gguf` Python package's `dequantize` on a real
//! file (`tests/gemma3.rs`).

use half::{bf16, f16};

use crate::check::{GgmlType, BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0};

fn half(bytes: &[u8]) -> f32 {
    f16::from_le_bytes([bytes[0], bytes[1]]).to_f32()
}

/// `bytes` (whole blocks of `ty`, as the GGUF check guarantees) as f32s.
pub(crate) fn dequantize(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let blocks = bytes.chunks_exact(ty.block_bytes as usize);
    let mut out = Vec::with_capacity(blocks.len() * ty.block as usize);
    match ty {
        F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        F16 => out.extend(bytes.chunks_exact(2).map(half)),
        BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        Q4_0 => blocks.for_each(|b| q4_0(b, &mut out)),
        Q4_1 => blocks.for_each(|b| q4_1(b, &mut out)),
        Q5_0 => blocks.for_each(|b| q5_0(b, &mut out)),
        Q8_0 => blocks.for_each(|b| q8_0(b, &mut out)),
        Q4_K => blocks.for_each(|b| q4_k(b, &mut out)),
        Q6_K => blocks.for_each(|b| q6_k(b, &mut out)),
        other => unreachable!("the GGUF check admits no type {}", other.name),
    }
    out
}

/// 32 values: f16 scale, 16 bytes of 4-bit values (low nibbles are the
/// first 16), each `(q − 8)·d`.
fn q4_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half(&b[0..2]);
    let qs = &b[2..18];
    out.extend(qs.iter().map(|&q| (f32::from(q & 0x0F) - 8.0) * d));
    out.extend(qs.iter().map(|&q| (f32::from(q >> 4) - 8.0) * d));
}

/// 32 values: f16 scale and minimum, 4-bit values, each `q·d + m`.
fn q4_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (half(&b[0..2]), half(&b[2..4]));
    let qs = &b[4..20];
    out.extend(qs.iter().map(|&q| f32::from(q & 0x0F) * d + m));
    out.extend(qs.iter().map(|&q| f32::from(q >> 4) * d + m));
}

/// 32 values: f16 scale, 32 fifth bits (one u32), 16 bytes of low nibbles;
/// each `(q − 16)·d`.
fn q5_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half(&b[0..2]);
    let high = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    let value = |low: u8, bit: u32| {
        let q = u32::from(low) | (((high >> bit) & 1) << 4);
        (q as f32 - 16.0) * d
    };
    out.extend((0..16).map(|j| value(qs[j] & 0x0F, j as u32)));
    out.extend((0..16).map(|j| value(qs[j] >> 4, j as u32 + 16)));
}

/// 32 values: f16 scale, 32 signed bytes; each `q·d`.
fn q8_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half(&b[0..2]);
    out.extend(b[2..34].iter().map(|&q| f32::from(q as i8) * d));
}

/// The scale and minimum of sub-block `j` (of 8) of a Q4_K block: six bits
/// each, packed into 12 bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// 256 values in 8 sub-blocks of 32: f16 super-scale `d` and super-minimum
/// `dmin`, 12 bytes of 6-bit sub-block scales and minimums, 128 bytes of
/// 4-bit values (each 32-byte run holds two sub-blocks: low nibbles first);
/// each `d·sc·q − dmin·m`.
fn q4_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (half(&b[0..2]), half(&b[2..4]));
    let scales = &b[4..16];
    for (pair, qs) in b[16..144].chunks_exact(32).enumerate() {
        for (half_index, shift) in [(0, 0), (1, 4)] {
            let (sc, m) = scale_min_k4(2 * pair + half_index, scales);
            let (scale, min) = (d * f32::from(sc), dmin * f32::from(m));
            out.extend(
                qs.iter()
                    .map(|&q| scale * f32::from((q >> shift) & 0x0F) - min),
            );
        }
    }
}

/// 256 values: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 signed
/// 8-bit sub-block scales (one per 16 values), f16 super-scale; each
/// `d·sc·(q − 32)`. Values come in two halves of 128, each half's four
/// runs of 32 taking their bits from the same 32 high-bit bytes.
fn q6_k(b: &[u8], out: &mut Vec<f32>) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half(&b[208..210]);
    for h in 0..2 {
        let (ql, qh, sc) = (&ql[64 * h..], &qh[32 * h..], &sc[8 * h..]);
        let mut run = [[0f32; 32]; 4];
        for l in 0..32 {
            let is = l / 16;
            let q = [
                (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, &q) in q.iter().enumerate() {
                let scale = d * f32::from(sc[is + 2 * k] as i8);
                run[k][l] = scale * (f32::from(q) - 32.0);
            }
        }
        out.extend(run.iter().flatten());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_is_scale_times_signed_bytes() {
        let mut b = vec![0u8; 34];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2] = 4;
        b[3] = (-6i8) as u8;
        let v = dequantize(Q8_0, &b);
        assert_eq!(v.len(), 32);
        assert_eq!(&v[..3], &[2.0, -3.0, 0.0]);
    }

    #[test]
    fn q5_0_takes_the_fifth_bit_from_the_high_word() {
        let mut b = vec![0u8; 22];
        b[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        // Value 0: low nibble 15, fifth bit set → 31 − 16 = 15.
        // Value 16: high nibble of byte 0 = 0, fifth bit (bit 16) clear → −16.
        b[2] = 1;
        b[6] = 0x0F;
        let v = dequantize(Q5_0, &b);
        assert_eq!(v[0], 15.0);
        assert_eq!(v[16], -16.0);
        assert_eq!(v[1], -16.0);
    }
}

//! Legacy 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (ggml's `block_q4_0` ... `block_q8_0`).
//!
//! Layouts (little-endian): Q4_0 `d:f16, qs[16]`; Q4_1 `d:f16, m:f16, qs[16]`; Q5_0 `d:f16, qh:u32, qs[16]`;
//! Q5_1 `d:f16, m:f16, qh:u32, qs[16]`; Q8_0 `d:f16, qs:i8[32]`. Nibble `j` of `qs` holds element `j` (low)
//! and element `j + 16` (high); bit `j` of `qh` is the fifth bit of element `j`.

use crate::block::{dequantize_blocks, min_max, quantize_blocks, read_f16, signed_absmax, write_f16};

/// Elements per legacy block.
const QK: usize = 32;

/// The 4-bit levels (0..=15) of 32 elements from 16 packed bytes.
#[inline(always)]
fn levels4(qs: &[u8]) -> [i32; QK] {
    let mut l = [0i32; QK];
    for j in 0..QK / 2 {
        l[j] = i32::from(qs[j] & 0x0f);
        l[j + QK / 2] = i32::from(qs[j] >> 4);
    }
    l
}

/// The 5-bit levels (0..=31) of 32 elements from the high-bit word and 16 packed bytes.
#[inline(always)]
fn levels5(qh: u32, qs: &[u8]) -> [i32; QK] {
    let mut l = levels4(qs);
    for (j, v) in l.iter_mut().enumerate() {
        *v |= (((qh >> j) & 1) << 4) as i32;
    }
    l
}

/// Packs 32 levels into 16 bytes of nibbles (element `j` low, element `j + 16` high).
fn pack_nibbles(levels: &[u8; QK], qs: &mut [u8]) {
    for j in 0..QK / 2 {
        qs[j] = (levels[j] & 0x0f) | ((levels[j + QK / 2] & 0x0f) << 4);
    }
}

/// The fifth bits of 32 levels as a little-endian word.
fn pack_high_bits(levels: &[u8; QK]) -> [u8; 4] {
    let qh = levels.iter().enumerate().fold(0u32, |qh, (j, &l)| qh | (u32::from(l >> 4) << j));
    qh.to_le_bytes()
}

/// ggml's symmetric rounding: levels `0..2*half` with value `(level - half) * d`, the largest-magnitude
/// element mapping to level 0. Returns `(d, levels)`.
fn quantize_symmetric(x: &[f32; QK], half: u8) -> (f32, [u8; QK]) {
    let d = signed_absmax(x) / -f32::from(half);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let top = 2 * half - 1;
    let levels = x.map(|v| ((v * id + f32::from(half) + 0.5) as u8).min(top));
    (d, levels)
}

/// ggml's min/max rounding: levels `0..=nmax` with value `level * d + min`. Returns `(d, min, levels)`.
fn quantize_affine(x: &[f32; QK], nmax: u8) -> (f32, f32, [u8; QK]) {
    let (min, max) = min_max(x);
    let d = (max - min) / f32::from(nmax);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let levels = x.map(|v| (((v - min) * id + 0.5) as u8).min(nmax));
    (d, min, levels)
}

/// Decodes Q4_0 blocks.
pub(crate) fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    dequantize_blocks(src, dst, |b: &[u8; 18], y: &mut [f32; QK]| {
        let d = read_f16(b, 0);
        let l = levels4(&b[2..18]);
        for j in 0..QK {
            y[j] = (l[j] - 8) as f32 * d;
        }
    });
}

/// Decodes Q4_1 blocks.
pub(crate) fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    dequantize_blocks(src, dst, |b: &[u8; 20], y: &mut [f32; QK]| {
        let (d, m) = (read_f16(b, 0), read_f16(b, 2));
        let l = levels4(&b[4..20]);
        for j in 0..QK {
            y[j] = l[j] as f32 * d + m;
        }
    });
}

/// Decodes Q5_0 blocks.
pub(crate) fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    dequantize_blocks(src, dst, |b: &[u8; 22], y: &mut [f32; QK]| {
        let d = read_f16(b, 0);
        let l = levels5(u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]);
        for j in 0..QK {
            y[j] = (l[j] - 16) as f32 * d;
        }
    });
}

/// Decodes Q5_1 blocks.
pub(crate) fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    dequantize_blocks(src, dst, |b: &[u8; 24], y: &mut [f32; QK]| {
        let (d, m) = (read_f16(b, 0), read_f16(b, 2));
        let l = levels5(u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24]);
        for j in 0..QK {
            y[j] = l[j] as f32 * d + m;
        }
    });
}

/// Decodes Q8_0 blocks.
pub(crate) fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    dequantize_blocks(src, dst, |b: &[u8; 34], y: &mut [f32; QK]| {
        let d = read_f16(b, 0);
        for j in 0..QK {
            y[j] = f32::from(b[2 + j] as i8) * d;
        }
    });
}

/// Encodes Q4_0 blocks (ggml's reference rounding).
pub(crate) fn quantize_q4_0(src: &[f32]) -> Result<Vec<u8>, usize> {
    quantize_blocks(src, |x: &[f32; QK]| {
        let mut b = [0u8; 18];
        let (d, levels) = quantize_symmetric(x, 8);
        write_f16(&mut b, 0, d)?;
        pack_nibbles(&levels, &mut b[2..]);
        Some(b)
    })
}

/// Encodes Q4_1 blocks (ggml's reference rounding).
pub(crate) fn quantize_q4_1(src: &[f32]) -> Result<Vec<u8>, usize> {
    quantize_blocks(src, |x: &[f32; QK]| {
        let mut b = [0u8; 20];
        let (d, m, levels) = quantize_affine(x, 15);
        write_f16(&mut b, 0, d)?;
        write_f16(&mut b, 2, m)?;
        pack_nibbles(&levels, &mut b[4..]);
        Some(b)
    })
}

/// Encodes Q5_0 blocks (ggml's reference rounding).
pub(crate) fn quantize_q5_0(src: &[f32]) -> Result<Vec<u8>, usize> {
    quantize_blocks(src, |x: &[f32; QK]| {
        let mut b = [0u8; 22];
        let (d, levels) = quantize_symmetric(x, 16);
        write_f16(&mut b, 0, d)?;
        b[2..6].copy_from_slice(&pack_high_bits(&levels));
        pack_nibbles(&levels, &mut b[6..]);
        Some(b)
    })
}

/// Encodes Q5_1 blocks (ggml's reference rounding).
pub(crate) fn quantize_q5_1(src: &[f32]) -> Result<Vec<u8>, usize> {
    quantize_blocks(src, |x: &[f32; QK]| {
        let mut b = [0u8; 24];
        let (d, m, levels) = quantize_affine(x, 31);
        write_f16(&mut b, 0, d)?;
        write_f16(&mut b, 2, m)?;
        b[4..8].copy_from_slice(&pack_high_bits(&levels));
        pack_nibbles(&levels, &mut b[8..]);
        Some(b)
    })
}

/// Encodes Q8_0 blocks (ggml's reference rounding).
pub(crate) fn quantize_q8_0(src: &[f32]) -> Result<Vec<u8>, usize> {
    quantize_blocks(src, |x: &[f32; QK]| {
        let mut b = [0u8; 34];
        let amax = signed_absmax(x).abs();
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        write_f16(&mut b, 0, d)?;
        for (q, &v) in b[2..].iter_mut().zip(x) {
            *q = ((v * id).round() as i8) as u8;
        }
        Some(b)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn high_bits_and_nibbles_round_trip() {
        let levels: [u8; QK] = std::array::from_fn(|j| (j as u8 * 7) % 32);
        let mut qs = [0u8; 16];
        pack_nibbles(&levels, &mut qs);
        let qh = u32::from_le_bytes(pack_high_bits(&levels));
        let back = levels5(qh, &qs);
        assert_eq!(back, levels.map(i32::from));
    }

    #[test]
    fn symmetric_rounding_matches_ggml() {
        // The extreme element maps to level 0 (value -half * d = max).
        let mut x = [0.5f32; QK];
        x[3] = -4.0;
        let (d, levels) = quantize_symmetric(&x, 8);
        assert_eq!(d, 0.5);
        assert_eq!(levels[3], 0);
        assert_eq!(levels[0], 9);
        let (d, _) = quantize_symmetric(&[0.0; QK], 8);
        assert_eq!(d, 0.0);
    }
}

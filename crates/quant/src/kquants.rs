//! K-quant super-block formats (256 elements): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K.
//!
//! Layouts (ggml's `block_q*_K`, little-endian):
//! - Q2_K `scales[16] (4-bit scale | 4-bit min << 4), qs[64], d:f16, dmin:f16`
//! - Q3_K `hmask[32], qs[64], scales[12] (16 packed 6-bit), d:f16`
//! - Q4_K `d:f16, dmin:f16, scales[12] (8 scales + 8 mins, 6-bit), qs[128]`
//! - Q5_K `d:f16, dmin:f16, scales[12], qh[32], qs[128]`
//! - Q6_K `ql[128], qh[64], scales:i8[16], d:f16`
//! - Q8_K `d:f32, qs:i8[256], bsums:i16[16]`
//!
//! The quantizers use plain round-to-nearest with per-sub-block absmax (symmetric formats) or min/max
//! (formats with mins) scales; they do not reproduce ggml's iterative scale search.

use crate::block::{dequantize_blocks, f16_round, min_max, quant_level, quantize_blocks, read_f16, signed_absmax, write_f16};

/// Elements per super-block.
const QK_K: usize = 256;

/// Unpacks the 8 six-bit scales and 8 six-bit mins of Q4_K/Q5_K (ggml's `get_scale_min_k4`).
#[inline(always)]
pub fn unpack_scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// Packs 8 six-bit scales and 8 six-bit mins into Q4_K/Q5_K's 12 bytes (inverse of [`unpack_scale_min_k4`]).
fn pack_scale_min_k4(sc: &[u8], mn: &[u8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0x0f) | ((mn[j + 4] & 0x0f) << 4);
    }
    s
}

/// Unpacks Q3_K's 16 six-bit scales, minus their bias of 32.
#[inline(always)]
pub fn unpack_q3_scales(s: &[u8]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (i, v) in out.iter_mut().enumerate() {
        let low = if i < 8 { s[i] & 0x0f } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *v = i32::from(low | (high << 4)) - 32;
    }
    out
}

/// Packs 16 biased six-bit scales (0..=63) into Q3_K's 12 bytes (inverse of [`unpack_q3_scales`]).
fn pack_q3_scales(v: &[u8; 16]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for (i, &x) in v.iter().enumerate() {
        if i < 8 {
            s[i] |= x & 0x0f;
        } else {
            s[i - 8] |= (x & 0x0f) << 4;
        }
        s[8 + i % 4] |= (x >> 4) << (2 * (i / 4));
    }
    s
}

/// Decodes Q2_K blocks.
pub(crate) fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    dequantize_blocks(src, dst, |b: &[u8; 84], y: &mut [f32; QK_K]| {
        let (d, dmin) = (read_f16(b, 80), read_f16(b, 82));
        for n in 0..2 {
            for j in 0..4 {
                for h in 0..2 {
                    let sc = b[8 * n + 2 * j + h];
                    let dl = d * f32::from(sc & 0x0f);
                    let ml = dmin * f32::from(sc >> 4);
                    let q = &b[16 + 32 * n + 16 * h..][..16];
                    let out = &mut y[128 * n + 32 * j + 16 * h..][..16];
                    for l in 0..16 {
                        out[l] = dl * f32::from((q[l] >> (2 * j)) & 3) - ml;
                    }
                }
            }
        }
    });
}

/// Decodes Q3_K blocks.
pub(crate) fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    dequantize_blocks(src, dst, |b: &[u8; 110], y: &mut [f32; QK_K]| {
        let d_all = read_f16(b, 108);
        let scales = unpack_q3_scales(&b[96..108]);
        for n in 0..2 {
            for j in 0..4 {
                let mask = 1u8 << (4 * n + j);
                for h in 0..2 {
                    let dl = d_all * scales[8 * n + 2 * j + h] as f32;
                    let q = &b[32 + 32 * n + 16 * h..][..16];
                    let hm = &b[16 * h..][..16];
                    let out = &mut y[128 * n + 32 * j + 16 * h..][..16];
                    for l in 0..16 {
                        let low = i32::from((q[l] >> (2 * j)) & 3);
                        let sub = if hm[l] & mask != 0 { 0 } else { 4 };
                        out[l] = dl * (low - sub) as f32;
                    }
                }
            }
        }
    });
}

/// Decodes Q4_K blocks.
pub(crate) fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    dequantize_blocks(src, dst, |b: &[u8; 144], y: &mut [f32; QK_K]| {
        let (d, dmin) = (read_f16(b, 0), read_f16(b, 2));
        let (sc, mn) = unpack_scale_min_k4(&b[4..16]);
        for j in 0..4 {
            let (d1, m1) = (d * f32::from(sc[2 * j]), dmin * f32::from(mn[2 * j]));
            let (d2, m2) = (d * f32::from(sc[2 * j + 1]), dmin * f32::from(mn[2 * j + 1]));
            let q = &b[16 + 32 * j..][..32];
            let out = &mut y[64 * j..][..64];
            for l in 0..32 {
                out[l] = d1 * f32::from(q[l] & 0x0f) - m1;
                out[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
            }
        }
    });
}

/// Decodes Q5_K blocks.
pub(crate) fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    dequantize_blocks(src, dst, |b: &[u8; 176], y: &mut [f32; QK_K]| {
        let (d, dmin) = (read_f16(b, 0), read_f16(b, 2));
        let (sc, mn) = unpack_scale_min_k4(&b[4..16]);
        let qh = &b[16..48];
        for j in 0..4 {
            let (d1, m1) = (d * f32::from(sc[2 * j]), dmin * f32::from(mn[2 * j]));
            let (d2, m2) = (d * f32::from(sc[2 * j + 1]), dmin * f32::from(mn[2 * j + 1]));
            let q = &b[48 + 32 * j..][..32];
            let out = &mut y[64 * j..][..64];
            for l in 0..32 {
                let lo = (q[l] & 0x0f) | (((qh[l] >> (2 * j)) & 1) << 4);
                let hi = (q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4);
                out[l] = d1 * f32::from(lo) - m1;
                out[l + 32] = d2 * f32::from(hi) - m2;
            }
        }
    });
}

/// Decodes Q6_K blocks.
pub(crate) fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    dequantize_blocks(src, dst, |b: &[u8; 210], y: &mut [f32; QK_K]| {
        let d = read_f16(b, 208);
        for n in 0..2 {
            let ql = &b[64 * n..][..64];
            let qh = &b[128 + 32 * n..][..32];
            let sc = &b[192 + 8 * n..][..8];
            let out = &mut y[128 * n..][..128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = i32::from((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
                let q2 = i32::from((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                out[l] = d * f32::from(sc[is] as i8) * q1 as f32;
                out[l + 32] = d * f32::from(sc[is + 2] as i8) * q2 as f32;
                out[l + 64] = d * f32::from(sc[is + 4] as i8) * q3 as f32;
                out[l + 96] = d * f32::from(sc[is + 6] as i8) * q4 as f32;
            }
        }
    });
}

/// Decodes Q8_K blocks.
pub(crate) fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    dequantize_blocks(src, dst, |b: &[u8; 292], y: &mut [f32; QK_K]| {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for j in 0..QK_K {
            y[j] = d * f32::from(b[4 + j] as i8);
        }
    });
}

/// A super-block quantized as `value = d * scale[k] * level - dmin * min[k]` over sub-blocks `k`.
struct AffineBlock {
    /// Super-block scale of the sub-block scales (f16-exact).
    d: f32,
    /// Super-block scale of the sub-block mins (f16-exact).
    dmin: f32,
    /// Quantized sub-block scales (`0..=scale_max`).
    scales: [u8; 16],
    /// Quantized sub-block mins (`0..=scale_max`).
    mins: [u8; 16],
    /// Per-element levels (`0..=nmax`).
    levels: [u8; QK_K],
}

/// Min/max quantization of a super-block with sub-blocks of `sub` elements, `nmax + 1` levels and
/// sub-block scales/mins quantized to `0..=scale_max` (Q2_K, Q4_K, Q5_K). `None` if a scale overflows f16.
fn quantize_affine(x: &[f32; QK_K], sub: usize, nmax: u8, scale_max: u8) -> Option<AffineBlock> {
    let (mut sub_scale, mut sub_min) = ([0f32; 16], [0f32; 16]);
    for (k, xs) in x.chunks_exact(sub).enumerate() {
        let (lo, hi) = min_max(xs);
        let lo = lo.min(0.0);
        sub_scale[k] = (hi - lo) / f32::from(nmax);
        sub_min[k] = -lo;
    }
    let max_of = |v: &[f32; 16]| v.iter().fold(0f32, |m, &s| m.max(s));
    let d = f16_round(max_of(&sub_scale) / f32::from(scale_max))?;
    let dmin = f16_round(max_of(&sub_min) / f32::from(scale_max))?;
    let top = i32::from(scale_max);
    let scales = sub_scale.map(|s| quant_level(s, d, 0, top) as u8);
    let mins = sub_min.map(|m| quant_level(m, dmin, 0, top) as u8);
    let levels = std::array::from_fn(|p| {
        let k = p / sub;
        let offset = dmin * f32::from(mins[k]);
        quant_level(x[p] + offset, d * f32::from(scales[k]), 0, i32::from(nmax)) as u8
    });
    Some(AffineBlock { d, dmin, scales, mins, levels })
}

/// A super-block quantized as `value = d * scale[k] * level` over 16 sub-blocks of 16 elements.
struct SymmetricBlock {
    /// Super-block scale (f16-exact).
    d: f32,
    /// Signed sub-block scales.
    scales: [i32; 16],
    /// Signed per-element levels.
    levels: [i32; QK_K],
}

/// Absmax quantization with levels `qlo..-qlo` and sub-block scales `slo..-slo` (Q3_K: -4/-32,
/// Q6_K: -32/-128); the largest-magnitude element of each sub-block maps to `qlo`. `None` if `d` overflows f16.
fn quantize_symmetric(x: &[f32; QK_K], qlo: i32, slo: i32) -> Option<SymmetricBlock> {
    let mut sub_scale = [0f32; 16];
    for (s, xs) in sub_scale.iter_mut().zip(x.chunks_exact(16)) {
        *s = signed_absmax(xs) / qlo as f32;
    }
    let d = f16_round(signed_absmax(&sub_scale) / slo as f32)?;
    let scales = sub_scale.map(|s| quant_level(s, d, slo, -slo - 1));
    let levels = std::array::from_fn(|p| quant_level(x[p], d * scales[p / 16] as f32, qlo, -qlo - 1));
    Some(SymmetricBlock { d, scales, levels })
}

/// Encodes Q2_K blocks.
pub(crate) fn quantize_q2_k(src: &[f32]) -> Result<Vec<u8>, usize> {
    quantize_blocks(src, |x: &[f32; QK_K]| {
        let a = quantize_affine(x, 16, 3, 15)?;
        let mut b = [0u8; 84];
        for (k, s) in b[..16].iter_mut().enumerate() {
            *s = a.scales[k] | (a.mins[k] << 4);
        }
        for (p, &l) in a.levels.iter().enumerate() {
            b[16 + 32 * (p / 128) + p % 32] |= l << (2 * ((p % 128) / 32));
        }
        write_f16(&mut b, 80, a.d)?;
        write_f16(&mut b, 82, a.dmin)?;
        Some(b)
    })
}

/// Encodes Q3_K blocks.
pub(crate) fn quantize_q3_k(src: &[f32]) -> Result<Vec<u8>, usize> {
    quantize_blocks(src, |x: &[f32; QK_K]| {
        let s = quantize_symmetric(x, -4, -32)?;
        let mut b = [0u8; 110];
        for (p, &l) in s.levels.iter().enumerate() {
            let v = (l + 4) as u8;
            b[32 + 32 * (p / 128) + p % 32] |= (v & 3) << (2 * ((p % 128) / 32));
            b[p % 32] |= (v >> 2) << (p / 32);
        }
        b[96..108].copy_from_slice(&pack_q3_scales(&s.scales.map(|v| (v + 32) as u8)));
        write_f16(&mut b, 108, s.d)?;
        Some(b)
    })
}

/// Encodes the shared part of Q4_K/Q5_K: `d`, `dmin`, packed scales and the low nibbles at `qs_at`.
fn encode_k4_common(b: &mut [u8], a: &AffineBlock, qs_at: usize) -> Option<()> {
    write_f16(b, 0, a.d)?;
    write_f16(b, 2, a.dmin)?;
    b[4..16].copy_from_slice(&pack_scale_min_k4(&a.scales[..8], &a.mins[..8]));
    for (p, &l) in a.levels.iter().enumerate() {
        b[qs_at + 32 * (p / 64) + p % 32] |= (l & 0x0f) << (4 * ((p / 32) % 2));
    }
    Some(())
}

/// Encodes Q4_K blocks.
pub(crate) fn quantize_q4_k(src: &[f32]) -> Result<Vec<u8>, usize> {
    quantize_blocks(src, |x: &[f32; QK_K]| {
        let a = quantize_affine(x, 32, 15, 63)?;
        let mut b = [0u8; 144];
        encode_k4_common(&mut b, &a, 16)?;
        Some(b)
    })
}

/// Encodes Q5_K blocks.
pub(crate) fn quantize_q5_k(src: &[f32]) -> Result<Vec<u8>, usize> {
    quantize_blocks(src, |x: &[f32; QK_K]| {
        let a = quantize_affine(x, 32, 31, 63)?;
        let mut b = [0u8; 176];
        encode_k4_common(&mut b, &a, 48)?;
        for (p, &l) in a.levels.iter().enumerate() {
            b[16 + p % 32] |= (l >> 4) << (p / 32);
        }
        Some(b)
    })
}

/// Encodes Q6_K blocks.
pub(crate) fn quantize_q6_k(src: &[f32]) -> Result<Vec<u8>, usize> {
    quantize_blocks(src, |x: &[f32; QK_K]| {
        let s = quantize_symmetric(x, -32, -128)?;
        let mut b = [0u8; 210];
        for (p, &l) in s.levels.iter().enumerate() {
            let u = (l + 32) as u8;
            let (n, g, l) = (p / 128, (p % 128) / 32, p % 32);
            b[64 * n + l + 32 * (g & 1)] |= (u & 0x0f) << (4 * (g >> 1));
            b[128 + 32 * n + l] |= (u >> 4) << (2 * g);
        }
        for (k, &sc) in s.scales.iter().enumerate() {
            b[192 + k] = sc as i8 as u8;
        }
        write_f16(&mut b, 208, s.d)?;
        Some(b)
    })
}

/// Encodes Q8_K blocks (ggml's reference rounding, with the 16-element sums).
pub(crate) fn quantize_q8_k(src: &[f32]) -> Result<Vec<u8>, usize> {
    quantize_blocks(src, |x: &[f32; QK_K]| {
        let mut b = [0u8; 292];
        let max = signed_absmax(x);
        if max == 0.0 {
            return Some(b);
        }
        let iscale = -127.0 / max;
        let q = x.map(|v| ((iscale * v).round_ties_even() as i32).min(127));
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        for (dst, &v) in b[4..260].iter_mut().zip(&q) {
            *dst = v as i8 as u8;
        }
        for (k, chunk) in q.chunks_exact(16).enumerate() {
            let sum = chunk.iter().sum::<i32>() as i16;
            b[260 + 2 * k..262 + 2 * k].copy_from_slice(&sum.to_le_bytes());
        }
        Some(b)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k4_scale_packing_round_trips() {
        let sc: [u8; 8] = [0, 1, 63, 17, 32, 48, 5, 62];
        let mn: [u8; 8] = [63, 0, 9, 40, 33, 1, 16, 31];
        let packed = pack_scale_min_k4(&sc, &mn);
        assert_eq!(unpack_scale_min_k4(&packed), (sc, mn));
    }

    #[test]
    fn q3_scale_packing_round_trips() {
        let v: [u8; 16] = std::array::from_fn(|i| (i as u8 * 13 + 5) % 64);
        let unpacked = unpack_q3_scales(&pack_q3_scales(&v));
        assert_eq!(unpacked, v.map(|x| i32::from(x) - 32));
    }

    #[test]
    fn zero_block_quantizes_to_zero_scales() {
        let a = quantize_affine(&[0.0; QK_K], 32, 15, 63).unwrap();
        assert_eq!((a.d, a.dmin), (0.0, 0.0));
        assert!(a.levels.iter().all(|&l| l == 0));
        let s = quantize_symmetric(&[0.0; QK_K], -32, -128).unwrap();
        assert_eq!(s.d, 0.0);
        assert!(s.levels.iter().all(|&l| l == 0));
    }

    #[test]
    fn huge_values_overflow_f16_scales() {
        assert!(quantize_affine(&[1e9; QK_K], 32, 15, 63).is_none());
        assert!(quantize_symmetric(&[1e9; QK_K], -4, -32).is_none());
    }
}

//! Portable block decoders and integer dot cores (the reference for the SIMD variants).

use kiln_quant::{f16_to_f32, unpack_q3_scales, unpack_scale_min_k4, GgmlType};

use super::{ActRow, KBlock};

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Unpacks one Q4_0, Q5_0 or Q8_0 block `b` into signed levels `qb`; returns its scale.
fn unpack_legacy(ty: GgmlType, b: &[u8], qb: &mut [i8; 32]) -> f32 {
    match ty {
        GgmlType::Q4_0 => {
            for j in 0..16 {
                qb[j] = (b[2 + j] & 15) as i8 - 8;
                qb[j + 16] = (b[2 + j] >> 4) as i8 - 8;
            }
        }
        GgmlType::Q5_0 => {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..16 {
                let lo = (b[6 + j] & 15) | (((qh >> j) & 1) << 4) as u8;
                let hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
                qb[j] = lo as i8 - 16;
                qb[j + 16] = hi as i8 - 16;
            }
        }
        GgmlType::Q8_0 => {
            for j in 0..32 {
                qb[j] = b[2 + j] as i8;
            }
        }
        _ => unreachable!("{ty} is not a 32-block fast format"),
    }
    f16_at(b, 0)
}

/// Unpacks one K-quant super-block `b` (Q2_K..Q6_K) into unsigned levels, per-16 scales and
/// corrections.
#[inline(never)]
pub fn unpack_k(ty: GgmlType, b: &[u8], w: &mut KBlock) {
    let KBlock { q, sc, corr, d, dcorr } = w;
    match ty {
        GgmlType::Q2_K => {
            *d = f16_at(b, 80);
            *dcorr = f16_at(b, 82);
            for g in 0..16 {
                sc[g] = i16::from(b[g] & 15);
                corr[g] = i16::from(b[g] >> 4);
            }
            for n in 0..2 {
                for j in 0..4 {
                    for l in 0..32 {
                        q[128 * n + 32 * j + l] = (b[16 + 32 * n + l] >> (2 * j)) & 3;
                    }
                }
            }
        }
        GgmlType::Q3_K => {
            *d = f16_at(b, 108);
            *dcorr = *d;
            let s = unpack_q3_scales(&b[96..108]);
            for g in 0..16 {
                sc[g] = s[g] as i16;
                corr[g] = 4 * s[g] as i16;
            }
            for n in 0..2 {
                for j in 0..4 {
                    let mask = 1u8 << (4 * n + j);
                    for l in 0..32 {
                        let low = (b[32 + 32 * n + l] >> (2 * j)) & 3;
                        let high = if b[l] & mask != 0 { 4 } else { 0 };
                        q[128 * n + 32 * j + l] = low | high;
                    }
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            *d = f16_at(b, 0);
            *dcorr = f16_at(b, 2);
            let (s, m) = unpack_scale_min_k4(&b[4..16]);
            for g in 0..16 {
                sc[g] = i16::from(s[g / 2]);
                corr[g] = i16::from(m[g / 2]);
            }
            let (qh, qs) = if ty == GgmlType::Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for j in 0..4 {
                for l in 0..32 {
                    let v = qs[32 * j + l];
                    let (hl, hh) = qh.map_or((0, 0), |h| (((h[l] >> (2 * j)) & 1) << 4, ((h[l] >> (2 * j + 1)) & 1) << 4));
                    q[64 * j + l] = (v & 15) | hl;
                    q[64 * j + 32 + l] = (v >> 4) | hh;
                }
            }
        }
        GgmlType::Q6_K => {
            *d = f16_at(b, 208);
            *dcorr = *d;
            for g in 0..16 {
                sc[g] = i16::from(b[192 + g] as i8);
                corr[g] = 32 * sc[g];
            }
            for n in 0..2 {
                let (ql, qh) = (&b[64 * n..64 * n + 64], &b[128 + 32 * n..128 + 32 * n + 32]);
                let o = &mut q[128 * n..128 * n + 128];
                for l in 0..32 {
                    o[l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
                    o[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
                    o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
        }
        _ => unreachable!("{ty} is not a K-quant fast format"),
    }
}

/// Products of one packed 32-block row (Q4_0, Q5_0 or Q8_0) with `R` activation rows.
pub fn legacy_rows<const R: usize>(ty: GgmlType, src: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
    let mut out = [0f32; R];
    let mut q = [0i8; 32];
    for (b, block) in src.chunks_exact(ty.type_size()).enumerate() {
        let dw = unpack_legacy(ty, block, &mut q);
        for (o, a) in out.iter_mut().zip(a) {
            let aq = &a.qs[32 * b..32 * b + 32];
            let s: i32 = q.iter().zip(aq).map(|(&x, &y)| i32::from(x) * i32::from(y)).sum();
            *o += dw * a.d[b] * s as f32;
        }
    }
    out
}

/// Products of one packed K-quant row (Q2_K..Q6_K) with `R` activation rows.
pub fn k_rows<const R: usize>(ty: GgmlType, src: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
    let mut out = [0f32; R];
    let mut w = KBlock::default();
    for (b, block) in src.chunks_exact(ty.type_size()).enumerate() {
        unpack_k(ty, block, &mut w);
        for (o, a) in out.iter_mut().zip(a) {
            // The whole super-block's sum can pass i32 (the SIMD cores spread it over 8 lanes).
            let (mut s, mut c) = (0i64, 0f32);
            for g in 0..16 {
                let wq = &w.q[16 * g..16 * g + 16];
                let aq = &a.qs[256 * b + 16 * g..256 * b + 16 * g + 16];
                let p: i32 = wq.iter().zip(aq).map(|(&x, &y)| i32::from(x) * i32::from(y)).sum();
                s += i64::from(w.sc[g]) * i64::from(p);
                c += f32::from(w.corr[g]) * a.sums[16 * b + g];
            }
            *o += a.d[b] * (w.d * s as f32 - w.dcorr * c);
        }
    }
    out
}

//! aarch64 NEON block decoders and integer dot cores (levels widened to 16 bits, multiplied and
//! accumulated into 32-bit lanes by `vmlal_s16`), the NEON activation quantizer and the screening
//! kernel: the AVX2 module's algorithms, contracts and overflow bounds on 128-bit registers.

use std::arch::aarch64::*;
use std::arch::asm;

use kiln_quant::GgmlType;

use super::screen::{group_len, header_len, GROUP, GROUP_BLOCK_BYTES, WINDOW_BLOCKS};
use super::{ActRow, KBlock};

/// The four f16 lanes of `h` as f32 (`fcvtl`, base aarch64; the f16 intrinsics need a newer Rust
/// than the project's minimum).
#[inline]
unsafe fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    asm!("fcvtl {0:v}.4s, {1:v}.4h", out(vreg) out, in(vreg) h, options(pure, nomem, nostack, preserves_flags));
    out
}

/// The f16 at `p` (any alignment) as f32 in every lane.
#[inline]
unsafe fn f16_splat(p: *const u8) -> float32x4_t {
    f16x4_to_f32(vdup_n_u16(u16::from_le(std::ptr::read_unaligned(p as *const u16))))
}

/// Quantizes one row per block of `block` (32 or 256) to 16-bit levels: `d = max|x| / max_level`,
/// `q = round(x / d)` (ties to even, as the scalar code); a block holding a NaN or an infinity gets
/// `d = NaN` and zero levels.
pub unsafe fn quantize_row(x: &[f32], block: usize, max_level: f32, qs: &mut [i16], d: &mut [f32]) {
    assert!(x.len() == qs.len() && x.len() == block * d.len() && block.is_multiple_of(16));
    for (b, db) in d.iter_mut().enumerate() {
        let xp = x.as_ptr().add(b * block);
        let qp = qs.as_mut_ptr().add(b * block);
        // `ordered` keeps all ones while no lane has held a NaN.
        let (mut m, mut ordered) = (vdupq_n_f32(0.0), vdupq_n_u32(u32::MAX));
        for i in (0..block).step_by(4) {
            let v = vld1q_f32(xp.add(i));
            m = vmaxq_f32(m, vabsq_f32(v));
            ordered = vandq_u32(ordered, vceqq_f32(v, v));
        }
        let amax = vmaxvq_f32(m);
        if vminvq_u32(ordered) == 0 || !amax.is_finite() {
            *db = f32::NAN;
            std::ptr::write_bytes(qp, 0, block);
            continue;
        }
        *db = amax / max_level;
        let id = vdupq_n_f32(if amax > 0.0 { max_level / amax } else { 0.0 });
        for i in (0..block).step_by(8) {
            let lo = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(xp.add(i)), id));
            let hi = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(xp.add(i + 4)), id));
            vst1q_s16(qp.add(i), vcombine_s16(vqmovn_s32(lo), vqmovn_s32(hi)));
        }
    }
}

/// 16 bytes: 0xf0 in byte `j` when bit `j` of `bits` is clear, else 0.
#[inline]
unsafe fn f0_where_bit_clear(bits: u32) -> uint8x16_t {
    let v = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
    let bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
    vbicq_u8(vdupq_n_u8(0xf0), vtstq_u8(v, bit))
}

/// Decoder selectors of the 32-block formats (const generic parameters of [`legacy_rows_of`]).
const DEC_Q4_0: u8 = 0;
const DEC_Q5_0: u8 = 1;
const DEC_Q8_0: u8 = 2;

/// The signed levels of the 32-element block at `p` (format `T`, its f16 scale first): elements
/// 0..16 and 16..32.
#[inline]
unsafe fn legacy_levels<const T: u8>(p: *const u8) -> [int8x16_t; 2] {
    let m4 = vdupq_n_u8(15);
    match T {
        DEC_Q4_0 => {
            let v = vld1q_u8(p.add(2));
            let off = vdupq_n_s8(8);
            [vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, m4)), off), vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)), off)]
        }
        DEC_Q5_0 => {
            let qh = u32::from_le(std::ptr::read_unaligned(p.add(2) as *const u32));
            let v = vld1q_u8(p.add(6));
            // Elements whose fifth bit is clear get 0xf0 or-ed in: as i8 that is level - 16.
            let lo = vorrq_u8(vandq_u8(v, m4), f0_where_bit_clear(qh));
            let hi = vorrq_u8(vshrq_n_u8::<4>(v), f0_where_bit_clear(qh >> 16));
            [vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi)]
        }
        _ => [vld1q_s8(p.add(2) as *const i8), vld1q_s8(p.add(18) as *const i8)],
    }
}

/// Products of one packed Q4_0, Q5_0 or Q8_0 row with `R` activation rows.
pub unsafe fn legacy_rows<const R: usize>(ty: GgmlType, src: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
    match ty {
        GgmlType::Q4_0 => legacy_rows_of::<DEC_Q4_0, R>(src, ty.type_size(), a),
        GgmlType::Q5_0 => legacy_rows_of::<DEC_Q5_0, R>(src, ty.type_size(), a),
        GgmlType::Q8_0 => legacy_rows_of::<DEC_Q8_0, R>(src, ty.type_size(), a),
        _ => unreachable!("{ty} is not a 32-block fast format"),
    }
}

/// [`legacy_rows`] for decoder `T` with `bytes` per block: each block is decoded into registers,
/// widened to 16 bits and multiplied with every activation row by `vmlal_s16`.
#[inline]
unsafe fn legacy_rows_of<const T: u8, const R: usize>(src: &[u8], bytes: usize, a: &[ActRow<'_>; R]) -> [f32; R] {
    let nb = src.len() / bytes;
    assert!(src.len() == bytes * nb && a.iter().all(|a| a.qs.len() == 32 * nb && a.d.len() == nb));
    // Even and odd blocks go to separate accumulators (as in the AVX2 module; the same order for
    // every `R`).
    let (mut acc, mut acc_odd) = ([vdupq_n_f32(0.0); R], [vdupq_n_f32(0.0); R]);
    let block = |b: usize, acc: &mut [float32x4_t; R]| {
        let p = src.as_ptr().add(b * bytes);
        let dw = f16_splat(p);
        let [q0, q1] = legacy_levels::<T>(p);
        let w = [vmovl_s8(vget_low_s8(q0)), vmovl_high_s8(q0), vmovl_s8(vget_low_s8(q1)), vmovl_high_s8(q1)];
        for r in 0..R {
            let ap = a[r].qs.as_ptr().add(32 * b);
            // 4 products of at most 128 · 32767 per lane and accumulator.
            let (mut s0, mut s1) = (vdupq_n_s32(0), vdupq_n_s32(0));
            for (i, &wi) in w.iter().enumerate() {
                let av = vld1q_s16(ap.add(8 * i));
                s0 = vmlal_s16(s0, vget_low_s16(wi), vget_low_s16(av));
                s1 = vmlal_high_s16(s1, wi, av);
            }
            let scale = vmulq_n_f32(dw, *a[r].d.get_unchecked(b));
            acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(vaddq_s32(s0, s1)), scale);
        }
    };
    let mut b = 0;
    while b + 2 <= nb {
        block(b, &mut acc);
        block(b + 1, &mut acc_odd);
        b += 2;
    }
    while b < nb {
        block(b, &mut acc);
        b += 1;
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = vaddvq_f32(vaddq_f32(acc[r], acc_odd[r]));
    }
    out
}

/// Decoder selectors of the K-quants (const generic parameters of [`k_rows_of`]); the others
/// (Q2_K, Q3_K) are unpacked onto the stack by the portable code.
const DEC_Q4_K: u8 = 0;
const DEC_Q5_K: u8 = 1;
const DEC_Q6_K: u8 = 2;
const DEC_STACK: u8 = 3;

/// Products of one packed K-quant row with `R` activation rows.
pub unsafe fn k_rows<const R: usize>(ty: GgmlType, src: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
    match ty {
        GgmlType::Q4_K => k_rows_of::<DEC_Q4_K, R>(ty, src, a),
        GgmlType::Q5_K => k_rows_of::<DEC_Q5_K, R>(ty, src, a),
        GgmlType::Q6_K => k_rows_of::<DEC_Q6_K, R>(ty, src, a),
        _ => k_rows_of::<DEC_STACK, R>(ty, src, a),
    }
}

/// The levels of elements `64c..64c + 64` of the super-block at `p` (format `T`) as eight vectors
/// of 8 `i16` (vectors `2g` and `2g + 1` are the 16 elements of scale group `4c + g`): unsigned for
/// Q4_K, Q5_K and the stack-unpacked formats (`w.q`), `q - 32` for Q6_K.
#[inline]
unsafe fn k_levels<const T: u8>(p: *const u8, c: usize, w: &KBlock) -> [int16x8_t; 8] {
    let m4 = vdupq_n_u8(15);
    let ld = |at: usize| vld1q_u8(p.add(at));
    // Elements 64c + 16i .. 64c + 16i + 16 in byte vector i.
    let v: [uint8x16_t; 4] = match T {
        DEC_Q4_K | DEC_Q5_K => {
            let qs = if T == DEC_Q5_K { 48 } else { 16 };
            let (v0, v1) = (ld(qs + 32 * c), ld(qs + 32 * c + 16));
            let mut l = [vandq_u8(v0, m4), vandq_u8(v1, m4), vshrq_n_u8::<4>(v0), vshrq_n_u8::<4>(v1)];
            if T == DEC_Q5_K {
                // Fifth bits: bit 2c of qh[l] for element 64c + l, bit 2c + 1 for 64c + 32 + l.
                let qh = [ld(16), ld(32)];
                let sixteen = vdupq_n_u8(16);
                let (bl, bh) = (vdupq_n_u8(1u8 << (2 * c)), vdupq_n_u8(2u8 << (2 * c)));
                for (i, li) in l.iter_mut().enumerate() {
                    let bit = if i < 2 { bl } else { bh };
                    *li = vorrq_u8(*li, vandq_u8(vtstq_u8(qh[i % 2], bit), sixteen));
                }
            }
            l
        }
        DEC_Q6_K => {
            let n = c / 2;
            let (ql0, ql1, h) = ([ld(64 * n), ld(64 * n + 16)], [ld(64 * n + 32), ld(64 * n + 48)], [ld(128 + 32 * n), ld(144 + 32 * n)]);
            if c.is_multiple_of(2) {
                let (m2, m2b) = (vdupq_n_u8(3), vdupq_n_u8(12));
                let a = |k: usize| vorrq_u8(vandq_u8(ql0[k], m4), vshlq_n_u8::<4>(vandq_u8(h[k], m2)));
                let b = |k: usize| vorrq_u8(vandq_u8(ql1[k], m4), vshlq_n_u8::<2>(vandq_u8(h[k], m2b)));
                [a(0), a(1), b(0), b(1)]
            } else {
                let m30 = vdupq_n_u8(0x30);
                let a = |k: usize| vorrq_u8(vshrq_n_u8::<4>(ql0[k]), vandq_u8(h[k], m30));
                let b = |k: usize| vorrq_u8(vshrq_n_u8::<4>(ql1[k]), vandq_u8(vshrq_n_u8::<2>(h[k]), m30));
                [a(0), a(1), b(0), b(1)]
            }
        }
        _ => std::array::from_fn(|i| vld1q_u8(w.q.as_ptr().add(64 * c + 16 * i))),
    };
    let mut out = [vdupq_n_s16(0); 8];
    for (i, &vi) in v.iter().enumerate() {
        if T == DEC_Q6_K {
            let s = vsubq_s8(vreinterpretq_s8_u8(vi), vdupq_n_s8(32));
            out[2 * i] = vmovl_s8(vget_low_s8(s));
            out[2 * i + 1] = vmovl_high_s8(s);
        } else {
            out[2 * i] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(vi)));
            out[2 * i + 1] = vreinterpretq_s16_u16(vmovl_high_u8(vi));
        }
    }
    out
}

/// [`k_rows`] for decoder `T`: per super-block the scales (and corrections) are read into `w`,
/// every 16 levels times their integer scale (at most 4096 in magnitude: Q6_K) are multiplied with
/// the activations by `vmlal_s16` into two accumulators (32 products of at most 4096 · 8191 per
/// 32-bit lane, as the AVX2 `madd` core), and the corrections are applied with the activations'
/// 16-sums.
#[inline]
unsafe fn k_rows_of<const T: u8, const R: usize>(ty: GgmlType, src: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
    let bytes = ty.type_size();
    let nb = src.len() / bytes;
    assert!(src.len() == bytes * nb);
    assert!(a.iter().all(|a| a.qs.len() == 256 * nb && a.d.len() == nb && a.sums.len() == 16 * nb));
    let mut w = KBlock::default();
    let mut acc = [vdupq_n_f32(0.0); R];
    for b in 0..nb {
        let p = src.as_ptr().add(b * bytes);
        w.read(ty, std::slice::from_raw_parts(p, bytes));
        let mut iacc = [[vdupq_n_s32(0); 2]; R];
        for c in 0..4 {
            let lv = k_levels::<T>(p, c, &w);
            for g in 0..4 {
                let sc = w.sc[4 * c + g];
                let (w0, w1) = (vmulq_n_s16(lv[2 * g], sc), vmulq_n_s16(lv[2 * g + 1], sc));
                for r in 0..R {
                    let ap = a[r].qs.as_ptr().add(256 * b + 64 * c + 16 * g);
                    let (a0, a1) = (vld1q_s16(ap), vld1q_s16(ap.add(8)));
                    let [s0, s1] = &mut iacc[r];
                    *s0 = vmlal_s16(*s0, vget_low_s16(w0), vget_low_s16(a0));
                    *s1 = vmlal_high_s16(*s1, w0, a0);
                    *s0 = vmlal_s16(*s0, vget_low_s16(w1), vget_low_s16(a1));
                    *s1 = vmlal_high_s16(*s1, w1, a1);
                }
            }
        }
        let prod = |r: usize| vaddq_f32(vcvtq_f32_s32(iacc[r][0]), vcvtq_f32_s32(iacc[r][1]));
        if T == DEC_Q6_K {
            // Signed levels: no correction.
            for r in 0..R {
                acc[r] = vfmaq_n_f32(acc[r], prod(r), w.d * *a[r].d.get_unchecked(b));
            }
            continue;
        }
        let cp = w.corr.as_ptr();
        let (c0, c1) = (vld1q_s16(cp), vld1q_s16(cp.add(8)));
        let cf = [
            vcvtq_f32_s32(vmovl_s16(vget_low_s16(c0))),
            vcvtq_f32_s32(vmovl_high_s16(c0)),
            vcvtq_f32_s32(vmovl_s16(vget_low_s16(c1))),
            vcvtq_f32_s32(vmovl_high_s16(c1)),
        ];
        let dc = vdupq_n_f32(w.dcorr);
        for r in 0..R {
            let sp = a[r].sums.as_ptr().add(16 * b);
            let mut corr = vmulq_f32(cf[0], vld1q_f32(sp));
            for (k, &cfk) in cf.iter().enumerate().skip(1) {
                corr = vfmaq_f32(corr, cfk, vld1q_f32(sp.add(4 * k)));
            }
            let v = vfmsq_f32(vmulq_n_f32(prod(r), w.d), corr, dc);
            acc[r] = vfmaq_n_f32(acc[r], v, *a[r].d.get_unchecked(b));
        }
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = vaddvq_f32(acc[r]);
    }
    out
}

/// The 8 scores of each of `out.len()` consecutive groups of the screening copy (`nb` blocks
/// each; see `screen`) for `R` activation rows (offset 8-bit levels and their scale), in row order.
/// The activations are made signed again and multiplied with the levels by widening
/// multiply-accumulates (8 products, at most 8128, per 16-bit lane); two pairwise additions give
/// the rows' block sums (at most 32512) in row order, multiplied by the block's multipliers into
/// 32-bit sums per window: the same integers as the other instruction sets.
pub unsafe fn screen_groups<const R: usize>(groups: &[u8], nb: usize, a: [(&[u8], f32); R], out: &mut [[[f32; 8]; R]]) {
    let (head, glen) = (header_len(nb), group_len(nb));
    assert!(groups.len() == out.len() * glen && a.iter().all(|(q, _)| q.len() == 32 * nb));
    let (m4, eight, flip) = (vdupq_n_u8(15), vdupq_n_s8(8), vdup_n_u8(0x80));
    let qs = a.map(|r| r.0.as_ptr());
    for (g, o) in out.iter_mut().enumerate() {
        let grp = groups.as_ptr().add(g * glen);
        let mut total = [[vdupq_n_f32(0.0); 2]; R];
        for w0 in (0..nb).step_by(WINDOW_BLOCKS) {
            let mut acc = [[vdupq_n_s32(0); 2]; R];
            for b in w0..(w0 + WINDOW_BLOCKS).min(nb) {
                let p = grp.add(head + b * GROUP_BLOCK_BYTES);
                let m = vmovl_s8(vld1_s8(p as *const i8));
                // w[i][h]: rows 4h..4h + 4 (4 bytes each) of elements 4i.. (low nibbles, i < 4) or
                // 16 + 4(i - 4).. (high nibbles).
                let mut w = [[vdupq_n_s8(0); 2]; 8];
                let (low, high) = w.split_at_mut(4);
                for (i, (wl, wh)) in low.iter_mut().zip(high.iter_mut()).enumerate() {
                    for (h, (l, hg)) in wl.iter_mut().zip(wh.iter_mut()).enumerate() {
                        let v = vld1q_u8(p.add(GROUP + 32 * i + 16 * h));
                        *l = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, m4)), eight);
                        *hg = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)), eight);
                    }
                }
                for r in 0..R {
                    let ap = qs[r].add(32 * b);
                    // sums[c]: rows 2c and 2c + 1, four lanes each.
                    let mut sums = [vdupq_n_s16(0); 4];
                    for (i, wi) in w.iter().enumerate() {
                        let a4 = vreinterpret_s8_u8(veor_u8(vreinterpret_u8_u32(vld1_dup_u32(ap.add(4 * i) as *const u32)), flip));
                        for (h, wh) in wi.iter().enumerate() {
                            sums[2 * h] = vmlal_s8(sums[2 * h], vget_low_s8(*wh), a4);
                            sums[2 * h + 1] = vmlal_s8(sums[2 * h + 1], vget_high_s8(*wh), a4);
                        }
                    }
                    let rows = vpaddq_s16(vpaddq_s16(sums[0], sums[1]), vpaddq_s16(sums[2], sums[3]));
                    acc[r][0] = vmlal_s16(acc[r][0], vget_low_s16(rows), vget_low_s16(m));
                    acc[r][1] = vmlal_high_s16(acc[r][1], rows, m);
                }
            }
            for (t, a) in total.iter_mut().zip(&acc) {
                for h in 0..2 {
                    t[h] = vaddq_f32(t[h], vcvtq_f32_s32(a[h]));
                }
            }
        }
        for r in 0..R {
            for (h, t) in total[r].iter().enumerate() {
                let base = vld1q_f32(grp.add(16 * h) as *const f32);
                vst1q_f32(o[r].as_mut_ptr().add(4 * h), vmulq_f32(vmulq_n_f32(base, a[r].1), *t));
            }
        }
    }
}

//! AVX2 unpack functions and integer dot cores (`maddubs` of unsigned weights by signed
//! activations, `madd` by the scales), and the AVX2 activation quantizer.

use std::arch::x86_64::*;

use kiln_quant::{f16_to_f32, GgmlType};

use super::{scalar, ActRow, KRow, KRowMut, LegacyRow, Unpacked, ROW_GROUP};

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hmax(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Quantizes one row per block of `block` (32 or 256): `d = max|x| / 127`, `q = round(x / d)`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_row(x: &[f32], block: usize, qs: &mut [i8], d: &mut [f32]) {
    assert!(x.len() == qs.len() && x.len() == block * d.len() && block.is_multiple_of(32));
    let sign_mask = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (b, db) in d.iter_mut().enumerate() {
        let xp = x.as_ptr().add(b * block);
        let (mut m, mut nan) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in (0..block).step_by(8) {
            let v = _mm256_loadu_ps(xp.add(i));
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign_mask, v));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        let amax = hmax(m);
        // A NaN makes the block's scale NaN, so every product with it is flagged.
        *db = if _mm256_movemask_ps(nan) != 0 { f32::NAN } else { amax / 127.0 };
        let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        for i in (0..block).step_by(32) {
            let mut v = [_mm256_setzero_si256(); 4];
            for (j, vj) in v.iter_mut().enumerate() {
                let f = _mm256_mul_ps(_mm256_loadu_ps(xp.add(i + 8 * j)), id);
                *vj = _mm256_cvtps_epi32(_mm256_round_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
            let p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            // packs interleaves the 128-bit lanes; restore element order.
            let p = _mm256_permutevar8x32_epi32(p, perm);
            _mm256_storeu_si256(qs.as_mut_ptr().add(b * block + i) as *mut __m256i, p);
        }
    }
}

/// 32 bytes whose byte `j` is 0xff when bit `j` of `bits` is set.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bytes_from_bits(bits: u32) -> __m256i {
    let shuf = _mm256_setr_epi64x(0x0000_0000_0000_0000, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303);
    let v = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
    let bit = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(v, bit), _mm256_set1_epi64x(-1))
}

/// Nibbles of 16 bytes: low nibbles in bytes 0..16, high nibbles in bytes 16..32.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn nibbles16(p: *const u8) -> __m256i {
    let x = _mm_loadu_si128(p as *const __m128i);
    let m = _mm_set1_epi8(15);
    _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(x, m))
}

/// Unpacks one row of Q4_0, Q5_0 or Q8_0.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn unpack_legacy(ty: GgmlType, src: &[u8], q: &mut [i8], d: &mut [f32]) {
    let bytes = ty.type_size();
    assert!(src.len() == bytes * d.len() && q.len() == 32 * d.len());
    for (i, db) in d.iter_mut().enumerate() {
        let b = &src[i * bytes..(i + 1) * bytes];
        *db = f16_at(b, 0);
        let v = match ty {
            GgmlType::Q4_0 => _mm256_sub_epi8(nibbles16(b.as_ptr().add(2)), _mm256_set1_epi8(8)),
            GgmlType::Q5_0 => {
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                // Elements whose fifth bit is clear get 0xf0 or-ed in: as i8 that is level - 16.
                let high = _mm256_andnot_si256(bytes_from_bits(qh), _mm256_set1_epi8(0xf0u8 as i8));
                _mm256_or_si256(nibbles16(b.as_ptr().add(6)), high)
            }
            GgmlType::Q8_0 => _mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i),
            _ => unreachable!("{ty} is not a 32-block fast format"),
        };
        _mm256_storeu_si256(q.as_mut_ptr().add(32 * i) as *mut __m256i, v);
    }
}

/// Unpacks one row of a K-quant: Q4_K and Q6_K levels with SIMD, the others with the portable code.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn unpack_k(ty: GgmlType, src: &[u8], out: KRowMut<'_>) {
    let bytes = ty.type_size();
    let nb = out.d.len();
    assert!(src.len() == bytes * nb && out.q.len() == 256 * nb && out.sc.len() == 16 * nb && out.corr.len() == 16 * nb);
    match ty {
        GgmlType::Q4_K => {
            let m = _mm256_set1_epi8(15);
            for i in 0..nb {
                let b = &src[i * bytes..(i + 1) * bytes];
                out.d[i] = f16_at(b, 0);
                out.dcorr[i] = f16_at(b, 2);
                let (s, mn) = kiln_quant::unpack_scale_min_k4(&b[4..16]);
                for g in 0..16 {
                    out.sc[16 * i + g] = i16::from(s[g / 2]);
                    out.corr[16 * i + g] = i16::from(mn[g / 2]);
                }
                let qo = out.q.as_mut_ptr().add(256 * i);
                for j in 0..4 {
                    let v = _mm256_loadu_si256(b.as_ptr().add(16 + 32 * j) as *const __m256i);
                    _mm256_storeu_si256(qo.add(64 * j) as *mut __m256i, _mm256_and_si256(v, m));
                    _mm256_storeu_si256(qo.add(64 * j + 32) as *mut __m256i, _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
                }
            }
        }
        GgmlType::Q6_K => {
            let m4 = _mm256_set1_epi8(15);
            let (m2, m2b, m30) = (_mm256_set1_epi8(3), _mm256_set1_epi8(12), _mm256_set1_epi8(0x30));
            for i in 0..nb {
                let b = &src[i * bytes..(i + 1) * bytes];
                out.d[i] = f16_at(b, 208);
                out.dcorr[i] = out.d[i];
                for g in 0..16 {
                    let s = i16::from(b[192 + g] as i8);
                    out.sc[16 * i + g] = s;
                    out.corr[16 * i + g] = 32 * s;
                }
                for n in 0..2 {
                    let p = b.as_ptr();
                    let ql0 = _mm256_loadu_si256(p.add(64 * n) as *const __m256i);
                    let ql1 = _mm256_loadu_si256(p.add(64 * n + 32) as *const __m256i);
                    let h = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
                    let o0 = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
                    let o1 = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2b), 2));
                    let o2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(h, m30));
                    let o3 =
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
                    let qo = out.q.as_mut_ptr().add(256 * i + 128 * n);
                    _mm256_storeu_si256(qo as *mut __m256i, o0);
                    _mm256_storeu_si256(qo.add(32) as *mut __m256i, o1);
                    _mm256_storeu_si256(qo.add(64) as *mut __m256i, o2);
                    _mm256_storeu_si256(qo.add(96) as *mut __m256i, o3);
                }
            }
        }
        _ => scalar::unpack_k(ty, src, out),
    }
}

/// Products of every unpacked 32-block row of `tile` (`out.len()` of them) with `R` Q8_0 rows.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn legacy_tile<const R: usize>(tile: &Unpacked, k: usize, a: [ActRow<'_>; R], out: &mut [[f32; ROW_GROUP]]) {
    for (j, o) in out.iter_mut().enumerate() {
        o[..R].copy_from_slice(&legacy_dot(tile.legacy(j, k), a));
    }
}

/// Products of every unpacked K-quant row of `tile` (`out.len()` of them) with `R` Q8_K rows.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn k_tile<const R: usize>(tile: &Unpacked, k: usize, a: [ActRow<'_>; R], out: &mut [[f32; ROW_GROUP]]) {
    for (j, o) in out.iter_mut().enumerate() {
        o[..R].copy_from_slice(&k_dot(tile.kquant(j, k), a));
    }
}

/// Products of one unpacked 32-block row with `R` Q8_0 activation rows.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn legacy_dot<const R: usize>(w: LegacyRow<'_>, a: [ActRow<'_>; R]) -> [f32; R] {
    let nb = w.d.len();
    assert!(w.qs.len() == 32 * nb && a.iter().all(|a| a.qs.len() == 32 * nb && a.d.len() == nb));
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let wq = _mm256_loadu_si256(w.qs.as_ptr().add(32 * b) as *const __m256i);
        let wabs = _mm256_sign_epi8(wq, wq);
        let dw = *w.d.get_unchecked(b);
        for r in 0..R {
            let aq = _mm256_loadu_si256(a[r].qs.as_ptr().add(32 * b) as *const __m256i);
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(aq, wq)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * *a[r].d.get_unchecked(b)), acc[r]);
        }
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum(acc[r]);
    }
    out
}

/// Products of one unpacked K-quant row with `R` Q8_K activation rows.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn k_dot<const R: usize>(w: KRow<'_>, a: [ActRow<'_>; R]) -> [f32; R] {
    let nb = w.d.len();
    assert!(w.q.len() == 256 * nb && w.sc.len() == 16 * nb && w.corr.len() == 16 * nb && w.dcorr.len() == nb);
    assert!(a.iter().all(|a| a.qs.len() == 256 * nb && a.d.len() == nb && a.sums.len() == 16 * nb));
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let mut iacc = [_mm256_setzero_si256(); R];
        for c in 0..8 {
            let q = _mm256_loadu_si256(w.q.as_ptr().add(256 * b + 32 * c) as *const __m256i);
            let g = 16 * b + 2 * c;
            let sc = _mm256_set_m128i(_mm_set1_epi16(*w.sc.get_unchecked(g + 1)), _mm_set1_epi16(*w.sc.get_unchecked(g)));
            for r in 0..R {
                let aq = _mm256_loadu_si256(a[r].qs.as_ptr().add(256 * b + 32 * c) as *const __m256i);
                iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, aq), sc));
            }
        }
        let corr = _mm256_loadu_si256(w.corr.as_ptr().add(16 * b) as *const __m256i);
        let (dw, dc) = (*w.d.get_unchecked(b), *w.dcorr.get_unchecked(b));
        for r in 0..R {
            let sums = _mm256_loadu_si256(a[r].sums.as_ptr().add(16 * b) as *const __m256i);
            let c = _mm256_cvtepi32_ps(_mm256_madd_epi16(corr, sums));
            let da = *a[r].d.get_unchecked(b);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_set1_ps(dw * da), acc[r]);
            acc[r] = _mm256_fnmadd_ps(c, _mm256_set1_ps(dc * da), acc[r]);
        }
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum(acc[r]);
    }
    out
}

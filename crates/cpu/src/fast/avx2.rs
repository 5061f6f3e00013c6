//! AVX2 block decoders and integer dot cores (`maddubs` of unsigned weights by signed
//! activations, `madd` by the scales), and the AVX2 activation quantizer. The product kernels are
//! also built for AVX-512 (`avx2_and_avx512!`): the same integers and bits, with 32 vector
//! registers and `vpdpwssd`.

use std::arch::x86_64::*;

use kiln_quant::GgmlType;

use super::screen::{group_len, header_len, GROUP, GROUP_BLOCK_BYTES, WINDOW_BLOCKS};
use super::{ActRow, KBlock};

/// A product kernel's two entry points over one `#[inline(always)]` body: `$avx2`, built for AVX2,
/// and `$avx512`, the same body built for AVX-512 (F, BW, VL, VNNI), whose 32 vector registers hold
/// the accumulators that AVX2's 16 spill to the stack, and where the compiler fuses a `madd` and
/// its addition into one `vpdpwssd` (the same integers). Both give the same bits
/// (`avx512_products_equal_avx2_bit_for_bit`).
macro_rules! avx2_and_avx512 {
    ($(#[$doc:meta])* $avx2:ident, $avx512:ident = $body:ident($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $(#[$doc])*
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $avx2<const R: usize>($($arg: $ty),*) -> $ret {
            $body::<R>($($arg),*)
        }

        #[doc = concat!("[`", stringify!($avx2), "`] built for AVX-512 (F, BW, VL, VNNI): the same bits.")]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub unsafe fn $avx512<const R: usize>($($arg: $ty),*) -> $ret {
            $body::<R>($($arg),*)
        }
    };
}

/// `x`'s Q4_0 blocks into `out` (18 bytes a block), as `kiln_quant::quantize` encodes them (ggml's
/// reference rounding: the same float operations in the same order, so the same bytes); false,
/// with `out` partly written, if a value is not finite or a scale overflows f16.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn q4_0_blocks(x: &[f32], out: &mut [u8]) -> bool {
    assert!(x.len().is_multiple_of(32) && out.len() == x.len() / 32 * 18);
    let (magnitude, inf) = (_mm256_set1_epi32(0x7fff_ffff), _mm256_set1_epi32(0x7f80_0000));
    let (zero, fifteen) = (_mm256_setzero_si256(), _mm256_set1_epi32(15));
    let (eight, half) = (_mm256_set1_ps(8.0), _mm256_set1_ps(0.5));
    for (b, o) in x.chunks_exact(32).zip(out.chunks_exact_mut(18)) {
        let v = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(b.as_ptr().add(i)));
        // Magnitudes as the integers of their bits: ordered as the values, finite below infinity's.
        let a = v.map(|v| _mm256_and_si256(_mm256_castps_si256(v), magnitude));
        let finite = a.iter().fold(_mm256_set1_epi32(-1), |f, &a| _mm256_and_si256(f, _mm256_cmpgt_epi32(inf, a)));
        if _mm256_movemask_epi8(finite) != -1 {
            return false;
        }
        let m = _mm256_max_epi32(_mm256_max_epi32(a[0], a[1]), _mm256_max_epi32(a[2], a[3]));
        let m = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        let m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0b01_00_11_10));
        let top = _mm_cvtsi128_si32(_mm_max_epi32(m, _mm_shuffle_epi32(m, 0b10_11_00_01)));
        // `signed_absmax`: the first element of the largest magnitude, sign kept (0 if none).
        let amax = if top == 0 {
            0.0
        } else {
            let t = _mm256_set1_epi32(top);
            let hits = a
                .iter()
                .enumerate()
                .fold(0u32, |h, (i, &a)| h | ((_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, t))) as u32) << (8 * i)));
            b[hits.trailing_zeros() as usize]
        };
        let d = amax / -8.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        // (v * id + 8) + 0.5, truncated and clamped to 0..=15: `(.. as u8).min(15)`.
        let l = v.map(|v| {
            let t = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(v, id), eight), half);
            _mm256_min_epi32(_mm256_max_epi32(_mm256_cvttps_epi32(t), zero), fifteen)
        });
        // Byte j: level j low, level j + 16 high.
        let lo = _mm256_or_si256(l[0], _mm256_slli_epi32(l[2], 4));
        let hi = _mm256_or_si256(l[1], _mm256_slli_epi32(l[3], 4));
        let bytes = _mm256_packus_epi16(_mm256_packus_epi32(lo, hi), zero);
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm_storeu_si128(o.as_mut_ptr().add(2) as *mut __m128i, _mm256_castsi256_si128(bytes));
        let h = kiln_quant::f32_to_f16(d);
        if !kiln_quant::f16_to_f32(h).is_finite() {
            return false;
        }
        o[..2].copy_from_slice(&h.to_le_bytes());
    }
    true
}

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

/// Quantizes one row per block of `block` (32 or 256) to 16-bit levels: `d = max|x| / max_level`,
/// `q = round(x / d)`; a block holding a NaN or an infinity gets `d = NaN` and zero levels.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_row(x: &[f32], block: usize, max_level: f32, qs: &mut [i16], d: &mut [f32]) {
    assert!(x.len() == qs.len() && x.len() == block * d.len() && block.is_multiple_of(16));
    let sign_mask = _mm256_set1_ps(-0.0);
    for (b, db) in d.iter_mut().enumerate() {
        let xp = x.as_ptr().add(b * block);
        let qp = qs.as_mut_ptr().add(b * block);
        let (mut m, mut nan) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in (0..block).step_by(8) {
            let v = _mm256_loadu_ps(xp.add(i));
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign_mask, v));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        let amax = hmax(m);
        if _mm256_movemask_ps(nan) != 0 || !amax.is_finite() {
            *db = f32::NAN;
            std::ptr::write_bytes(qp, 0, block);
            continue;
        }
        *db = amax / max_level;
        let id = _mm256_set1_ps(if amax > 0.0 { max_level / amax } else { 0.0 });
        for i in (0..block).step_by(16) {
            let lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xp.add(i)), id));
            let hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xp.add(i + 8)), id));
            // packs interleaves the 128-bit lanes; restore element order.
            let p = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0b11_01_10_00);
            _mm256_storeu_si256(qp.add(i) as *mut __m256i, p);
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

/// Decoder selectors of the 32-block formats (const generic parameters of [`legacy_rows`]).
const DEC_Q4_0: u8 = 0;
const DEC_Q5_0: u8 = 1;
const DEC_Q8_0: u8 = 2;

/// The signed levels of the 32-element block at `p` (format `T`, its f16 scale first).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn legacy_levels<const T: u8>(p: *const u8) -> __m256i {
    match T {
        DEC_Q4_0 => _mm256_sub_epi8(nibbles16(p.add(2)), _mm256_set1_epi8(8)),
        DEC_Q5_0 => {
            let qh = std::ptr::read_unaligned(p.add(2) as *const u32);
            // Elements whose fifth bit is clear get 0xf0 or-ed in: as i8 that is level - 16.
            let high = _mm256_andnot_si256(bytes_from_bits(qh), _mm256_set1_epi8(0xf0u8 as i8));
            _mm256_or_si256(nibbles16(p.add(6)), high)
        }
        _ => _mm256_loadu_si256(p.add(2) as *const __m256i),
    }
}

/// The f16 at `p` in every lane, converted with F16C. (Converted as a whole vector: converting
/// one lane lets the compiler insert the half into an arbitrary register, often a live
/// accumulator, which chains every block on the previous one.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_splat(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_set1_epi16(std::ptr::read_unaligned(p as *const i16)))
}

avx2_and_avx512! {
    /// Products of one packed Q4_0, Q5_0 or Q8_0 row with `R` activation rows (32-element blocks);
    /// `d_t` holds their block scales block-major ([`super::ActGroup::d_t`]).
    legacy_rows, legacy_rows_avx512 = legacy_rows_any(ty: GgmlType, src: &[u8], a: &[ActRow<'_>; R], d_t: &[f32]) -> [f32; R]
}

/// The body of [`legacy_rows`] and [`legacy_rows_avx512`].
#[inline(always)]
unsafe fn legacy_rows_any<const R: usize>(ty: GgmlType, src: &[u8], a: &[ActRow<'_>; R], d_t: &[f32]) -> [f32; R] {
    match ty {
        GgmlType::Q4_0 => legacy_rows_of::<DEC_Q4_0, R>(src, ty.type_size(), a, d_t),
        GgmlType::Q5_0 => legacy_rows_of::<DEC_Q5_0, R>(src, ty.type_size(), a, d_t),
        GgmlType::Q8_0 => legacy_rows_of::<DEC_Q8_0, R>(src, ty.type_size(), a, d_t),
        _ => unreachable!("{ty} is not a 32-block fast format"),
    }
}

/// [`legacy_rows`] for decoder `T` with `bytes` per block. Each block is decoded into registers
/// (levels widened to 16 bits) and multiplied with every activation row by `madd`; two rounds of
/// interleave-and-add then pack four rows' block sums into one register (row `i`'s sum over one
/// 128-bit half in lane `i`, over the other in lane `i + 4`), which is converted and scaled once.
/// A single row takes the same steps with itself in every slot, so a row's product is the same
/// bits whichever rows it is batched with.
#[inline(always)]
unsafe fn legacy_rows_of<const T: u8, const R: usize>(src: &[u8], bytes: usize, a: &[ActRow<'_>; R], d_t: &[f32]) -> [f32; R] {
    let nb = src.len() / bytes;
    assert!(src.len() == bytes * nb && a.iter().all(|a| a.qs.len() == 32 * nb && a.d.len() == nb));
    assert!(R == 1 || d_t.len() >= 8 * nb);
    let mut acc = [_mm256_setzero_ps(); 2];
    for b in 0..nb {
        let p = src.as_ptr().add(b * bytes);
        let dw = f16_splat(p);
        let wq = legacy_levels::<T>(p);
        let w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(wq));
        let w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(wq, 1));
        let mut prod = [_mm256_setzero_si256(); R];
        for r in 0..R {
            let ap = a[r].qs.as_ptr().add(32 * b);
            let a0 = _mm256_loadu_si256(ap as *const __m256i);
            let a1 = _mm256_loadu_si256(ap.add(16) as *const __m256i);
            prod[r] = _mm256_add_epi32(_mm256_madd_epi16(w0, a0), _mm256_madd_epi16(w1, a1));
        }
        if R == 1 {
            // The same sums as the pairwise additions below, by two swaps within each half.
            let q = _mm256_add_epi32(prod[0], _mm256_shuffle_epi32(prod[0], 0b01_00_11_10));
            let t = _mm256_add_epi32(q, _mm256_shuffle_epi32(q, 0b10_11_00_01));
            let scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(a[0].d.get_unchecked(b)));
            acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, acc[0]);
            continue;
        }
        for h in 0..R.div_ceil(4) {
            let row = |i: usize| prod[(4 * h + i).min(R - 1)];
            // Interleave-and-add instead of `hadd` (a quarter of the throughput on Zen 3).
            let pairs = |x: __m256i, y: __m256i| _mm256_add_epi32(_mm256_unpacklo_epi32(x, y), _mm256_unpackhi_epi32(x, y));
            let (s01, s23) = (pairs(row(0), row(1)), pairs(row(2), row(3)));
            let t = _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
            let da = _mm256_broadcast_ps(&*(d_t.as_ptr().add(8 * b + 4 * h) as *const __m128));
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, da), acc[h]);
        }
    }
    let mut lanes = [[0f32; 8]; 2];
    for (l, v) in lanes.iter_mut().zip(acc) {
        _mm256_storeu_ps(l.as_mut_ptr(), v);
    }
    std::array::from_fn(|r| lanes[r / 4][r % 4] + lanes[r / 4][r % 4 + 4])
}

/// Decoder selectors of the K-quants (const generic parameters of [`k_rows_of`]); the others
/// (Q2_K, Q3_K) are unpacked onto the stack by the portable code.
const DEC_Q4_K: u8 = 0;
const DEC_Q5_K: u8 = 1;
const DEC_Q6_K: u8 = 2;
const DEC_STACK: u8 = 3;

avx2_and_avx512! {
    /// Products of one packed K-quant row with `R` activation rows.
    k_rows, k_rows_avx512 = k_rows_any(ty: GgmlType, src: &[u8], a: &[ActRow<'_>; R]) -> [f32; R]
}

/// The body of [`k_rows`] and [`k_rows_avx512`].
#[inline(always)]
unsafe fn k_rows_any<const R: usize>(ty: GgmlType, src: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
    match ty {
        GgmlType::Q4_K => k_rows_of::<DEC_Q4_K, R>(ty, src, a),
        GgmlType::Q5_K => k_rows_of::<DEC_Q5_K, R>(ty, src, a),
        GgmlType::Q6_K => k_rows_of::<DEC_Q6_K, R>(ty, src, a),
        _ => k_rows_of::<DEC_STACK, R>(ty, src, a),
    }
}

/// 32 unsigned bytes widened to two vectors of 16 `i16`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen_u8(v: __m256i) -> [__m256i; 2] {
    [_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1))]
}

/// 32 bytes of two 16-byte groups a, b in the paired order: 32-bit lane j holds a's and b's bytes
/// 2j and 2j + 1 (see [`k_row_bytes`]).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn paired(v: __m256i) -> __m256i {
    let pairs =
        _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v, 0b11_01_10_00), pairs)
}

/// The levels of elements `64c..64c + 64` of the super-block at `p` (format `T`) as two vectors of
/// 32 unsigned bytes (`w.q` for the stack-unpacked formats; Q6_K's offset by 32), in element order
/// or, with `PAIRED`, each in the [`paired`] order (Q4_K and Q5_K order their packed bytes, which
/// orders both vectors at once).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn k_bytes<const T: u8, const PAIRED: bool>(p: *const u8, c: usize, w: &KBlock) -> [__m256i; 2] {
    let m4 = _mm256_set1_epi8(15);
    let order = |v: __m256i| if PAIRED { paired(v) } else { v };
    let [a, b] = match T {
        DEC_Q4_K | DEC_Q5_K => {
            let qs = if T == DEC_Q5_K { 48 } else { 16 };
            let v = order(_mm256_loadu_si256(p.add(qs + 32 * c) as *const __m256i));
            let (mut lo, mut hi) = (_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            if T == DEC_Q5_K {
                // Fifth bits: bit 2c of qh[l] for element 64c + l, bit 2c + 1 for 64c + 32 + l.
                let qh = order(_mm256_loadu_si256(p.add(16) as *const __m256i));
                let sixteen = _mm256_set1_epi8(16);
                let (bl, bh) = (_mm256_set1_epi8((1u8 << (2 * c)) as i8), _mm256_set1_epi8((2u8 << (2 * c)) as i8));
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bl), bl), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bh), bh), sixteen));
            }
            return [lo, hi];
        }
        DEC_Q6_K => {
            let n = c / 2;
            let ql0 = _mm256_loadu_si256(p.add(64 * n) as *const __m256i);
            let ql1 = _mm256_loadu_si256(p.add(64 * n + 32) as *const __m256i);
            let h = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
            if c.is_multiple_of(2) {
                let (m2, m2b) = (_mm256_set1_epi8(3), _mm256_set1_epi8(12));
                [
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4)),
                    _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2b), 2)),
                ]
            } else {
                let m30 = _mm256_set1_epi8(0x30);
                [
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(h, m30)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)),
                ]
            }
        }
        _ => [
            _mm256_loadu_si256(w.q.as_ptr().add(64 * c) as *const __m256i),
            _mm256_loadu_si256(w.q.as_ptr().add(64 * c + 32) as *const __m256i),
        ],
    };
    [order(a), order(b)]
}

/// [`k_bytes`] as four vectors of 16 `i16`: unsigned, `q - 32` for Q6_K.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn k_levels<const T: u8>(p: *const u8, c: usize, w: &KBlock) -> [__m256i; 4] {
    let [a, b] = k_bytes::<T, false>(p, c, w);
    let ([a0, a1], [b0, b1]) = (widen_u8(a), widen_u8(b));
    if T == DEC_Q6_K {
        let off = _mm256_set1_epi16(32);
        [_mm256_sub_epi16(a0, off), _mm256_sub_epi16(a1, off), _mm256_sub_epi16(b0, off), _mm256_sub_epi16(b1, off)]
    } else {
        [a0, a1, b0, b1]
    }
}

/// One activation row's integer products with super-block `p`, per 32-bit lane the same integers
/// as the 16-bit `madd` of [`k_levels`] (so a row's product does not depend on its group), from the
/// row's level bytes (`q = 256 · hi + lo`, in `act::split_bytes`' paired order): `maddubs` of the
/// level bytes with `hi` and of `lo` with the level bytes, 32 products an instruction with no
/// widening (Q6_K's signed levels multiply `hi` through `sign`), then `madd` by the scales. Every
/// pair sum fits 16 bits (at most 2 · 255 · 63).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn k_row_bytes<const T: u8>(p: *const u8, w: &KBlock, hi: *const i8, lo: *const u8) -> __m256i {
    let (mut ih, mut il) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    for c in 0..4 {
        // (The paired order: 32-bit lane j holds both groups' elements 2j and 2j + 1, the lane
        // `madd` gives them in `k_levels`' order.)
        for (i, v) in k_bytes::<T, true>(p, c, w).into_iter().enumerate() {
            let e = 64 * c + 32 * i;
            // The two groups' scales alternating, a's in the low 16 bits of each lane.
            let sc = _mm256_set1_epi32((w.sc.as_ptr().add(e / 16) as *const i32).read_unaligned());
            let (h, l) = (_mm256_loadu_si256(hi.add(e) as *const __m256i), _mm256_loadu_si256(lo.add(e) as *const __m256i));
            let (ph, pl) = if T == DEC_Q6_K {
                let s = _mm256_sub_epi8(v, _mm256_set1_epi8(32));
                (_mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(h, s)), _mm256_maddubs_epi16(l, s))
            } else {
                (_mm256_maddubs_epi16(v, h), _mm256_maddubs_epi16(l, v))
            };
            ih = _mm256_add_epi32(ih, _mm256_madd_epi16(ph, sc));
            il = _mm256_add_epi32(il, _mm256_madd_epi16(pl, sc));
        }
    }
    _mm256_add_epi32(_mm256_slli_epi32(ih, 8), il)
}

/// [`KBlock::read`] of super-block `p` (format `ty`, decoder `T`) with F16C conversions and vector
/// unpacking of Q4_K/Q5_K's and Q6_K's scales: the same values (the portable read's conversions and
/// per-scale loops took as many instructions as a one-row product's arithmetic).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn read_k<const T: u8>(w: &mut KBlock, ty: GgmlType, p: *const u8) {
    let f16x2 = |at: usize| _mm_cvtph_ps(_mm_cvtsi32_si128((p.add(at) as *const i32).read_unaligned()));
    match T {
        DEC_Q4_K | DEC_Q5_K => {
            let dd = f16x2(0);
            (w.d, w.dcorr) = (_mm_cvtss_f32(dd), _mm_cvtss_f32(_mm_movehdup_ps(dd)));
            // `kiln_quant::unpack_scale_min_k4` a word at a time: bytes j of the results are
            // scales (mins) j and j + 4.
            let u = [0, 1, 2].map(|i| (p.add(4 + 4 * i) as *const u32).read_unaligned());
            let (low6, low4, top2) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
            let sc = u64::from(u[0] & low6) | u64::from((u[2] & low4) | (((u[0] >> 6) & top2) << 4)) << 32;
            let mn = u64::from(u[1] & low6) | u64::from(((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4)) << 32;
            // Each 6-bit value twice (one per 16 elements), widened to i16.
            let twice = |v: u64| {
                let b = _mm_cvtsi64_si128(v as i64);
                _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(b, b))
            };
            _mm256_storeu_si256(w.sc.as_mut_ptr() as *mut __m256i, twice(sc));
            _mm256_storeu_si256(w.corr.as_mut_ptr() as *mut __m256i, twice(mn));
        }
        DEC_Q6_K => {
            // (d is the block's last two bytes: read with the scales' last two.)
            w.d = _mm_cvtss_f32(_mm_movehdup_ps(f16x2(206)));
            let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192) as *const __m128i));
            _mm256_storeu_si256(w.sc.as_mut_ptr() as *mut __m256i, sc);
        }
        _ => w.read(ty, std::slice::from_raw_parts(p, ty.type_size())),
    }
}

/// How many super-blocks ahead a one-row K-quant product prefetches its weights (24: 3.5-5 KiB).
const PREFETCH_BLOCKS: usize = 24;

/// [`k_rows`] for decoder `T`: per super-block the scales (and corrections) are read into `w`,
/// every 16 levels times their integer scale (at most 4096 in magnitude: Q6_K) are multiplied with the
/// activations by `madd` (a lone row with its level bytes: [`k_row_bytes`], the same lane sums),
/// and the corrections are applied with the activations' 16-sums.
#[inline(always)]
unsafe fn k_rows_of<const T: u8, const R: usize>(ty: GgmlType, src: &[u8], a: &[ActRow<'_>; R]) -> [f32; R] {
    let bytes = ty.type_size();
    let nb = src.len() / bytes;
    assert!(src.len() == bytes * nb);
    assert!(a.iter().all(|a| a.qs.len() == 256 * nb && a.d.len() == nb && a.sums.len() == 16 * nb));
    // One row with its level bytes: `maddubs` without widening (k_row_bytes); several rows share
    // each 16-bit level vector's widening and scaling, so they keep `madd`.
    let bytes_path = R == 1 && a[0].hi.len() == 256 * nb;
    let mut w = KBlock::default();
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let p = src.as_ptr().add(b * bytes);
        if R == 1 {
            // One row streams each weight once: ask for the super-block PREFETCH_BLOCKS ahead
            // (past the row's end, the next row's: a tile's rows lie back to back). Several rows
            // reuse a tile from L2, and the prefetches would crowd out their levels in L1.
            for line in (0..bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BLOCKS * bytes + line) as *const i8);
            }
        }
        read_k::<T>(&mut w, ty, p);
        let mut iacc = [_mm256_setzero_si256(); R];
        if bytes_path {
            iacc[0] = k_row_bytes::<T>(p, &w, a[0].hi.as_ptr().add(256 * b), a[0].lo.as_ptr().add(256 * b));
        } else {
            for c in 0..4 {
                let lv = k_levels::<T>(p, c, &w);
                for (i, &l) in lv.iter().enumerate() {
                    let wv = _mm256_mullo_epi16(l, _mm256_set1_epi16(w.sc[4 * c + i]));
                    for r in 0..R {
                        let aq = _mm256_loadu_si256(a[r].qs.as_ptr().add(256 * b + 64 * c + 16 * i) as *const __m256i);
                        iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(wv, aq));
                    }
                }
            }
        }
        let dw = _mm256_set1_ps(w.d);
        if T == DEC_Q6_K {
            // Signed levels: no correction.
            for r in 0..R {
                let da = _mm256_broadcast_ss(a[r].d.get_unchecked(b));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_mul_ps(dw, da), acc[r]);
            }
            continue;
        }
        let c0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(w.corr.as_ptr() as *const __m128i)));
        let c1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(w.corr.as_ptr().add(8) as *const __m128i)));
        let dc = _mm256_set1_ps(w.dcorr);
        for r in 0..R {
            let sp = a[r].sums.as_ptr().add(16 * b);
            let corr = _mm256_fmadd_ps(c1, _mm256_loadu_ps(sp.add(8)), _mm256_mul_ps(c0, _mm256_loadu_ps(sp)));
            let da = _mm256_broadcast_ss(a[r].d.get_unchecked(b));
            let v = _mm256_fmsub_ps(_mm256_cvtepi32_ps(iacc[r]), dw, _mm256_mul_ps(corr, dc));
            acc[r] = _mm256_fmadd_ps(v, da, acc[r]);
        }
    }
    let mut out = [0f32; R];
    for r in 0..R {
        out[r] = hsum(acc[r]);
    }
    out
}

avx2_and_avx512! {
    /// The 8 scores of each of `out.len()` consecutive groups of the screening copy (`nb` blocks
    /// each; see `screen`) for `R` activation rows (offset 8-bit levels and their scale), in row order.
    /// One 32-bit lane per row: `maddubs` of the offset activations (4 elements broadcast) with the
    /// signed levels, seven 16-bit additions (at most 8 · 4080 = 32640 per lane) and one `madd` with
    /// the block's multipliers give each row's block sum times its multiplier, accumulated in 32 bits
    /// per window (exact modulo 2³², and the window's true sum fits); the offset term `K` is
    /// subtracted before the conversion to f32.
    screen_groups, screen_groups_avx512 = screen_groups_any(groups: &[u8], nb: usize, a: [(&[u8], f32); R], out: &mut [[[f32; 8]; R]]) -> ()
}

/// The body of [`screen_groups`] and [`screen_groups_avx512`].
#[inline(always)]
unsafe fn screen_groups_any<const R: usize>(groups: &[u8], nb: usize, a: [(&[u8], f32); R], out: &mut [[[f32; 8]; R]]) {
    let (head, glen) = (header_len(nb), group_len(nb));
    assert!(groups.len() == out.len() * glen && a.iter().all(|(q, _)| q.len() == 32 * nb));
    let (m4, eight, low16) = (_mm256_set1_epi8(15), _mm256_set1_epi8(8), _mm256_set1_epi32(0xffff));
    let qs = a.map(|r| r.0.as_ptr());
    for (g, o) in out.iter_mut().enumerate() {
        let grp = groups.as_ptr().add(g * glen);
        let mut total = [_mm256_setzero_ps(); R];
        for (win, w0) in (0..nb).step_by(WINDOW_BLOCKS).enumerate() {
            let mut acc = [_mm256_setzero_si256(); R];
            for b in w0..(w0 + WINDOW_BLOCKS).min(nb) {
                let p = grp.add(head + b * GROUP_BLOCK_BYTES);
                // Each row's multiplier in both 16-bit halves of its lane.
                let m = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i));
                let mv = _mm256_or_si256(_mm256_and_si256(m, low16), _mm256_slli_epi32(m, 16));
                let mut w = [_mm256_setzero_si256(); 8];
                for i in 0..4 {
                    let v = _mm256_loadu_si256(p.add(GROUP + 32 * i) as *const __m256i);
                    w[i] = _mm256_sub_epi8(_mm256_and_si256(v, m4), eight);
                    w[i + 4] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), eight);
                }
                for r in 0..R {
                    let ap = qs[r].add(32 * b) as *const i32;
                    let p: [__m256i; 8] =
                        std::array::from_fn(|i| _mm256_maddubs_epi16(_mm256_set1_epi32(ap.add(i).read_unaligned()), w[i]));
                    let s = _mm256_add_epi16(
                        _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                        _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])),
                    );
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(s, mv));
                }
            }
            let k = _mm256_loadu_si256(grp.add(4 * GROUP * (1 + win)) as *const __m256i);
            for r in 0..R {
                total[r] = _mm256_add_ps(total[r], _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r], k)));
            }
        }
        let base = _mm256_loadu_ps(grp as *const f32);
        for r in 0..R {
            _mm256_storeu_ps(o[r].as_mut_ptr(), _mm256_mul_ps(_mm256_mul_ps(base, _mm256_set1_ps(a[r].1)), total[r]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `read_k` reads what the portable `KBlock::read` reads, bit for bit, from blocks of random
    /// bytes (their f16 scales include NaNs, infinities and subnormals).
    #[test]
    fn read_k_equals_the_portable_read() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
            eprintln!("no AVX2/FMA/F16C on this CPU: read_k cannot run here");
            return;
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut byte = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 56) as u8
        };
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
            for _ in 0..2000 {
                let b: Vec<u8> = (0..ty.type_size()).map(|_| byte()).collect();
                let (mut want, mut got) = (KBlock::default(), KBlock::default());
                want.read(ty, &b);
                // SAFETY: the CPU has the features (checked above); `b` is one whole block.
                unsafe {
                    match ty {
                        GgmlType::Q4_K => read_k::<DEC_Q4_K>(&mut got, ty, b.as_ptr()),
                        GgmlType::Q5_K => read_k::<DEC_Q5_K>(&mut got, ty, b.as_ptr()),
                        _ => read_k::<DEC_Q6_K>(&mut got, ty, b.as_ptr()),
                    }
                }
                let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
                assert!(
                    same(got.d, want.d) && same(got.dcorr, want.dcorr),
                    "{ty} {b:?}: d {} {} want {} {}",
                    got.d,
                    got.dcorr,
                    want.d,
                    want.dcorr
                );
                assert_eq!(got.sc, want.sc, "{ty} {b:?}");
                assert_eq!(got.corr, want.corr, "{ty} {b:?}");
            }
        }
    }
}

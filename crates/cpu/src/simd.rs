//! f32 vector primitives, one implementation per instruction set, chosen once at run time.

use std::sync::OnceLock;

/// An instruction-set variant of the vector primitives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable code (any CPU).
    Scalar,
    /// x86-64 AVX2 with FMA (and F16C, which every AVX2 CPU has).
    Avx2Fma,
    /// x86-64 AVX-512 (F, BW, VL, VNNI) beside AVX2: the integer product kernels built with its 32
    /// vector registers and `vpdpwssd` (the same integers, so the same bits as [`Isa::Avx2Fma`]);
    /// the f32 primitives are AVX2's.
    Avx512,
    /// aarch64 Advanced SIMD (NEON, present on every aarch64 CPU).
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl Isa {
    /// The best variant this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            let avx512 = is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni");
            return if avx512 { Isa::Avx512 } else { Isa::Avx2Fma };
        }
        // NEON is part of every aarch64 CPU: no run-time check.
        #[cfg(target_arch = "aarch64")]
        let baseline = Isa::Neon;
        #[cfg(not(target_arch = "aarch64"))]
        let baseline = Isa::Scalar;
        baseline
    }

    /// Every variant this CPU can run (for tests that force each one).
    pub fn supported() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        match Isa::detect() {
            Isa::Avx2Fma => v.push(Isa::Avx2Fma),
            Isa::Avx512 => v.extend([Isa::Avx2Fma, Isa::Avx512]),
            _ => {}
        }
        #[cfg(target_arch = "aarch64")]
        v.push(Isa::Neon);
        v
    }
}

/// The variant used by the kernels.
pub fn active_isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(Isa::detect)
}

/// Dot products of four rows `w[0..4]` with `x` (all of `x.len()` elements).
pub fn dot4(isa: Isa, w: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len();
    assert!(w.iter().all(|r| r.len() >= n));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2Fma and Avx512 are only selected when the CPU has AVX2 and FMA; lengths checked above.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { avx2::dot4(w, x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is part of every aarch64 CPU; lengths checked above.
        Isa::Neon => unsafe { neon::dot4(w, x) },
        _ => w.map(|r| dot_scalar(&r[..n], x)),
    }
}

/// Most queries the attention primitives ([`dots`], [`weighted_sum`]) take at once.
pub const MAX_QUERIES: usize = 4;

/// `out[q * keys.len() + j] = queries[q] · keys[j]` for up to [`MAX_QUERIES`] queries, all rows of
/// one length. Each product's arithmetic is the same whatever the other queries and keys are.
pub fn dots(isa: Isa, queries: &[&[f32]], keys: &[&[f32]], out: &mut [f32]) {
    let d = queries.first().map_or(0, |q| q.len());
    assert!(queries.len() <= MAX_QUERIES && out.len() >= queries.len() * keys.len());
    assert!(queries.iter().chain(keys).all(|r| r.len() == d));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in dot4; lengths checked above.
        Isa::Avx2Fma | Isa::Avx512 => unsafe {
            match queries.len() {
                1 => avx2::dots::<1>(queries, keys, out),
                2 => avx2::dots::<2>(queries, keys, out),
                3 => avx2::dots::<3>(queries, keys, out),
                4 => avx2::dots::<4>(queries, keys, out),
                _ => {}
            }
        },
        _ => {
            for (q, qv) in queries.iter().enumerate() {
                for (j, kv) in keys.iter().enumerate() {
                    out[q * keys.len() + j] = dot_scalar(qv, kv);
                }
            }
        }
    }
}

/// `x[i] = exp(x[i] - shift)` (AVX2: a polynomial `exp` within a few ulp of libm's).
pub fn exp_shifted(isa: Isa, x: &mut [f32], shift: f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in dot4.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { avx2::exp_shifted(x, shift) },
        _ => x.iter_mut().for_each(|v| *v = (*v - shift).exp()),
    }
}

/// `acc[q] = acc[q] * alpha[q] + Σ_j weights[q * values.len() + j] * values[j]` for up to
/// [`MAX_QUERIES`] accumulator rows of `acc` (each as long as the value rows). Each accumulator's
/// arithmetic is the same whatever the other rows are.
pub fn weighted_sum(isa: Isa, acc: &mut [f32], alpha: &[f32], weights: &[f32], values: &[&[f32]]) {
    let nq = alpha.len();
    assert!(nq <= MAX_QUERIES && weights.len() >= nq * values.len());
    let d = acc.len().checked_div(nq).unwrap_or(0);
    assert!(acc.len() == nq * d && values.iter().all(|v| v.len() == d));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in dot4; lengths checked above.
        Isa::Avx2Fma | Isa::Avx512 => unsafe {
            match nq {
                1 => avx2::weighted_sum::<1>(acc, alpha, weights, values),
                2 => avx2::weighted_sum::<2>(acc, alpha, weights, values),
                3 => avx2::weighted_sum::<3>(acc, alpha, weights, values),
                4 => avx2::weighted_sum::<4>(acc, alpha, weights, values),
                _ => {}
            }
        },
        _ => {
            let nk = values.len();
            for (q, row) in acc.chunks_exact_mut(d.max(1)).take(nq).enumerate() {
                row.iter_mut().for_each(|a| *a *= alpha[q]);
                for (j, v) in values.iter().enumerate() {
                    let w = weights[q * nk + j];
                    row.iter_mut().zip(v.iter()).for_each(|(a, x)| *a += w * x);
                }
            }
        }
    }
}

/// `dst[i] = f32(src[i])` for IEEE half bits (exact; F16C on AVX2).
pub fn f16_to_f32(isa: Isa, src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2Fma and Avx512 are only selected on CPUs with F16C (`Isa::detect`); lengths checked.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { avx2::f16_to_f32(src, dst) },
        _ => 0,
    };
    dst[done..].iter_mut().zip(&src[done..]).for_each(|(d, &h)| *d = kiln_quant::f16_to_f32(h));
}

/// `dst[i] = half(src[i])`, rounded to nearest even (overflow to infinity; F16C on AVX2, the
/// same bits as the scalar conversion).
pub fn f32_to_f16(isa: Isa, src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in f16_to_f32.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { avx2::f32_to_f16(src, dst) },
        _ => 0,
    };
    dst[done..].iter_mut().zip(&src[done..]).for_each(|(d, &x)| *d = kiln_quant::f32_to_f16(x));
}

/// `dst[i] = f32(half(src[i]))`: the values an f16 cache holds for `src`.
pub fn round_f16(isa: Isa, src: &[f32], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    let mut bits = [0u16; 64];
    for (s, d) in src.chunks(64).zip(dst.chunks_mut(64)) {
        let b = &mut bits[..s.len()];
        f32_to_f16(isa, s, b);
        f16_to_f32(isa, b, d);
    }
}

/// `out = gelu_tanh(gate) * up` with a polynomial `exp` (a few ulp from libm's `tanh`; the fast
/// kernels' GELU).
pub fn gelu_mul_fast(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in dot4.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { avx2::gelu_mul(gate, up, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is part of every aarch64 CPU; lengths checked above.
        Isa::Neon => unsafe { neon::gelu_mul(gate, up, out) },
        _ => out.iter_mut().zip(gate.iter().zip(up)).for_each(|(o, (g, u))| *o = crate::kernels::gelu_tanh(*g) * u),
    }
}

fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8 * 8;
    for (ca, cb) in a[..chunks].chunks_exact(8).zip(b[..chunks].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for i in chunks..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Converts the first multiple of 8 elements; returns how many.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_to_f32(src: &[u16], dst: &mut [f32]) -> usize {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        n
    }

    /// Converts the first multiple of 8 elements (round to nearest even); returns how many.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f32_to_f16(src: &[f32], dst: &mut [u16]) -> usize {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
        }
        n
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4(w: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
        let n = x.len();
        let body = n / 8 * 8;
        let (xp, p0, p1, p2, p3) = (x.as_ptr(), w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr());
        let (mut a0, mut a1, mut a2, mut a3) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < body {
            let xv = _mm256_loadu_ps(xp.add(i));
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(p0.add(i)), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(p1.add(i)), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(p2.add(i)), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(p3.add(i)), xv, a3);
            i += 8;
        }
        let mut out = [hsum(a0), hsum(a1), hsum(a2), hsum(a3)];
        for j in body..n {
            let xv = *xp.add(j);
            out[0] += *p0.add(j) * xv;
            out[1] += *p1.add(j) * xv;
            out[2] += *p2.add(j) * xv;
            out[3] += *p3.add(j) * xv;
        }
        out
    }

    /// `exp(x)` for 8 lanes: range reduction by ln 2 and a degree-6 polynomial (Cephes `expf`),
    /// clamped to the finite range of f32 (so `exp(large)` is the largest float, then 1/inf-safe).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp(x: __m256) -> __m256 {
        // Operands ordered so a NaN lane stays NaN (max/min return the second operand on NaN).
        let x = _mm256_min_ps(_mm256_set1_ps(88.7), _mm256_max_ps(_mm256_set1_ps(-87.3), x));
        let n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
        _mm256_mul_ps(p, scale)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gelu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = out.len();
        let body = n / 8 * 8;
        let (c0, c1) = (_mm256_set1_ps(2.0 * 0.797_884_6), _mm256_set1_ps(0.044715));
        let (one, two, half) = (_mm256_set1_ps(1.0), _mm256_set1_ps(2.0), _mm256_set1_ps(0.5));
        let mut i = 0;
        while i < body {
            let x = _mm256_loadu_ps(gate.as_ptr().add(i));
            // tanh(u) = 1 - 2 / (1 + exp(2u)), u = sqrt(2/pi) (x + 0.044715 x^3).
            let x2 = _mm256_mul_ps(x, x);
            let u2 = _mm256_mul_ps(c0, _mm256_fmadd_ps(_mm256_mul_ps(c1, x2), x, x));
            let t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, exp(u2))));
            let g = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(g, _mm256_loadu_ps(up.as_ptr().add(i))));
            i += 8;
        }
        for j in body..n {
            out[j] = crate::kernels::gelu_tanh(gate[j]) * up[j];
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots<const NQ: usize>(queries: &[&[f32]], keys: &[&[f32]], out: &mut [f32]) {
        let d = queries[0].len();
        let (nk, body) = (keys.len(), d / 8 * 8);
        let qp: [*const f32; NQ] = std::array::from_fn(|q| queries[q].as_ptr());
        let mut j = 0;
        // Two keys at a time (the second repeats the first when one is left); one accumulator per
        // product, so a product's arithmetic never depends on its neighbours.
        while j < nk {
            let pair = (nk - j).min(2);
            let (k0, k1) = (keys[j].as_ptr(), keys[j + pair - 1].as_ptr());
            let mut acc = [[_mm256_setzero_ps(); 2]; NQ];
            let mut c = 0;
            while c < body {
                let (kv0, kv1) = (_mm256_loadu_ps(k0.add(c)), _mm256_loadu_ps(k1.add(c)));
                for q in 0..NQ {
                    let qv = _mm256_loadu_ps(qp[q].add(c));
                    acc[q][0] = _mm256_fmadd_ps(qv, kv0, acc[q][0]);
                    acc[q][1] = _mm256_fmadd_ps(qv, kv1, acc[q][1]);
                }
                c += 8;
            }
            for q in 0..NQ {
                for (p, kp) in [k0, k1].into_iter().enumerate().take(pair) {
                    let mut s = hsum(acc[q][p]);
                    for t in body..d {
                        s += *qp[q].add(t) * *kp.add(t);
                    }
                    out[q * nk + j + p] = s;
                }
            }
            j += pair;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted(x: &mut [f32], shift: f32) {
        let shift_v = _mm256_set1_ps(shift);
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            _mm256_storeu_ps(c.as_mut_ptr(), exp(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), shift_v)));
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            // The tail goes through the same polynomial, lane for lane.
            let mut buf = [0f32; 8];
            buf[..tail.len()].copy_from_slice(tail);
            _mm256_storeu_ps(buf.as_mut_ptr(), exp(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), shift_v)));
            tail.copy_from_slice(&buf[..tail.len()]);
        }
    }

    /// Accumulates `W` vectors of 8 lanes at lane offset `c` of every accumulator row.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weighted_lanes<const NQ: usize, const W: usize>(
        acc: *mut f32,
        d: usize,
        c: usize,
        alpha: &[f32],
        weights: &[f32],
        values: &[&[f32]],
    ) {
        let nk = values.len();
        let mut a = [[_mm256_setzero_ps(); W]; NQ];
        for q in 0..NQ {
            let s = _mm256_set1_ps(alpha[q]);
            for (w, lanes) in a[q].iter_mut().enumerate() {
                *lanes = _mm256_mul_ps(_mm256_loadu_ps(acc.add(q * d + c + 8 * w)), s);
            }
        }
        for (j, v) in values.iter().enumerate() {
            let vp = v.as_ptr().add(c);
            let vv: [__m256; W] = std::array::from_fn(|w| _mm256_loadu_ps(vp.add(8 * w)));
            for (q, lanes) in a.iter_mut().enumerate() {
                let wt = _mm256_set1_ps(*weights.get_unchecked(q * nk + j));
                for (l, v) in lanes.iter_mut().zip(&vv) {
                    *l = _mm256_fmadd_ps(wt, *v, *l);
                }
            }
        }
        for (q, lanes) in a.iter().enumerate() {
            for (w, l) in lanes.iter().enumerate() {
                _mm256_storeu_ps(acc.add(q * d + c + 8 * w), *l);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_sum<const NQ: usize>(acc: &mut [f32], alpha: &[f32], weights: &[f32], values: &[&[f32]]) {
        let d = acc.len() / NQ;
        let nk = values.len();
        let ap = acc.as_mut_ptr();
        let mut c = 0;
        while c + 16 <= d {
            weighted_lanes::<NQ, 2>(ap, d, c, alpha, weights, values);
            c += 16;
        }
        if c + 8 <= d {
            weighted_lanes::<NQ, 1>(ap, d, c, alpha, weights, values);
            c += 8;
        }
        for t in c..d {
            for q in 0..NQ {
                let mut s = *ap.add(q * d + t) * alpha[q];
                for (j, v) in values.iter().enumerate() {
                    s += weights[q * nk + j] * v[t];
                }
                *ap.add(q * d + t) = s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand_vec(seed: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                (*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    #[test]
    fn half_conversions_of_every_isa_equal_the_scalar_ones() {
        // Ties between halves (1 + 2^-11 rounds to 1, 1 + 3 * 2^-11 to 1 + 2^-9), subnormals,
        // overflow to infinity, signed zeros, and random values over many binades, at odd lengths.
        let mut seed = 0x51ed_270b_1f37_2c45;
        let special = [1.0 + f32::EPSILON * 1024.0, 1.0 + 3.0 * 1024.0 * f32::EPSILON, 3e-6, -7e-8, 65519.0, 65520.0, 1e9, -0.0, 0.0];
        for isa in Isa::supported() {
            for n in [1, 7, 8, 9, 31, 64, 65, 300] {
                let mut x: Vec<f32> = rand_vec(&mut seed, n).iter().enumerate().map(|(i, v)| v * 2f32.powi(i as i32 % 40 - 24)).collect();
                for (a, b) in x.iter_mut().zip(special) {
                    *a = b;
                }
                let (mut h, mut back, mut round) = (vec![0u16; n], vec![0f32; n], vec![0f32; n]);
                f32_to_f16(isa, &x, &mut h);
                assert_eq!(h, x.iter().map(|&v| kiln_quant::f32_to_f16(v)).collect::<Vec<_>>(), "{isa:?} n={n}");
                f16_to_f32(isa, &h, &mut back);
                assert!(back.iter().zip(&h).all(|(b, &h)| b.to_bits() == kiln_quant::f16_to_f32(h).to_bits()), "{isa:?} n={n}");
                round_f16(isa, &x, &mut round);
                assert!(round.iter().zip(&back).all(|(r, b)| r.to_bits() == b.to_bits()), "{isa:?} n={n}");
            }
        }
    }

    #[test]
    fn every_isa_matches_f64_on_odd_sizes() {
        let mut seed = 0x9e3779b97f4a7c15;
        for isa in Isa::supported() {
            for n in [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 255, 640, 1001] {
                let x = rand_vec(&mut seed, n);
                let rows: Vec<Vec<f32>> = (0..4).map(|_| rand_vec(&mut seed, n)).collect();
                let exact = |r: &[f32]| r.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
                let got = dot4(isa, [&rows[0], &rows[1], &rows[2], &rows[3]], &x);
                for (g, r) in got.iter().zip(&rows) {
                    assert!((*g as f64 - exact(r)).abs() < 1e-4 * (n as f64).sqrt(), "{isa:?} n={n}");
                }
                let mut g = vec![0f32; n];
                let gate: Vec<f32> = x.iter().map(|v| v * 12.0).collect();
                gelu_mul_fast(isa, &gate, &rows[2], &mut g);
                for i in 0..n {
                    let want = crate::kernels::gelu_tanh(gate[i]) * rows[2][i];
                    assert!((g[i] - want).abs() <= 1e-6 * (1.0 + gate[i].abs()), "{isa:?} gelu({}) = {} want {want}", gate[i], g[i]);
                }
            }
        }
    }

    #[test]
    fn attention_primitives_match_f64_on_odd_sizes() {
        let mut seed = 0x2545_f491_4f6c_dd1d;
        for isa in Isa::supported() {
            for d in [1, 5, 8, 13, 16, 24, 33, 256, 259] {
                for nq in 1..=MAX_QUERIES {
                    for nk in [1, 2, 3, 7, 32] {
                        let what = format!("{isa:?} d={d} queries={nq} keys={nk}");
                        let qs: Vec<Vec<f32>> = (0..nq).map(|_| rand_vec(&mut seed, d)).collect();
                        let ks: Vec<Vec<f32>> = (0..nk).map(|_| rand_vec(&mut seed, d)).collect();
                        let (qr, kr): (Vec<&[f32]>, Vec<&[f32]>) =
                            (qs.iter().map(|v| &v[..]).collect(), ks.iter().map(|v| &v[..]).collect());
                        let mut got = vec![f32::NAN; nq * nk];
                        dots(isa, &qr, &kr, &mut got);
                        for q in 0..nq {
                            for j in 0..nk {
                                let want = qs[q].iter().zip(&ks[j]).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
                                assert!((got[q * nk + j] as f64 - want).abs() < 1e-5 * (d as f64).sqrt(), "{what}: dot {q},{j}");
                                // One query alone gives the same bits as in company.
                                let mut alone = [0f32];
                                dots(isa, &qr[q..q + 1], &kr[j..j + 1], &mut alone);
                                assert_eq!(alone[0].to_bits(), got[q * nk + j].to_bits(), "{what}: dot {q},{j} alone");
                            }
                        }
                        let scores: Vec<f32> = rand_vec(&mut seed, nq * nk).iter().map(|v| v * 40.0).collect();
                        let mut e = scores.clone();
                        exp_shifted(isa, &mut e, 3.0);
                        for (g, s) in e.iter().zip(&scores) {
                            // The shift is an f32 subtraction; exp itself is within a few ulp.
                            let want = ((*s - 3.0) as f64).exp();
                            assert!((*g as f64 - want).abs() <= 4e-7 * want, "{what}: exp({s} - 3) = {g} want {want}");
                        }
                        let alpha: Vec<f32> = (0..nq).map(|q| 0.25 + q as f32 * 0.5).collect();
                        let acc0 = rand_vec(&mut seed, nq * d);
                        let mut acc = acc0.clone();
                        weighted_sum(isa, &mut acc, &alpha, &e, &kr);
                        for q in 0..nq {
                            for t in 0..d {
                                let want = acc0[q * d + t] as f64 * alpha[q] as f64
                                    + (0..nk).map(|j| e[q * nk + j] as f64 * ks[j][t] as f64).sum::<f64>();
                                let mag = 1.0 + (0..nk).map(|j| e[q * nk + j] as f64).sum::<f64>();
                                assert!((acc[q * d + t] as f64 - want).abs() < 1e-6 * mag, "{what}: acc {q},{t}");
                            }
                            let mut alone = acc0[q * d..(q + 1) * d].to_vec();
                            let wq: Vec<f32> = e[q * nk..(q + 1) * nk].to_vec();
                            weighted_sum(isa, &mut alone, &alpha[q..q + 1], &wq, &kr);
                            assert_eq!(alone, acc[q * d..(q + 1) * d], "{what}: accumulator {q} alone");
                        }
                    }
                }
            }
        }
    }
}

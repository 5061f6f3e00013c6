//! f32 vector primitives, one implementation per instruction set, chosen once at run time.

use std::sync::OnceLock;

/// An instruction-set variant of the vector primitives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable code (any CPU).
    Scalar,
    /// x86-64 AVX2 with FMA (and F16C, which every AVX2 CPU has).
    Avx2Fma,
    /// aarch64 Advanced SIMD (NEON, present on every aarch64 CPU).
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl Isa {
    /// The best variant this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            return Isa::Avx2Fma;
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
        if Isa::detect() == Isa::Avx2Fma {
            v.push(Isa::Avx2Fma);
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
        // SAFETY: Avx2Fma is only selected when the CPU has both features; lengths checked above.
        Isa::Avx2Fma => unsafe { avx2::dot4(w, x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is part of every aarch64 CPU; lengths checked above.
        Isa::Neon => unsafe { neon::dot4(w, x) },
        _ => w.map(|r| dot_scalar(&r[..n], x)),
    }
}

/// Dot product of `a` and `b` (equal lengths).
pub fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in dot4.
        Isa::Avx2Fma => unsafe { avx2::dot(a, b) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is part of every aarch64 CPU; lengths checked above.
        Isa::Neon => unsafe { neon::dot(a, b) },
        _ => dot_scalar(a, b),
    }
}

/// `y += a * x` (equal lengths).
pub fn axpy(isa: Isa, y: &mut [f32], a: f32, x: &[f32]) {
    assert_eq!(y.len(), x.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in dot4.
        Isa::Avx2Fma => unsafe { avx2::axpy(y, a, x) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is part of every aarch64 CPU; lengths checked above.
        Isa::Neon => unsafe { neon::axpy(y, a, x) },
        _ => y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x),
    }
}

/// `out = gelu_tanh(gate) * up` with a polynomial `exp` (a few ulp from libm's `tanh`; the fast
/// kernels' GELU).
pub fn gelu_mul_fast(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in dot4.
        Isa::Avx2Fma => unsafe { avx2::gelu_mul(gate, up, out) },
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

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let body = n / 16 * 16;
        let (ap, bp) = (a.as_ptr(), b.as_ptr());
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < body {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(i)), _mm256_loadu_ps(bp.add(i)), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(i + 8)), _mm256_loadu_ps(bp.add(i + 8)), s1);
            i += 16;
        }
        let mut s = hsum(_mm256_add_ps(s0, s1));
        for j in body..n {
            s += *ap.add(j) * *bp.add(j);
        }
        s
    }

    /// `exp(x)` for 8 lanes: range reduction by ln 2 and a degree-6 polynomial (Cephes `expf`),
    /// clamped to the finite range of f32 (so `exp(large)` is the largest float, then 1/inf-safe).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.7));
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
    pub unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let n = y.len();
        let body = n / 8 * 8;
        let (yp, xp) = (y.as_mut_ptr(), x.as_ptr());
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i < body {
            _mm256_storeu_ps(yp.add(i), _mm256_fmadd_ps(av, _mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(yp.add(i))));
            i += 8;
        }
        for j in body..n {
            *yp.add(j) += a * *xp.add(j);
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
                assert!((dot(isa, &rows[0], &x) as f64 - exact(&rows[0])).abs() < 1e-4 * (n as f64).sqrt());
                let mut g = vec![0f32; n];
                let gate: Vec<f32> = x.iter().map(|v| v * 12.0).collect();
                gelu_mul_fast(isa, &gate, &rows[2], &mut g);
                for i in 0..n {
                    let want = crate::kernels::gelu_tanh(gate[i]) * rows[2][i];
                    assert!((g[i] - want).abs() <= 1e-6 * (1.0 + gate[i].abs()), "{isa:?} gelu({}) = {} want {want}", gate[i], g[i]);
                }
                let mut y = rows[1].clone();
                axpy(isa, &mut y, 0.5, &x);
                for i in 0..n {
                    assert!((y[i] - (rows[1][i] + 0.5 * x[i])).abs() < 1e-6);
                }
            }
        }
    }
}

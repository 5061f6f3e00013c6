//! aarch64 NEON variants of the f32 vector primitives (NEON is part of every aarch64 CPU).

use std::arch::aarch64::*;

/// Dot products of four rows with `x` (the rows at least `x.len()` long).
pub unsafe fn dot4(w: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len();
    let body = n / 8 * 8;
    let (xp, p) = (x.as_ptr(), w.map(|r| r.as_ptr()));
    // Two accumulators per row (elements 8i..8i+4 and 8i+4..8i+8).
    let mut acc = [[vdupq_n_f32(0.0); 2]; 4];
    let mut i = 0;
    while i < body {
        let (x0, x1) = (vld1q_f32(xp.add(i)), vld1q_f32(xp.add(i + 4)));
        for (a, &pr) in acc.iter_mut().zip(&p) {
            a[0] = vfmaq_f32(a[0], vld1q_f32(pr.add(i)), x0);
            a[1] = vfmaq_f32(a[1], vld1q_f32(pr.add(i + 4)), x1);
        }
        i += 8;
    }
    let mut out = acc.map(|a| vaddvq_f32(vaddq_f32(a[0], a[1])));
    for j in body..n {
        let xv = *xp.add(j);
        for (o, &pr) in out.iter_mut().zip(&p) {
            *o += *pr.add(j) * xv;
        }
    }
    out
}

/// Dot product of `a` and `b` (equal lengths).
pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let body = n / 16 * 16;
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut s = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i < body {
        for (k, sk) in s.iter_mut().enumerate() {
            *sk = vfmaq_f32(*sk, vld1q_f32(ap.add(i + 4 * k)), vld1q_f32(bp.add(i + 4 * k)));
        }
        i += 16;
    }
    let mut sum = vaddvq_f32(vaddq_f32(vaddq_f32(s[0], s[1]), vaddq_f32(s[2], s[3])));
    for j in body..n {
        sum += *ap.add(j) * *bp.add(j);
    }
    sum
}

/// `exp(x)` for 4 lanes: the same range reduction and polynomial as the AVX2 variant (Cephes
/// `expf`), clamped to the finite range of f32.
#[inline]
unsafe fn exp(x: float32x4_t) -> float32x4_t {
    let x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.3)), vdupq_n_f32(88.7));
    let n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(std::f32::consts::LOG2_E)));
    let r = vfmsq_f32(x, n, vdupq_n_f32(0.693_359_4));
    let r = vfmsq_f32(r, n, vdupq_n_f32(-2.121_944_4e-4));
    let mut p = vdupq_n_f32(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5e-1] {
        p = vfmaq_f32(vdupq_n_f32(c), p, r);
    }
    let p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0)), vmulq_f32(p, r), r);
    let scale = vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127))));
    vmulq_f32(p, scale)
}

/// `out = gelu_tanh(gate) * up` with the polynomial `exp`.
pub unsafe fn gelu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len();
    let body = n / 4 * 4;
    let (c0, c1) = (vdupq_n_f32(2.0 * 0.797_884_6), vdupq_n_f32(0.044715));
    let (one, two, half) = (vdupq_n_f32(1.0), vdupq_n_f32(2.0), vdupq_n_f32(0.5));
    let mut i = 0;
    while i < body {
        let x = vld1q_f32(gate.as_ptr().add(i));
        // tanh(u) = 1 - 2 / (1 + exp(2u)), u = sqrt(2/pi) (x + 0.044715 x^3).
        let x2 = vmulq_f32(x, x);
        let u2 = vmulq_f32(c0, vfmaq_f32(x, vmulq_f32(c1, x2), x));
        let t = vsubq_f32(one, vdivq_f32(two, vaddq_f32(one, exp(u2))));
        let g = vmulq_f32(vmulq_f32(half, x), vaddq_f32(one, t));
        vst1q_f32(out.as_mut_ptr().add(i), vmulq_f32(g, vld1q_f32(up.as_ptr().add(i))));
        i += 4;
    }
    for j in body..n {
        out[j] = crate::kernels::gelu_tanh(gate[j]) * up[j];
    }
}

/// `y += a * x` (equal lengths).
pub unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    let n = y.len();
    let body = n / 4 * 4;
    let (yp, xp) = (y.as_mut_ptr(), x.as_ptr());
    let av = vdupq_n_f32(a);
    let mut i = 0;
    while i < body {
        vst1q_f32(yp.add(i), vfmaq_f32(vld1q_f32(yp.add(i)), av, vld1q_f32(xp.add(i))));
        i += 4;
    }
    for j in body..n {
        *yp.add(j) += a * *xp.add(j);
    }
}

//! Activation rows quantized to 8-bit blocks: `x ≈ d * q` per block of 32 (Q8_0) or 256 (Q8_K,
//! with the sum of every 16 levels), levels in -127..=127; with two passes, each row is followed
//! by its quantized residual (`x ≈ d1 q1 + d2 q2`, about 1/127² relative error instead of 1/127).

use super::ActRow;
use crate::kernels::SharedMut;
use crate::pool::ThreadPool;
use crate::simd::Isa;

/// `rows` rows of `k` activations, quantized in `passes` passes (`rows * passes` stored rows).
pub struct QuantizedRows {
    k: usize,
    rows: usize,
    passes: usize,
    block: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    sums: Vec<i16>,
}

impl QuantizedRows {
    /// Quantizes `x` (`rows × k`) in blocks of `block` (32 or 256; `k` a multiple of it), in
    /// `passes` passes (1, or 2 to add each row's quantized residual).
    pub fn new(pool: &ThreadPool, isa: Isa, x: &[f32], rows: usize, k: usize, block: usize, passes: usize) -> Self {
        assert!(k.is_multiple_of(block) && x.len() >= rows * k && (1..=2).contains(&passes));
        let nb = k / block;
        let ng = if block == 256 { k / 16 } else { 0 };
        let stored = rows * passes;
        let mut q =
            QuantizedRows { k, rows, passes, block, qs: vec![0; stored * k], d: vec![0.0; stored * nb], sums: vec![0; stored * ng] };
        let (qp, dp, sp) = (SharedMut(q.qs.as_mut_ptr()), SharedMut(q.d.as_mut_ptr()), SharedMut(q.sums.as_mut_ptr()));
        let each = |r: usize| {
            let mut residual = Vec::new();
            for p in 0..passes {
                let s = r * passes + p;
                // SAFETY: stored row s of each buffer is written by this call only.
                let (qs, d, sums) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(qp.ptr().add(s * k), k),
                        std::slice::from_raw_parts_mut(dp.ptr().add(s * nb), nb),
                        std::slice::from_raw_parts_mut(sp.ptr().add(s * ng), ng),
                    )
                };
                let src = if p == 0 { &x[r * k..(r + 1) * k] } else { &residual[..] };
                quantize_row(isa, src, block, qs, d);
                for (g, s) in sums.iter_mut().enumerate() {
                    *s = qs[g * 16..(g + 1) * 16].iter().map(|&v| i16::from(v)).sum();
                }
                if p + 1 < passes {
                    residual = src.iter().enumerate().map(|(i, &v)| v - d[i / block] * f32::from(qs[i])).collect();
                }
            }
        };
        if rows * k < 32768 {
            (0..rows).for_each(each);
        } else {
            pool.for_chunks(rows, 1, &|range| range.for_each(each));
        }
        q
    }

    /// Rows (each stored as `passes` rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Stored rows per row.
    pub fn passes(&self) -> usize {
        self.passes
    }

    /// Stored row `r` (pass `r % passes` of row `r / passes`).
    pub fn row(&self, r: usize) -> ActRow<'_> {
        let (k, nb) = (self.k, self.k / self.block);
        let ng = if self.block == 256 { k / 16 } else { 0 };
        ActRow { qs: &self.qs[r * k..(r + 1) * k], d: &self.d[r * nb..(r + 1) * nb], sums: &self.sums[r * ng..(r + 1) * ng] }
    }

    /// Row `r` alone (all its passes).
    pub fn select(&self, r: usize) -> QuantizedRows {
        let (k, nb, p) = (self.k, self.k / self.block, self.passes);
        let ng = if self.block == 256 { k / 16 } else { 0 };
        QuantizedRows {
            k,
            rows: 1,
            passes: p,
            block: self.block,
            qs: self.qs[r * p * k..(r + 1) * p * k].to_vec(),
            d: self.d[r * p * nb..(r + 1) * p * nb].to_vec(),
            sums: self.sums[r * p * ng..(r + 1) * p * ng].to_vec(),
        }
    }

    /// The values the quantized rows stand for, passes summed (tests).
    #[cfg(test)]
    pub fn dequantized(&self) -> Vec<f32> {
        let k = self.k;
        let v: Vec<f32> = self.qs.iter().enumerate().map(|(i, &q)| self.d[i / self.block] * f32::from(q)).collect();
        (0..self.rows * k).map(|i| (0..self.passes).map(|p| v[((i / k) * self.passes + p) * k + i % k]).sum()).collect()
    }
}

/// Quantizes one row: per block `d = max|x| / 127`, `q = round(x / d)` (`d` NaN or infinite when
/// the block holds such a value).
fn quantize_row(isa: Isa, x: &[f32], block: usize, qs: &mut [i8], d: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2Fma is only chosen on CPUs that have it; lengths agree.
        Isa::Avx2Fma => unsafe { super::avx2::quantize_row(x, block, qs, d) },
        _ => {
            for ((xb, qb), db) in x.chunks_exact(block).zip(qs.chunks_exact_mut(block)).zip(d.iter_mut()) {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                // A NaN makes the block's scale NaN, so every product with it is flagged.
                *db = if xb.iter().any(|v| v.is_nan()) { f32::NAN } else { amax / 127.0 };
                let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                for (q, &v) in qb.iter_mut().zip(xb) {
                    *q = round_half_away(v * id) as i8;
                }
            }
        }
    }
}

/// Rounds half away from zero, as `f32::round`, for |v| <= 127 (without a libm call).
#[inline]
fn round_half_away(v: f32) -> i32 {
    (v + 0.5f32.copysign(v)) as i32
}

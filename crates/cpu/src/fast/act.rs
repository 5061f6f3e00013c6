//! Activation rows quantized to 8-bit blocks: `x ≈ d * q` per block of 32 (Q8_0) or 256 (Q8_K,
//! with the sum of every 16 levels), levels in -127..=127.

use super::ActRow;
use crate::kernels::SharedMut;
use crate::pool::ThreadPool;
use crate::simd::Isa;

/// `rows` rows of `k` activations, quantized.
pub struct QuantizedRows {
    k: usize,
    rows: usize,
    block: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    sums: Vec<i16>,
}

impl QuantizedRows {
    /// Quantizes `x` (`rows × k`) in blocks of `block` (32 or 256; `k` a multiple of it).
    pub fn new(pool: &ThreadPool, isa: Isa, x: &[f32], rows: usize, k: usize, block: usize) -> Self {
        assert!(k.is_multiple_of(block) && x.len() >= rows * k);
        let nb = k / block;
        let ng = if block == 256 { k / 16 } else { 0 };
        let mut q = QuantizedRows { k, rows, block, qs: vec![0; rows * k], d: vec![0.0; rows * nb], sums: vec![0; rows * ng] };
        let (qp, dp, sp) = (SharedMut(q.qs.as_mut_ptr()), SharedMut(q.d.as_mut_ptr()), SharedMut(q.sums.as_mut_ptr()));
        let each = |r: usize| {
            // SAFETY: row r of each buffer is written by this call only.
            let (qs, d, sums) = unsafe {
                (
                    std::slice::from_raw_parts_mut(qp.ptr().add(r * k), k),
                    std::slice::from_raw_parts_mut(dp.ptr().add(r * nb), nb),
                    std::slice::from_raw_parts_mut(sp.ptr().add(r * ng), ng),
                )
            };
            quantize_row(isa, &x[r * k..(r + 1) * k], block, qs, d);
            for (g, s) in sums.iter_mut().enumerate() {
                *s = qs[g * 16..(g + 1) * 16].iter().map(|&v| i16::from(v)).sum();
            }
        };
        if rows * k < 32768 {
            (0..rows).for_each(each);
        } else {
            pool.for_chunks(rows, 1, &|range| range.for_each(each));
        }
        q
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Row `r`.
    pub fn row(&self, r: usize) -> ActRow<'_> {
        let (k, nb) = (self.k, self.k / self.block);
        let ng = if self.block == 256 { k / 16 } else { 0 };
        ActRow { qs: &self.qs[r * k..(r + 1) * k], d: &self.d[r * nb..(r + 1) * nb], sums: &self.sums[r * ng..(r + 1) * ng] }
    }

    /// The values the quantized rows stand for (tests).
    #[cfg(test)]
    pub fn dequantized(&self) -> Vec<f32> {
        self.qs.iter().enumerate().map(|(i, &q)| self.d[i / self.block] * f32::from(q)).collect()
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

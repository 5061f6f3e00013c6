//! Activation rows quantized to 16-bit integer blocks: `x ≈ d * q` per block of 32 (for the 32-block
//! weight formats, levels in ±32767) or 256 (for the K-quants, levels in ±8191 so a super-block's
//! integer sum cannot overflow, with the sum of every 16 levels for the K-quants' corrections).
//! The relative rounding error is 1/65534 or 1/16382 of the block's largest value, far below the
//! 1/254 of ggml's 8-bit activations, and `madd` multiplies 16-bit pairs as fast as `maddubs` does
//! 8-bit ones.

use super::{ActGroup, ActRow, Family, ROW_GROUP};
use crate::kernels::SharedMut;
use crate::pool::ThreadPool;
use crate::simd::Isa;

/// `rows` rows of `k` activations quantized for one weight family.
pub struct QuantizedRows {
    k: usize,
    rows: usize,
    block: usize,
    qs: Vec<i16>,
    /// A single K-quant row's levels split into bytes for AVX2's one-row products (see
    /// [`ActRow::hi`]); empty for several rows, other families and instruction sets.
    hi: Vec<i8>,
    /// The low bytes (see [`ActRow::lo`]).
    lo: Vec<u8>,
    d: Vec<f32>,
    sums: Vec<f32>,
    /// The scales again, block-major per group of [`ROW_GROUP`] rows (see [`ActGroup::d_t`]; only
    /// x86's legacy kernels read them, so empty for K-quant activations).
    #[cfg(target_arch = "x86_64")]
    d_t: Vec<f32>,
}

impl Family {
    /// The largest activation level of this family's blocks.
    pub fn act_max(self) -> f32 {
        match self {
            // A K-quant super-block sums 32 products per 32-bit lane of up to 4096 · 8191 each (with room to spare).
            Family::KQuant => 8191.0,
            Family::Legacy => 32767.0,
        }
    }
}

impl QuantizedRows {
    /// Quantizes `x` (`rows × k`, `k` a multiple of the family's block) for weights of family `fam`.
    pub fn new(pool: &ThreadPool, isa: Isa, x: &[f32], rows: usize, k: usize, fam: Family) -> Self {
        let block = fam.act_block();
        assert!(k.is_multiple_of(block) && x.len() >= rows * k);
        let nb = k / block;
        let ng = if fam == Family::KQuant { k / 16 } else { 0 };
        // (One row only: several rows multiply each weight row in groups, whose 16-bit products
        // share each level vector's widening.)
        let split = if fam == Family::KQuant && matches!(isa, Isa::Avx2Fma | Isa::Avx512) && rows == 1 { k } else { 0 };
        let mut q = QuantizedRows {
            k,
            rows,
            block,
            qs: vec![0; rows * k],
            hi: vec![0; split],
            lo: vec![0; split],
            d: vec![0.0; rows * nb],
            sums: vec![0.0; rows * ng],
            #[cfg(target_arch = "x86_64")]
            d_t: Vec::new(),
        };
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
            quantize_row(isa, &x[r * k..(r + 1) * k], block, fam.act_max(), qs, d);
            for (g, s) in sums.iter_mut().enumerate() {
                *s = qs[g * 16..(g + 1) * 16].iter().map(|&v| i32::from(v)).sum::<i32>() as f32;
            }
        };
        if rows * k < 32768 {
            (0..rows).for_each(each);
        } else {
            pool.for_chunks(rows, 1, &|range| range.for_each(each));
        }
        if split > 0 {
            split_bytes(&q.qs, &mut q.hi, &mut q.lo);
        }
        #[cfg(target_arch = "x86_64")]
        if fam == Family::Legacy {
            q.d_t = group_scales(&q.d, rows, nb);
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
        let ng = self.sums.len() / self.rows.max(1);
        ActRow {
            qs: &self.qs[r * k..(r + 1) * k],
            // (Split only where there is one row: row 0's, or empty.)
            hi: &self.hi,
            lo: &self.lo,
            d: &self.d[r * nb..(r + 1) * nb],
            sums: &self.sums[r * ng..(r + 1) * ng],
        }
    }

    /// Rows `r0..r0 + len` (`r0` a multiple of [`ROW_GROUP`], `len` at most that), the last
    /// repeated to fill the group.
    pub fn group(&self, r0: usize, len: usize) -> ActGroup<'_> {
        assert!(r0.is_multiple_of(ROW_GROUP) && (1..=ROW_GROUP).contains(&len) && r0 + len <= self.rows);
        ActGroup {
            rows: std::array::from_fn(|i| self.row(r0 + i.min(len - 1))),
            len,
            #[cfg(target_arch = "x86_64")]
            d_t: if self.d_t.is_empty() {
                &[]
            } else {
                let per = self.k / self.block * ROW_GROUP;
                &self.d_t[r0 / ROW_GROUP * per..(r0 / ROW_GROUP + 1) * per]
            },
        }
    }

    /// Row `r` alone.
    pub fn select(&self, r: usize) -> QuantizedRows {
        let a = self.row(r);
        QuantizedRows {
            k: self.k,
            rows: 1,
            block: self.block,
            qs: a.qs.to_vec(),
            hi: a.hi.to_vec(),
            lo: a.lo.to_vec(),
            d: a.d.to_vec(),
            sums: a.sums.to_vec(),
            #[cfg(target_arch = "x86_64")]
            d_t: if self.d_t.is_empty() { Vec::new() } else { group_scales(a.d, 1, self.k / self.block) },
        }
    }

    /// The values the quantized rows stand for (tests).
    #[cfg(test)]
    pub fn dequantized(&self) -> Vec<f32> {
        self.qs.iter().enumerate().map(|(i, &q)| self.d[i / self.block] * f32::from(q)).collect()
    }
}

/// The scales `d` (`rows × nb`, row-major) block-major per group of [`ROW_GROUP`] rows: entry
/// `(g · nb + b) · ROW_GROUP + i` is the scale of block `b` of row `g · ROW_GROUP + i`, where a last
/// group short of rows repeats its last row.
#[cfg(target_arch = "x86_64")]
fn group_scales(d: &[f32], rows: usize, nb: usize) -> Vec<f32> {
    let groups = rows.div_ceil(ROW_GROUP);
    let mut t = vec![0f32; groups * nb * ROW_GROUP];
    for g in 0..groups {
        for b in 0..nb {
            for i in 0..ROW_GROUP {
                let r = (g * ROW_GROUP + i).min(rows - 1);
                t[(g * nb + b) * ROW_GROUP + i] = d[r * nb + b];
            }
        }
    }
    t
}

/// Levels `qs` (in ±8191, a multiple of 32 of them) as `q = 256 · hi + lo`: `hi` the arithmetic
/// shift (-32..=31), `lo` the low byte; each 32 in the paired order of AVX2's one-row K-quant
/// products (`avx2::k_row_bytes`): elements 2j and 2j + 1 of the first 16, then the same of the
/// second 16, for j = 0..8.
fn split_bytes(qs: &[i16], hi: &mut [i8], lo: &mut [u8]) {
    for ((q, h), l) in qs.chunks_exact(32).zip(hi.chunks_exact_mut(32)).zip(lo.chunks_exact_mut(32)) {
        for j in 0..8 {
            for (o, e) in [(0, 2 * j), (1, 2 * j + 1), (2, 16 + 2 * j), (3, 17 + 2 * j)] {
                (h[4 * j + o], l[4 * j + o]) = ((q[e] >> 8) as i8, q[e] as u8);
            }
        }
    }
}

/// Quantizes one row: per block `d = max|x| / max_level`, `q = round(x / d)` (`d` NaN when the
/// block holds a NaN or an infinity).
fn quantize_row(isa: Isa, x: &[f32], block: usize, max_level: f32, qs: &mut [i16], d: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2Fma and Avx512 are only chosen on CPUs with AVX2 and FMA; lengths agree.
        Isa::Avx2Fma | Isa::Avx512 => unsafe { super::avx2::quantize_row(x, block, max_level, qs, d) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is part of every aarch64 CPU; lengths are checked inside.
        Isa::Neon => unsafe { super::neon::quantize_row(x, block, max_level, qs, d) },
        _ => {
            for ((xb, qb), db) in x.chunks_exact(block).zip(qs.chunks_exact_mut(block)).zip(d.iter_mut()) {
                // A NaN or an infinity makes the block's scale NaN, so every product with it is flagged.
                if xb.iter().any(|v| !v.is_finite()) {
                    *db = f32::NAN;
                    qb.fill(0);
                    continue;
                }
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                *db = amax / max_level;
                let id = if amax > 0.0 { max_level / amax } else { 0.0 };
                for (q, &v) in qb.iter_mut().zip(xb) {
                    *q = (v * id).round_ties_even() as i16;
                }
            }
        }
    }
}

//! The fast greedy head over a large vocabulary: a 4-bit (Q4_0) copy of the output matrix, made
//! once per weight, scores every row at under half the memory traffic; the [`CANDIDATES`] best
//! rows per activation row are then rescored with the real weights by the fast kernel, and the
//! best of those is the answer. The result equals the full fast argmax unless the true best row
//! is not among the 4-bit scores' top [`CANDIDATES`], which quantization noise of the 4-bit copy
//! (a few hundredths of a logit) cannot cause in practice.

use kiln_quant::{dequantize, quantize, GgmlType};

use super::{products, QuantizedRows};
use crate::kernels::SharedMut;
use crate::pool::ThreadPool;
use crate::simd::Isa;
use crate::weights::PackedMatrix;

/// Rows rescored with the real weights per activation row.
pub const CANDIDATES: usize = 64;

/// Fewest weight rows for which a screening copy pays off (a vocabulary-sized head).
pub const MIN_ROWS: usize = 32768;

/// Most activation rows screened at once (decode of up to this many sequences, the last prompt row).
pub const MAX_ACT_ROWS: usize = 16;

/// Rows read between two calls of `release` while making a copy.
const RELEASE_ROWS: usize = 1024;

/// Makes the Q4_0 copy of `w` (rows of a multiple of 32 elements), in parallel, handing every
/// stretch of `w`'s bytes it has read to `release` (so a memory-mapped matrix read only for the
/// copy does not stay resident next to it).
pub fn make_copy(pool: &ThreadPool, w: &PackedMatrix<'_>, release: &(dyn Fn(&[u8]) + Sync)) -> Vec<u8> {
    let k = w.k;
    let row_bytes = k / 32 * GgmlType::Q4_0.type_size();
    let mut out = vec![0u8; w.n * row_bytes];
    let op = SharedMut(out.as_mut_ptr());
    pool.for_chunks(w.n, 256, &|range| {
        let mut row = vec![0f32; k];
        let mut done = range.start;
        for r in range.clone() {
            if r - done == RELEASE_ROWS {
                release(w.rows_bytes(done..r));
                done = r;
            }
            dequantize(w.ty, w.row(r), &mut row).expect("weight layout validated at load");
            // Weights are finite and small, so Q4_0 cannot overflow its f16 scale.
            let q = quantize(GgmlType::Q4_0, &row).expect("finite weights quantize");
            // SAFETY: row r of the copy is written by this task only.
            unsafe { std::ptr::copy_nonoverlapping(q.as_ptr(), op.ptr().add(r * row_bytes), row_bytes) };
        }
        release(w.rows_bytes(done..range.end));
    });
    out
}

/// Keeps the `CANDIDATES` largest `(value, index)` pairs seen.
struct TopK {
    items: Vec<(f32, usize)>,
    /// The smallest kept value once full.
    floor: f32,
}

impl TopK {
    fn new() -> Self {
        TopK { items: Vec::with_capacity(CANDIDATES + 1), floor: f32::NEG_INFINITY }
    }

    fn push(&mut self, v: f32, j: usize) {
        if self.items.len() < CANDIDATES {
            self.items.push((v, j));
            if self.items.len() == CANDIDATES {
                self.floor = self.items.iter().map(|c| c.0).fold(f32::INFINITY, f32::min);
            }
        } else if v > self.floor {
            let at = self.items.iter().position(|c| c.0 == self.floor).expect("the floor is kept");
            self.items[at] = (v, j);
            self.floor = self.items.iter().map(|c| c.0).fold(f32::INFINITY, f32::min);
        }
    }
}

/// `out[r] = argmax_j q16(x[r]) · w[j]` through the screening copy `screen` of `w` (see the module
/// doc); `-1` for a row with a non-finite value.
pub fn argmax(
    pool: &ThreadPool,
    isa: Isa,
    acts: &QuantizedRows,
    acts32: &QuantizedRows,
    w: &PackedMatrix<'_>,
    screen: &PackedMatrix<'_>,
    out: &mut [i32],
) {
    let rows = acts.rows();
    let n = w.n;
    let tasks = (pool.threads() * 4).min(n.div_ceil(256)).max(1);
    let chunk = n.div_ceil(tasks);
    let mut tops: Vec<(TopK, bool)> = (0..tasks * rows).map(|_| (TopK::new(), false)).collect();
    let tp = SharedMut(tops.as_mut_ptr());
    pool.run(tasks, &|t| {
        let range = t * chunk..((t + 1) * chunk).min(n);
        // SAFETY: entries t * rows .. (t + 1) * rows belong to task t only.
        let mine = unsafe { std::slice::from_raw_parts_mut(tp.ptr().add(t * rows), rows) };
        products(isa, screen, acts32, range, |r, j, v| {
            if v.is_finite() {
                mine[r].0.push(v, j);
            } else {
                mine[r].1 = true;
            }
        });
    });
    for (r, o) in out.iter_mut().take(rows).enumerate() {
        let bad = (0..tasks).any(|t| tops[t * rows + r].1);
        let mut cands: Vec<(f32, usize)> = (0..tasks).flat_map(|t| tops[t * rows + r].0.items.iter().copied()).collect();
        cands.sort_by(|a, b| b.0.total_cmp(&a.0));
        cands.truncate(CANDIDATES);
        // Rescored in index order, so the lowest index wins among equal maxima.
        cands.sort_unstable_by_key(|c| c.1);
        let mut best = (f32::NEG_INFINITY, usize::MAX);
        let one = acts.select(r);
        for &(_, j) in &cands {
            products(isa, w, &one, j..j + 1, |_, j, v| {
                if !v.is_finite() {
                    best = (f32::NAN, j);
                } else if v > best.0 || best.1 == usize::MAX {
                    best = (v, j);
                }
            });
        }
        *o = if bad || best.1 == usize::MAX || !best.0.is_finite() { -1 } else { best.1 as i32 };
    }
}

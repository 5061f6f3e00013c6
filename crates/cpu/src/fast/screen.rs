//! The fast greedy head over a large vocabulary: a 4-bit copy of the output matrix, made once per
//! weight, scores every row at about half the memory traffic and a third of the integer work of
//! the real weights; the [`CANDIDATES`] best rows per activation row are then rescored with the
//! real weights by the fast kernel, and the best of those is the answer. The result equals the
//! full fast argmax unless the true best row is not among the 4-bit scores' top [`CANDIDATES`],
//! which quantization noise of the copy (a few hundredths of a logit) cannot cause in practice.
//!
//! The copy is Q4_0 (levels 0..=15 standing for -8..=7, an f16 scale per 32 elements) laid out
//! for the kernel: rows in groups of [`GROUP`], and per group and 32-element block the group's 8
//! scales followed by its 8 rows' 16 bytes of nibbles (byte `j`: element `j` low, `j + 16` high).
//! Two rows' nibbles fill one 256-bit register, each activation row is multiplied with the
//! unsigned levels by `maddubs` (the -8 offset is applied once per block through the activations'
//! block sums), and three pairwise additions leave the group's 8 sums in one register, in the lane
//! order [`LANE_ROW`], which is also the order the scales are stored in.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

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

/// Rows per interleaved group of the copy.
pub const GROUP: usize = 8;

/// Bytes per group and 32-element block: 8 f16 scales, then 8 rows of 16 bytes of nibbles.
pub const GROUP_BLOCK_BYTES: usize = 2 * GROUP + 16 * GROUP;

/// The row (within its group) whose sum every result lane holds, and whose scale every scale
/// slot holds.
pub const LANE_ROW: [usize; GROUP] = [0, 2, 4, 6, 1, 3, 5, 7];

/// Groups scored per kernel call (their scores fill an L1-sized buffer).
const SCORE_RUN: usize = 32;

/// Rows handled between two calls of `release` while making a copy.
const RELEASE_ROWS: usize = 1024;

/// Bytes of the copy of an `n`-row matrix with rows of `k` elements.
pub fn copy_len(n: usize, k: usize) -> usize {
    n.div_ceil(GROUP) * (k / 32) * GROUP_BLOCK_BYTES
}

/// Makes the screening copy of `w` (rows of a multiple of 32 elements; see the module doc), in
/// parallel, handing every stretch of `w`'s bytes it has read to `release` (so a memory-mapped
/// matrix read only for the copy does not stay resident next to it). Rows past `n` in the last
/// group are zero.
pub fn make_copy(pool: &ThreadPool, w: &PackedMatrix<'_>, release: &(dyn Fn(&[u8]) + Sync)) -> Vec<u8> {
    let (k, n) = (w.k, w.n);
    let nb = k / 32;
    let group_bytes = nb * GROUP_BLOCK_BYTES;
    let mut out = vec![0u8; copy_len(n, k)];
    let op = SharedMut(out.as_mut_ptr());
    let q4 = GgmlType::Q4_0.type_size();
    pool.for_chunks(n.div_ceil(GROUP), 32, &|groups| {
        let mut row = vec![0f32; k];
        let rows = groups.start * GROUP..(groups.end * GROUP).min(n);
        let mut done = rows.start;
        for r in rows.clone() {
            if r - done == RELEASE_ROWS {
                release(w.rows_bytes(done..r));
                done = r;
            }
            dequantize(w.ty, w.row(r), &mut row).expect("weight layout validated at load");
            // Weights are finite and small, so Q4_0 cannot overflow its f16 scale.
            let q = quantize(GgmlType::Q4_0, &row).expect("finite weights quantize");
            let (g, s) = (r / GROUP, r % GROUP);
            let lane = LANE_ROW.iter().position(|&l| l == s).expect("every row has a lane");
            for b in 0..nb {
                let blk = &q[b * q4..(b + 1) * q4];
                let at = g * group_bytes + b * GROUP_BLOCK_BYTES;
                // SAFETY: row r's scale slot and nibbles in group g are written by this task only.
                unsafe {
                    std::ptr::copy_nonoverlapping(blk.as_ptr(), op.ptr().add(at + 2 * lane), 2);
                    std::ptr::copy_nonoverlapping(blk[2..].as_ptr(), op.ptr().add(at + 2 * GROUP + 16 * s), 16);
                }
            }
        }
        release(w.rows_bytes(done..rows.end));
    });
    out
}

/// Activation rows quantized for the copy: 8-bit levels per 32 elements (as ggml's Q8_0), their
/// scales, and each block's offset term `-8 · d · Σq`.
pub struct ScreenActs {
    k: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    offset: Vec<f32>,
}

impl ScreenActs {
    /// Quantizes `rows` rows of `x` (`k` a multiple of 32).
    pub fn new(x: &[f32], rows: usize, k: usize) -> Self {
        let nb = k / 32;
        let mut a = ScreenActs { k, qs: vec![0; rows * k], d: vec![0.0; rows * nb], offset: vec![0.0; rows * nb] };
        for (i, xb) in x[..rows * k].chunks_exact(32).enumerate() {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = if xb.iter().all(|v| v.is_finite()) { amax / 127.0 } else { f32::NAN };
            let id = if amax > 0.0 && d.is_finite() { 127.0 / amax } else { 0.0 };
            let qb = &mut a.qs[32 * i..32 * i + 32];
            for (q, &v) in qb.iter_mut().zip(xb) {
                *q = (v * id).round() as i8;
            }
            a.d[i] = d;
            a.offset[i] = -8.0 * d * qb.iter().map(|&q| f32::from(q)).sum::<f32>();
        }
        a
    }

    /// Row `r`: levels, block scales and block offset terms.
    pub fn row(&self, r: usize) -> (&[i8], &[f32], &[f32]) {
        let nb = self.k / 32;
        (&self.qs[r * self.k..(r + 1) * self.k], &self.d[r * nb..(r + 1) * nb], &self.offset[r * nb..(r + 1) * nb])
    }
}

/// The 8 scores of each of `out.len()` consecutive groups (`groups`: their bytes of the copy, `nb`
/// blocks each) for `R` activation rows, in lane order ([`LANE_ROW`]).
pub fn group_scores<const R: usize>(isa: Isa, groups: &[u8], nb: usize, a: [(&[i8], &[f32], &[f32]); R], out: &mut [[[f32; GROUP]; R]]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2Fma is only chosen on CPUs that have it; lengths are checked inside.
        Isa::Avx2Fma => unsafe { super::avx2::screen_groups(groups, nb, a, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is part of every aarch64 CPU; lengths are checked inside.
        Isa::Neon => unsafe { super::neon::screen_groups(groups, nb, a, out) },
        _ => {
            assert!(groups.len() == out.len() * nb * GROUP_BLOCK_BYTES);
            for (grp, o) in groups.chunks_exact(nb * GROUP_BLOCK_BYTES).zip(out.iter_mut()) {
                *o = [[0f32; GROUP]; R];
                for (o, (qs, d, offset)) in o.iter_mut().zip(a) {
                    for (lane, &s) in LANE_ROW.iter().enumerate() {
                        for b in 0..nb {
                            let blk = &grp[b * GROUP_BLOCK_BYTES..(b + 1) * GROUP_BLOCK_BYTES];
                            let dw = kiln_quant::f16_to_f32(u16::from_le_bytes([blk[2 * lane], blk[2 * lane + 1]]));
                            let nib = &blk[2 * GROUP + 16 * s..2 * GROUP + 16 * s + 16];
                            let aq = &qs[32 * b..32 * b + 32];
                            let sum: i32 = (0..16)
                                .map(|j| i32::from(nib[j] & 15) * i32::from(aq[j]) + i32::from(nib[j] >> 4) * i32::from(aq[j + 16]))
                                .sum();
                            o[lane] += dw * (d[b] * sum as f32 + offset[b]);
                        }
                    }
                }
            }
        }
    }
}

/// A screening candidate `(value, index)`, ordered from worse to better: by value, then the lower
/// index first (a total order, so the best candidates do not depend on the order of arrival).
#[derive(Clone, Copy, PartialEq)]
struct Candidate(f32, usize);

impl Eq for Candidate {}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0).then(other.1.cmp(&self.1))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// Keeps the `CANDIDATES` best candidates seen (finite values), the worst of them on top.
struct TopK {
    heap: BinaryHeap<Reverse<Candidate>>,
    /// The worst kept value once full (a candidate below it cannot enter).
    floor: f32,
}

impl TopK {
    fn new() -> Self {
        TopK { heap: BinaryHeap::with_capacity(CANDIDATES), floor: f32::NEG_INFINITY }
    }

    fn push(&mut self, v: f32, j: usize) {
        let c = Candidate(v, j);
        if self.heap.len() < CANDIDATES {
            self.heap.push(Reverse(c));
        } else if let Some(mut worst) = self.heap.peek_mut().filter(|w| c > w.0) {
            *worst = Reverse(c);
        } else {
            return;
        }
        if self.heap.len() == CANDIDATES {
            self.floor = self.heap.peek().map_or(f32::NEG_INFINITY, |w| w.0 .0);
        }
    }

    /// The kept candidates as `(value, index)`, in no particular order.
    fn items(&self) -> impl Iterator<Item = (f32, usize)> + '_ {
        self.heap.iter().map(|c| (c.0 .0, c.0 .1))
    }
}

/// `out[r] = argmax_j q16(x[r]) · w[j]` through the screening copy `copy` of `w` (see the module
/// doc); `-1` for a row with a non-finite value.
pub fn argmax(pool: &ThreadPool, isa: Isa, x: &[f32], acts: &QuantizedRows, w: &PackedMatrix<'_>, copy: &[u8], out: &mut [i32]) {
    let (rows, n, k) = (acts.rows(), w.n, w.k);
    let nb = k / 32;
    let group_bytes = nb * GROUP_BLOCK_BYTES;
    assert!(copy.len() == copy_len(n, k) && rows <= MAX_ACT_ROWS && out.len() >= rows);
    let sa = ScreenActs::new(x, rows, k);
    let groups = n.div_ceil(GROUP);
    let threads = pool.threads();
    // Per participating thread and row: its best candidates, and whether it saw a non-finite score.
    let mut tops: Vec<(TopK, bool)> = (0..threads * rows).map(|_| (TopK::new(), false)).collect();
    let tp = SharedMut(tops.as_mut_ptr());
    pool.for_chunks_with(groups, SCORE_RUN, &|p, chunk| {
        // SAFETY: entries p * rows .. (p + 1) * rows belong to participant p, whose chunks run one
        // after another on one thread.
        let mine = unsafe { std::slice::from_raw_parts_mut(tp.ptr().add(p * rows), rows) };
        let mut g0 = chunk.start;
        while g0 < chunk.end {
            // Scores of a run of groups at a time (one kernel call, an L1-sized buffer), then the
            // candidates among them.
            let g1 = (g0 + SCORE_RUN).min(chunk.end);
            let run_bytes = &copy[g0 * group_bytes..g1 * group_bytes];
            let mut r0 = 0;
            while r0 < rows {
                macro_rules! scores {
                    ($r:literal) => {{
                        let mut buf = [[[0f32; GROUP]; $r]; SCORE_RUN];
                        let buf = &mut buf[..g1 - g0];
                        group_scores::<$r>(isa, run_bytes, nb, std::array::from_fn(|i| sa.row(r0 + i)), buf);
                        for (gi, group) in buf.iter().enumerate() {
                            let g = g0 + gi;
                            for (i, lanes) in group.iter().enumerate() {
                                // Most groups hold no candidate: one pass over the lanes skips them
                                // (a NaN fails the comparison and is flagged below). Not
                                // short-circuited, so it compiles to vector compares.
                                let floor = mine[r0 + i].0.floor;
                                if lanes.iter().fold(0u8, |any, &v| any | u8::from(v >= floor) | u8::from(v.is_nan())) == 0 {
                                    continue;
                                }
                                for (lane, &v) in lanes.iter().enumerate() {
                                    let j = g * GROUP + LANE_ROW[lane];
                                    if j >= n {
                                        continue;
                                    }
                                    if v.is_finite() {
                                        mine[r0 + i].0.push(v, j);
                                    } else {
                                        mine[r0 + i].1 = true;
                                    }
                                }
                            }
                        }
                        r0 += $r;
                    }};
                }
                match rows - r0 {
                    1 => scores!(1),
                    2 | 3 => scores!(2),
                    4..=7 => scores!(4),
                    _ => scores!(8),
                }
            }
            g0 = g1;
        }
    });
    // Each row's candidates are rescored by its own task (their reads of w may fault pages in).
    let op = SharedMut(out.as_mut_ptr());
    pool.run(rows, &|r| {
        // SAFETY: out[r] is written by task r only, and r < rows <= out.len().
        let o = unsafe { &mut *op.ptr().add(r) };
        let bad = (0..threads).any(|p| tops[p * rows + r].1);
        // The best CANDIDATES of all are among the participants' best CANDIDATES each.
        let mut cands: Vec<(f32, usize)> = (0..threads).flat_map(|p| tops[p * rows + r].0.items()).collect();
        cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
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
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_keeps_the_best_pairs_whatever_their_order() {
        let mut seed = 0x70b4_u64;
        for len in [0, 1, CANDIDATES - 1, CANDIDATES, CANDIDATES + 1, 5000] {
            // Values from a small range, so many are equal and the index decides.
            let values: Vec<f32> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed % 1000) as f32 - 500.0
                })
                .collect();
            let mut want: Vec<(f32, usize)> = values.iter().copied().zip(0..).collect();
            want.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            want.truncate(CANDIDATES);
            for reversed in [false, true] {
                let mut top = TopK::new();
                let order: Vec<usize> = if reversed { (0..len).rev().collect() } else { (0..len).collect() };
                for j in order {
                    top.push(values[j], j);
                }
                let mut kept: Vec<(f32, usize)> = top.items().collect();
                kept.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                assert_eq!(kept, want, "{len} values, reversed {reversed}");
                if len >= CANDIDATES {
                    assert_eq!(top.floor, want[CANDIDATES - 1].0);
                }
            }
        }
    }
}

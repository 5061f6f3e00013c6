//! The fast greedy and top-k heads over a large vocabulary: a 4-bit copy of the output matrix, made
//! once per weight, scores every row at about half the memory traffic and a third of the integer
//! work of the real weights; the [`CANDIDATES`] (top-k: [`TOP_K_CANDIDATES`]) best rows per
//! activation row are then rescored with the real weights by the fast kernel: the best of those is
//! the greedy answer, the best 64 the top-k head's. The result equals the full fast products' unless
//! a true best row is not among the 4-bit scores' top rows, which quantization noise of the copy (a
//! few hundredths of a logit) does not cause in practice.
//!
//! Each row of the copy is the row's Q4_0 form (levels `w` in -8..=7 per 32-element block) with
//! its block scales written as `base · m`: one f32 `base` per row and a 7-bit integer multiplier
//! `m` per block. Activation rows are quantized to 8 bits with one scale per row. A score is then
//! an integer sum `T = Σ_b m_b Σ_e w_e q_e`, exact in 32 bits over windows of [`WINDOW_BLOCKS`]
//! blocks, times `base · d`: no per-block floating-point work, and every instruction set computes
//! the same integers, so the same scores bit for bit.
//!
//! Layout, for the kernels: rows in groups of [`GROUP`]; a group starts with its header (the 8
//! rows' `base`, then per window the 8 rows' offset terms `K`, below), then per 32-element block
//! the 8 rows' multipliers (one byte each) and 4 × 32 bytes of nibbles: in the `i`-th 32 bytes,
//! bytes `4s..4s + 4` are bytes `4i..4i + 4` of row `s`'s Q4_0 nibbles (byte `j`: element `j` low,
//! `j + 16` high, stored as `w + 8`), so one 32-bit lane holds one row. The AVX2 kernel multiplies
//! the signed levels with activations offset by 128 (`maddubs` wants one unsigned operand) and
//! subtracts `K = 128 Σ_b m_b Σ_e w_e` per row and window.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use kiln_quant::{dequantize, quantize, GgmlType};

use super::{products, QuantizedRows};
use crate::kernels::SharedMut;
use crate::pool::ThreadPool;
use crate::simd::Isa;
use crate::weights::PackedMatrix;

/// Rows the greedy head rescores with the real weights per activation row.
pub const CANDIDATES: usize = 64;

/// Rows the top-k head rescores per activation row: 4 times the candidates it gives
/// (`kiln_ir::CANDIDATES`). Its last ones lie among many close logits: with twice as many, the
/// 64th of the default model's was missing at the third of 24 tokens; with 4 and 8 times, none
/// was (kiln-models' `candidates_are_the_likeliest_logits` test). Each rescored row costs a
/// fault on the mapped weights: 4 times took 3.6% longer a sampled token than twice.
pub const TOP_K_CANDIDATES: usize = 4 * kiln_ir::CANDIDATES;

/// Fewest weight rows for which a screening copy pays off (a vocabulary-sized head).
pub const MIN_ROWS: usize = 32768;

/// Most activation rows screened at once (decode of up to this many sequences, the last prompt row).
pub const MAX_ACT_ROWS: usize = 16;

/// Rows per interleaved group of the copy.
pub const GROUP: usize = 8;

/// Bytes per group and 32-element block: 8 multipliers, then 8 rows of 16 bytes of nibbles.
pub const GROUP_BLOCK_BYTES: usize = GROUP + 16 * GROUP;

/// Blocks summed in 32-bit integers before conversion: a window's sum `T` is at most
/// 256 · 32 · 8 · 127 · 127 < 2³¹ in magnitude, and kernels that add offset terms on the way
/// (wrapping) still end on it exactly.
pub const WINDOW_BLOCKS: usize = 256;

/// Largest block-scale multiplier.
const MAX_MULTIPLIER: f32 = 127.0;

/// Groups scored per kernel call (their scores fill an L1-sized buffer).
const SCORE_RUN: usize = 32;

/// Rows handled between two calls of `release` while making a copy.
const RELEASE_ROWS: usize = 1024;

/// Bytes of a group's header for rows of `nb` blocks: 8 f32 `base`, then 8 i32 `K` per window.
pub fn header_len(nb: usize) -> usize {
    4 * GROUP * (1 + nb.div_ceil(WINDOW_BLOCKS))
}

/// Bytes of one group of the copy for rows of `nb` blocks.
pub fn group_len(nb: usize) -> usize {
    header_len(nb) + nb * GROUP_BLOCK_BYTES
}

/// Bytes of the copy of an `n`-row matrix with rows of `k` elements.
pub fn copy_len(n: usize, k: usize) -> usize {
    n.div_ceil(GROUP) * group_len(k / 32)
}

/// Makes the screening copy of `w` (rows of a multiple of 32 elements; see the module doc), in
/// parallel, handing every stretch of `w`'s bytes it has read to `release` (so a memory-mapped
/// matrix read only for the copy does not stay resident next to it). Rows past `n` in the last
/// group are zero. Every `isa` makes the same bytes.
pub fn make_copy(pool: &ThreadPool, isa: Isa, w: &PackedMatrix<'_>, release: &(dyn Fn(&[u8]) + Sync)) -> Vec<u8> {
    let (k, n) = (w.k, w.n);
    let nb = k / 32;
    let (head, glen) = (header_len(nb), group_len(nb));
    let mut out = vec![0u8; copy_len(n, k)];
    let op = SharedMut(out.as_mut_ptr());
    let q4 = GgmlType::Q4_0.type_size();
    pool.for_chunks(n.div_ceil(GROUP), 32, &|groups| {
        let (mut row, mut q, mut d) = (vec![0f32; k], vec![0u8; nb * q4], vec![0f32; nb]);
        let mut offsets = vec![0i32; nb.div_ceil(WINDOW_BLOCKS)];
        let rows = groups.start * GROUP..(groups.end * GROUP).min(n);
        let mut done = rows.start;
        for r in rows.clone() {
            if r - done == RELEASE_ROWS {
                release(w.rows_bytes(done..r));
                done = r;
            }
            dequantize(w.ty, w.row(r), &mut row).expect("weight layout validated at load");
            q4_0_row(isa, &row, &mut q);
            for (d, blk) in d.iter_mut().zip(q.chunks_exact(q4)) {
                *d = kiln_quant::f16_to_f32(u16::from_le_bytes([blk[0], blk[1]]));
            }
            let top = d.iter().fold(0f32, |m, v| m.max(v.abs()));
            let base = top / MAX_MULTIPLIER;
            let (g, s) = (r / GROUP, r % GROUP);
            let group = g * glen;
            offsets.fill(0);
            for (b, blk) in q.chunks_exact(q4).enumerate() {
                let m = if base > 0.0 { (d[b] / base).round().clamp(-MAX_MULTIPLIER, MAX_MULTIPLIER) as i8 } else { 0 };
                let levels: i32 = blk[2..].iter().map(|&v| i32::from(v & 15) + i32::from(v >> 4) - 16).sum();
                offsets[b / WINDOW_BLOCKS] += 128 * i32::from(m) * levels;
                let at = group + head + b * GROUP_BLOCK_BYTES;
                // SAFETY: row r's bytes in group g are written by this task only.
                unsafe {
                    *op.ptr().add(at + s) = m as u8;
                    for i in 0..4 {
                        std::ptr::copy_nonoverlapping(blk[2 + 4 * i..].as_ptr(), op.ptr().add(at + GROUP + 32 * i + 4 * s), 4);
                    }
                }
            }
            // SAFETY: as above.
            unsafe {
                std::ptr::copy_nonoverlapping(base.to_le_bytes().as_ptr(), op.ptr().add(group + 4 * s), 4);
                for (win, o) in offsets.iter().enumerate() {
                    std::ptr::copy_nonoverlapping(o.to_le_bytes().as_ptr(), op.ptr().add(group + 4 * GROUP * (1 + win) + 4 * s), 4);
                }
            }
        }
        release(w.rows_bytes(done..rows.end));
    });
    out
}

/// Row `x`'s Q4_0 blocks into `q`: `kiln_quant`'s encoding, which the AVX2 encoder repeats bit for
/// bit (with it, the default model's copy takes ~0.16 s on two cores instead of ~0.56: most of
/// that was the scalar encoding; bench/RESULTS.md "issue 4aw").
pub(super) fn q4_0_row(isa: Isa, x: &[f32], q: &mut [u8]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2Fma and Avx512 are only selected when the CPU has AVX2 and FMA; `q` holds
        // x's blocks.
        Isa::Avx2Fma | Isa::Avx512 if unsafe { super::avx2::q4_0_blocks(x, q) } => {}
        // Weights are finite and small, so Q4_0 cannot overflow its f16 scale.
        _ => q.copy_from_slice(&quantize(GgmlType::Q4_0, x).expect("finite weights quantize")),
    }
}

/// Activation rows quantized for the copy: 8-bit levels with one scale per row, stored offset by
/// 128 (`q + 128`, in 1..=255).
pub struct ScreenActs {
    k: usize,
    qs: Vec<u8>,
    d: Vec<f32>,
}

impl ScreenActs {
    /// Quantizes `rows` rows of `x` (`k` a multiple of 32). A row with a non-finite value gets a
    /// NaN scale, so all its scores are NaN.
    pub fn new(x: &[f32], rows: usize, k: usize) -> Self {
        let mut a = ScreenActs { k, qs: vec![0; rows * k], d: vec![0.0; rows] };
        for ((xr, qr), d) in x[..rows * k].chunks_exact(k).zip(a.qs.chunks_exact_mut(k)).zip(&mut a.d) {
            let amax = xr.iter().fold(0f32, |m, v| m.max(v.abs()));
            *d = if xr.iter().all(|v| v.is_finite()) { amax / 127.0 } else { f32::NAN };
            let id = if amax > 0.0 && d.is_finite() { 127.0 / amax } else { 0.0 };
            for (q, &v) in qr.iter_mut().zip(xr) {
                *q = ((v * id).round().clamp(-127.0, 127.0) as i32 + 128) as u8;
            }
        }
        a
    }

    /// Row `r`: offset levels and scale.
    pub fn row(&self, r: usize) -> (&[u8], f32) {
        (&self.qs[r * self.k..(r + 1) * self.k], self.d[r])
    }
}

/// The 8 scores of each of `out.len()` consecutive groups (`groups`: their bytes of the copy, `nb`
/// blocks each) for `R` activation rows, in row order.
pub fn group_scores<const R: usize>(isa: Isa, groups: &[u8], nb: usize, a: [(&[u8], f32); R], out: &mut [[[f32; GROUP]; R]]) {
    assert!(groups.len() == out.len() * group_len(nb) && a.iter().all(|(q, _)| q.len() == 32 * nb));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2Fma is only chosen on CPUs that have it; lengths are checked above.
        Isa::Avx2Fma => unsafe { super::avx2::screen_groups(groups, nb, a, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx512 is only chosen on CPUs that have it (and AVX2); lengths are checked above.
        Isa::Avx512 => unsafe { super::avx2::screen_groups_avx512(groups, nb, a, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON is part of every aarch64 CPU; lengths are checked above.
        Isa::Neon => unsafe { super::neon::screen_groups(groups, nb, a, out) },
        _ => {
            for (grp, o) in groups.chunks_exact(group_len(nb)).zip(out.iter_mut()) {
                let blocks = &grp[header_len(nb)..];
                for (o, &(qs, d)) in o.iter_mut().zip(&a) {
                    for (s, o) in o.iter_mut().enumerate() {
                        let mut total = 0f32;
                        for w0 in (0..nb).step_by(WINDOW_BLOCKS) {
                            let mut t = 0i32;
                            for b in w0..(w0 + WINDOW_BLOCKS).min(nb) {
                                let blk = &blocks[b * GROUP_BLOCK_BYTES..(b + 1) * GROUP_BLOCK_BYTES];
                                let aq = |e: usize| i32::from(qs[32 * b + e]) - 128;
                                let dot: i32 = (0..16)
                                    .map(|j| {
                                        let v = blk[GROUP + 32 * (j / 4) + 4 * s + j % 4];
                                        (i32::from(v & 15) - 8) * aq(j) + (i32::from(v >> 4) - 8) * aq(j + 16)
                                    })
                                    .sum();
                                t += i32::from(blk[s] as i8) * dot;
                            }
                            total += t as f32;
                        }
                        *o = group_base(grp, s) * d * total;
                    }
                }
            }
        }
    }
}

/// Row `s`'s `base` in the group starting at `grp`.
fn group_base(grp: &[u8], s: usize) -> f32 {
    f32::from_le_bytes(grp[4 * s..4 * s + 4].try_into().expect("4 bytes"))
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

/// Keeps the `keep` best candidates seen (finite values), the worst of them on top.
struct TopK {
    keep: usize,
    heap: BinaryHeap<Reverse<Candidate>>,
    /// The worst kept value once full (a candidate below it cannot enter).
    floor: f32,
}

impl TopK {
    fn new(keep: usize) -> Self {
        TopK { keep, heap: BinaryHeap::with_capacity(keep), floor: f32::NEG_INFINITY }
    }

    fn push(&mut self, v: f32, j: usize) {
        let c = Candidate(v, j);
        if self.heap.len() < self.keep {
            self.heap.push(Reverse(c));
        } else if let Some(mut worst) = self.heap.peek_mut().filter(|w| c > w.0) {
            *worst = Reverse(c);
        } else {
            return;
        }
        if self.heap.len() == self.keep {
            self.floor = self.heap.peek().map_or(f32::NEG_INFINITY, |w| w.0 .0);
        }
    }

    /// The kept candidates as `(value, index)`, in no particular order.
    fn items(&self) -> impl Iterator<Item = (f32, usize)> + '_ {
        self.heap.iter().map(|c| (c.0 .0, c.0 .1))
    }
}

/// Each activation row's best `keep` rows of `w` by the screening copy `copy` (see the module
/// doc), rescored `q16(x[r]) · w[j]` by the fast kernel: `(value, j)` best first (by value, then
/// the lower index), or `None` for a row with a non-finite score or product.
pub fn best(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    acts: &QuantizedRows,
    w: &PackedMatrix<'_>,
    copy: &[u8],
    keep: usize,
) -> Vec<Option<Vec<(f32, usize)>>> {
    let (rows, n, k) = (acts.rows(), w.n, w.k);
    let nb = k / 32;
    let group_bytes = group_len(nb);
    assert!(copy.len() == copy_len(n, k) && rows <= MAX_ACT_ROWS);
    let sa = ScreenActs::new(x, rows, k);
    let groups = n.div_ceil(GROUP);
    let threads = pool.threads();
    // Per participating thread and row: its best candidates, and whether it saw a non-finite score.
    let mut tops: Vec<(TopK, bool)> = (0..threads * rows).map(|_| (TopK::new(keep), false)).collect();
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
                                    let j = g * GROUP + lane;
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
    let mut out: Vec<Option<Vec<(f32, usize)>>> = vec![None; rows];
    let op = SharedMut(out.as_mut_ptr());
    pool.run(rows, &|r| {
        // SAFETY: out[r] is written by task r only, and r < rows = out.len().
        let o = unsafe { &mut *op.ptr().add(r) };
        if (0..threads).any(|p| tops[p * rows + r].1) {
            return;
        }
        // The best `keep` of all are among the participants' best `keep` each.
        let mut cands: Vec<(f32, usize)> = (0..threads).flat_map(|p| tops[p * rows + r].0.items()).collect();
        cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        cands.truncate(keep);
        let one = acts.select(r);
        let mut finite = true;
        for c in cands.iter_mut() {
            products(isa, w, &one, c.1..c.1 + 1, |_, _, v| {
                finite &= v.is_finite();
                c.0 = v;
            });
        }
        if finite && !cands.is_empty() {
            cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            *o = Some(cands);
        }
    });
    out
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
                let mut top = TopK::new(CANDIDATES);
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

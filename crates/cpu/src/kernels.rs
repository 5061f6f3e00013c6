//! The exact CPU kernels: weights dequantized exactly to f32, products accumulated in f32.

use std::cell::RefCell;

use kiln_ir::{RopeMode, RopeSpec};
use kiln_runtime::KvType;

use crate::kv::{LayerStore, StoredRow};
use crate::pool::ThreadPool;
use crate::simd::{self, dot4, dots, exp_shifted, weighted_sum, Isa, MAX_QUERIES};
use crate::weights::PackedMatrix;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A pointer that may be shared across the pool's threads; each task writes a disjoint part.
#[derive(Clone, Copy)]
pub struct SharedMut<T>(pub *mut T);
impl<T> SharedMut<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    pub fn ptr(&self) -> *mut T {
        self.0
    }
}

// SAFETY: users guarantee tasks write disjoint elements.
unsafe impl<T> Sync for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T> Send for SharedMut<T> {}

/// Rows of weights dequantized per tile.
const TILE: usize = 4;

/// Runs `f(tile_start, tile_rows, dequantized_tile)` over 4-row tiles of `w` rows in `range`.
fn for_tiles(w: &PackedMatrix<'_>, range: std::ops::Range<usize>, mut f: impl FnMut(usize, usize, [&[f32]; TILE])) {
    let k = w.k;
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < TILE * k {
            s.resize(TILE * k, 0.0);
        }
        let mut r0 = range.start;
        while r0 < range.end {
            let cnt = TILE.min(range.end - r0);
            for j in 0..cnt {
                w.row_into(r0 + j, &mut s[j * k..(j + 1) * k]);
            }
            let rows: [&[f32]; TILE] = std::array::from_fn(|j| {
                let j = if j < cnt { j } else { 0 };
                &s[j * k..(j + 1) * k]
            });
            f(r0, cnt, rows);
            r0 += cnt;
        }
    });
}

/// `out[r, j] = x[r, :] · w[j, :]` for `rows` rows.
pub fn matmul(pool: &ThreadPool, isa: Isa, x: &[f32], rows: usize, w: &PackedMatrix<'_>, out: &mut [f32]) {
    let (k, n) = (w.k, w.n);
    let x = &x[..rows * k];
    let out = SharedMut(out[..rows * n].as_mut_ptr());
    pool.for_chunks(n, 16, &|range| {
        for_tiles(w, range, |r0, cnt, tile| {
            for r in 0..rows {
                let d = dot4(isa, tile, &x[r * k..(r + 1) * k]);
                for (j, v) in d.iter().take(cnt).enumerate() {
                    // SAFETY: column r0 + j < n belongs to this task's range only.
                    unsafe { *out.ptr().add(r * n + r0 + j) = *v };
                }
            }
        });
    });
}

/// `out[r] = argmax_j x[r, :] · w[j, :]` (lowest index among equal maxima), without storing the
/// products; `-1` when any product is NaN or infinite (the caller reports it).
pub fn matmul_argmax(pool: &ThreadPool, isa: Isa, x: &[f32], rows: usize, w: &PackedMatrix<'_>, out: &mut [i32]) {
    let (k, n) = (w.k, w.n);
    let threads = pool.threads();
    // Per participating thread and row: (best value, its index, whether a non-finite value was seen).
    let mut best = vec![(f32::NEG_INFINITY, usize::MAX, false); threads * rows];
    let best_ptr = SharedMut(best.as_mut_ptr());
    pool.for_chunks_with(n, 16, &|p, range| {
        for_tiles(w, range, |r0, cnt, tile| {
            for r in 0..rows {
                let d = dot4(isa, tile, &x[r * k..(r + 1) * k]);
                // SAFETY: entry p * rows + r belongs to participant p, whose chunks run one after
                // another on one thread.
                let b = unsafe { &mut *best_ptr.ptr().add(p * rows + r) };
                for (j, v) in d.iter().take(cnt).enumerate() {
                    if !v.is_finite() {
                        b.2 = true;
                    } else if *v > b.0 || b.1 == usize::MAX {
                        *b = (*v, r0 + j, b.2);
                    }
                }
            }
        });
    });
    reduce_argmax(&best, threads, rows, out);
}

/// Merges per-thread `(best value, index, saw a non-finite value)` entries (`threads × rows`) into
/// each row's argmax: the lowest index among equal maxima, `-1` for a row with a non-finite value.
pub fn reduce_argmax(best: &[(f32, usize, bool)], threads: usize, rows: usize, out: &mut [i32]) {
    for (r, o) in out.iter_mut().take(rows).enumerate() {
        let mut b = (f32::NEG_INFINITY, usize::MAX);
        let mut bad = false;
        for t in 0..threads {
            let c = best[t * rows + r];
            bad |= c.2;
            if c.1 != usize::MAX && (b.1 == usize::MAX || c.0 > b.0 || (c.0 == b.0 && c.1 < b.1)) {
                b = (c.0, c.1);
            }
        }
        *o = if bad || b.1 == usize::MAX { -1 } else { b.1 as i32 };
    }
}

/// `out[r] = table[ids[r]] * scale`.
pub fn embed(table: &PackedMatrix<'_>, ids: &[i32], scale: f32, out: &mut [f32]) {
    let k = table.k;
    for (r, &id) in ids.iter().enumerate() {
        let row = &mut out[r * k..(r + 1) * k];
        table.row_into(id as usize, row);
        row.iter_mut().for_each(|v| *v *= scale);
    }
}

/// The `count` largest values of `row` as `(value, index)`, largest first (the lower index first
/// among equals); `None` if a value is not finite. (A heap of the best so far: once it is full,
/// most values are passed over by one comparison with its least.)
pub fn top_of_row(row: &[f32], count: usize) -> Option<Vec<(f32, usize)>> {
    if !kiln_runtime::all_finite(row) {
        return None;
    }
    // A value and its index as one integer, larger first: the value's order, then the lower index.
    let key = |v: f32, j: usize| {
        let b = v.to_bits();
        let ordered = if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 };
        (u64::from(ordered) << 32) | u64::from(u32::MAX - j as u32)
    };
    let mut heap = std::collections::BinaryHeap::with_capacity(count + 1);
    let mut least = f32::NEG_INFINITY;
    for (j, &v) in row.iter().enumerate() {
        // (An equal value comes later than the kept one: its index is higher, it loses.)
        if heap.len() == count && v <= least {
            continue;
        }
        heap.push(std::cmp::Reverse((key(v, j), v.to_bits(), j)));
        if heap.len() > count {
            heap.pop();
        }
        if heap.len() == count {
            least = heap.peek().map_or(f32::NEG_INFINITY, |m| f32::from_bits(m.0 .1));
        }
    }
    let mut best: Vec<(u64, f32, usize)> = heap.into_iter().map(|m| (m.0 .0, f32::from_bits(m.0 .1), m.0 .2)).collect();
    best.sort_unstable_by_key(|b| std::cmp::Reverse(b.0));
    Some(best.into_iter().map(|(_, v, j)| (v, j)).collect())
}

/// Writes one row of a top-k output ([`Kernel::TopK`](kiln_runtime::Kernel)): `count` values
/// (soft-capped by `cap`) then their indices, from `best` (`(value, index)` best first, at least
/// `count` of them); NaN values (so the step reports a non-finite output) when `best` is `None`.
pub fn write_top(out: &mut [f32], best: Option<&[(f32, usize)]>, count: usize, cap: Option<f32>) {
    let (values, ids) = out[..2 * count].split_at_mut(count);
    match best {
        Some(best) => {
            for ((v, id), &(b, j)) in values.iter_mut().zip(ids.iter_mut()).zip(best) {
                *v = cap.map_or(b, |c| soft_cap(b, c));
                *id = j as f32;
            }
        }
        None => {
            values.fill(f32::NAN);
            ids.fill(0.0);
        }
    }
}

/// Each row's top `count` of `x` [rows, width] into `out` [rows, 2 count] (see [`write_top`]).
pub fn top_k_rows(x: &[f32], width: usize, count: usize, cap: Option<f32>, out: &mut [f32]) {
    for (row, o) in x.chunks_exact(width).zip(out.chunks_exact_mut(2 * count)) {
        write_top(o, top_of_row(row, count).as_deref(), count, cap);
    }
}

/// RMS norm over groups of `width` elements: `out = x / rms(x) * w (+ residual)`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, residual: Option<&[f32]>, out: &mut [f32]) {
    let width = w.len();
    for (g, (xg, og)) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)).enumerate() {
        let ms = xg.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / width as f64;
        let inv = 1.0 / ((ms as f32) + eps).sqrt();
        match residual {
            Some(res) => {
                let rg = &res[g * width..(g + 1) * width];
                for i in 0..width {
                    og[i] = rg[i] + xg[i] * inv * w[i];
                }
            }
            None => {
                for i in 0..width {
                    og[i] = xg[i] * inv * w[i];
                }
            }
        }
    }
}

/// RMS normalisation over groups of `group` elements without a weight: `out = x / rms(x)`.
pub fn rms_normalize(x: &[f32], group: usize, eps: f32, out: &mut [f32]) {
    for (xg, og) in x.chunks_exact(group).zip(out.chunks_exact_mut(group)) {
        let ms = xg.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / group as f64;
        let inv = 1.0 / ((ms as f32) + eps).sqrt();
        og.iter_mut().zip(xg).for_each(|(o, x)| *o = x * inv);
    }
}

/// cos/sin of every (row position, frequency) pair for one RoPE spec and head size: computed once
/// per step and shared by every `Rope` kernel with the same frequencies (queries and keys of all layers).
pub struct RopeTable {
    spec: RopeSpec,
    head_dim: usize,
    /// `rows × head_dim / 2` pairs.
    cs: Vec<(f32, f32)>,
}

impl RopeTable {
    /// The table for `spec`'s frequencies, `freq_scale * theta^(-2i/d) / freq_factors[i]`, at
    /// `positions` (f64 angles, rounded to f32 once).
    pub fn with_spec(positions: &[i32], head_dim: usize, spec: &RopeSpec) -> Self {
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| {
                let f = spec.freq_scale as f64 / (spec.theta as f64).powf((2 * i) as f64 / head_dim as f64);
                f / spec.freq_factors.as_ref().map_or(1.0, |ff| ff[i] as f64)
            })
            .collect();
        let cs = positions
            .iter()
            .flat_map(|&pos| inv_freq.iter().map(move |f| pos as f64 * f).map(|a| (a.cos() as f32, a.sin() as f32)))
            .collect();
        // The pairing does not change the table: one table serves both modes.
        RopeTable { spec: RopeSpec { mode: RopeMode::Neox, ..spec.clone() }, head_dim, cs }
    }

    /// Whether this table serves a kernel with `spec` and `head_dim` (any pairing).
    pub fn serves_spec(&self, spec: &RopeSpec, head_dim: usize) -> bool {
        self.head_dim == head_dim
            && self.spec.theta == spec.theta
            && self.spec.freq_scale == spec.freq_scale
            && self.spec.freq_factors == spec.freq_factors
    }
}

/// Rotary embedding of the rows of `x` (rows `first_row..` of the table's positions) of `heads`
/// heads with `mode`'s pairing: NeoX rotates element `i` with `i + d/2`, Norm rotates `2i` with
/// `2i + 1`; pair `i` turns by the table's angle `i`.
pub fn rope_mode(x: &[f32], table: &RopeTable, first_row: usize, heads: usize, mode: RopeMode, out: &mut [f32]) {
    let (head_dim, half) = (table.head_dim, table.head_dim / 2);
    let rows = x.len() / (heads * head_dim);
    // Pair i is (i * stride, i * stride + offset).
    let (stride, offset) = match mode {
        RopeMode::Neox => (1, half),
        RopeMode::Norm => (2, 1),
    };
    for (r, cs) in table.cs[first_row * half..(first_row + rows) * half].chunks_exact(half).enumerate() {
        for h in 0..heads {
            let base = (r * heads + h) * head_dim;
            let (xs, os) = (&x[base..base + head_dim], &mut out[base..base + head_dim]);
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = (i * stride, i * stride + offset);
                let (x0, x1) = (xs[a], xs[b]);
                os[a] = x0 * c - x1 * s;
                os[b] = x1 * c + x0 * s;
            }
        }
    }
}

/// SiLU (`x * sigmoid(x)`), as PyTorch computes it in f32.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Soft-capping `cap * tanh(x / cap)`, as Hugging Face computes it in f32.
#[inline]
pub fn soft_cap(x: f32, cap: f32) -> f32 {
    (x / cap).tanh() * cap
}

/// GELU with the tanh approximation, as PyTorch computes it in f32.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// Shape of an attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads (divides `q_heads`).
    pub kv_heads: usize,
    /// Head size.
    pub head_dim: usize,
    /// Sliding window, if any.
    pub window: Option<usize>,
    /// Score scale.
    pub scale: f32,
}

/// Keys per block of the online softmax. Blocks start at multiples of this absolute position, so
/// a query's arithmetic does not depend on the step it is computed in (chunked prefill, decode,
/// batched decode all give the same bits).
const KEY_BLOCK: usize = 32;

/// Most query rows whose tiles share one pass over the key blocks (their keys and values stay in
/// cache while every row of the chunk uses them).
const ROW_CHUNK: usize = 8;

/// Online-softmax state of one attention task: per query, running max, running sum and the
/// unnormalised output; plus one key block's scores.
#[derive(Default)]
struct AttentionScratch {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
    scores: Vec<f32>,
    /// One key block's keys and values as f32 (f16 caches only).
    keys: Vec<f32>,
    values: Vec<f32>,
}

thread_local! {
    static ATTENTION_SCRATCH: RefCell<AttentionScratch> = RefCell::new(AttentionScratch::default());
}

/// One sequence's rows in an attention step: `rows` new rows at positions `start..start + rows`
/// (queries `q`, new keys and values `k_new`/`v_new`), its cache layer and its output rows.
pub struct AttentionSegment<'a> {
    /// Queries, `rows × q_heads × head_dim`.
    pub q: &'a [f32],
    /// New keys, `rows × kv_heads × head_dim`.
    pub k_new: &'a [f32],
    /// New values, as the keys.
    pub v_new: &'a [f32],
    /// New rows.
    pub rows: usize,
    /// Position of the first new row (the cached positions before it).
    pub start: usize,
    /// The sequence's cache of this layer.
    pub layer: &'a mut LayerStore,
    /// Output, as the queries.
    pub out: &'a mut [f32],
}

/// Causal attention of every segment's new rows over its own cached positions and the new rows
/// themselves; then appends each segment's new keys and values to its cache. With a `softcap`,
/// the scaled scores `s` become `softcap * tanh(s / softcap)`.
///
/// One pass over the keys with an online softmax (no score row is materialised): a task takes a
/// chunk of one segment's rows and a tile of query heads sharing one KV head, walks the key blocks
/// once, and for each row of the chunk scores the tile's queries against the block's keys together
/// ([`dots`]), rescales its running sums and accumulates the block's values ([`weighted_sum`]).
/// The tasks of all segments run as one pool job (a batched decode step attends for every
/// sequence at once). A query's arithmetic does not depend on the tile or chunk it falls in.
pub fn attention(pool: &ThreadPool, isa: Isa, segments: &mut [AttentionSegment<'_>], shape: AttentionShape, softcap: Option<f32>) {
    let AttentionShape { q_heads, kv_heads, head_dim: d, window, scale } = shape;
    let group = q_heads / kv_heads;
    let kvw = kv_heads * d;
    let threads = pool.threads();
    let total_rows: usize = segments.iter().map(|s| s.rows).sum();
    // Heads per tile: up to the primitives' width, fewer when there are too few tiles to busy every
    // thread (decode of one sequence).
    let mut tile = group.min(MAX_QUERIES);
    while tile > 1 && total_rows * kv_heads * group.div_ceil(tile) < threads {
        tile = tile.div_ceil(2);
    }
    let tiles = group.div_ceil(tile);
    // Rows per task: up to ROW_CHUNK, fewer while that leaves under four tasks per thread.
    let chunk = (total_rows * kv_heads * tiles / (4 * threads)).clamp(1, ROW_CHUNK);
    // Task ranges per segment: its row chunks times KV heads times tiles.
    let per_chunk = kv_heads * tiles;
    let mut first_task = Vec::with_capacity(segments.len() + 1);
    first_task.push(0);
    for seg in segments.iter() {
        first_task.push(first_task.last().copied().unwrap_or(0) + seg.rows.div_ceil(chunk) * per_chunk);
    }
    let outs: Vec<SharedMut<f32>> = segments.iter_mut().map(|s| SharedMut(s.out.as_mut_ptr())).collect();
    let segs: &[AttentionSegment<'_>] = segments;
    // Over an f16 cache the step's own rows are read rounded as the cache will hold them (so a
    // row's attention is the same whether its keys were cached by an earlier step or are new in
    // this one): rounded once here for every task.
    let rounded: Vec<Option<(Vec<f32>, Vec<f32>)>> = segs
        .iter()
        .map(|s| {
            (s.layer.elem() == KvType::F16).then(|| {
                let n = s.rows * kvw;
                let (mut k, mut v) = (vec![0f32; n], vec![0f32; n]);
                simd::round_f16(isa, &s.k_new[..n], &mut k);
                simd::round_f16(isa, &s.v_new[..n], &mut v);
                (k, v)
            })
        })
        .collect();
    let first_visible = |p: usize| window.map_or(0, |w| (p + 1).saturating_sub(w));
    pool.run(first_task[segs.len()], &|t| {
        let si = first_task.partition_point(|&f| f <= t) - 1;
        let (seg, out_ptr) = (&segs[si], &outs[si]);
        let (k_new, v_new) = rounded[si].as_ref().map_or((seg.k_new, seg.v_new), |(k, v)| (&k[..], &v[..]));
        let (q, rows, start, layer) = (seg.q, seg.rows, seg.start, &*seg.layer);
        let local = t - first_task[si];
        // Later rows see more keys: hand them out first.
        let chunks = rows.div_ceil(chunk);
        let c = chunks - 1 - local / per_chunk;
        let (g, ti) = (local % per_chunk / tiles, local % tiles);
        let (r0, r1) = (c * chunk, ((c + 1) * chunk).min(rows));
        let (h0, h1) = (g * group + ti * tile, (g * group + (ti + 1) * tile).min((g + 1) * group));
        let nq = h1 - h0;
        // Head g's elements of a row.
        let heads = g * d..(g + 1) * d;
        ATTENTION_SCRATCH.with(|s| {
            let mut guard = s.borrow_mut();
            let AttentionScratch { max, sum, acc, scores, keys: kbuf, values: vbuf } = &mut *guard;
            let states = (r1 - r0) * nq;
            max.clear();
            max.resize(states, f32::NEG_INFINITY);
            sum.clear();
            sum.resize(states, 0.0);
            acc.clear();
            acc.resize(states * d, 0.0);
            scores.resize(nq * KEY_BLOCK, 0.0);
            kbuf.resize(KEY_BLOCK * d, 0.0);
            vbuf.resize(KEY_BLOCK * d, 0.0);
            let (lo, hi) = (first_visible(start + r0), start + r1);
            let mut b0 = lo / KEY_BLOCK * KEY_BLOCK;
            while b0 < hi {
                let b1 = (b0 + KEY_BLOCK).min(hi);
                // An f16 cache's rows of the block are read as f32 once for all the task's rows.
                for pos in b0.max(lo)..b1.min(start) {
                    for (buf, row) in [(&mut *kbuf, layer.k_row(pos)), (&mut *vbuf, layer.v_row(pos))] {
                        if let StoredRow::F16(_) = row {
                            row.read_f32(isa, heads.clone(), &mut buf[(pos - b0) * d..][..d]);
                        }
                    }
                }
                let mut keys: [&[f32]; KEY_BLOCK] = [&[]; KEY_BLOCK];
                let mut values: [&[f32]; KEY_BLOCK] = [&[]; KEY_BLOCK];
                for pos in b0.max(lo)..b1 {
                    let j = pos - b0;
                    (keys[j], values[j]) = if pos >= start {
                        let r = (pos - start) * kvw + g * d;
                        (&k_new[r..r + d], &v_new[r..r + d])
                    } else if let (StoredRow::F32(k), StoredRow::F32(v)) = (layer.k_row(pos), layer.v_row(pos)) {
                        (&k[heads.clone()], &v[heads.clone()])
                    } else {
                        // (f16 rows: converted above.)
                        (&kbuf[j * d..][..d], &vbuf[j * d..][..d])
                    };
                }
                for i in r0..r1 {
                    let p = start + i;
                    let (a, z) = (b0.max(first_visible(p)), b1.min(p + 1));
                    if a >= z {
                        continue;
                    }
                    let nk = z - a;
                    let (ks, vs) = (&keys[a - b0..z - b0], &values[a - b0..z - b0]);
                    let qs: [&[f32]; MAX_QUERIES] = std::array::from_fn(|j| {
                        let h = (h0 + j).min(h1 - 1);
                        &q[(i * q_heads + h) * d..][..d]
                    });
                    let sc = &mut scores[..nq * nk];
                    dots(isa, &qs[..nq], ks, sc);
                    let state = (i - r0) * nq;
                    let mut alpha = [0f32; MAX_QUERIES];
                    for (j, row) in sc.chunks_exact_mut(nk).enumerate() {
                        row.iter_mut().for_each(|s| *s *= scale);
                        if let Some(cap) = softcap {
                            row.iter_mut().for_each(|s| *s = soft_cap(*s, cap));
                        }
                        let (m, l) = (&mut max[state + j], &mut sum[state + j]);
                        let m_new = row.iter().copied().fold(*m, f32::max);
                        // Nothing finite seen yet (only possible for non-finite scores): wait.
                        if m_new == f32::NEG_INFINITY {
                            row.fill(0.0);
                            alpha[j] = 1.0;
                            continue;
                        }
                        alpha[j] = if *m == f32::NEG_INFINITY { 0.0 } else { (*m - m_new).exp() };
                        exp_shifted(isa, row, m_new);
                        *l = *l * alpha[j] + row.iter().sum::<f32>();
                        *m = m_new;
                    }
                    weighted_sum(isa, &mut acc[state * d..(state + nq) * d], &alpha[..nq], sc, vs);
                }
                b0 += KEY_BLOCK;
            }
            for i in r0..r1 {
                for j in 0..nq {
                    let state = (i - r0) * nq + j;
                    let inv = 1.0 / sum[state];
                    // SAFETY: row i, head h0 + j of the output is written by this task only.
                    let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.ptr().add((i * q_heads + h0 + j) * d), d) };
                    o.iter_mut().zip(&acc[state * d..(state + 1) * d]).for_each(|(o, a)| *o = a * inv);
                }
            }
        });
    });
    for seg in segments.iter_mut() {
        seg.layer.append(isa, &seg.k_new[..seg.rows * kvw], &seg.v_new[..seg.rows * kvw], seg.rows);
    }
}

#[cfg(test)]
mod tests;

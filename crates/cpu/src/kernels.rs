//! The exact CPU kernels: weights dequantized exactly to f32, products accumulated in f32.

use std::cell::RefCell;

use kiln_ir::{RopeMode, RopeSpec};

use crate::kv::LayerStore;
use crate::pool::ThreadPool;
use crate::simd::{axpy, dot, dot4, Isa};
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
    let tasks = (pool.threads() * 4).min(n.div_ceil(16)).max(1);
    let chunk = n.div_ceil(tasks);
    // Per task and row: (best value, its index, whether a non-finite value was seen).
    let mut best = vec![(f32::NEG_INFINITY, usize::MAX, false); tasks * rows];
    let best_ptr = SharedMut(best.as_mut_ptr());
    pool.run(tasks, &|t| {
        let range = t * chunk..((t + 1) * chunk).min(n);
        for_tiles(w, range, |r0, cnt, tile| {
            for r in 0..rows {
                let d = dot4(isa, tile, &x[r * k..(r + 1) * k]);
                // SAFETY: entry t * rows + r is written by task t only.
                let b = unsafe { &mut *best_ptr.ptr().add(t * rows + r) };
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
    reduce_argmax(&best, tasks, rows, out);
}

/// Merges per-task `(best value, index, saw a non-finite value)` entries (`tasks × rows`) into
/// each row's argmax: the lowest index among equal maxima, `-1` for a row with a non-finite value.
pub fn reduce_argmax(best: &[(f32, usize, bool)], tasks: usize, rows: usize, out: &mut [i32]) {
    for (r, o) in out.iter_mut().take(rows).enumerate() {
        let mut b = (f32::NEG_INFINITY, usize::MAX);
        let mut bad = false;
        for t in 0..tasks {
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

/// NeoX rotary embedding of every row of `heads` heads, with the table's positions.
pub fn rope(x: &[f32], table: &RopeTable, heads: usize, out: &mut [f32]) {
    rope_mode(x, table, heads, RopeMode::Neox, out);
}

/// Rotary embedding of every row of `heads` heads with `mode`'s pairing: NeoX rotates element `i`
/// with `i + d/2`, Norm rotates `2i` with `2i + 1`; pair `i` turns by the table's angle `i`.
pub fn rope_mode(x: &[f32], table: &RopeTable, heads: usize, mode: RopeMode, out: &mut [f32]) {
    let (head_dim, half) = (table.head_dim, table.head_dim / 2);
    // Pair i is (i * stride, i * stride + offset).
    let (stride, offset) = match mode {
        RopeMode::Neox => (1, half),
        RopeMode::Norm => (2, 1),
    };
    for (r, cs) in table.cs.chunks_exact(half).enumerate() {
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

/// Causal attention of `rows` new rows at positions `start..start + rows` over the cached
/// positions of `layer` and the new rows themselves; then appends the new keys and values. With a
/// `softcap`, the scaled scores `s` become `softcap * tanh(s / softcap)`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    isa: Isa,
    q: &[f32],
    k_new: &[f32],
    v_new: &[f32],
    rows: usize,
    start: usize,
    layer: &mut LayerStore,
    shape: AttentionShape,
    softcap: Option<f32>,
    out: &mut [f32],
) {
    let AttentionShape { q_heads, kv_heads, head_dim: d, window, scale } = shape;
    let group = q_heads / kv_heads;
    let kvw = kv_heads * d;
    let out_ptr = SharedMut(out.as_mut_ptr());
    let layer_ref: &LayerStore = layer;
    pool.run(rows * q_heads, &|t| {
        let (i, h) = (t / q_heads, t % q_heads);
        let g = h / group;
        let p = start + i;
        let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
        let qh = &q[(i * q_heads + h) * d..(i * q_heads + h + 1) * d];
        let key = |pos: usize| -> &[f32] {
            if pos < start {
                &layer_ref.k_row(pos)[g * d..(g + 1) * d]
            } else {
                &k_new[(pos - start) * kvw + g * d..(pos - start) * kvw + (g + 1) * d]
            }
        };
        let value = |pos: usize| -> &[f32] {
            if pos < start {
                &layer_ref.v_row(pos)[g * d..(g + 1) * d]
            } else {
                &v_new[(pos - start) * kvw + g * d..(pos - start) * kvw + (g + 1) * d]
            }
        };
        SCRATCH.with(|s| {
            let mut scores = s.borrow_mut();
            scores.clear();
            scores.extend((lo..=p).map(|pos| dot(isa, qh, key(pos)) * scale));
            if let Some(cap) = softcap {
                scores.iter_mut().for_each(|s| *s = soft_cap(*s, cap));
            }
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for v in scores.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            // SAFETY: row i, head h of the output is written by this task only.
            let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.ptr().add((i * q_heads + h) * d), d) };
            o.fill(0.0);
            for (pos, &w) in (lo..=p).zip(scores.iter()) {
                axpy(isa, o, w, value(pos));
            }
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|v| *v *= inv);
        });
    });
    layer.append(&k_new[..rows * kvw], &v_new[..rows * kvw], rows);
}

#[cfg(test)]
mod tests;

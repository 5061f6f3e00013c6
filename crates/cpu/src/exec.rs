//! Runs a [`Plan`] on the CPU: one arena per executable, kernels dispatched step by step.

use std::sync::Arc;

use kiln_ir::{DType, RopeMode, RopeSpec};
use kiln_runtime::{
    draw, DrawSpec, Executable, HostData, HostTensor, Kernel, KernelPrecision, KvCache, Plan, Rows, RuntimeError, Slot, StepInputs,
};

use crate::fast;
use crate::kernels::{self, AttentionShape, RopeTable};
use crate::kv::CpuKvCache;
use crate::pool::ThreadPool;
use crate::simd::Isa;
use crate::weights::CpuWeights;

/// A plan bound to the CPU's weights, with its own activation arena.
pub struct CpuExecutable {
    plan: Arc<Plan>,
    weights: Arc<CpuWeights>,
    pool: Arc<ThreadPool>,
    isa: Isa,
    kernels: KernelPrecision,
    arena: Vec<f32>,
}

impl CpuExecutable {
    /// Binds `plan` to `weights`, checking every weight it uses.
    pub fn new(
        plan: Arc<Plan>,
        weights: Arc<CpuWeights>,
        pool: Arc<ThreadPool>,
        isa: Isa,
        kernels: KernelPrecision,
    ) -> Result<Self, RuntimeError> {
        for step in &plan.steps {
            match &step.kernel {
                Kernel::Embed { table: w, .. } | Kernel::MatMul { w, .. } | Kernel::MatMulArgmax { w, .. } => {
                    weights.matrix(*w)?;
                }
                Kernel::RmsNorm { weight, .. } | Kernel::AddBias { bias: weight, .. } => {
                    weights.vector(*weight)?;
                }
                _ => {}
            }
        }
        let arena = vec![0f32; plan.arena_words];
        Ok(CpuExecutable { plan, weights, pool, isa, kernels, arena })
    }
}

/// Views into the arena. The compiler guarantees that a step's output slot never overlaps the
/// slots it reads, so handing out one `&mut` and several `&` per step is sound.
struct Arena(*mut f32);

impl Arena {
    /// SAFETY: `s` lies inside the arena and no `&mut` to it is alive.
    unsafe fn f32<'a>(&self, s: Slot, len: usize) -> &'a [f32] {
        std::slice::from_raw_parts(self.0.add(s.offset), len.min(s.len))
    }

    /// SAFETY: `s` lies inside the arena and nothing else views it during the step.
    unsafe fn f32_mut<'a>(&self, s: Slot, len: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(s.offset), len.min(s.len))
    }

    /// SAFETY: as `f32`.
    unsafe fn i32<'a>(&self, s: Slot, len: usize) -> &'a [i32] {
        std::slice::from_raw_parts(self.0.add(s.offset) as *const i32, len.min(s.len))
    }

    /// SAFETY: as `f32_mut`.
    unsafe fn i32_mut<'a>(&self, s: Slot, len: usize) -> &'a mut [i32] {
        std::slice::from_raw_parts_mut(self.0.add(s.offset) as *mut i32, len.min(s.len))
    }
}

/// The rows of one sequence in a step: its KV cache, its first position, how many rows, and its
/// draw where the plan draws.
struct Segment<'k> {
    kv: &'k mut CpuKvCache,
    start: usize,
    rows: usize,
    draw: Option<DrawSpec>,
}

/// Recovers the CPU cache behind a `dyn KvCache`.
fn cpu_kv(kv: &mut dyn KvCache) -> Result<&mut CpuKvCache, RuntimeError> {
    kv.as_any_mut()
        .downcast_mut::<CpuKvCache>()
        .ok_or_else(|| RuntimeError::StepShape("the KV cache does not belong to the CPU backend".into()))
}

impl Executable for CpuExecutable {
    fn plan(&self) -> &Plan {
        &self.plan
    }

    fn run(&mut self, inputs: StepInputs<'_>, kv: &mut dyn KvCache) -> Result<Vec<HostTensor>, RuntimeError> {
        let kv = cpu_kv(kv)?;
        if kv.len() != inputs.start_pos {
            return Err(RuntimeError::StepShape(format!("step starts at {} but the KV cache holds {}", inputs.start_pos, kv.len())));
        }
        let rows = inputs.tokens.len();
        self.plan.check_draws(inputs.draw.iter().len(), 1)?;
        self.execute(inputs.tokens, &mut [Segment { kv, start: inputs.start_pos, rows, draw: inputs.draw.copied() }])
    }

    fn run_batch(
        &mut self,
        tokens: &[u32],
        rows: &[usize],
        kvs: &mut [&mut dyn KvCache],
        draws: &[DrawSpec],
    ) -> Result<Vec<HostTensor>, RuntimeError> {
        self.plan.check_batch(tokens.len(), rows, kvs.len())?;
        self.plan.check_draws(draws.len(), kvs.len())?;
        let mut segments = Vec::with_capacity(kvs.len());
        for (i, (kv, &rows)) in kvs.iter_mut().zip(rows).enumerate() {
            let kv = cpu_kv(&mut **kv)?;
            let start = kv.len();
            segments.push(Segment { kv, start, rows, draw: draws.get(i).copied() });
        }
        self.execute(tokens, &mut segments)
    }
}

impl CpuExecutable {
    /// Runs the plan over `tokens`, split into `segments` (consecutive rows of one sequence each),
    /// and copies the outputs back.
    fn execute(&mut self, tokens: &[u32], segments: &mut [Segment<'_>]) -> Result<Vec<HostTensor>, RuntimeError> {
        let n = tokens.len();
        if n == 0 || n > self.plan.rows() {
            return Err(RuntimeError::StepShape(format!("{n} tokens for a plan of {} rows", self.plan.rows())));
        }
        for seg in segments.iter() {
            if seg.start + seg.rows > seg.kv.context() {
                return Err(RuntimeError::KvFull { capacity: seg.kv.context(), needed: seg.start + seg.rows });
            }
        }
        let positions: Vec<i32> = segments.iter().flat_map(|s| (s.start..s.start + s.rows).map(|p| p as i32)).collect();
        if positions.len() != n {
            return Err(RuntimeError::StepShape(format!("{n} tokens for {} rows of sequences", positions.len())));
        }
        let arena = Arena(self.arena.as_mut_ptr());
        for input in &self.plan.inputs {
            // SAFETY: input slots are inside the arena; nothing else is borrowed yet.
            let dst = unsafe { arena.i32_mut(input.slot, n) };
            match input.name.as_str() {
                "tokens" => dst.iter_mut().zip(tokens).for_each(|(d, t)| *d = *t as i32),
                "positions" => dst.copy_from_slice(&positions),
                other => return Err(RuntimeError::StepShape(format!("unknown plan input '{other}'"))),
            }
        }
        // One cos/sin table per distinct RoPE base, shared by the queries and keys of every layer.
        let mut rope_tables: Vec<RopeTable> = Vec::new();
        for step in &self.plan.steps {
            let (head_dim, spec) = match &step.kernel {
                Kernel::Rope { head_dim, theta, .. } => (*head_dim, RopeSpec::neox(*theta)),
                Kernel::RopeScaled { head_dim, spec, .. } => (*head_dim, spec.clone()),
                _ => continue,
            };
            if !rope_tables.iter().any(|t| t.serves_spec(&spec, head_dim)) {
                rope_tables.push(RopeTable::with_spec(&positions, head_dim, &spec));
            }
        }
        for step in &self.plan.steps {
            let rows = match step.rows {
                Rows::Active => n,
                Rows::One => segments.len(),
            };
            // SAFETY: see `Arena`.
            unsafe { self.step(&arena, &step.kernel, rows, n, segments, &rope_tables)? };
        }
        let mut outs = Vec::with_capacity(self.plan.outputs.len());
        for o in &self.plan.outputs {
            let rows = if o.rows == Rows::One { segments.len() } else { n };
            let len = rows * o.width;
            // SAFETY: output slots are inside the arena; no step is running.
            let data = unsafe {
                match o.dtype {
                    DType::F32 => HostData::F32(arena.f32(o.slot, len).to_vec()),
                    DType::I32 => HostData::I32(arena.i32(o.slot, len).to_vec()),
                }
            };
            outs.push(HostTensor { name: o.name.clone(), shape: [rows, o.width], data });
        }
        Ok(outs)
    }
}

impl CpuExecutable {
    /// Whether products with `m` run the fast kernels (fast precision and a format they handle).
    fn fast(&self, m: &crate::weights::PackedMatrix<'_>) -> bool {
        self.kernels == KernelPrecision::Fast && fast::supports(m.ty)
    }

    /// `out[r, j] = x[r] · w[j]` for `rows` rows with `m`'s kernels (fast or exact).
    fn matmul(&self, pool: &ThreadPool, x: &[f32], rows: usize, m: &crate::weights::PackedMatrix<'_>, out: &mut [f32]) {
        if self.fast(m) {
            fast::matmul(pool, self.isa, x, rows, m, out);
        } else {
            kernels::matmul(pool, self.isa, x, rows, m, out);
        }
    }

    /// Runs one kernel over `rows` rows (`active` is the step's active row count, split into the
    /// sequences of `segments`).
    ///
    /// SAFETY: the slots of `kernel` come from the compiler's arena plan for this executable.
    unsafe fn step(
        &self,
        a: &Arena,
        kernel: &Kernel,
        rows: usize,
        active: usize,
        segments: &mut [Segment<'_>],
        rope_tables: &[RopeTable],
    ) -> Result<(), RuntimeError> {
        let (pool, isa, w) = (&*self.pool, self.isa, &*self.weights);
        match *kernel {
            Kernel::Embed { table: table_id, ids, out, width, scale } => {
                let table = w.matrix(table_id)?;
                let ids = a.i32(ids, rows);
                if let Some(&bad) = ids.iter().find(|&&id| id < 0 || id as usize >= table.n) {
                    return Err(RuntimeError::TokenOutOfRange { id: bad as u32, vocab: table.n });
                }
                kernels::embed(&table, ids, scale, a.f32_mut(out, rows * width));
                w.note_rows_read(table_id, rows);
            }
            Kernel::RmsNorm { x, weight, out, width, eps, residual } => {
                let wv = w.vector(weight)?;
                let len = rows * width;
                let res = residual.map(|r| a.f32(r, len));
                let x = a.f32(x, len);
                let out = kernels::SharedMut(a.f32_mut(out, len).as_mut_ptr());
                pool.for_chunks(rows, 8, &|range| {
                    let (lo, hi) = (range.start * width, range.end * width);
                    // SAFETY: each chunk writes its own rows.
                    let o = std::slice::from_raw_parts_mut(out.ptr().add(lo), hi - lo);
                    kernels::rms_norm(&x[lo..hi], wv, eps, res.map(|r| &r[lo..hi]), o);
                });
            }
            Kernel::MatMul { x, w: wid, out, k, n } => {
                let m = w.matrix(wid)?;
                let (x, out) = (a.f32(x, rows * k), a.f32_mut(out, rows * n));
                self.matmul(pool, x, rows, &m, out);
            }
            Kernel::MatMulArgmax { x, w: wid, out, k, .. } => {
                let m = w.matrix(wid)?;
                let (x, out) = (a.f32(x, rows * k), a.i32_mut(out, rows));
                if self.fast(&m) {
                    let screen = w.screening_copy(wid, pool)?;
                    let read = fast::matmul_argmax(pool, isa, x, rows, &m, screen, out);
                    w.note_rows_read(wid, read);
                } else {
                    kernels::matmul_argmax(pool, isa, x, rows, &m, out);
                }
            }
            Kernel::MatMulTopK { x, w: wid, out, k, n, count, cap } => {
                let m = w.matrix(wid)?;
                let (x, out) = (a.f32(x, rows * k), a.f32_mut(out, rows * 2 * count));
                let screen = if self.fast(&m) { w.screening_copy(wid, pool)? } else { None };
                if let Some(screen) = screen {
                    // The screened head's best (more than `count`: see TOP_K_CANDIDATES).
                    let keep = fast::TOP_K_CANDIDATES.max(count);
                    let best = fast::screened_best(pool, isa, x, rows, &m, screen, keep);
                    for (o, b) in out.chunks_exact_mut(2 * count).zip(&best) {
                        kernels::write_top(o, b.as_deref(), count, cap);
                    }
                    w.note_rows_read(wid, rows * keep);
                } else {
                    let mut products = vec![0f32; rows * n];
                    self.matmul(pool, x, rows, &m, &mut products);
                    kernels::top_k_rows(&products, n, count, cap, out);
                }
            }
            Kernel::Rope { x, out, heads, head_dim, theta, .. } => {
                let len = rows * heads * head_dim;
                let table = rope_tables
                    .iter()
                    .find(|t| t.serves_spec(&RopeSpec::neox(theta), head_dim))
                    .ok_or_else(|| RuntimeError::StepShape("no RoPE table for a rope step".into()))?;
                rope_rows(pool, a.f32(x, len), table, heads, head_dim, RopeMode::Neox, a.f32_mut(out, len));
            }
            Kernel::RopeScaled { x, out, heads, head_dim, ref spec, .. } => {
                let len = rows * heads * head_dim;
                let table = rope_tables
                    .iter()
                    .find(|t| t.serves_spec(spec, head_dim))
                    .ok_or_else(|| RuntimeError::StepShape("no RoPE table for a rope step".into()))?;
                rope_rows(pool, a.f32(x, len), table, heads, head_dim, spec.mode, a.f32_mut(out, len));
            }
            Kernel::AddBias { x, bias, out, width } => {
                let (bv, len) = (w.vector(bias)?, rows * width);
                let (x, o) = (a.f32(x, len), a.f32_mut(out, len));
                for (orow, xrow) in o.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
                    orow.iter_mut().zip(xrow.iter().zip(bv)).for_each(|(o, (x, b))| *o = x + b);
                }
            }
            Kernel::Normalize { x, out, width, group, eps } => {
                let len = rows * width;
                kernels::rms_normalize(a.f32(x, len), group, eps, a.f32_mut(out, len));
            }
            Kernel::Scale { x, out, width, factor } => {
                let len = rows * width;
                let x = a.f32(x, len);
                elementwise(pool, a.f32_mut(out, len), &|r, o| o.iter_mut().zip(&x[r]).for_each(|(o, x)| *o = x * factor));
            }
            Kernel::Silu { x, out, width } => {
                let len = rows * width;
                let x = a.f32(x, len);
                elementwise(pool, a.f32_mut(out, len), &|r, o| o.iter_mut().zip(&x[r]).for_each(|(o, x)| *o = kernels::silu(*x)));
            }
            Kernel::SiluMul { gate, up, out, width } => {
                let len = rows * width;
                let (g, u) = (a.f32(gate, len), a.f32(up, len));
                elementwise(pool, a.f32_mut(out, len), &|r, o| {
                    o.iter_mut().zip(g[r.clone()].iter().zip(&u[r])).for_each(|(o, (g, u))| *o = kernels::silu(*g) * u)
                });
            }
            Kernel::SoftCap { x, out, width, cap } => {
                let len = rows * width;
                let x = a.f32(x, len);
                elementwise(pool, a.f32_mut(out, len), &|r, o| o.iter_mut().zip(&x[r]).for_each(|(o, x)| *o = kernels::soft_cap(*x, cap)));
            }
            Kernel::Attention { q, k, v, out, layer, q_heads, kv_heads, head_dim, window, scale }
            | Kernel::AttentionSoftCap { q, k, v, out, layer, q_heads, kv_heads, head_dim, window, scale, .. } => {
                let softcap = match *kernel {
                    Kernel::AttentionSoftCap { softcap, .. } => Some(softcap),
                    _ => None,
                };
                let shape = AttentionShape { q_heads, kv_heads, head_dim, window, scale };
                let (kw, qw) = (kv_heads * head_dim, q_heads * head_dim);
                let (q, k, v) = (a.f32(q, active * qw), a.f32(k, active * kw), a.f32(v, active * kw));
                let out = a.f32_mut(out, active * qw);
                // Each sequence's rows attend to its own cache; all sequences in one pool job.
                let mut parts = Vec::with_capacity(segments.len());
                let (mut row, mut out_rest) = (0, out);
                for seg in segments.iter_mut() {
                    let store =
                        seg.kv.layer_mut(layer).ok_or_else(|| RuntimeError::StepShape(format!("the KV cache has no layer {layer}")))?;
                    if store.len() != seg.start || store.spec().k_width() != kw {
                        return Err(RuntimeError::StepShape(format!("KV cache layer {layer} does not match the plan")));
                    }
                    let (lo, hi) = (row, row + seg.rows);
                    let (seg_out, rest) = std::mem::take(&mut out_rest).split_at_mut(seg.rows * qw);
                    out_rest = rest;
                    parts.push(kernels::AttentionSegment {
                        q: &q[lo * qw..hi * qw],
                        k_new: &k[lo * kw..hi * kw],
                        v_new: &v[lo * kw..hi * kw],
                        rows: seg.rows,
                        start: seg.start,
                        layer: store,
                        out: seg_out,
                    });
                    row = hi;
                }
                kernels::attention(pool, isa, &mut parts, shape, softcap);
            }
            Kernel::Add { a: l, b: r, out, width } => {
                let len = rows * width;
                let (l, r) = (a.f32(l, len), a.f32(r, len));
                elementwise(pool, a.f32_mut(out, len), &|e, o| {
                    o.iter_mut().zip(l[e.clone()].iter().zip(&r[e])).for_each(|(o, (l, r))| *o = l + r)
                });
            }
            Kernel::Mul { a: l, b: r, out, width } => {
                let len = rows * width;
                let (l, r) = (a.f32(l, len), a.f32(r, len));
                elementwise(pool, a.f32_mut(out, len), &|e, o| {
                    o.iter_mut().zip(l[e.clone()].iter().zip(&r[e])).for_each(|(o, (l, r))| *o = l * r)
                });
            }
            Kernel::Gelu { x, out, width } => {
                let len = rows * width;
                let x = a.f32(x, len);
                elementwise(pool, a.f32_mut(out, len), &|r, o| o.iter_mut().zip(&x[r]).for_each(|(o, x)| *o = kernels::gelu_tanh(*x)));
            }
            Kernel::GeluMul { gate, up, out, width } => {
                let len = rows * width;
                let (g, u) = (a.f32(gate, len), a.f32(up, len));
                let fast = self.kernels == KernelPrecision::Fast;
                elementwise(pool, a.f32_mut(out, len), &|r, o| {
                    if fast {
                        crate::simd::gelu_mul_fast(isa, &g[r.clone()], &u[r], o);
                    } else {
                        o.iter_mut().zip(g[r.clone()].iter().zip(&u[r])).for_each(|(o, (g, u))| *o = kernels::gelu_tanh(*g) * u);
                    }
                });
            }
            Kernel::LastRow { x, out, width } => {
                let (x, out) = (a.f32(x, active * width), a.f32_mut(out, segments.len() * width));
                let mut end = 0;
                for (seg, o) in segments.iter().zip(out.chunks_exact_mut(width)) {
                    end += seg.rows;
                    o.copy_from_slice(&x[(end - 1) * width..end * width]);
                }
            }
            Kernel::TopK { x, out, width, count, cap } => {
                kernels::top_k_rows(a.f32(x, rows * width), width, count, cap, a.f32_mut(out, rows * 2 * count));
            }
            Kernel::Draw { x, out, width, among } => {
                let x = a.f32(x, rows * width);
                let draws = segments.iter().map(|s| s.draw).collect::<Option<Vec<DrawSpec>>>();
                let draws =
                    draws.filter(|d| d.len() >= rows).ok_or_else(|| RuntimeError::StepShape("a drawing step without its draws".into()))?;
                let out = kernels::SharedMut(a.i32_mut(out, rows).as_mut_ptr());
                // (A row a task: a draw among the whole vocabulary weighs every token.)
                pool.for_chunks(rows, 1, &|range| {
                    let mut weights = Vec::new();
                    for r in range {
                        // SAFETY: each task writes its own rows.
                        unsafe { *out.ptr().add(r) = draw::draw_row(&x[r * width..(r + 1) * width], among, &draws[r], &mut weights) };
                    }
                });
            }
            Kernel::Argmax { x, out, width } => {
                let x = a.f32(x, rows * width);
                let o = a.i32_mut(out, rows);
                for (r, o) in o.iter_mut().enumerate() {
                    let row = &x[r * width..(r + 1) * width];
                    // -1 flags a non-finite row, as MatMulArgmax does; the caller reports it.
                    *o = if row.iter().all(|v| v.is_finite()) {
                        (0..width).fold(0, |best, j| if row[j] > row[best] { j } else { best }) as i32
                    } else {
                        -1
                    };
                }
            }
        }
        Ok(())
    }
}

/// Elements per task of element-wise work (below two tasks' worth it runs on the caller alone).
const ELEMENTS_PER_TASK: usize = 4096;

/// Runs element-wise work `f(element range, out[range])` over `out` in parallel chunks.
fn elementwise(pool: &ThreadPool, out: &mut [f32], f: &(dyn Fn(std::ops::Range<usize>, &mut [f32]) + Sync)) {
    let op = kernels::SharedMut(out.as_mut_ptr());
    pool.for_chunks(out.len(), ELEMENTS_PER_TASK, &|range| {
        // SAFETY: the chunks are disjoint ranges of `out`.
        let o = unsafe { std::slice::from_raw_parts_mut(op.ptr().add(range.start), range.len()) };
        f(range, o)
    });
}

/// Rotary embedding of every row of `x` (`heads` heads each) in parallel chunks of rows.
fn rope_rows(pool: &ThreadPool, x: &[f32], table: &RopeTable, heads: usize, head_dim: usize, mode: RopeMode, out: &mut [f32]) {
    let width = heads * head_dim;
    let rows = x.len() / width;
    let op = kernels::SharedMut(out.as_mut_ptr());
    pool.for_chunks(rows, ELEMENTS_PER_TASK.div_ceil(width), &|range| {
        let (lo, hi) = (range.start * width, range.end * width);
        // SAFETY: the chunks are disjoint row ranges of `out`.
        let o = unsafe { std::slice::from_raw_parts_mut(op.ptr().add(lo), hi - lo) };
        kernels::rope_mode(&x[lo..hi], table, range.start, heads, mode, o)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_elementwise_and_rope_equal_one_pass_on_odd_sizes() {
        let pool = ThreadPool::new(3);
        for len in [1, 7, ELEMENTS_PER_TASK * 2 + 13, ELEMENTS_PER_TASK * 9 - 5] {
            let x: Vec<f32> = (0..len).map(|i| (i % 97) as f32 * 0.25 - 12.0).collect();
            let mut out = vec![f32::NAN; len];
            elementwise(&pool, &mut out, &|r, o| o.iter_mut().zip(&x[r]).for_each(|(o, x)| *o = kernels::gelu_tanh(*x)));
            assert!(out.iter().zip(&x).all(|(o, x)| *o == kernels::gelu_tanh(*x)), "len {len}");
        }
        let (heads, head_dim) = (3, 10);
        for rows in [1, 5, 300] {
            let positions: Vec<i32> = (0..rows as i32).map(|p| p * 3 + 1).collect();
            let table = RopeTable::with_spec(&positions, head_dim, &RopeSpec::neox(1e4));
            let x: Vec<f32> = (0..rows * heads * head_dim).map(|i| (i % 31) as f32 - 15.0).collect();
            for mode in [RopeMode::Neox, RopeMode::Norm] {
                let (mut one, mut split) = (vec![f32::NAN; x.len()], vec![f32::NAN; x.len()]);
                kernels::rope_mode(&x, &table, 0, heads, mode, &mut one);
                rope_rows(&pool, &x, &table, heads, head_dim, mode, &mut split);
                assert_eq!(one, split, "rows {rows} {mode:?}");
            }
        }
    }
}

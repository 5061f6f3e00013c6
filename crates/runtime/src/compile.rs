//! The compiler: graph IR → fused, arena-planned [`Plan`].
//!
//! Passes: (1) bind weights by name and check their shapes and formats against the store;
//! (2) fuse — `gelu(a) * b` and `silu(a) * b` become one gated-activation kernel, `r + rmsnorm(y)` one norm with a
//! residual, `argmax(x · Wᵀ)` one greedy-head kernel that never writes the logits; reshapes become
//! aliases; (3) plan one arena: every value gets a slot, slots of values whose lifetimes do not
//! overlap share memory; (4) emit kernel steps with their row counts (active rows, or one row after
//! `last_row`).

use std::collections::HashMap;

use kiln_ir::{Bucket, Graph, NodeId, Op};

use crate::plan::{Kernel, Plan, PlanInput, PlanOutput, Rows, Slot, Step};
use crate::{RuntimeError, WeightId, WeightStore};

/// Compiles `graph` against the weights in `store`.
pub fn compile(graph: &Graph, store: &WeightStore) -> Result<Plan, RuntimeError> {
    let weights = bind_weights(graph, store)?;
    let uses = use_counts(graph);
    let absorbed = fusion_candidates(graph, &uses);
    let rows = row_kinds(graph);
    let mut c = Lowering { graph, weights, absorbed, rows, buffers: Vec::new(), value_buf: HashMap::new(), steps: Vec::new() };
    c.lower()?;
    c.finish()
}

fn bind_weights(graph: &Graph, store: &WeightStore) -> Result<HashMap<NodeId, WeightId>, RuntimeError> {
    let mut out = HashMap::new();
    for (i, node) in graph.nodes().iter().enumerate() {
        let Op::Weight { name } = &node.op else { continue };
        let id = store.id(name).ok_or_else(|| RuntimeError::MissingWeight(name.clone()))?;
        let info = store.info(id);
        let found = if info.is_vector() { vec![info.row_len] } else { vec![info.n_rows, info.row_len] };
        if found != node.shape {
            return Err(RuntimeError::WeightShape { name: name.clone(), expected: node.shape.clone(), found });
        }
        if !info.ty.can_dequantize() {
            return Err(RuntimeError::UnsupportedWeightType { name: name.clone(), ty: info.ty });
        }
        out.insert(NodeId(i), id);
    }
    Ok(out)
}

fn use_counts(graph: &Graph) -> Vec<usize> {
    let mut uses = vec![0; graph.nodes().len()];
    for node in graph.nodes() {
        for o in node.op.operands() {
            uses[o.0] += 1;
        }
    }
    for (_, id) in graph.outputs() {
        uses[id.0] += 1;
    }
    uses
}

/// Nodes folded into their single consumer.
fn fusion_candidates(graph: &Graph, uses: &[usize]) -> Vec<bool> {
    let nodes = graph.nodes();
    let mut absorbed = vec![false; nodes.len()];
    let single = |id: NodeId, pred: &dyn Fn(&Op) -> bool| uses[id.0] == 1 && pred(&nodes[id.0].op);
    for node in nodes {
        match node.op {
            Op::Mul { a, b } => {
                let is_gelu = |op: &Op| matches!(op, Op::Gelu { .. } | Op::Silu { .. });
                if single(a, &is_gelu) {
                    absorbed[a.0] = true;
                } else if single(b, &is_gelu) {
                    absorbed[b.0] = true;
                }
            }
            Op::Add { a, b } => {
                let is_norm = |op: &Op| matches!(op, Op::RmsNorm { .. });
                if single(b, &is_norm) {
                    absorbed[b.0] = true;
                } else if single(a, &is_norm) {
                    absorbed[a.0] = true;
                }
            }
            Op::Argmax { x } | Op::TopK { x, .. } if single(x, &|op| matches!(op, Op::MatMul { .. })) => absorbed[x.0] = true,
            _ => {}
        }
    }
    absorbed
}

fn row_kinds(graph: &Graph) -> Vec<Rows> {
    let mut rows = Vec::with_capacity(graph.nodes().len());
    for node in graph.nodes() {
        let r = match node.op {
            Op::LastRow { .. } => Rows::One,
            Op::Input { .. } | Op::Weight { .. } => Rows::Active,
            ref op => {
                let operands = op.operands();
                let data: Vec<Rows> =
                    operands.iter().filter(|o| !matches!(graph.node(**o).op, Op::Weight { .. })).map(|o| rows[o.0]).collect();
                if data.contains(&Rows::One) {
                    Rows::One
                } else {
                    Rows::Active
                }
            }
        };
        rows.push(r);
    }
    rows
}

/// Steps after its last reader during which a decode plan keeps a value's words (its activations
/// are a few rows, so this costs the arena little): no step writes where a value read up to this
/// many steps before lies, so a backend may run up to this many + 1 consecutive steps as one
/// kernel (the CUDA decode step runs the q/k norms, their RoPE and attention, five steps, as one)
/// whatever the arena's layout. Prefill plans reuse words at once (their activations are large).
const DECODE_REUSE_DISTANCE: usize = 4;

struct Buffer {
    words: usize,
    first: usize,
    last: usize,
    offset: usize,
}

struct Lowering<'g> {
    graph: &'g Graph,
    weights: HashMap<NodeId, WeightId>,
    absorbed: Vec<bool>,
    rows: Vec<Rows>,
    buffers: Vec<Buffer>,
    value_buf: HashMap<NodeId, usize>,
    steps: Vec<(Kernel, Rows)>, // kernels with buffer placeholders
}

/// A slot placeholder: buffer index in `offset`, fixed up once offsets are planned.
fn placeholder(buf: usize) -> Slot {
    Slot { offset: buf, len: 0 }
}

impl Lowering<'_> {
    fn weight(&self, id: NodeId) -> Result<WeightId, RuntimeError> {
        self.weights.get(&id).copied().ok_or_else(|| RuntimeError::Compile(format!("node {} is not a weight", id.0)))
    }

    fn new_buffer(&mut self, node: NodeId) -> usize {
        let words = self.graph.node(node).numel();
        let step = self.steps.len();
        self.buffers.push(Buffer { words, first: step, last: step, offset: 0 });
        let b = self.buffers.len() - 1;
        self.value_buf.insert(node, b);
        b
    }

    fn read(&mut self, node: NodeId) -> Result<usize, RuntimeError> {
        let b =
            *self.value_buf.get(&node).ok_or_else(|| RuntimeError::Compile(format!("node {} is read before it is computed", node.0)))?;
        self.buffers[b].last = self.buffers[b].last.max(self.steps.len());
        Ok(b)
    }

    fn width(&self, node: NodeId) -> usize {
        self.graph.node(node).shape[1..].iter().product()
    }

    fn emit(&mut self, node: NodeId, kernel: impl FnOnce(&mut Self, Slot) -> Result<Kernel, RuntimeError>) -> Result<(), RuntimeError> {
        let out = self.new_buffer(node);
        let k = kernel(self, placeholder(out))?;
        let rows = self.rows[node.0];
        self.steps.push((k, rows));
        Ok(())
    }

    fn lower(&mut self) -> Result<(), RuntimeError> {
        let g = self.graph;
        for (i, node) in g.nodes().iter().enumerate() {
            let id = NodeId(i);
            if self.absorbed[i] {
                continue;
            }
            match node.op {
                Op::Weight { .. } => {}
                Op::Input { .. } => {
                    let b = self.new_buffer(id);
                    self.buffers[b].first = 0; // written before the first step
                }
                Op::Reshape { x } => {
                    let b = self.read(x)?;
                    self.value_buf.insert(id, b);
                }
                Op::Embed { table, ids, scale } => {
                    let (t, ids) = (self.weight(table)?, self.read(ids)?);
                    let width = self.width(id);
                    self.emit(id, |_, out| Ok(Kernel::Embed { table: t, ids: placeholder(ids), out, width, scale }))?;
                }
                Op::RmsNorm { x, weight, eps } => {
                    let (w, xb) = (self.weight(weight)?, self.read(x)?);
                    let width = self.width(id);
                    self.emit(id, |_, out| Ok(Kernel::RmsNorm { x: placeholder(xb), weight: w, out, width, eps, residual: None }))?;
                }
                Op::MatMul { x, w } => {
                    let (wid, xb) = (self.weight(w)?, self.read(x)?);
                    let (k, n) = (self.width(x), self.width(id));
                    self.emit(id, |_, out| Ok(Kernel::MatMul { x: placeholder(xb), w: wid, out, k, n }))?;
                }
                Op::Rope { x, positions, ref spec } => {
                    let (xb, pb) = (self.read(x)?, self.read(positions)?);
                    let (heads, head_dim) = (node.shape[1], node.shape[2]);
                    let (x, positions) = (placeholder(xb), placeholder(pb));
                    // Unscaled NeoX RoPE keeps the plain kernel every backend has.
                    self.emit(id, |_, out| {
                        Ok(if spec.is_plain_neox() {
                            Kernel::Rope { x, positions, out, heads, head_dim, theta: spec.theta }
                        } else {
                            Kernel::RopeScaled { x, positions, out, heads, head_dim, spec: spec.clone() }
                        })
                    })?;
                }
                Op::Attention { q, k, v, layer, window, scale, softcap } => {
                    let (qb, kb, vb) = (self.read(q)?, self.read(k)?, self.read(v)?);
                    let (qs, ks) = (g.node(q).shape.clone(), g.node(k).shape.clone());
                    let (q, k, v) = (placeholder(qb), placeholder(kb), placeholder(vb));
                    let (q_heads, kv_heads, head_dim) = (qs[1], ks[1], qs[2]);
                    self.emit(id, |_, out| {
                        Ok(match softcap {
                            None => Kernel::Attention { q, k, v, out, layer, q_heads, kv_heads, head_dim, window, scale },
                            Some(softcap) => {
                                Kernel::AttentionSoftCap { q, k, v, out, layer, q_heads, kv_heads, head_dim, window, scale, softcap }
                            }
                        })
                    })?;
                }
                Op::AddBias { x, bias } => {
                    let (bid, xb, width) = (self.weight(bias)?, self.read(x)?, self.width(id));
                    self.emit(id, |_, out| Ok(Kernel::AddBias { x: placeholder(xb), bias: bid, out, width }))?;
                }
                Op::Add { a, b } => self.lower_add(id, a, b)?,
                Op::Mul { a, b } => {
                    let width = self.width(id);
                    let act_operand = [a, b].into_iter().find(|o| self.absorbed[o.0]);
                    if let Some(gate) = act_operand {
                        let (gate_in, silu) = match g.node(gate).op {
                            Op::Gelu { x } => (x, false),
                            Op::Silu { x } => (x, true),
                            _ => return Err(RuntimeError::Compile("fused mul operand is not an activation".into())),
                        };
                        let up = if gate == a { b } else { a };
                        let (gb, ub) = (self.read(gate_in)?, self.read(up)?);
                        let (gate, up) = (placeholder(gb), placeholder(ub));
                        self.emit(id, |_, out| {
                            Ok(if silu { Kernel::SiluMul { gate, up, out, width } } else { Kernel::GeluMul { gate, up, out, width } })
                        })?;
                    } else {
                        let (ab, bb) = (self.read(a)?, self.read(b)?);
                        self.emit(id, |_, out| Ok(Kernel::Mul { a: placeholder(ab), b: placeholder(bb), out, width }))?;
                    }
                }
                Op::Gelu { x } => {
                    let (xb, width) = (self.read(x)?, self.width(id));
                    self.emit(id, |_, out| Ok(Kernel::Gelu { x: placeholder(xb), out, width }))?;
                }
                Op::Normalize { x, eps } => {
                    let (xb, width, group) = (self.read(x)?, self.width(id), node.shape[node.shape.len() - 1]);
                    self.emit(id, |_, out| Ok(Kernel::Normalize { x: placeholder(xb), out, width, group, eps }))?;
                }
                Op::Scale { x, factor } => {
                    let (xb, width) = (self.read(x)?, self.width(id));
                    self.emit(id, |_, out| Ok(Kernel::Scale { x: placeholder(xb), out, width, factor }))?;
                }
                Op::Silu { x } => {
                    let (xb, width) = (self.read(x)?, self.width(id));
                    self.emit(id, |_, out| Ok(Kernel::Silu { x: placeholder(xb), out, width }))?;
                }
                Op::SoftCap { x, cap } => {
                    let (xb, width) = (self.read(x)?, self.width(id));
                    self.emit(id, |_, out| Ok(Kernel::SoftCap { x: placeholder(xb), out, width, cap }))?;
                }
                Op::LastRow { x } => {
                    let (xb, width) = (self.read(x)?, self.width(id));
                    self.emit(id, |_, out| Ok(Kernel::LastRow { x: placeholder(xb), out, width }))?;
                }
                Op::Argmax { x } => {
                    if self.absorbed[x.0] {
                        let Op::MatMul { x: mx, w } = g.node(x).op else {
                            return Err(RuntimeError::Compile("fused argmax operand is not a matmul".into()));
                        };
                        let (wid, xb) = (self.weight(w)?, self.read(mx)?);
                        let (k, n) = (self.width(mx), self.width(x));
                        self.emit(id, |_, out| Ok(Kernel::MatMulArgmax { x: placeholder(xb), w: wid, out, k, n }))?;
                    } else {
                        let (xb, width) = (self.read(x)?, self.width(x));
                        self.emit(id, |_, out| Ok(Kernel::Argmax { x: placeholder(xb), out, width }))?;
                    }
                }
                Op::TopK { x, k: count, cap } => {
                    if self.absorbed[x.0] {
                        let Op::MatMul { x: mx, w } = g.node(x).op else {
                            return Err(RuntimeError::Compile("fused top-k operand is not a matmul".into()));
                        };
                        let (wid, xb) = (self.weight(w)?, self.read(mx)?);
                        let (k, n) = (self.width(mx), self.width(x));
                        self.emit(id, |_, out| Ok(Kernel::MatMulTopK { x: placeholder(xb), w: wid, out, k, n, count, cap }))?;
                    } else {
                        let (xb, width) = (self.read(x)?, self.width(x));
                        self.emit(id, |_, out| Ok(Kernel::TopK { x: placeholder(xb), out, width, count, cap }))?;
                    }
                }
                Op::Draw { x, among } => {
                    let (xb, width) = (self.read(x)?, self.width(x));
                    self.emit(id, |_, out| Ok(Kernel::Draw { x: placeholder(xb), out, width, among }))?;
                }
            }
        }
        Ok(())
    }

    fn lower_add(&mut self, id: NodeId, a: NodeId, b: NodeId) -> Result<(), RuntimeError> {
        let g = self.graph;
        let width = self.width(id);
        let norm_operand = [b, a].into_iter().find(|o| self.absorbed[o.0]);
        if let Some(norm) = norm_operand {
            let Op::RmsNorm { x, weight, eps } = g.node(norm).op else {
                return Err(RuntimeError::Compile("fused add operand is not an rms_norm".into()));
            };
            let residual = if norm == b { a } else { b };
            let (w, xb, rb) = (self.weight(weight)?, self.read(x)?, self.read(residual)?);
            self.emit(id, |_, out| Ok(Kernel::RmsNorm { x: placeholder(xb), weight: w, out, width, eps, residual: Some(placeholder(rb)) }))
        } else {
            let (ab, bb) = (self.read(a)?, self.read(b)?);
            self.emit(id, |_, out| Ok(Kernel::Add { a: placeholder(ab), b: placeholder(bb), out, width }))
        }
    }

    /// Extends output lifetimes to the end (and, in decode plans, every lifetime by
    /// `DECODE_REUSE_DISTANCE`), plans offsets, and resolves placeholders.
    fn finish(mut self) -> Result<Plan, RuntimeError> {
        let end = self.steps.len();
        if matches!(self.graph.bucket(), Bucket::Decode { .. }) {
            for b in &mut self.buffers {
                b.last += DECODE_REUSE_DISTANCE;
            }
        }
        let mut outputs = Vec::new();
        for (name, id) in self.graph.outputs() {
            let b = *self.value_buf.get(id).ok_or_else(|| RuntimeError::Compile(format!("output '{name}' is never computed")))?;
            self.buffers[b].last = end;
            let node = self.graph.node(*id);
            outputs.push((name.clone(), b, node.dtype, self.width(*id), self.rows[id.0]));
        }
        let arena_words = plan_offsets(&mut self.buffers);
        let slot = |b: usize, bufs: &[Buffer]| Slot { offset: bufs[b].offset, len: bufs[b].words };
        let mut inputs = Vec::new();
        for (i, node) in self.graph.nodes().iter().enumerate() {
            if let Op::Input { name } = &node.op {
                if let Some(&b) = self.value_buf.get(&NodeId(i)) {
                    inputs.push(PlanInput { name: name.clone(), slot: slot(b, &self.buffers) });
                }
            }
        }
        let bufs = &self.buffers;
        let fix = |s: &mut Slot| *s = slot(s.offset, bufs);
        let steps = self
            .steps
            .into_iter()
            .map(|(mut kernel, rows)| {
                for_each_slot(&mut kernel, fix);
                Step { kernel, rows }
            })
            .collect();
        let outputs =
            outputs.into_iter().map(|(name, b, dtype, width, rows)| PlanOutput { name, slot: slot(b, bufs), dtype, width, rows }).collect();
        Ok(Plan { bucket: self.graph.bucket(), steps, arena_words, inputs, outputs })
    }
}

/// Applies `f` to every slot of a kernel.
fn for_each_slot(kernel: &mut Kernel, mut f: impl FnMut(&mut Slot)) {
    match kernel {
        Kernel::Embed { ids, out, .. } => [ids, out].into_iter().for_each(f),
        Kernel::RmsNorm { x, out, residual, .. } => {
            f(x);
            f(out);
            if let Some(r) = residual {
                f(r);
            }
        }
        Kernel::MatMul { x, out, .. } | Kernel::MatMulArgmax { x, out, .. } | Kernel::MatMulTopK { x, out, .. } => {
            [x, out].into_iter().for_each(f)
        }
        Kernel::Rope { x, positions, out, .. } | Kernel::RopeScaled { x, positions, out, .. } => {
            [x, positions, out].into_iter().for_each(f)
        }
        Kernel::Attention { q, k, v, out, .. } | Kernel::AttentionSoftCap { q, k, v, out, .. } => [q, k, v, out].into_iter().for_each(f),
        Kernel::Add { a, b, out, .. } | Kernel::Mul { a, b, out, .. } => [a, b, out].into_iter().for_each(f),
        Kernel::GeluMul { gate, up, out, .. } | Kernel::SiluMul { gate, up, out, .. } => [gate, up, out].into_iter().for_each(f),
        Kernel::Gelu { x, out, .. }
        | Kernel::Silu { x, out, .. }
        | Kernel::SoftCap { x, out, .. }
        | Kernel::Normalize { x, out, .. }
        | Kernel::Scale { x, out, .. }
        | Kernel::AddBias { x, out, .. }
        | Kernel::LastRow { x, out, .. }
        | Kernel::Argmax { x, out, .. }
        | Kernel::TopK { x, out, .. }
        | Kernel::Draw { x, out, .. } => [x, out].into_iter().for_each(f),
    }
}

/// Greedy offset assignment: largest buffers first, each at the lowest offset that does not
/// collide with an already placed buffer whose lifetime overlaps. Returns the arena size.
fn plan_offsets(buffers: &mut [Buffer]) -> usize {
    let mut order: Vec<usize> = (0..buffers.len()).collect();
    order.sort_by_key(|&b| std::cmp::Reverse(buffers[b].words));
    let mut placed: Vec<usize> = Vec::new();
    let mut total = 0;
    for b in order {
        let (first, last, words) = (buffers[b].first, buffers[b].last, buffers[b].words);
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .map(|&p| &buffers[p])
            .filter(|p| p.first <= last && first <= p.last)
            .map(|p| (p.offset, p.offset + p.words))
            .collect();
        busy.sort_unstable();
        let mut offset = 0;
        for (start, end) in busy {
            if offset + words <= start {
                break;
            }
            offset = offset.max(end);
        }
        buffers[b].offset = offset;
        total = total.max(offset + words);
        placed.push(b);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(words: usize, first: usize, last: usize) -> Buffer {
        Buffer { words, first, last, offset: 0 }
    }

    #[test]
    fn offsets_never_overlap_for_live_buffers() {
        let mut bufs = vec![buf(10, 0, 2), buf(5, 1, 3), buf(10, 3, 4), buf(7, 2, 5), buf(1, 5, 6)];
        let total = plan_offsets(&mut bufs);
        for (i, a) in bufs.iter().enumerate() {
            assert!(a.offset + a.words <= total);
            for b in &bufs[i + 1..] {
                let live = a.first <= b.last && b.first <= a.last;
                let overlap = a.offset < b.offset + b.words && b.offset < a.offset + a.words;
                assert!(!(live && overlap));
            }
        }
        // buffers 0 and 2 are never live together: they share memory.
        assert!(total < 10 + 5 + 10 + 7 + 1);
    }
}

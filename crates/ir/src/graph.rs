//! Nodes, ops and the checked graph builder.

use crate::Bucket;

/// Element type of a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 32-bit signed integer (token ids, positions).
    I32,
}

/// Index of a node in its graph (operands always precede their users).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub usize);

/// What a graph should hand back: one decode/prefill path, parameterised by its output.
///
/// "The last active row" is per sequence: a prefill step has one sequence (its last row), a decode
/// step has one row per sequence (every active row), see [`GraphBuilder::head_rows`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OutputMode {
    /// Logits of each sequence's last active row (`logits`: [sequences, vocab]) — for sampling.
    Logits,
    /// Logits of every active row (`logits`: [rows, vocab]) — for perplexity.
    AllLogits,
    /// Greedy next token of each sequence's last active row (`next_token`: [sequences] i32),
    /// computed in the graph.
    NextToken,
    /// Final-norm hidden state of each sequence's last active row (`hidden`: [sequences, hidden]).
    Hidden,
    /// The [`CANDIDATES`] largest logits of each sequence's last active row and their token ids
    /// (`candidates`: [sequences, 2 x CANDIDATES], see [`Op::TopK`]) — for sampling among the
    /// likeliest tokens only (top-k up to `CANDIDATES`), without the whole vocabulary's logits.
    Candidates,
    /// The next token of each sequence's last active row drawn in the graph (`next_token`:
    /// [sequences] i32, see [`Op::Draw`]) by the sampling parameters and random state the step
    /// carries for each sequence: its draw's 4 bytes are all a sampled step reads back.
    Drawn(Among),
}

/// What an [`Op::Draw`] draws from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Among {
    /// The [`CANDIDATES`] likeliest tokens of an [`Op::TopK`] (top-k sampling below
    /// `CANDIDATES`).
    Candidates,
    /// Every token's logit (temperature alone: no top-k, top-p or min-p cut).
    Vocabulary,
}

/// Logits an [`OutputMode::Candidates`] step keeps per sequence.
pub const CANDIDATES: usize = 64;

/// Most columns an [`Op::TopK`] may choose from: its ids must be exact in an f32.
pub const TOP_K_MAX_WIDTH: usize = 1 << 24;

impl OutputMode {
    /// The name of the graph output this mode produces.
    pub fn output_name(self) -> &'static str {
        match self {
            OutputMode::Logits | OutputMode::AllLogits => "logits",
            OutputMode::NextToken | OutputMode::Drawn(_) => "next_token",
            OutputMode::Hidden => "hidden",
            OutputMode::Candidates => "candidates",
        }
    }
}

/// How RoPE pairs the elements of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeMode {
    /// GPT-NeoX / Hugging Face `rotate_half`: element `i` pairs with `i + head_dim / 2`.
    Neox,
    /// Original (GPT-J / llama.cpp "normal"): element `2i` pairs with `2i + 1`.
    Norm,
}

/// Rotary position embedding parameters: pairing, base and frequency scaling.
///
/// Frequency `i` of a head of size `d` is `freq_scale * theta^(-2i/d) / freq_factors[i]`.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    /// Frequency base.
    pub theta: f32,
    /// Element pairing.
    pub mode: RopeMode,
    /// Multiplies every frequency (linear position scaling: `1 / factor`).
    pub freq_scale: f32,
    /// Per-frequency divisors (`rope_freqs.weight`: Llama 3 scaling, proportional RoPE), `d / 2` long.
    pub freq_factors: Option<Vec<f32>>,
}

impl RopeSpec {
    /// Unscaled NeoX RoPE with base `theta`.
    pub fn neox(theta: f32) -> Self {
        RopeSpec { theta, mode: RopeMode::Neox, freq_scale: 1.0, freq_factors: None }
    }

    /// Whether this is unscaled NeoX RoPE (the plain `Rope` kernel).
    pub fn is_plain_neox(&self) -> bool {
        self.mode == RopeMode::Neox && self.freq_scale == 1.0 && self.freq_factors.is_none()
    }
}

/// One operation. Shapes are row-major; the first dimension of every activation is the row count.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A named input fed at run time (`tokens`, `positions`: [rows] i32).
    Input {
        /// Input name.
        name: String,
    },
    /// A named model parameter: [n, k] for a matrix (rows of length k), [k] for a vector.
    Weight {
        /// Tensor name in the weight store.
        name: String,
    },
    /// Gathers rows of `table` ([vocab, width]) by `ids` and multiplies them by `scale`.
    Embed {
        /// Embedding table (a weight).
        table: NodeId,
        /// Token ids ([rows] i32).
        ids: NodeId,
        /// Scale applied to every gathered value.
        scale: f32,
    },
    /// RMS normalisation over the last dimension, times `weight` (length = last dimension).
    RmsNorm {
        /// Input.
        x: NodeId,
        /// Per-element weight vector.
        weight: NodeId,
        /// Epsilon added to the mean square.
        eps: f32,
    },
    /// RMS normalisation over the last dimension without a weight (Gemma 4 value norm).
    Normalize {
        /// Input.
        x: NodeId,
        /// Epsilon added to the mean square.
        eps: f32,
    },
    /// `x * factor` (Gemma 4 per-layer output scale).
    Scale {
        /// Input.
        x: NodeId,
        /// The factor.
        factor: f32,
    },
    /// `x` [rows, k] times the transpose of weight `w` [n, k]: [rows, n].
    MatMul {
        /// Activations.
        x: NodeId,
        /// Weight matrix.
        w: NodeId,
    },
    /// Rotary position embedding on `x` [rows, heads, head_dim].
    Rope {
        /// Input.
        x: NodeId,
        /// Absolute positions ([rows] i32).
        positions: NodeId,
        /// Pairing, base and frequency scaling.
        spec: RopeSpec,
    },
    /// Causal attention of `q` [rows, q_heads, d] over the layer's KV cache plus `k`, `v`
    /// [rows, kv_heads, d]; appends `k`, `v` to the cache. Output [rows, q_heads * d].
    Attention {
        /// Queries.
        q: NodeId,
        /// New keys.
        k: NodeId,
        /// New values.
        v: NodeId,
        /// Layer index (selects the KV cache layer).
        layer: usize,
        /// Sliding window (a query sees the last `window` positions including itself), or none.
        window: Option<usize>,
        /// Score scale (usually 1/sqrt(d)).
        scale: f32,
        /// Soft-capping of the scaled scores, `c * tanh(s / c)` (Gemma 2), or none.
        softcap: Option<f32>,
    },
    /// Element-wise sum of two values of the same shape.
    Add {
        /// Left operand.
        a: NodeId,
        /// Right operand.
        b: NodeId,
    },
    /// Element-wise product of two values of the same shape.
    Mul {
        /// Left operand.
        a: NodeId,
        /// Right operand.
        b: NodeId,
    },
    /// `x` [rows, n] plus the weight vector `bias` [n] on every row.
    AddBias {
        /// Input.
        x: NodeId,
        /// Bias vector (a weight).
        bias: NodeId,
    },
    /// GELU, tanh approximation.
    Gelu {
        /// Input.
        x: NodeId,
    },
    /// SiLU: `x * sigmoid(x)`.
    Silu {
        /// Input.
        x: NodeId,
    },
    /// Soft-capping: `cap * tanh(x / cap)`.
    SoftCap {
        /// Input.
        x: NodeId,
        /// The cap (> 0).
        cap: f32,
    },
    /// Same data, new shape (same row count, same element count).
    Reshape {
        /// Input.
        x: NodeId,
    },
    /// The last active row of each sequence of the step in `x` [rows, d]: [seqs, d] (the bucket's
    /// sequence capacity; one row for a single sequence).
    LastRow {
        /// Input.
        x: NodeId,
    },
    /// Index of the largest value of each row of `x` [rows, n]: [rows] i32.
    Argmax {
        /// Input.
        x: NodeId,
    },
    /// The `k` largest values of each row of `x` [rows, n] (n at most [`TOP_K_MAX_WIDTH`]), then
    /// their column indices: [rows, 2k] f32, columns 0..k the values largest first (the lower
    /// index first among equals), columns k..2k their indices (exact integers). With `cap`, the
    /// kept values are soft-capped (`cap * tanh(v / cap)`: monotonic, so the choice is the raw
    /// values').
    TopK {
        /// Input.
        x: NodeId,
        /// Values kept per row (at most n).
        k: usize,
        /// Soft cap applied to the kept values.
        cap: Option<f32>,
    },
    /// A token drawn from each row of `x` by the sampling parameters and random state the step
    /// carries for that row's sequence: [rows] i32 (-1 where the row holds a value that is not
    /// finite). `among` says what `x` holds: an [`Op::TopK`]'s [rows, 2 x CANDIDATES] (drawn among
    /// its first top-k) or [rows, vocab] logits (drawn among all). The draw is
    /// `kiln_runtime::draw::draw_row`'s on every backend, so a seed gives the same tokens wherever
    /// it runs.
    Draw {
        /// Candidates or logits.
        x: NodeId,
        /// Which of the two `x` is.
        among: Among,
    },
}

impl Op {
    /// The operands of this op, in order.
    pub fn operands(&self) -> Vec<NodeId> {
        match *self {
            Op::Input { .. } | Op::Weight { .. } => vec![],
            Op::Embed { table, ids, .. } => vec![table, ids],
            Op::RmsNorm { x, weight, .. } => vec![x, weight],
            Op::MatMul { x, w } => vec![x, w],
            Op::Rope { x, positions, .. } => vec![x, positions],
            Op::Attention { q, k, v, .. } => vec![q, k, v],
            Op::Add { a, b } | Op::Mul { a, b } => vec![a, b],
            Op::AddBias { x, bias } => vec![x, bias],
            Op::Gelu { x }
            | Op::Silu { x }
            | Op::Normalize { x, .. }
            | Op::Scale { x, .. }
            | Op::SoftCap { x, .. }
            | Op::Reshape { x }
            | Op::LastRow { x }
            | Op::Argmax { x }
            | Op::TopK { x, .. }
            | Op::Draw { x, .. } => vec![x],
        }
    }
}

/// A node: an op and the static shape and type of its value.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The operation.
    pub op: Op,
    /// Static shape of the value.
    pub shape: Vec<usize>,
    /// Element type of the value.
    pub dtype: DType,
}

impl Node {
    /// Number of elements of the value.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Errors found while building a graph.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum IrError {
    /// An op received operands of incompatible shapes or types.
    #[error("graph op {op}: {msg}")]
    Shape {
        /// The op being added.
        op: &'static str,
        /// What was wrong.
        msg: String,
    },
    /// A named output was never set.
    #[error("graph has no output named '{0}'")]
    MissingOutput(String),
}

/// A static-shape graph for one bucket.
#[derive(Clone, Debug)]
pub struct Graph {
    nodes: Vec<Node>,
    outputs: Vec<(String, NodeId)>,
    bucket: Bucket,
}

impl Graph {
    /// All nodes, operands before users.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// One node.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0]
    }

    /// Named outputs.
    pub fn outputs(&self) -> &[(String, NodeId)] {
        &self.outputs
    }

    /// The bucket this graph was built for.
    pub fn bucket(&self) -> Bucket {
        self.bucket
    }

    /// Row capacity of every activation.
    pub fn rows(&self) -> usize {
        self.bucket.rows()
    }
}

/// Builds a [`Graph`], checking every op's operands as it is added.
///
/// Methods return the new node's id; the first error is kept and reported by [`GraphBuilder::finish`].
pub struct GraphBuilder {
    nodes: Vec<Node>,
    outputs: Vec<(String, NodeId)>,
    bucket: Bucket,
    error: Option<IrError>,
}

impl GraphBuilder {
    /// Starts a graph for `bucket`.
    pub fn new(bucket: Bucket) -> Self {
        GraphBuilder { nodes: Vec::new(), outputs: Vec::new(), bucket, error: None }
    }

    /// Row capacity of the graph.
    pub fn rows(&self) -> usize {
        self.bucket.rows()
    }

    /// Shape of a node already added.
    pub fn shape(&self, id: NodeId) -> &[usize] {
        &self.nodes[id.0].shape
    }

    fn push(&mut self, op: Op, shape: Vec<usize>, dtype: DType) -> NodeId {
        self.nodes.push(Node { op, shape, dtype });
        NodeId(self.nodes.len() - 1)
    }

    fn fail(&mut self, op: &'static str, msg: String) {
        if self.error.is_none() {
            self.error = Some(IrError::Shape { op, msg });
        }
    }

    fn check(&mut self, op: &'static str, ok: bool, msg: impl FnOnce() -> String) -> bool {
        if !ok {
            self.fail(op, msg());
        }
        ok
    }

    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0]
    }

    /// A run-time input of `width` values per row (width 1: shape [rows]).
    pub fn input(&mut self, name: &str, dtype: DType) -> NodeId {
        let rows = self.rows();
        self.push(Op::Input { name: name.to_string() }, vec![rows], dtype)
    }

    /// A named weight of the given shape ([n, k] or [k]).
    pub fn weight(&mut self, name: &str, shape: &[usize]) -> NodeId {
        self.check("weight", !shape.is_empty() && shape.len() <= 2, || format!("weight '{name}' must be 1-D or 2-D, got {shape:?}"));
        self.push(Op::Weight { name: name.to_string() }, shape.to_vec(), DType::F32)
    }

    /// Gathers `table` rows by `ids`, times `scale`.
    pub fn embed(&mut self, table: NodeId, ids: NodeId, scale: f32) -> NodeId {
        let (t, i) = (self.node(table).clone(), self.node(ids).clone());
        let ok = matches!(t.op, Op::Weight { .. }) && t.shape.len() == 2 && i.dtype == DType::I32;
        self.check("embed", ok, || format!("needs a 2-D weight table and i32 ids, got {:?} and {:?}", t.shape, i.dtype));
        let width = t.shape.get(1).copied().unwrap_or(0);
        self.push(Op::Embed { table, ids, scale }, vec![i.shape[0], width], DType::F32)
    }

    /// RMS norm over the last dimension with `weight`.
    pub fn rms_norm(&mut self, x: NodeId, weight: NodeId, eps: f32) -> NodeId {
        let (xs, ws) = (self.node(x).shape.clone(), self.node(weight).shape.clone());
        self.check("rms_norm", ws.len() == 1 && xs.last() == ws.first(), || {
            format!("weight {ws:?} does not match the last dimension of {xs:?}")
        });
        self.push(Op::RmsNorm { x, weight, eps }, xs, DType::F32)
    }

    /// RMS normalisation over the last dimension, without a weight.
    pub fn normalize(&mut self, x: NodeId, eps: f32) -> NodeId {
        let s = self.node(x).shape.clone();
        self.check("normalize", s.len() >= 2, || format!("needs [rows, ..., d], got {s:?}"));
        self.push(Op::Normalize { x, eps }, s, DType::F32)
    }

    /// `x * factor`.
    pub fn scale(&mut self, x: NodeId, factor: f32) -> NodeId {
        self.check("scale", factor.is_finite(), || format!("factor {factor} must be finite"));
        let s = self.node(x).shape.clone();
        self.push(Op::Scale { x, factor }, s, DType::F32)
    }

    /// `x` [rows, k] times `w` [n, k] transposed.
    pub fn matmul(&mut self, x: NodeId, w: NodeId) -> NodeId {
        let (xs, ws) = (self.node(x).shape.clone(), self.node(w).shape.clone());
        let ok = xs.len() == 2 && ws.len() == 2 && xs[1] == ws[1] && matches!(self.node(w).op, Op::Weight { .. });
        self.check("matmul", ok, || format!("x {xs:?} and weight {ws:?} do not multiply"));
        let n = ws.first().copied().unwrap_or(0);
        self.push(Op::MatMul { x, w }, vec![xs[0], n], DType::F32)
    }

    /// Unscaled NeoX rotary embedding of `x` [rows, heads, head_dim] at `positions`.
    pub fn rope(&mut self, x: NodeId, positions: NodeId, theta: f32) -> NodeId {
        self.rope_with(x, positions, RopeSpec::neox(theta))
    }

    /// Rotary embedding of `x` [rows, heads, head_dim] at `positions` as `spec` says.
    pub fn rope_with(&mut self, x: NodeId, positions: NodeId, spec: RopeSpec) -> NodeId {
        let xs = self.node(x).shape.clone();
        let ok = xs.len() == 3 && xs[2].is_multiple_of(2) && self.node(positions).dtype == DType::I32;
        self.check("rope", ok, || format!("needs [rows, heads, even head_dim] and i32 positions, got {xs:?}"));
        let half = xs.get(2).copied().unwrap_or(0) / 2;
        let factors_ok = spec.freq_factors.as_ref().is_none_or(|f| f.len() == half && f.iter().all(|v| *v > 0.0));
        self.check("rope", factors_ok, || format!("frequency factors must be {half} positive values"));
        let scale_ok = spec.freq_scale > 0.0 && spec.freq_scale.is_finite() && spec.theta > 0.0;
        self.check("rope", scale_ok, || format!("base {} and frequency scale {} must be positive", spec.theta, spec.freq_scale));
        self.push(Op::Rope { x, positions, spec }, xs, DType::F32)
    }

    /// Causal attention over the cache of `layer` plus the new rows.
    pub fn attention(&mut self, q: NodeId, k: NodeId, v: NodeId, layer: usize, window: Option<usize>, scale: f32) -> NodeId {
        self.attention_capped(q, k, v, layer, window, scale, None)
    }

    /// Causal attention whose scaled scores are soft-capped at `softcap` (when given).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_capped(
        &mut self,
        q: NodeId,
        k: NodeId,
        v: NodeId,
        layer: usize,
        window: Option<usize>,
        scale: f32,
        softcap: Option<f32>,
    ) -> NodeId {
        self.check("attention", softcap.is_none_or(|c| c > 0.0 && c.is_finite()), || format!("soft-cap {softcap:?} must be positive"));
        let (qs, ks, vs) = (self.node(q).shape.clone(), self.node(k).shape.clone(), self.node(v).shape.clone());
        let ok = qs.len() == 3 && ks.len() == 3 && ks == vs && qs[0] == ks[0] && qs[2] == ks[2] && ks[1] > 0 && qs[1] % ks[1] == 0;
        self.check("attention", ok, || format!("q {qs:?}, k {ks:?}, v {vs:?} are not compatible"));
        let out = vec![qs[0], qs.get(1).copied().unwrap_or(0) * qs.get(2).copied().unwrap_or(0)];
        self.push(Op::Attention { q, k, v, layer, window, scale, softcap }, out, DType::F32)
    }

    fn binary(&mut self, name: &'static str, a: NodeId, b: NodeId, op: Op) -> NodeId {
        let (as_, bs) = (self.node(a).shape.clone(), self.node(b).shape.clone());
        self.check(name, as_ == bs, || format!("operand shapes differ: {as_:?} vs {bs:?}"));
        self.push(op, as_, DType::F32)
    }

    /// `a + b`.
    pub fn add(&mut self, a: NodeId, b: NodeId) -> NodeId {
        self.binary("add", a, b, Op::Add { a, b })
    }

    /// `a * b`.
    pub fn mul(&mut self, a: NodeId, b: NodeId) -> NodeId {
        self.binary("mul", a, b, Op::Mul { a, b })
    }

    /// `x` [rows, n] plus the bias weight vector [n] on every row.
    pub fn add_bias(&mut self, x: NodeId, bias: NodeId) -> NodeId {
        let (xs, bs) = (self.node(x).shape.clone(), self.node(bias).shape.clone());
        let ok = xs.len() == 2 && bs.len() == 1 && xs[1] == bs[0] && matches!(self.node(bias).op, Op::Weight { .. });
        self.check("add_bias", ok, || format!("bias weight {bs:?} does not match the rows of {xs:?}"));
        self.push(Op::AddBias { x, bias }, xs, DType::F32)
    }

    /// GELU (tanh approximation).
    pub fn gelu(&mut self, x: NodeId) -> NodeId {
        let s = self.node(x).shape.clone();
        self.push(Op::Gelu { x }, s, DType::F32)
    }

    /// SiLU (`x * sigmoid(x)`).
    pub fn silu(&mut self, x: NodeId) -> NodeId {
        let s = self.node(x).shape.clone();
        self.push(Op::Silu { x }, s, DType::F32)
    }

    /// Soft-capping `cap * tanh(x / cap)`.
    pub fn soft_cap(&mut self, x: NodeId, cap: f32) -> NodeId {
        self.check("soft_cap", cap > 0.0 && cap.is_finite(), || format!("cap {cap} must be positive"));
        let s = self.node(x).shape.clone();
        self.push(Op::SoftCap { x, cap }, s, DType::F32)
    }

    /// Reinterprets `x` with `shape` (same rows, same element count).
    pub fn reshape(&mut self, x: NodeId, shape: &[usize]) -> NodeId {
        let xs = self.node(x).shape.clone();
        let ok = shape.first() == xs.first() && shape.iter().product::<usize>() == xs.iter().product::<usize>();
        self.check("reshape", ok, || format!("cannot reshape {xs:?} to {shape:?}"));
        self.push(Op::Reshape { x }, shape.to_vec(), DType::F32)
    }

    /// The rows of `x` [rows, d] that feed the output head in `mode`: every row for
    /// [`OutputMode::AllLogits`] and in decode buckets (one row per sequence), else the last
    /// active row of each sequence of the prefill step.
    pub fn head_rows(&mut self, x: NodeId, mode: OutputMode) -> NodeId {
        match self.bucket {
            Bucket::Prefill { .. } if mode != OutputMode::AllLogits => self.last_row(x),
            _ => x,
        }
    }

    /// The last active row of each sequence in `x` [rows, d]: [seqs, d].
    pub fn last_row(&mut self, x: NodeId) -> NodeId {
        let xs = self.node(x).shape.clone();
        self.check("last_row", xs.len() == 2, || format!("needs [rows, d], got {xs:?}"));
        let seqs = match self.bucket {
            Bucket::Prefill { seqs, .. } => seqs,
            Bucket::Decode { .. } => 1,
        };
        self.push(Op::LastRow { x }, vec![seqs, xs.get(1).copied().unwrap_or(0)], DType::F32)
    }

    /// Row-wise argmax of `x` [rows, n].
    pub fn argmax(&mut self, x: NodeId) -> NodeId {
        let xs = self.node(x).shape.clone();
        self.check("argmax", xs.len() == 2, || format!("needs [rows, n], got {xs:?}"));
        self.push(Op::Argmax { x }, vec![xs[0]], DType::I32)
    }

    /// Row-wise top `k` of `x` [rows, n], soft-capped by `cap` (see [`Op::TopK`]).
    pub fn top_k(&mut self, x: NodeId, k: usize, cap: Option<f32>) -> NodeId {
        let xs = self.node(x).shape.clone();
        let ok = xs.len() == 2 && k >= 1 && k <= xs[1] && xs[1] <= TOP_K_MAX_WIDTH && cap.is_none_or(|c| c > 0.0);
        self.check("top_k", ok, || format!("needs [rows, n] with 1 <= k <= n <= 2^24 and a positive cap, got {xs:?}, k {k}, cap {cap:?}"));
        self.push(Op::TopK { x, k, cap }, vec![xs.first().copied().unwrap_or(0), 2 * k], DType::F32)
    }

    /// A token drawn from each row of `x` (see [`Op::Draw`]): `among` candidates needs an
    /// [`Op::TopK`] of [`CANDIDATES`] values a row.
    pub fn draw(&mut self, x: NodeId, among: Among) -> NodeId {
        let xs = self.node(x).shape.clone();
        let ok = xs.len() == 2
            && match among {
                Among::Candidates => matches!(self.node(x).op, Op::TopK { k: CANDIDATES, .. }),
                Among::Vocabulary => xs[1] >= 1,
            };
        self.check("draw", ok, || format!("needs [rows, n] logits or a top-{CANDIDATES} for {among:?}, got {xs:?}"));
        self.push(Op::Draw { x, among }, vec![xs.first().copied().unwrap_or(0)], DType::I32)
    }

    /// Marks `id` as the graph output `name`.
    pub fn output(&mut self, name: &str, id: NodeId) {
        self.outputs.push((name.to_string(), id));
    }

    /// Finishes the graph, reporting the first error met while building.
    pub fn finish(self) -> Result<Graph, IrError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        Ok(Graph { nodes: self.nodes, outputs: self.outputs, bucket: self.bucket })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_and_infers_shapes() {
        let mut b = GraphBuilder::new(Bucket::Prefill { rows: 4, seqs: 1 });
        let ids = b.input("tokens", DType::I32);
        let table = b.weight("emb", &[10, 8]);
        let x = b.embed(table, ids, 2.0);
        let w = b.weight("w", &[6, 8]);
        let y = b.matmul(x, w);
        let last = b.last_row(y);
        let am = b.argmax(last);
        b.output("next_token", am);
        let g = b.finish().unwrap();
        assert_eq!(g.node(y).shape, vec![4, 6]);
        assert_eq!(g.node(last).shape, vec![1, 6]);
        assert_eq!(g.node(am).dtype, DType::I32);
        assert_eq!(g.outputs().len(), 1);
    }

    #[test]
    fn reports_shape_errors() {
        let mut b = GraphBuilder::new(Bucket::Prefill { rows: 2, seqs: 1 });
        let ids = b.input("tokens", DType::I32);
        let table = b.weight("emb", &[10, 8]);
        let x = b.embed(table, ids, 1.0);
        let w = b.weight("w", &[6, 7]);
        b.matmul(x, w);
        let err = b.finish().unwrap_err();
        assert!(err.to_string().contains("matmul"), "{err}");
        assert!(err.to_string().contains("[6, 7]"), "{err}");
    }

    #[test]
    fn top_k_takes_one_to_n_values_a_row() {
        for (k, cap, ok) in [(1, None, true), (6, Some(30.0), true), (0, None, false), (7, None, false), (3, Some(0.0), false)] {
            let mut b = GraphBuilder::new(Bucket::Decode { past: 8, seqs: 2 });
            let ids = b.input("tokens", DType::I32);
            let table = b.weight("emb", &[6, 8]);
            let x = b.embed(table, ids, 1.0);
            let logits = b.matmul(x, table);
            let top = b.top_k(logits, k, cap);
            b.output("candidates", top);
            match b.finish() {
                Ok(g) => {
                    assert!(ok, "k {k}, cap {cap:?}");
                    assert_eq!((g.node(top).shape.clone(), g.node(top).dtype), (vec![2, 2 * k], DType::F32));
                }
                Err(e) => assert!(!ok && e.to_string().contains("top_k"), "k {k}, cap {cap:?}: {e}"),
            }
        }
    }

    #[test]
    fn draws_take_logits_or_a_top_k_of_candidates() {
        for (k, among, ok) in [
            (None, Among::Vocabulary, true),
            (Some(CANDIDATES), Among::Candidates, true),
            (Some(CANDIDATES), Among::Vocabulary, true),
            (None, Among::Candidates, false),
            (Some(CANDIDATES - 1), Among::Candidates, false),
        ] {
            let mut b = GraphBuilder::new(Bucket::Decode { past: 8, seqs: 3 });
            let ids = b.input("tokens", DType::I32);
            let table = b.weight("emb", &[100, 8]);
            let x = b.embed(table, ids, 1.0);
            let logits = b.matmul(x, table);
            let x = k.map_or(logits, |k| b.top_k(logits, k, None));
            let drawn = b.draw(x, among);
            b.output("next_token", drawn);
            match b.finish() {
                Ok(g) => {
                    assert!(ok, "{k:?} {among:?}");
                    assert_eq!((g.node(drawn).shape.clone(), g.node(drawn).dtype), (vec![3], DType::I32));
                }
                Err(e) => assert!(!ok && e.to_string().contains("draw"), "{k:?} {among:?}: {e}"),
            }
        }
    }

    #[test]
    fn attention_checks_heads() {
        let mut b = GraphBuilder::new(Bucket::Decode { past: 64, seqs: 1 });
        let w = b.weight("x", &[1, 12]);
        let ids = b.input("tokens", DType::I32);
        let x = b.embed(w, ids, 1.0);
        let q = b.reshape(x, &[1, 3, 4]);
        let k = b.reshape(x, &[1, 2, 6]);
        b.attention(q, k, k, 0, None, 1.0);
        assert!(b.finish().is_err());
    }

    #[test]
    fn new_ops_check_their_operands() {
        let prefill = Bucket::Prefill { rows: 2, seqs: 1 };
        let base = |b: &mut GraphBuilder| {
            let ids = b.input("tokens", DType::I32);
            let table = b.weight("emb", &[10, 8]);
            (ids, b.embed(table, ids, 1.0))
        };
        // A bias must be a weight vector as long as the rows.
        let mut b = GraphBuilder::new(prefill);
        let (_, x) = base(&mut b);
        let bias = b.weight("b", &[8]);
        let y = b.add_bias(x, bias);
        let s = b.silu(y);
        let c = b.soft_cap(s, 30.0);
        let n = b.normalize(c, 1e-6);
        let m = b.scale(n, 0.5);
        b.output("out", m);
        let g = b.finish().unwrap();
        assert_eq!(g.node(c).shape, vec![2, 8]);
        assert_eq!(g.node(m).op, Op::Scale { x: n, factor: 0.5 });
        assert_eq!(g.node(y).op, Op::AddBias { x, bias });
        let mut b = GraphBuilder::new(prefill);
        let (_, x) = base(&mut b);
        let bias = b.weight("b", &[7]);
        b.add_bias(x, bias);
        assert!(b.finish().unwrap_err().to_string().contains("add_bias"));
        let mut b = GraphBuilder::new(prefill);
        let (_, x) = base(&mut b);
        b.add_bias(x, x);
        assert!(b.finish().is_err(), "a bias must be a weight");
        // Caps must be positive.
        let mut b = GraphBuilder::new(prefill);
        let (_, x) = base(&mut b);
        b.soft_cap(x, 0.0);
        assert!(b.finish().unwrap_err().to_string().contains("soft_cap"));
        let mut b = GraphBuilder::new(prefill);
        let (_, x) = base(&mut b);
        b.scale(x, f32::NAN);
        assert!(b.finish().unwrap_err().to_string().contains("scale"));
        let mut b = GraphBuilder::new(prefill);
        let (_, x) = base(&mut b);
        let q = b.reshape(x, &[2, 2, 4]);
        b.attention_capped(q, q, q, 0, None, 1.0, Some(-1.0));
        assert!(b.finish().unwrap_err().to_string().contains("soft-cap"));
        // RoPE frequency factors: one positive value per frequency.
        let mut b = GraphBuilder::new(prefill);
        let (ids, x) = base(&mut b);
        let q = b.reshape(x, &[2, 2, 4]);
        let spec = RopeSpec { theta: 1e4, mode: RopeMode::Norm, freq_scale: 0.5, freq_factors: Some(vec![1.0, 2.0]) };
        let r = b.rope_with(q, ids, spec.clone());
        let g = b.finish().unwrap();
        assert_eq!(g.node(r).op, Op::Rope { x: q, positions: ids, spec });
        let mut b = GraphBuilder::new(prefill);
        let (ids, x) = base(&mut b);
        let q = b.reshape(x, &[2, 2, 4]);
        b.rope_with(q, ids, RopeSpec { freq_factors: Some(vec![1.0; 3]), ..RopeSpec::neox(1e4) });
        assert!(b.finish().unwrap_err().to_string().contains("frequency factors"));
        assert!(RopeSpec::neox(1e4).is_plain_neox());
    }
}

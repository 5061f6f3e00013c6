//! Executable plans: a list of kernel steps over one planned arena.

use kiln_ir::{Bucket, DType, RopeSpec};

use crate::{RuntimeError, WeightId};

/// A region of the plan's arena, in 4-byte words (f32 or i32 elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// First word.
    pub offset: usize,
    /// Words reserved (for the bucket's full row count).
    pub len: usize,
}

/// How many rows a step processes when it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// The active rows of this run (the real length, at most the bucket's rows).
    Active,
    /// One row per sequence of the run (values derived from each sequence's last row; a single
    /// row when the run is one sequence).
    One,
}

/// One lowered, possibly fused, operation. Widths are elements per row.
#[derive(Clone, Debug, PartialEq)]
pub enum Kernel {
    /// `out[r] = table[ids[r]] * scale`; the table is gathered row by row from its packed form.
    Embed { table: WeightId, ids: Slot, out: Slot, width: usize, scale: f32 },
    /// `out[r] = rmsnorm(x[r]) * weight (+ residual[r])`; rows of `width` elements are normalised
    /// in groups of the weight's length (one group per head for q/k norms).
    RmsNorm { x: Slot, weight: WeightId, out: Slot, width: usize, eps: f32, residual: Option<Slot> },
    /// `out = x / rms(x)` over groups of `group` elements (no weight).
    Normalize { x: Slot, out: Slot, width: usize, group: usize, eps: f32 },
    /// `out = x * factor`.
    Scale { x: Slot, out: Slot, width: usize, factor: f32 },
    /// `out[r] = x[r] · Wᵀ` with W packed [n, k].
    MatMul { x: Slot, w: WeightId, out: Slot, k: usize, n: usize },
    /// `out[r] = argmax(x[r] · Wᵀ)` without materialising the products (greedy head).
    MatMulArgmax { x: Slot, w: WeightId, out: Slot, k: usize, n: usize },
    /// `out[r]` = the `count` largest of `x[r] · Wᵀ` and their indices, as `TopK` (sampling head).
    MatMulTopK { x: Slot, w: WeightId, out: Slot, k: usize, n: usize, count: usize, cap: Option<f32> },
    /// NeoX rotary embedding of `heads` heads of `head_dim` at `positions`.
    Rope { x: Slot, positions: Slot, out: Slot, heads: usize, head_dim: usize, theta: f32 },
    /// Causal attention over the KV cache of `layer` plus the new rows; appends the new rows.
    Attention {
        q: Slot,
        k: Slot,
        v: Slot,
        out: Slot,
        layer: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        window: Option<usize>,
        scale: f32,
    },
    /// `Attention` whose scaled scores are soft-capped: `softcap * tanh(s / softcap)` (Gemma 2).
    AttentionSoftCap {
        q: Slot,
        k: Slot,
        v: Slot,
        out: Slot,
        layer: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        window: Option<usize>,
        scale: f32,
        softcap: f32,
    },
    /// Rotary embedding with any pairing and frequency scaling (the plain `Rope` is unscaled NeoX).
    RopeScaled { x: Slot, positions: Slot, out: Slot, heads: usize, head_dim: usize, spec: RopeSpec },
    /// `out = a + b`.
    Add { a: Slot, b: Slot, out: Slot, width: usize },
    /// `out[r] = x[r] + bias` (a weight vector of `width` elements).
    AddBias { x: Slot, bias: WeightId, out: Slot, width: usize },
    /// `out = a * b`.
    Mul { a: Slot, b: Slot, out: Slot, width: usize },
    /// `out = gelu_tanh(x)`.
    Gelu { x: Slot, out: Slot, width: usize },
    /// `out = gelu_tanh(gate) * up` (fused gated MLP activation).
    GeluMul { gate: Slot, up: Slot, out: Slot, width: usize },
    /// `out = silu(x)`.
    Silu { x: Slot, out: Slot, width: usize },
    /// `out = silu(gate) * up` (fused SwiGLU activation).
    SiluMul { gate: Slot, up: Slot, out: Slot, width: usize },
    /// `out = cap * tanh(x / cap)`.
    SoftCap { x: Slot, out: Slot, width: usize, cap: f32 },
    /// `out[0] = x[active - 1]`.
    LastRow { x: Slot, out: Slot, width: usize },
    /// `out[r] = argmax(x[r])` (i32).
    Argmax { x: Slot, out: Slot, width: usize },
    /// `out[r]` = the `count` largest values of `x[r]` (largest first, the lower index first among
    /// equals; soft-capped by `cap`), then their indices as f32 (`kiln_ir::Op::TopK`).
    TopK { x: Slot, out: Slot, width: usize, count: usize, cap: Option<f32> },
    /// `out[r]` = the token drawn from `x[r]` (a top-k head's candidates or logits, `width` wide)
    /// by the draw the step carries for row r's sequence (i32; `kiln_ir::Op::Draw`).
    Draw { x: Slot, out: Slot, width: usize, among: kiln_ir::Among },
}

impl Kernel {
    /// The slots this kernel reads.
    pub fn reads(&self) -> Vec<Slot> {
        match *self {
            Kernel::Embed { ids, .. } => vec![ids],
            Kernel::RmsNorm { x, residual, .. } => std::iter::once(x).chain(residual).collect(),
            Kernel::Normalize { x, .. }
            | Kernel::Scale { x, .. }
            | Kernel::MatMul { x, .. }
            | Kernel::MatMulArgmax { x, .. }
            | Kernel::MatMulTopK { x, .. }
            | Kernel::AddBias { x, .. }
            | Kernel::Gelu { x, .. }
            | Kernel::Silu { x, .. }
            | Kernel::SoftCap { x, .. }
            | Kernel::LastRow { x, .. }
            | Kernel::Argmax { x, .. }
            | Kernel::TopK { x, .. }
            | Kernel::Draw { x, .. } => vec![x],
            Kernel::Rope { x, positions, .. } | Kernel::RopeScaled { x, positions, .. } => vec![x, positions],
            Kernel::Attention { q, k, v, .. } | Kernel::AttentionSoftCap { q, k, v, .. } => vec![q, k, v],
            Kernel::Add { a, b, .. } | Kernel::Mul { a, b, .. } => vec![a, b],
            Kernel::GeluMul { gate, up, .. } | Kernel::SiluMul { gate, up, .. } => vec![gate, up],
        }
    }

    /// The slot this kernel writes.
    pub fn out(&self) -> Slot {
        match *self {
            Kernel::Embed { out, .. }
            | Kernel::RmsNorm { out, .. }
            | Kernel::Normalize { out, .. }
            | Kernel::Scale { out, .. }
            | Kernel::MatMul { out, .. }
            | Kernel::MatMulArgmax { out, .. }
            | Kernel::MatMulTopK { out, .. }
            | Kernel::Rope { out, .. }
            | Kernel::RopeScaled { out, .. }
            | Kernel::Attention { out, .. }
            | Kernel::AttentionSoftCap { out, .. }
            | Kernel::Add { out, .. }
            | Kernel::AddBias { out, .. }
            | Kernel::Mul { out, .. }
            | Kernel::Gelu { out, .. }
            | Kernel::GeluMul { out, .. }
            | Kernel::Silu { out, .. }
            | Kernel::SiluMul { out, .. }
            | Kernel::SoftCap { out, .. }
            | Kernel::LastRow { out, .. }
            | Kernel::Argmax { out, .. }
            | Kernel::TopK { out, .. }
            | Kernel::Draw { out, .. } => out,
        }
    }
}

/// A kernel and how many rows it runs over.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// The kernel.
    pub kernel: Kernel,
    /// Its row count at run time.
    pub rows: Rows,
}

/// A named run-time input and where it goes.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanInput {
    /// Input name (`tokens` or `positions`).
    pub name: String,
    /// Where its values go.
    pub slot: Slot,
}

/// A named output and where to read it.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOutput {
    /// Output name.
    pub name: String,
    /// Where its values are.
    pub slot: Slot,
    /// Element type.
    pub dtype: DType,
    /// Elements per row.
    pub width: usize,
    /// Its row count.
    pub rows: Rows,
}

/// A compiled, device-independent plan for one bucket.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The bucket it was compiled for.
    pub bucket: Bucket,
    /// Steps in execution order.
    pub steps: Vec<Step>,
    /// Arena size in words.
    pub arena_words: usize,
    /// Run-time inputs.
    pub inputs: Vec<PlanInput>,
    /// Named outputs.
    pub outputs: Vec<PlanOutput>,
}

impl Plan {
    /// Most rows one run may process.
    pub fn rows(&self) -> usize {
        self.bucket.rows()
    }

    /// Checks that a batched step of `tokens` tokens, in consecutive runs of `rows[i]` rows for
    /// `caches` sequences, fits this plan (`Executable::run_batch`): at most the bucket's
    /// sequences, one row each in decode, at least one in prefill.
    pub fn check_batch(&self, tokens: usize, rows: &[usize], caches: usize) -> Result<(), RuntimeError> {
        let fits = match self.bucket {
            Bucket::Decode { seqs, .. } => rows.len() <= seqs && rows.iter().all(|&r| r == 1),
            Bucket::Prefill { seqs, .. } => rows.len() <= seqs && rows.iter().all(|&r| r >= 1),
        };
        if !fits || caches != rows.len() || rows.iter().sum::<usize>() != tokens {
            return Err(RuntimeError::StepShape(format!(
                "{tokens} tokens in sequences of {rows:?} rows for {caches} caches do not fit a {:?} plan",
                self.bucket
            )));
        }
        Ok(())
    }

    /// Whether the plan draws its next tokens (a [`Kernel::Draw`] step).
    pub fn draws(&self) -> bool {
        self.steps.iter().any(|s| matches!(s.kernel, Kernel::Draw { .. }))
    }

    /// Checks that a step of `seqs` sequences carries one draw each where the plan draws.
    pub fn check_draws(&self, draws: usize, seqs: usize) -> Result<(), RuntimeError> {
        if self.draws() && draws != seqs {
            return Err(RuntimeError::StepShape(format!(
                "a plan that draws its next tokens needs one draw per sequence: got {draws} for {seqs}"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(bucket: Bucket) -> Plan {
        Plan { bucket, steps: Vec::new(), arena_words: 0, inputs: Vec::new(), outputs: Vec::new() }
    }

    #[test]
    fn batched_steps_are_checked_against_the_bucket() {
        let decode = plan(Bucket::Decode { past: 64, seqs: 4 });
        assert!(decode.check_batch(3, &[1, 1, 1], 3).is_ok());
        for (tokens, rows, caches) in [(5, vec![1; 5], 5), (3, vec![1, 2], 2), (2, vec![1, 1], 3), (3, vec![1, 1], 2)] {
            let e = decode.check_batch(tokens, &rows, caches).unwrap_err().to_string();
            assert!(e.contains("do not fit") && e.contains("Decode"), "{e}");
        }
        let prefill = plan(Bucket::Prefill { rows: 16, seqs: 2 });
        assert!(prefill.check_batch(9, &[1, 8], 2).is_ok());
        assert!(prefill.check_batch(9, &[0, 9], 2).is_err());
        assert!(prefill.check_batch(9, &[3, 3, 3], 3).is_err());
    }
}

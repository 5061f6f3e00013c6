//! The compiler on small graphs against an in-memory GGUF: fusions, aliases, arena planning and
//! the errors that name what is wrong.

use std::sync::Arc;

use kiln_gguf::{GgufFile, GgufWriter};
use kiln_ir::{Among, Bucket, DType, Graph, GraphBuilder, RopeMode, RopeSpec, CANDIDATES};
use kiln_quant::GgmlType;
use kiln_runtime::{compile, Kernel, Plan, Rows, RuntimeError, Slot, WeightStore};

const ROWS: usize = 4;
const D: usize = 8;
const FF: usize = 16;
const VOCAB: usize = 10;

/// A weight store over an in-memory GGUF. Shapes are given as the graph sees them ([n, k] or
/// [k]); values are zero (the compiler never reads them).
fn store_with(tensors: &[(&str, &[usize], GgmlType)]) -> WeightStore {
    let mut w = GgufWriter::new(3).unwrap();
    for &(name, shape, ty) in tensors {
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect(); // ggml order
        let numel: usize = shape.iter().product();
        let bytes = numel / ty.block_size() * ty.type_size();
        w.add_tensor(name, &dims, ty, vec![0; bytes]).unwrap();
    }
    let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
    WeightStore::new(Arc::new(file)).unwrap()
}

fn f32_store(tensors: &[(&str, &[usize])]) -> WeightStore {
    let t: Vec<(&str, &[usize], GgmlType)> = tensors.iter().map(|&(n, s)| (n, s, GgmlType::F32)).collect();
    store_with(&t)
}

/// Embedding, gated MLP, residual norm, two reshapes, greedy head:
/// `argmax(last_row(reshape(reshape(x + rms_norm(down(gelu(gate(x)) * up(x)))))) · embᵀ)`.
fn fused_graph() -> Graph {
    let mut b = GraphBuilder::new(Bucket::Prefill { rows: ROWS, seqs: 1 });
    let tokens = b.input("tokens", DType::I32);
    let emb = b.weight("emb", &[VOCAB, D]);
    let x = b.embed(emb, tokens, 1.0);
    let (wg, wu, wd) = (b.weight("gate", &[FF, D]), b.weight("up", &[FF, D]), b.weight("down", &[D, FF]));
    let norm = b.weight("norm", &[D]);
    let g = b.matmul(x, wg);
    let u = b.matmul(x, wu);
    let a = b.gelu(g);
    let h = b.mul(a, u);
    let dn = b.matmul(h, wd);
    let y = b.rms_norm(dn, norm, 1e-6);
    let r = b.add(x, y);
    let r3 = b.reshape(r, &[ROWS, 2, D / 2]);
    let r2 = b.reshape(r3, &[ROWS, D]);
    let last = b.last_row(r2);
    let logits = b.matmul(last, emb);
    let next = b.argmax(logits);
    b.output("next_token", next);
    b.finish().unwrap()
}

fn fused_store() -> WeightStore {
    f32_store(&[("emb", &[VOCAB, D]), ("gate", &[FF, D]), ("up", &[FF, D]), ("down", &[D, FF]), ("norm", &[D])])
}

/// The slot a kernel writes.
fn out_slot(k: &Kernel) -> Slot {
    match *k {
        Kernel::Embed { out, .. }
        | Kernel::RmsNorm { out, .. }
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
        | Kernel::Normalize { out, .. }
        | Kernel::Scale { out, .. }
        | Kernel::LastRow { out, .. }
        | Kernel::Argmax { out, .. }
        | Kernel::TopK { out, .. }
        | Kernel::Draw { out, .. } => out,
    }
}

/// The slots a kernel reads.
fn read_slots(k: &Kernel) -> Vec<Slot> {
    match *k {
        Kernel::Embed { ids, .. } => vec![ids],
        Kernel::RmsNorm { x, residual, .. } => std::iter::once(x).chain(residual).collect(),
        Kernel::MatMul { x, .. } | Kernel::MatMulArgmax { x, .. } | Kernel::MatMulTopK { x, .. } => vec![x],
        Kernel::Rope { x, positions, .. } | Kernel::RopeScaled { x, positions, .. } => vec![x, positions],
        Kernel::Attention { q, k, v, .. } | Kernel::AttentionSoftCap { q, k, v, .. } => vec![q, k, v],
        Kernel::Add { a, b, .. } | Kernel::Mul { a, b, .. } => vec![a, b],
        Kernel::GeluMul { gate, up, .. } | Kernel::SiluMul { gate, up, .. } => vec![gate, up],
        Kernel::Gelu { x, .. }
        | Kernel::Silu { x, .. }
        | Kernel::SoftCap { x, .. }
        | Kernel::Normalize { x, .. }
        | Kernel::Scale { x, .. }
        | Kernel::AddBias { x, .. }
        | Kernel::LastRow { x, .. }
        | Kernel::Argmax { x, .. }
        | Kernel::TopK { x, .. }
        | Kernel::Draw { x, .. } => vec![x],
    }
}

fn overlap(a: Slot, b: Slot) -> bool {
    a.offset < b.offset + b.len && b.offset < a.offset + a.len
}

/// Checks the arena plan: every slot fits; no step's output overlaps what it reads; and every
/// value read (or handed back as an output) is still intact: nothing written after the value's
/// producer (the last earlier step writing exactly that slot, or a plan input) overlaps it.
fn check_arena(plan: &Plan) {
    let outs: Vec<Slot> = plan.steps.iter().map(|s| out_slot(&s.kernel)).collect();
    let reads = plan.steps.iter().flat_map(|s| read_slots(&s.kernel));
    let inputs = plan.inputs.iter().map(|i| i.slot);
    for s in outs.iter().copied().chain(reads).chain(inputs) {
        assert!(s.len > 0 && s.offset + s.len <= plan.arena_words, "{s:?} outside an arena of {}", plan.arena_words);
    }
    let intact = |slot: Slot, reader: usize, what: &str| {
        let producer = (0..reader).rev().find(|&i| outs[i] == slot);
        let first_after = match producer {
            Some(p) => p + 1,
            None => {
                assert!(plan.inputs.iter().any(|i| i.slot == slot), "{what}: {slot:?} is read but never written");
                0
            }
        };
        for (m, &o) in outs.iter().enumerate().take(reader).skip(first_after) {
            assert!(!overlap(o, slot), "{what}: step {m} clobbers {slot:?} (written to {o:?})");
        }
    };
    for (i, step) in plan.steps.iter().enumerate() {
        for r in read_slots(&step.kernel) {
            assert!(!overlap(outs[i], r), "step {i} ({:?}) writes over a slot it reads", step.kernel);
            intact(r, i, &format!("step {i}"));
        }
    }
    for o in &plan.outputs {
        intact(o.slot, plan.steps.len(), &format!("output '{}'", o.name));
    }
}

#[test]
fn fuses_gelu_mul_residual_norm_and_greedy_head() {
    let store = fused_store();
    let plan = compile(&fused_graph(), &store).unwrap();
    let k: Vec<&Kernel> = plan.steps.iter().map(|s| &s.kernel).collect();
    assert_eq!(k.len(), 8, "{k:#?}");
    let (emb, norm) = (store.id("emb").unwrap(), store.id("norm").unwrap());

    let Kernel::Embed { table, width: D, scale, .. } = *k[0] else { panic!("{:?}", k[0]) };
    assert_eq!((table, scale), (emb, 1.0));
    let Kernel::MatMul { out: gate_out, k: D, n: FF, .. } = *k[1] else { panic!("{:?}", k[1]) };
    let Kernel::MatMul { out: up_out, k: D, n: FF, .. } = *k[2] else { panic!("{:?}", k[2]) };
    // gelu(a) * b: one kernel reading the two products directly.
    let Kernel::GeluMul { gate, up, out: h, width: FF } = *k[3] else { panic!("{:?}", k[3]) };
    assert_eq!((gate, up), (gate_out, up_out));
    let Kernel::MatMul { x, out: down_out, k: FF, n: D, .. } = *k[4] else { panic!("{:?}", k[4]) };
    assert_eq!(x, h);
    // x + rms_norm(y): one norm with the embedding as its residual.
    let Kernel::RmsNorm { x, weight, out: normed, width: D, eps, residual: Some(res) } = *k[5] else { panic!("{:?}", k[5]) };
    assert_eq!((x, weight, eps, res), (down_out, norm, 1e-6, out_slot(k[0])));
    // Reshapes are aliases: the last row is read straight from the norm's output.
    let Kernel::LastRow { x, out: last, width: D } = *k[6] else { panic!("{:?}", k[6]) };
    assert_eq!(x, normed);
    // argmax(x · Wᵀ): one greedy-head kernel, no logits.
    let Kernel::MatMulArgmax { x, w, out: next, k: D, n: VOCAB } = *k[7] else { panic!("{:?}", k[7]) };
    assert_eq!((x, w), (last, emb));

    let rows: Vec<Rows> = plan.steps.iter().map(|s| s.rows).collect();
    assert_eq!(rows, [[Rows::Active; 6].as_slice(), &[Rows::One; 2]].concat());
    assert_eq!(plan.inputs.len(), 1);
    assert_eq!((plan.inputs[0].name.as_str(), plan.inputs[0].slot), ("tokens", read_slots(k[0])[0]));
    assert_eq!(plan.outputs.len(), 1);
    let o = &plan.outputs[0];
    assert_eq!((o.name.as_str(), o.slot, o.dtype, o.width, o.rows), ("next_token", next, DType::I32, 1, Rows::One));
    assert_eq!(plan.rows(), ROWS);
    check_arena(&plan);
    // Compiling is deterministic.
    assert_eq!(compile(&fused_graph(), &store).unwrap(), plan);
}

#[test]
fn fuses_with_operands_in_either_order() {
    let mut b = GraphBuilder::new(Bucket::Decode { past: 8, seqs: 1 });
    let tokens = b.input("tokens", DType::I32);
    let emb = b.weight("emb", &[VOCAB, D]);
    let norm = b.weight("norm", &[D]);
    let x = b.embed(emb, tokens, 2.0);
    let up = b.matmul(x, emb); // [1, VOCAB]: any two values of one shape will do
    let g = b.gelu(up);
    let m = b.mul(up, g); // gelu on the right
    let y = b.rms_norm(x, norm, 1e-5);
    let r = b.add(y, x); // norm on the left
    b.output("m", m);
    b.output("hidden", r);
    let plan = compile(&b.finish().unwrap(), &f32_store(&[("emb", &[VOCAB, D]), ("norm", &[D])])).unwrap();
    let k: Vec<&Kernel> = plan.steps.iter().map(|s| &s.kernel).collect();
    assert_eq!(k.len(), 4, "{k:#?}");
    let (x, product) = (out_slot(k[0]), out_slot(k[1]));
    assert!(matches!(*k[2], Kernel::GeluMul { gate, up, .. } if gate == product && up == product), "{:?}", k[2]);
    assert!(matches!(*k[3], Kernel::RmsNorm { x: nx, residual: Some(res), .. } if nx == x && res == x), "{:?}", k[3]);
    check_arena(&plan);
}

#[test]
fn values_used_elsewhere_are_not_fused() {
    // The gelu, the norm and the logits are also graph outputs: each must be materialised.
    let mut b = GraphBuilder::new(Bucket::Prefill { rows: ROWS, seqs: 1 });
    let tokens = b.input("tokens", DType::I32);
    let emb = b.weight("emb", &[VOCAB, D]);
    let norm = b.weight("norm", &[D]);
    let x = b.embed(emb, tokens, 1.0);
    let g = b.gelu(x);
    let m = b.mul(g, x);
    let y = b.rms_norm(m, norm, 1e-6);
    let r = b.add(m, y);
    let logits = b.matmul(r, emb);
    let next = b.argmax(logits);
    for (name, id) in [("gelu", g), ("norm", y), ("logits", logits), ("next_token", next)] {
        b.output(name, id);
    }
    let plan = compile(&b.finish().unwrap(), &f32_store(&[("emb", &[VOCAB, D]), ("norm", &[D])])).unwrap();
    let names: Vec<&str> = plan
        .steps
        .iter()
        .map(|s| match s.kernel {
            Kernel::Embed { .. } => "embed",
            Kernel::Gelu { .. } => "gelu",
            Kernel::Mul { .. } => "mul",
            Kernel::RmsNorm { residual: None, .. } => "norm",
            Kernel::Add { .. } => "add",
            Kernel::MatMul { .. } => "matmul",
            Kernel::Argmax { .. } => "argmax",
            ref other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(names, ["embed", "gelu", "mul", "norm", "add", "matmul", "argmax"]);
    assert_eq!(plan.outputs.len(), 4);
    check_arena(&plan);
}

#[test]
fn top_k_of_a_product_is_one_kernel_unless_the_product_is_used_elsewhere() {
    let store = f32_store(&[("emb", &[VOCAB, D])]);
    for logits_out in [false, true] {
        let mut b = GraphBuilder::new(Bucket::Decode { past: 8, seqs: 2 });
        let tokens = b.input("tokens", DType::I32);
        let emb = b.weight("emb", &[VOCAB, D]);
        let x = b.embed(emb, tokens, 1.0);
        let logits = b.matmul(x, emb);
        let top = b.top_k(logits, 5, Some(30.0));
        b.output("candidates", top);
        if logits_out {
            b.output("logits", logits);
        }
        let plan = compile(&b.finish().unwrap(), &store).unwrap();
        let o = &plan.outputs[0];
        assert_eq!((o.name.as_str(), o.dtype, o.width, o.rows), ("candidates", DType::F32, 10, Rows::Active));
        match (logits_out, &plan.steps[1].kernel, plan.steps.get(2).map(|s| &s.kernel)) {
            (false, &Kernel::MatMulTopK { w, k: D, n: VOCAB, count: 5, cap: Some(30.0), out, .. }, None) => {
                assert_eq!((w, out), (store.id("emb").unwrap(), o.slot));
            }
            (true, Kernel::MatMul { .. }, Some(&Kernel::TopK { width: VOCAB, count: 5, cap: Some(30.0), out, .. })) => {
                assert_eq!(out, o.slot)
            }
            (_, a, b) => panic!("logits out {logits_out}: {a:?}, {b:?}"),
        }
        check_arena(&plan);
    }
}

#[test]
fn a_draw_reads_the_fused_top_k_head_or_the_logits() {
    const WIDE: usize = 100;
    let store = f32_store(&[("emb", &[VOCAB, D]), ("head", &[WIDE, D])]);
    for among in [Among::Candidates, Among::Vocabulary] {
        let mut b = GraphBuilder::new(Bucket::Decode { past: 8, seqs: 2 });
        let tokens = b.input("tokens", DType::I32);
        let (emb, head) = (b.weight("emb", &[VOCAB, D]), b.weight("head", &[WIDE, D]));
        let x = b.embed(emb, tokens, 1.0);
        let logits = b.matmul(x, head);
        let x = if among == Among::Candidates { b.top_k(logits, CANDIDATES, None) } else { logits };
        let next = b.draw(x, among);
        b.output("next_token", next);
        let plan = compile(&b.finish().unwrap(), &store).unwrap();
        let o = &plan.outputs[0];
        assert_eq!((o.name.as_str(), o.dtype, o.width, o.rows), ("next_token", DType::I32, 1, Rows::Active));
        assert!(plan.draws());
        let kernels: Vec<&Kernel> = plan.steps.iter().map(|s| &s.kernel).collect();
        match (among, &kernels[1..]) {
            (Among::Candidates, [Kernel::MatMulTopK { count: CANDIDATES, out: top, .. }, Kernel::Draw { x, width, among, out }]) => {
                assert_eq!((x, *width, *among, *out), (top, 2 * CANDIDATES, Among::Candidates, o.slot))
            }
            (Among::Vocabulary, [Kernel::MatMul { out: l, .. }, Kernel::Draw { x, width: WIDE, among: Among::Vocabulary, out }]) => {
                assert_eq!((x, *out), (l, o.slot))
            }
            (_, k) => panic!("{among:?}: {k:?}"),
        }
        assert!(plan.check_draws(2, 2).is_ok());
        let e = plan.check_draws(1, 2).unwrap_err().to_string();
        assert!(e.contains("one draw per sequence: got 1 for 2"), "{e}");
        check_arena(&plan);
    }
}

/// One attention block: q/k/v projections, per-head q/k norms, rope, attention, output
/// projection, residual, and a final norm.
fn block_graph() -> Graph {
    let mut b = GraphBuilder::new(Bucket::Prefill { rows: ROWS, seqs: 1 });
    let tokens = b.input("tokens", DType::I32);
    let positions = b.input("positions", DType::I32);
    let emb = b.weight("emb", &[VOCAB, D]);
    let x = b.embed(emb, tokens, 1.0);
    let (wq, wk, wv, wo) = (b.weight("wq", &[D, D]), b.weight("wk", &[4, D]), b.weight("wv", &[4, D]), b.weight("wo", &[D, D]));
    let head_norm = b.weight("head_norm", &[4]);
    let q = b.matmul(x, wq);
    let q = b.reshape(q, &[ROWS, 2, 4]);
    let q = b.rms_norm(q, head_norm, 1e-6);
    let q = b.rope(q, positions, 10000.0);
    let k = b.matmul(x, wk);
    let k = b.reshape(k, &[ROWS, 1, 4]);
    let k = b.rms_norm(k, head_norm, 1e-6);
    let k = b.rope(k, positions, 10000.0);
    let v = b.matmul(x, wv);
    let v = b.reshape(v, &[ROWS, 1, 4]);
    let att = b.attention(q, k, v, 0, Some(3), 0.5);
    let o = b.matmul(att, wo);
    let h = b.add(x, o);
    let fin = b.weight("final_norm", &[D]);
    let out = b.rms_norm(h, fin, 1e-6);
    b.output("hidden", out);
    b.finish().unwrap()
}

#[test]
fn no_step_overwrites_a_value_still_needed() {
    let store = f32_store(&[
        ("emb", &[VOCAB, D]),
        ("wq", &[D, D]),
        ("wk", &[4, D]),
        ("wv", &[4, D]),
        ("wo", &[D, D]),
        ("head_norm", &[4]),
        ("final_norm", &[D]),
    ]);
    let plan = compile(&block_graph(), &store).unwrap();
    let attention = plan.steps.iter().find_map(|s| match s.kernel {
        Kernel::Attention { layer, q_heads, kv_heads, head_dim, window, scale, .. } => {
            Some((layer, q_heads, kv_heads, head_dim, window, scale))
        }
        _ => None,
    });
    assert_eq!(attention, Some((0, 2, 1, 4, Some(3), 0.5)));
    // The per-head norms normalise rows of all heads in groups of the head size.
    let norm_widths: Vec<usize> = plan
        .steps
        .iter()
        .filter_map(|s| match s.kernel {
            Kernel::RmsNorm { width, .. } => Some(width),
            _ => None,
        })
        .collect();
    assert_eq!(norm_widths, [8, 4, D]);
    assert_eq!(plan.inputs.iter().map(|i| i.name.as_str()).collect::<Vec<_>>(), ["tokens", "positions"]);
    check_arena(&plan);
}

#[test]
fn lowers_bias_silu_soft_capping_and_scaled_rope() {
    // q = rope_norm(x·Wqᵀ + b), attention soft-capped at 50, silu(x)·x fused, logits capped at 30.
    let mut b = GraphBuilder::new(Bucket::Prefill { rows: ROWS, seqs: 1 });
    let tokens = b.input("tokens", DType::I32);
    let positions = b.input("positions", DType::I32);
    let emb = b.weight("emb", &[VOCAB, D]);
    let x = b.embed(emb, tokens, 1.0);
    let (wq, bq) = (b.weight("wq", &[D, D]), b.weight("bq", &[D]));
    let q = b.matmul(x, wq);
    let q = b.add_bias(q, bq);
    let q = b.reshape(q, &[ROWS, 2, 4]);
    let spec = RopeSpec { theta: 5e5, mode: RopeMode::Norm, freq_scale: 0.25, freq_factors: Some(vec![1.0, 8.0]) };
    let qr = b.rope_with(q, positions, spec.clone());
    let plain = b.rope_with(q, positions, RopeSpec::neox(1e4));
    let att = b.attention_capped(qr, plain, plain, 0, None, 0.5, Some(50.0));
    let s = b.silu(att);
    let m = b.mul(s, x);
    let logits = b.matmul(m, emb);
    let capped = b.soft_cap(logits, 30.0);
    let v = b.reshape(x, &[ROWS, 2, 4]);
    let vn = b.normalize(v, 1e-6);
    let scaled = b.scale(capped, 0.5);
    b.output("logits", scaled);
    b.output("v", vn);
    let plan = compile(&b.finish().unwrap(), &f32_store(&[("emb", &[VOCAB, D]), ("wq", &[D, D]), ("bq", &[D])])).unwrap();
    let k: Vec<&Kernel> = plan.steps.iter().map(|s| &s.kernel).collect();
    assert_eq!(k.len(), 11, "{k:#?}");
    let bias = plan.steps.iter().find_map(|s| match s.kernel {
        Kernel::AddBias { x, width, .. } => Some((x, width)),
        _ => None,
    });
    assert_eq!(bias, Some((out_slot(k[1]), D)));
    assert!(matches!(k[3], Kernel::RopeScaled { heads: 2, head_dim: 4, spec: s, .. } if *s == spec), "{:?}", k[3]);
    assert!(matches!(*k[4], Kernel::Rope { heads: 2, head_dim: 4, theta: 1e4, .. }), "{:?}", k[4]);
    assert!(matches!(*k[5], Kernel::AttentionSoftCap { softcap: 50.0, scale: 0.5, .. }), "{:?}", k[5]);
    let Kernel::SiluMul { gate, up, .. } = *k[6] else { panic!("{:?}", k[6]) };
    assert_eq!((gate, up), (out_slot(k[5]), out_slot(k[0])));
    assert!(matches!(*k[7], Kernel::MatMul { .. }), "{:?}", k[7]);
    assert!(matches!(*k[8], Kernel::SoftCap { cap: 30.0, width: VOCAB, x, .. } if x == out_slot(k[7])), "{:?}", k[8]);
    // The value norm normalises each head of 4 on its own; the scale multiplies the capped logits.
    assert!(matches!(*k[9], Kernel::Normalize { width: D, group: 4, x, .. } if x == out_slot(k[0])), "{:?}", k[9]);
    assert!(matches!(*k[10], Kernel::Scale { factor: 0.5, width: VOCAB, x, .. } if x == out_slot(k[8])), "{:?}", k[10]);
    check_arena(&plan);
}

/// tokens -> embed -> six matmuls, as a graph of `bucket`, and its plan.
fn chain(bucket: Bucket) -> (Graph, Plan) {
    let mut b = GraphBuilder::new(bucket);
    let tokens = b.input("tokens", DType::I32);
    let emb = b.weight("emb", &[VOCAB, D]);
    let w = b.weight("w", &[D, D]);
    let mut x = b.embed(emb, tokens, 1.0);
    for _ in 0..6 {
        x = b.matmul(x, w);
    }
    b.output("hidden", x);
    let graph = b.finish().unwrap();
    let plan = compile(&graph, &f32_store(&[("emb", &[VOCAB, D]), ("w", &[D, D])])).unwrap();
    (graph, plan)
}

#[test]
fn a_chain_reuses_arena_memory() {
    // At most two activations are live at any step of a prompt's chain.
    let (graph, plan) = chain(Bucket::Prefill { rows: ROWS, seqs: 1 });
    assert_eq!(plan.steps.len(), 7);
    let sum: usize = graph.nodes().iter().filter(|n| !matches!(n.op, kiln_ir::Op::Weight { .. })).map(|n| n.numel()).sum();
    assert_eq!(sum, ROWS + 7 * ROWS * D);
    assert!(plan.arena_words < sum, "arena {} words, values {sum}", plan.arena_words);
    assert!(plan.arena_words <= 2 * ROWS * D + ROWS, "arena {} words", plan.arena_words);
    check_arena(&plan);
}

#[test]
fn a_decode_chain_keeps_each_value_four_steps_past_its_last_reader() {
    // The chain as a one-row decode step: no step writes over what any of the 4 steps before it
    // (or itself) read, so a backend may fuse 5 consecutive steps.
    let (_, plan) = chain(Bucket::Decode { past: 8, seqs: 1 });
    for (j, st) in plan.steps.iter().enumerate() {
        for earlier in &plan.steps[j.saturating_sub(4)..=j] {
            for r in earlier.kernel.reads() {
                assert!(!overlap(st.kernel.out(), r), "step {j} writes {:?} over {r:?}", st.kernel.out());
            }
        }
    }
    check_arena(&plan);
}

#[test]
fn a_missing_weight_is_named() {
    let store = f32_store(&[("emb", &[VOCAB, D]), ("gate", &[FF, D]), ("up", &[FF, D]), ("norm", &[D])]);
    let err = compile(&fused_graph(), &store).unwrap_err();
    assert!(matches!(&err, RuntimeError::MissingWeight(name) if name == "down"), "{err:?}");
    assert!(err.to_string().contains("'down'"), "{err}");
}

#[test]
fn a_weight_of_the_wrong_shape_names_both_shapes() {
    let store = f32_store(&[("emb", &[VOCAB, D]), ("gate", &[FF, D]), ("up", &[FF + 1, D]), ("down", &[D, FF]), ("norm", &[D])]);
    let err = compile(&fused_graph(), &store).unwrap_err();
    match &err {
        RuntimeError::WeightShape { name, expected, found } => {
            assert_eq!((name.as_str(), expected.as_slice(), found.as_slice()), ("up", [FF, D].as_slice(), [FF + 1, D].as_slice()));
        }
        other => panic!("{other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("'up'") && msg.contains("[16, 8]") && msg.contains("[17, 8]"), "{msg}");

    // A matrix where the graph wants a vector.
    let store = f32_store(&[("emb", &[VOCAB, D]), ("gate", &[FF, D]), ("up", &[FF, D]), ("down", &[D, FF]), ("norm", &[1, D])]);
    let err = compile(&fused_graph(), &store).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::WeightShape { name, expected, found } if name == "norm" && *expected == [D] && *found == [1, D]),
        "{err:?}"
    );
}

#[test]
fn a_weight_kiln_cannot_compute_with_is_rejected() {
    // IQ2_XXS data of the right size for a [2, 256] matrix: a valid file, but no codec.
    let mut b = GraphBuilder::new(Bucket::Decode { past: 4, seqs: 1 });
    let tokens = b.input("tokens", DType::I32);
    let emb = b.weight("token_embd.weight", &[2, 256]);
    let x = b.embed(emb, tokens, 1.0);
    b.output("hidden", x);
    let store = store_with(&[("token_embd.weight", &[2, 256], GgmlType::IQ2_XXS)]);
    assert_eq!(store.bytes(store.id("token_embd.weight").unwrap()).len(), 2 * 66);
    let err = compile(&b.finish().unwrap(), &store).unwrap_err();
    assert!(matches!(&err, RuntimeError::UnsupportedWeightType { name, ty: GgmlType::IQ2_XXS } if name == "token_embd.weight"), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("token_embd.weight") && msg.contains("IQ2_XXS"), "{msg}");
}

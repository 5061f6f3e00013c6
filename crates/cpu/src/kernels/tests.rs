//! Kernel tests: every computable weight format, every instruction set this CPU runs, pools of one
//! and three threads, each compared with a naive f64 reference.

use kiln_ir::{RopeMode, RopeSpec};
use kiln_quant::{dequantize, quantize, GgmlType};
use kiln_runtime::{KvLayout, LayerKv};

use super::*;
use crate::kv::CpuKvCache;

/// xorshift64: a tiny deterministic generator.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

/// A one-thread pool (everything on the caller) and a three-thread one (work split across tasks).
fn pools() -> [ThreadPool; 2] {
    [ThreadPool::new(1), ThreadPool::new(3)]
}

/// Every format the kernels can compute with.
fn computable_types() -> Vec<GgmlType> {
    GgmlType::ALL.iter().copied().filter(|t| t.can_dequantize()).collect()
}

/// Row lengths of one or a few blocks (odd lengths for the unblocked float formats).
fn row_lengths(ty: GgmlType) -> Vec<usize> {
    match ty.block_size() {
        1 => vec![1, 7, 45],
        32 => vec![32, 96],
        bs => vec![bs, 2 * bs],
    }
}

const NS: [usize; 4] = [1, 5, 37, 131];
const ROWS: [usize; 3] = [1, 3, 7];

/// `n` random rows of `k` weights stored as `ty`, and their exact dequantized values.
struct Weights {
    packed: Vec<u8>,
    deq: Vec<f32>,
}

fn random_weights(rng: &mut Rng, ty: GgmlType, k: usize, n: usize) -> Weights {
    let w = rng.vec(k * n);
    let packed = quantize(ty, &w).unwrap_or_else(|e| panic!("{ty}: {e}"));
    let mut deq = vec![0f32; k * n];
    dequantize(ty, &packed, &mut deq).unwrap();
    Weights { packed, deq }
}

/// `(x · Wᵀ, |x| · |W|ᵀ)` in f64, `rows × n` each.
fn reference_matmul(deq: &[f32], x: &[f32], rows: usize, k: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut value = vec![0f64; rows * n];
    let mut magnitude = vec![0f64; rows * n];
    for r in 0..rows {
        for j in 0..n {
            for i in 0..k {
                let p = deq[j * k + i] as f64 * x[r * k + i] as f64;
                value[r * n + j] += p;
                magnitude[r * n + j] += p.abs();
            }
        }
    }
    (value, magnitude)
}

/// The f32 kernels may differ from the f64 sum by rounding only: a small fraction of the sum of
/// the products' magnitudes (a wrong row, element or scale is off by far more).
fn close(got: f32, want: f64, magnitude: f64) -> bool {
    (got as f64 - want).abs() <= REL_TOL * magnitude + 1e-30
}

/// Error allowed relative to the sum of the products' magnitudes.
const REL_TOL: f64 = 2e-6;

const SENTINEL: f32 = 12345.5;

#[test]
fn every_computable_format_is_covered() {
    use GgmlType as T;
    let expected =
        [T::F32, T::F16, T::Q4_0, T::Q4_1, T::Q5_0, T::Q5_1, T::Q8_0, T::Q2_K, T::Q3_K, T::Q4_K, T::Q5_K, T::Q6_K, T::Q8_K, T::BF16];
    assert_eq!(computable_types(), expected);
}

#[test]
fn matmul_matches_f64_for_every_format_isa_and_pool() {
    let mut rng = Rng(0x243f_6a88_85a3_08d3);
    let pools = pools();
    let mut checked = 0;
    for ty in computable_types() {
        for k in row_lengths(ty) {
            for n in NS {
                let w = random_weights(&mut rng, ty, k, n);
                let m = PackedMatrix::from_bytes(&w.packed, ty, k, n);
                for rows in ROWS {
                    let x = rng.vec(rows * k);
                    let (want, mag) = reference_matmul(&w.deq, &x, rows, k, n);
                    for isa in Isa::supported() {
                        for pool in &pools {
                            let mut out = vec![SENTINEL; rows * n + 3];
                            matmul(pool, isa, &x, rows, &m, &mut out);
                            let what = format!("{ty} k={k} n={n} rows={rows} {isa:?} threads={}", pool.threads());
                            for e in 0..rows * n {
                                assert!(close(out[e], want[e], mag[e]), "{what}: out[{e}] = {} want {}", out[e], want[e]);
                            }
                            assert_eq!(out[rows * n..], [SENTINEL; 3], "{what}: wrote past the output");
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(checked >= 14 * 2 * NS.len() * ROWS.len() * 2);
}

/// The reference argmax of each row, after checking that it is unambiguous: the best product
/// beats the runner-up by several times the rounding error `close` allows, so any kernel within
/// that error must pick it.
fn unambiguous_argmax(want: &[f64], mag: &[f64], rows: usize, n: usize) -> Vec<i32> {
    (0..rows)
        .map(|r| {
            let row = &want[r * n..(r + 1) * n];
            let best = (0..n).fold(0, |b, j| if row[j] > row[b] { j } else { b });
            let runner_up = (0..n).filter(|&j| j != best).map(|j| row[j]).fold(f64::NEG_INFINITY, f64::max);
            let margin = 4.0 * REL_TOL * mag[r * n..(r + 1) * n].iter().copied().fold(0.0, f64::max);
            assert!(row[best] - runner_up > margin, "test input has a near tie in row {r}");
            best as i32
        })
        .collect()
}

#[test]
fn matmul_argmax_matches_f64_for_every_format_isa_and_pool() {
    let mut rng = Rng(0x1319_8a2e_0370_7344);
    let pools = pools();
    for ty in computable_types() {
        for k in row_lengths(ty) {
            for n in NS {
                let w = random_weights(&mut rng, ty, k, n);
                let m = PackedMatrix::from_bytes(&w.packed, ty, k, n);
                for rows in ROWS {
                    // Each activation row is a weight row plus noise: that row's product stands out.
                    let mut x = rng.vec(rows * k);
                    for r in 0..rows {
                        let t = (r * 29 + n / 2) % n;
                        for i in 0..k {
                            x[r * k + i] = w.deq[t * k + i] + 0.1 * x[r * k + i];
                        }
                    }
                    let (want, mag) = reference_matmul(&w.deq, &x, rows, k, n);
                    let expected = unambiguous_argmax(&want, &mag, rows, n);
                    for isa in Isa::supported() {
                        for pool in &pools {
                            let mut out = vec![-7; rows + 2];
                            matmul_argmax(pool, isa, &x, rows, &m, &mut out);
                            let what = format!("{ty} k={k} n={n} rows={rows} {isa:?} threads={}", pool.threads());
                            assert_eq!(out[..rows], expected, "{what}");
                            assert_eq!(out[rows..], [-7, -7], "{what}: wrote past the output");
                        }
                    }
                }
            }
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    quantize(GgmlType::F32, v).unwrap()
}

#[test]
fn matmul_argmax_takes_the_lowest_index_among_equal_maxima() {
    // 131 rows: with three threads the equal rows 5, 6 and 100 fall in different tiles and tasks.
    let (k, n) = (13, 131);
    let mut rng = Rng(0xa409_3822_299f_31d0);
    let mut w: Vec<f32> = rng.vec(k * n).iter().map(|v| v * 0.5).collect();
    let best: Vec<f32> = (0..k).map(|i| 1.0 + i as f32 * 0.25).collect();
    for j in [100, 6, 5] {
        w[j * k..(j + 1) * k].copy_from_slice(&best);
    }
    let bytes = f32_bytes(&w);
    let m = PackedMatrix::from_bytes(&bytes, GgmlType::F32, k, n);
    let x: Vec<f32> = best.iter().chain(&best).copied().collect();
    for isa in Isa::supported() {
        for pool in &pools() {
            let mut out = [0i32; 2];
            matmul_argmax(pool, isa, &x, 2, &m, &mut out);
            assert_eq!(out, [5, 5], "{isa:?} threads={}", pool.threads());
        }
    }
}

#[test]
fn matmul_argmax_reports_non_finite_products() {
    let (k, n, rows) = (9, 131, 3);
    let mut rng = Rng(0x082e_fa98_ec4e_6c89);
    let base = rng.vec(k * n);
    // Positive activations so that huge finite weights overflow to +inf.
    let x: Vec<f32> = rng.vec(rows * k).iter().map(|v| 0.75 + v / 4.0).collect();
    let pools = pools();
    let run = |ty: GgmlType, w: &[f32]| -> Vec<Vec<i32>> {
        let bytes = quantize(ty, w).unwrap();
        let m = PackedMatrix::from_bytes(&bytes, ty, k, n);
        let mut all = Vec::new();
        for isa in Isa::supported() {
            for pool in &pools {
                let mut out = vec![0i32; rows];
                matmul_argmax(pool, isa, &x, rows, &m, &mut out);
                all.push(out);
            }
        }
        all
    };
    // Control: the finite matrix has an answer.
    for out in run(GgmlType::F32, &base) {
        assert!(out.iter().all(|&o| (0..n as i32).contains(&o)), "{out:?}");
    }
    let cases: [(GgmlType, f32, usize); 6] = [
        (GgmlType::F32, f32::NAN, 0),
        (GgmlType::F32, f32::NAN, 64),
        (GgmlType::F32, f32::NAN, n - 1),
        (GgmlType::F32, f32::INFINITY, 77),
        (GgmlType::F16, f32::NEG_INFINITY, 130),
        (GgmlType::F32, 3e38, 33), // finite weights whose products overflow
    ];
    for (ty, bad, j) in cases {
        let mut w = base.clone();
        w[j * k + 4] = bad;
        if bad.is_finite() {
            w[j * k..(j + 1) * k].fill(bad);
        }
        for out in run(ty, &w) {
            assert_eq!(out, [-1; 3], "{ty} row {j} holds {bad}");
        }
    }
}

/// [`attention`] of one sequence's `rows` new rows.
#[allow(clippy::too_many_arguments)]
fn attend(
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
    attention(pool, isa, &mut [AttentionSegment { q, k_new, v_new, rows, start, layer, out }], shape, softcap);
}

/// Naive causal attention in f64: `len` rows at positions `0..len`, every key/value row of a
/// position visible when it is within the window.
#[allow(clippy::too_many_arguments)]
fn reference_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    window: Option<usize>,
    scale: f32,
) -> Vec<f64> {
    reference_attention_capped(q, k, v, len, q_heads, kv_heads, d, window, scale, None)
}

/// [`reference_attention`] with soft-capped scores: `cap * tanh(s / cap)`.
#[allow(clippy::too_many_arguments)]
fn reference_attention_capped(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    window: Option<usize>,
    scale: f32,
    softcap: Option<f32>,
) -> Vec<f64> {
    let group = q_heads / kv_heads;
    let mut out = vec![0f64; len * q_heads * d];
    for p in 0..len {
        for h in 0..q_heads {
            let g = h / group;
            let visible: Vec<usize> = (0..=p).filter(|&s| window.is_none_or(|w| p - s < w)).collect();
            let qh = &q[(p * q_heads + h) * d..][..d];
            let scores: Vec<f64> = visible
                .iter()
                .map(|&s| {
                    let ks = &k[(s * kv_heads + g) * d..][..d];
                    let s = qh.iter().zip(ks).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64;
                    softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh())
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            let o = &mut out[(p * q_heads + h) * d..][..d];
            for (&s, &wt) in visible.iter().zip(&e) {
                let vs = &v[(s * kv_heads + g) * d..][..d];
                for (o, x) in o.iter_mut().zip(vs) {
                    *o += wt / sum * *x as f64;
                }
            }
        }
    }
    out
}

#[test]
fn attention_matches_f64_in_one_chunk_and_in_several() {
    let (len, d, q_heads, scale) = (10, 8, 4, 0.6);
    let mut rng = Rng(0x4528_21e6_38d0_1377);
    let chunkings: [&[usize]; 4] = [&[10], &[5, 1, 4], &[1; 10], &[3, 7]];
    let pools = pools();
    for kv_heads in [2, 1] {
        for window in [None, Some(3)] {
            let q: Vec<f32> = rng.vec(len * q_heads * d).iter().map(|v| v * 2.0).collect();
            let k: Vec<f32> = rng.vec(len * kv_heads * d).iter().map(|v| v * 2.0).collect();
            let v = rng.vec(len * kv_heads * d);
            let want = reference_attention(&q, &k, &v, len, q_heads, kv_heads, d, window, scale);
            let spec = LayerKv { kv_heads, head_dim_k: d, head_dim_v: d, window };
            let shape = AttentionShape { q_heads, kv_heads, head_dim: d, window, scale };
            let (qw, kw) = (q_heads * d, kv_heads * d);
            for isa in Isa::supported() {
                for pool in &pools {
                    let mut one_chunk: Option<Vec<f32>> = None;
                    for chunks in chunkings {
                        let what = format!("kv_heads={kv_heads} window={window:?} {isa:?} threads={} chunks={chunks:?}", pool.threads());
                        let mut cache = CpuKvCache::new(&KvLayout { layers: vec![spec], context: 64, elem: KvType::F32 });
                        let layer = cache.layer_mut(0).unwrap();
                        let mut out = vec![f32::NAN; len * qw];
                        let mut start = 0;
                        for &rows in chunks {
                            let (a, b) = (start, start + rows);
                            attend(
                                pool,
                                isa,
                                &q[a * qw..b * qw],
                                &k[a * kw..b * kw],
                                &v[a * kw..b * kw],
                                rows,
                                start,
                                layer,
                                shape,
                                None,
                                &mut out[a * qw..b * qw],
                            );
                            start = b;
                            assert_eq!(layer.len(), start, "{what}");
                        }
                        for (e, (&got, &w)) in out.iter().zip(&want).enumerate() {
                            assert!((got as f64 - w).abs() < 1e-5, "{what}: out[{e}] = {got} want {w}");
                        }
                        // Cached rows are the same floats as new ones: chunking changes nothing.
                        match &one_chunk {
                            None => one_chunk = Some(out),
                            Some(first) => assert_eq!(&out, first, "{what}"),
                        }
                        // The layer holds the last positions (a ring of `window` rows when sliding).
                        let kept = window.map_or(0, |w| len - w);
                        let mut row = vec![0f32; kw];
                        for p in kept..len {
                            layer.k_row(p).read_f32(isa, 0..kw, &mut row);
                            assert_eq!(row, &k[p * kw..(p + 1) * kw], "{what}: key of position {p}");
                            layer.v_row(p).read_f32(isa, 0..kw, &mut row);
                            assert_eq!(row, &v[p * kw..(p + 1) * kw], "{what}: value of position {p}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn attention_over_several_key_blocks_matches_f64_on_odd_sizes() {
    // Longer than a few key blocks, odd head sizes, groups wider than one query tile, and chunkings
    // that cut blocks anywhere: every chunking gives the same bits. With an f16 cache, the keys and
    // values the reference sees are the f16-rounded ones, the step's own rows included.
    let len = 3 * KEY_BLOCK + 7;
    let mut rng = Rng(0x0dd5_12e5);
    let chunkings: [&[usize]; 3] = [&[len], &[KEY_BLOCK + 5, 1, 2 * KEY_BLOCK + 1], &[13; 8]];
    let rounded = |x: &[f32]| -> Vec<f32> { x.iter().map(|&x| kiln_quant::f16_to_f32(kiln_quant::f32_to_f16(x))).collect() };
    for (q_heads, kv_heads, d, window) in [(6, 2, 13, None), (5, 1, 37, Some(KEY_BLOCK + 3)), (3, 3, 9, Some(50)), (9, 1, 24, None)] {
        let q: Vec<f32> = rng.vec(len * q_heads * d).iter().map(|v| v * 3.0).collect();
        let k: Vec<f32> = rng.vec(len * kv_heads * d).iter().map(|v| v * 3.0).collect();
        let v = rng.vec(len * kv_heads * d);
        let scale = 1.0 / (d as f32).sqrt();
        let spec = LayerKv { kv_heads, head_dim_k: d, head_dim_v: d, window };
        let shape = AttentionShape { q_heads, kv_heads, head_dim: d, window, scale };
        let (qw, kw) = (q_heads * d, kv_heads * d);
        for (elem, isa) in [KvType::F32, KvType::F16].into_iter().flat_map(|e| Isa::supported().into_iter().map(move |i| (e, i))) {
            let want = match elem {
                KvType::F32 => reference_attention(&q, &k, &v, len, q_heads, kv_heads, d, window, scale),
                KvType::F16 => reference_attention(&q, &rounded(&k), &rounded(&v), len, q_heads, kv_heads, d, window, scale),
            };
            for pool in &pools() {
                let mut first: Option<Vec<f32>> = None;
                for chunks in chunkings {
                    let what = format!(
                        "heads {q_heads}/{kv_heads} d={d} window={window:?} {elem:?} {isa:?} threads={} chunks={chunks:?}",
                        pool.threads()
                    );
                    let mut cache = CpuKvCache::new(&KvLayout { layers: vec![spec], context: len, elem });
                    let layer = cache.layer_mut(0).unwrap();
                    let mut out = vec![f32::NAN; len * qw];
                    let mut start = 0;
                    for &rows in chunks {
                        if start == len {
                            break;
                        }
                        let (a, b) = (start, (start + rows).min(len));
                        let (qs, ks, vs) = (&q[a * qw..b * qw], &k[a * kw..b * kw], &v[a * kw..b * kw]);
                        attend(pool, isa, qs, ks, vs, b - a, start, layer, shape, None, &mut out[a * qw..b * qw]);
                        start = b;
                    }
                    assert_eq!(start, len, "{what}");
                    for (e, (&got, &w)) in out.iter().zip(&want).enumerate() {
                        assert!((got as f64 - w).abs() < 1e-5, "{what}: out[{e}] = {got} want {w}");
                    }
                    match &first {
                        None => first = Some(out),
                        Some(f) => assert_eq!(&out, f, "{what}"),
                    }
                }
            }
        }
    }
}

#[test]
fn attention_of_the_first_position_returns_its_value() {
    // One visible key: the softmax weight is exactly 1 whatever the scores.
    let (q_heads, kv_heads, d) = (4, 2, 8);
    let q: Vec<f32> = (0..q_heads * d).map(|i| i as f32 * 10.0).collect();
    let k: Vec<f32> = (0..kv_heads * d).map(|i| i as f32).collect();
    let v: Vec<f32> = (0..kv_heads * d).map(|i| 100.0 + i as f32).collect();
    let spec = LayerKv { kv_heads, head_dim_k: d, head_dim_v: d, window: Some(3) };
    let mut cache = CpuKvCache::new(&KvLayout { layers: vec![spec], context: 4, elem: KvType::F32 });
    let mut out = vec![0f32; q_heads * d];
    let shape = AttentionShape { q_heads, kv_heads, head_dim: d, window: Some(3), scale: 1.0 };
    attend(&ThreadPool::new(1), Isa::Scalar, &q, &k, &v, 1, 0, cache.layer_mut(0).unwrap(), shape, None, &mut out);
    // Query heads 0, 1 share kv head 0; heads 2, 3 share kv head 1.
    for h in 0..q_heads {
        assert_eq!(out[h * d..(h + 1) * d], v[(h / 2) * d..(h / 2 + 1) * d], "head {h}");
    }
}

#[test]
fn embed_gathers_scaled_rows() {
    // Row r of the F32 table is [10r, 10r + 1, 10r + 2].
    let table: Vec<f32> = (0..4).flat_map(|r| (0..3).map(move |c| (10 * r + c) as f32)).collect();
    let bytes = f32_bytes(&table);
    let m = PackedMatrix::from_bytes(&bytes, GgmlType::F32, 3, 4);
    let mut out = [0f32; 9];
    embed(&m, &[2, 0, 3], 0.5, &mut out);
    assert_eq!(out, [10.0, 10.5, 11.0, 0.0, 0.5, 1.0, 15.0, 15.5, 16.0]);

    // A quantized table gathers its exactly dequantized rows.
    let mut rng = Rng(0xbe54_66cf_34e9_0c6c);
    let w = random_weights(&mut rng, GgmlType::Q4_K, 256, 5);
    let m = PackedMatrix::from_bytes(&w.packed, GgmlType::Q4_K, 256, 5);
    let mut out = vec![0f32; 2 * 256];
    embed(&m, &[4, 1], 2.0, &mut out);
    let want: Vec<f32> = w.deq[4 * 256..5 * 256].iter().chain(&w.deq[256..2 * 256]).map(|v| v * 2.0).collect();
    assert_eq!(out, want);
}

#[test]
fn rms_norm_normalises_each_group_separately() {
    // Two rows of three heads of two elements, one weight vector per head (q/k norms).
    let x = [3.0, 4.0, 1.0, -1.0, 0.0, 2.0, /* row 1 */ 6.0, 8.0, -2.0, 0.0, 5.0, 5.0];
    let w = [1.0, 0.5];
    let mut out = [f32::NAN; 12];
    rms_norm(&x, &w, 0.0, None, &mut out);
    let (r0, r2, r3) = (12.5f32.sqrt(), 2f32.sqrt(), 50f32.sqrt()); // rms of (3, 4), (0, 2), (6, 8)
    let want = [3.0 / r0, 2.0 / r0, 1.0, -0.5, 0.0, 1.0 / r2, 6.0 / r3, 4.0 / r3, -r2, 0.0, 1.0, 0.5];
    for (i, (o, w)) in out.iter().zip(want).enumerate() {
        assert!((o - w).abs() < 1e-6, "out[{i}] = {o} want {w}");
    }
    // eps is added to the mean square: (1, 1) with eps 3 has rms 2.
    let mut out = [0f32; 2];
    rms_norm(&[1.0, 1.0], &[1.0, 4.0], 3.0, None, &mut out);
    assert_eq!(out, [0.5, 2.0]);
    // With a residual, per group.
    let mut out = [0f32; 4];
    rms_norm(&[2.0, 2.0, -5.0, 5.0], &[1.0, 1.0], 0.0, Some(&[1.0, 2.0, 3.0, 4.0]), &mut out);
    assert_eq!(out, [2.0, 3.0, 2.0, 5.0]);
}

#[test]
fn rope_rotates_every_head_by_its_position() {
    // head_dim 2: one pair per head, frequency 1, so position p rotates by p radians.
    let x = [1.0, 0.0, 0.0, 1.0, /* row 1 */ 1.0, 0.0, 2.0, 0.0];
    let mut out = [f32::NAN; 8];
    rope_mode(&x, &RopeTable::with_spec(&[0, 3], 2, &RopeSpec::neox(10000.0)), 0, 2, RopeMode::Neox, &mut out);
    let (c, s) = (3f32.cos(), 3f32.sin());
    let want = [1.0, 0.0, 0.0, 1.0, c, s, 2.0 * c, 2.0 * s];
    for (i, (o, w)) in out.iter().zip(want).enumerate() {
        assert!((o - w).abs() < 1e-6, "out[{i}] = {o} want {w}");
    }
    // head_dim 4, theta 100: pair (0, 2) turns by p, pair (1, 3) by p / 10; norms are kept.
    let x = [0.0, 2.0, 1.0, 0.0];
    let mut out = [0f32; 4];
    rope_mode(&x, &RopeTable::with_spec(&[5], 4, &RopeSpec::neox(100.0)), 0, 1, RopeMode::Neox, &mut out);
    let want = [-5f32.sin(), 2.0 * 0.5f32.cos(), 5f32.cos(), 2.0 * 0.5f32.sin()];
    for (i, (o, w)) in out.iter().zip(want).enumerate() {
        assert!((o - w).abs() < 1e-6, "out[{i}] = {o} want {w}");
    }
}

#[test]
fn gelu_matches_known_values() {
    assert_eq!(gelu_tanh(0.0), 0.0);
    assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
    assert!((gelu_tanh(-1.0) + 0.158_808).abs() < 1e-5);
}

#[test]
fn rope_rotates_pairs() {
    let x = [1.0, 0.0, 0.0, 1.0]; // head_dim 4, pairs (0,2) and (1,3)
    let mut out = [0.0; 4];
    rope_mode(&x, &RopeTable::with_spec(&[1], 4, &RopeSpec::neox(10000.0)), 0, 1, RopeMode::Neox, &mut out);
    // pair (0,2): freq 1 -> angle 1 rad
    assert!((out[0] - 1f32.cos()).abs() < 1e-6 && (out[2] - 1f32.sin()).abs() < 1e-6);
    // pair (1,3): freq 1e-2 -> angle 0.01 rad
    assert!((out[1] + 0.01f32.sin()).abs() < 1e-6 && (out[3] - 0.01f32.cos()).abs() < 1e-6);
}

#[test]
fn rms_norm_with_residual() {
    let x = [3.0, 4.0];
    let w = [1.0, 2.0];
    let mut out = [0.0; 2];
    rms_norm(&x, &w, 0.0, Some(&[10.0, 10.0]), &mut out);
    let rms = (12.5f32).sqrt();
    assert!((out[0] - (10.0 + 3.0 / rms)).abs() < 1e-5);
    assert!((out[1] - (10.0 + 8.0 / rms)).abs() < 1e-5);
}

#[test]
fn silu_and_soft_cap_match_known_values() {
    assert_eq!(silu(0.0), 0.0);
    assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
    assert!((silu(-2.0) + 0.238_405_84).abs() < 1e-6);
    assert_eq!(silu(-200.0), 0.0);
    assert_eq!(silu(200.0), 200.0);
    assert!((soft_cap(10.0, 30.0) - 30.0 * (1f32 / 3.0).tanh()).abs() < 1e-5);
    assert_eq!(soft_cap(1e6, 50.0), 50.0);
    assert_eq!(soft_cap(-1e6, 50.0), -50.0);
    assert!((soft_cap(1e-3, 50.0) - 1e-3).abs() < 1e-9, "near zero the cap is the identity");
}

/// Naive f64 RoPE: pair `(a(i), b(i))` turns by `pos * freq_scale * theta^(-2i/d) / factor[i]`.
fn reference_rope(x: &[f32], positions: &[i32], heads: usize, d: usize, spec: &RopeSpec) -> Vec<f64> {
    let mut out = vec![0f64; x.len()];
    for (r, &pos) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (r * heads + h) * d;
            for i in 0..d / 2 {
                let factor = spec.freq_factors.as_ref().map_or(1.0, |f| f[i] as f64);
                let angle = pos as f64 * spec.freq_scale as f64 * (spec.theta as f64).powf(-(2.0 * i as f64) / d as f64) / factor;
                let (a, b) = match spec.mode {
                    RopeMode::Neox => (i, i + d / 2),
                    RopeMode::Norm => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (x[base + a] as f64, x[base + b] as f64);
                out[base + a] = x0 * angle.cos() - x1 * angle.sin();
                out[base + b] = x1 * angle.cos() + x0 * angle.sin();
            }
        }
    }
    out
}

#[test]
fn rope_modes_and_frequency_scaling_match_f64() {
    let (heads, d) = (3, 8);
    let positions = [0, 1, 7, 300];
    let mut rng = Rng(0x0bad_cafe);
    let x = rng.vec(positions.len() * heads * d);
    let specs = [
        RopeSpec::neox(1e4),
        RopeSpec { mode: RopeMode::Norm, ..RopeSpec::neox(5e5) },
        RopeSpec { theta: 1e4, mode: RopeMode::Norm, freq_scale: 0.25, freq_factors: None },
        RopeSpec { theta: 5e5, mode: RopeMode::Norm, freq_scale: 1.0, freq_factors: Some(vec![1.0, 1.5, 8.0, 32.0]) },
        // Proportional RoPE leaves frequencies with a huge factor unrotated.
        RopeSpec { theta: 1e6, mode: RopeMode::Neox, freq_scale: 1.0, freq_factors: Some(vec![1.0, 1.0, 1e30, 1e30]) },
    ];
    let mut outs = Vec::new();
    for spec in &specs {
        let table = RopeTable::with_spec(&positions, d, spec);
        assert!(table.serves_spec(spec, d) && !table.serves_spec(spec, d + 2));
        let mut out = vec![f32::NAN; x.len()];
        rope_mode(&x, &table, 0, heads, spec.mode, &mut out);
        let want = reference_rope(&x, &positions, heads, d, spec);
        for (i, (o, w)) in out.iter().zip(&want).enumerate() {
            assert!((*o as f64 - w).abs() < 1e-5, "{spec:?}: out[{i}] = {o} want {w}");
        }
        // Rows taken from the middle of the table (a task's share) rotate as in the whole.
        let row = heads * d;
        let mut part = vec![f32::NAN; 2 * row];
        rope_mode(&x[row..3 * row], &table, 1, heads, spec.mode, &mut part);
        assert_eq!(part, out[row..3 * row], "{spec:?}: rows 1..3");
        outs.push(out);
    }
    // Every spec rotates differently; the pairing alone does not change the table.
    for i in 0..outs.len() {
        for j in i + 1..outs.len() {
            assert_ne!(outs[i], outs[j], "specs {i} and {j}");
        }
    }
    let norm = RopeSpec { mode: RopeMode::Norm, ..RopeSpec::neox(1e4) };
    assert!(RopeTable::with_spec(&positions, d, &RopeSpec::neox(1e4)).serves_spec(&norm, d));
    assert!(!RopeTable::with_spec(&positions, d, &specs[2]).serves_spec(&RopeSpec::neox(1e4), d));
    // Unrotated frequencies of proportional RoPE keep their values.
    let last = &outs[4];
    for (r, &p) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (r * heads + h) * d;
            for e in [2, 3, 6, 7] {
                assert!((last[base + e] - x[base + e]).abs() < 1e-6, "position {p} element {e}");
            }
        }
    }
}

#[test]
fn soft_capped_attention_matches_f64() {
    let (len, d, q_heads, kv_heads, scale, cap) = (9, 8, 4, 2, 0.9, 3.0);
    let mut rng = Rng(0x5eed_50f7);
    for window in [None, Some(4)] {
        // Large queries: many scores exceed the cap, so capping changes the result.
        let q: Vec<f32> = rng.vec(len * q_heads * d).iter().map(|v| v * 4.0).collect();
        let k: Vec<f32> = rng.vec(len * kv_heads * d).iter().map(|v| v * 2.0).collect();
        let v = rng.vec(len * kv_heads * d);
        let want = reference_attention_capped(&q, &k, &v, len, q_heads, kv_heads, d, window, scale, Some(cap));
        let uncapped = reference_attention(&q, &k, &v, len, q_heads, kv_heads, d, window, scale);
        let differs = want.iter().zip(&uncapped).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
        assert!(differs > 1e-2, "the cap must matter in this test (max difference {differs})");
        let spec = LayerKv { kv_heads, head_dim_k: d, head_dim_v: d, window };
        let shape = AttentionShape { q_heads, kv_heads, head_dim: d, window, scale };
        let (qw, kw) = (q_heads * d, kv_heads * d);
        for isa in Isa::supported() {
            for pool in &pools() {
                for chunks in [&[9usize][..], &[4, 1, 4]] {
                    let mut cache = CpuKvCache::new(&KvLayout { layers: vec![spec], context: 16, elem: KvType::F32 });
                    let layer = cache.layer_mut(0).unwrap();
                    let mut out = vec![f32::NAN; len * qw];
                    let mut start = 0;
                    for &rows in chunks {
                        let (a, b) = (start, start + rows);
                        let (qs, ks, vs) = (&q[a * qw..b * qw], &k[a * kw..b * kw], &v[a * kw..b * kw]);
                        attend(pool, isa, qs, ks, vs, rows, start, layer, shape, Some(cap), &mut out[a * qw..b * qw]);
                        start = b;
                    }
                    for (e, (&got, &w)) in out.iter().zip(&want).enumerate() {
                        assert!((got as f64 - w).abs() < 1e-5, "{window:?} {isa:?} {chunks:?}: out[{e}] = {got} want {w}");
                    }
                }
            }
        }
    }
}

#[test]
fn rms_normalize_matches_rms_norm_with_unit_weights() {
    let mut rng = Rng(0x00dd_ba11);
    let x = rng.vec(3 * 8);
    let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
    rms_normalize(&x, 4, 1e-6, &mut a);
    rms_norm(&x, &[1.0; 4], 1e-6, None, &mut b);
    assert_eq!(a, b);
    // Each group of 4 has unit mean square.
    for g in a.chunks_exact(4) {
        let ms: f32 = g.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-4, "{ms}");
    }
}

/// Sequences attending in one call (a batched decode step, or prefill chunks of several
/// sequences) get the same bits as each attending alone.
#[test]
fn attention_of_several_sequences_equals_each_alone() {
    let mut rng = Rng(0xa77e_0005);
    let (q_heads, kv_heads, d) = (4, 1, 16);
    let (qw, kw) = (q_heads * d, kv_heads * d);
    let spec = LayerKv { kv_heads, head_dim_k: d, head_dim_v: d, window: None };
    let shape = AttentionShape { q_heads, kv_heads, head_dim: d, window: None, scale: 0.25 };
    // (cached positions, new rows) per sequence.
    let seqs = [(5usize, 1usize), (0, 3), (40, 1), (17, 2), (1, 1)];
    let pasts: Vec<(Vec<f32>, Vec<f32>)> = seqs.iter().map(|&(p, _)| (rng.vec(p * kw), rng.vec(p * kw))).collect();
    let news: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> =
        seqs.iter().map(|&(_, r)| (rng.vec(r * qw), rng.vec(r * kw), rng.vec(r * kw))).collect();
    let cached = || -> Vec<CpuKvCache> {
        seqs.iter()
            .zip(&pasts)
            .map(|(&(p, _), (k, v))| {
                let mut c = CpuKvCache::new(&KvLayout { layers: vec![spec], context: 64, elem: KvType::F32 });
                c.layer_mut(0).unwrap().append(Isa::Scalar, k, v, p);
                c
            })
            .collect()
    };
    for isa in Isa::supported() {
        for pool in &pools() {
            let mut alone_caches = cached();
            let alone: Vec<Vec<f32>> = seqs
                .iter()
                .zip(&news)
                .zip(alone_caches.iter_mut())
                .map(|((&(p, r), (q, k, v)), c)| {
                    let mut out = vec![f32::NAN; r * qw];
                    attend(pool, isa, q, k, v, r, p, c.layer_mut(0).unwrap(), shape, None, &mut out);
                    out
                })
                .collect();
            let mut caches = cached();
            let mut outs: Vec<Vec<f32>> = seqs.iter().map(|&(_, r)| vec![f32::NAN; r * qw]).collect();
            let mut parts: Vec<AttentionSegment<'_>> = seqs
                .iter()
                .zip(&news)
                .zip(caches.iter_mut().zip(outs.iter_mut()))
                .map(|((&(p, r), (q, k, v)), (c, out))| AttentionSegment {
                    q,
                    k_new: k,
                    v_new: v,
                    rows: r,
                    start: p,
                    layer: c.layer_mut(0).unwrap(),
                    out,
                })
                .collect();
            attention(pool, isa, &mut parts, shape, None);
            drop(parts);
            for (i, ((out, want), c)) in outs.iter().zip(&alone).zip(caches.iter_mut()).enumerate() {
                assert_eq!(out, want, "{isa:?} threads={} sequence {i}", pool.threads());
                assert_eq!(c.layer_mut(0).unwrap().len(), seqs[i].0 + seqs[i].1);
            }
        }
    }
}

#[test]
fn top_of_row_is_a_full_sort_s_head() {
    let mut rng = Rng(0x7071);
    for (n, count) in [(1, 1), (10, 10), (100, 7), (5000, 64), (70_000, 64)] {
        // Values from a small range, so that many are equal and the index decides.
        let row: Vec<f32> = (0..n).map(|_| (rng.next_u64() % 97) as f32 * 0.25 - 12.0).collect();
        let mut want: Vec<(f32, usize)> = row.iter().copied().zip(0..).collect();
        want.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        want.truncate(count);
        assert_eq!(top_of_row(&row, count).unwrap(), want, "{n} values, top {count}");
        let mut out = vec![0f32; 2 * count];
        top_k_rows(&row, n, count, Some(2.0), &mut out);
        let capped: Vec<f32> = want.iter().map(|w| soft_cap(w.0, 2.0)).collect();
        assert_eq!(out[..count], capped[..]);
        assert_eq!(out[count..], want.iter().map(|w| w.1 as f32).collect::<Vec<_>>()[..]);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut r = row.clone();
            r[n / 2] = bad;
            assert_eq!(top_of_row(&r, count), None);
            top_k_rows(&r, n, count, None, &mut out);
            assert!(out[..count].iter().all(|v| v.is_nan()), "{n} values with {bad}");
        }
    }
}

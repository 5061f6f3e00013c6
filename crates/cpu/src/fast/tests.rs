//! Fast-kernel tests: every fast format, every instruction set this CPU runs, pools of one and
//! three threads, odd sizes; each compared with an f64 product of the exactly dequantized weights
//! and the dequantized 16-bit activations (so only rounding separates them).

use kiln_quant::{dequantize, quantize, GgmlType};

use super::*;

/// xorshift64.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

/// The model's formats and the other common ones.
const FAST: [GgmlType; 8] =
    [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K];

/// Error allowed relative to the sum of the products' magnitudes (f32 scales and accumulation,
/// and the K-quants' correction terms that cancel part of the sum).
const REL_TOL: f64 = 1e-5;

const NS: [usize; 4] = [1, 5, 37, 131];
const ROWS: [usize; 5] = [1, 3, 8, 9, 15];

fn pools() -> [ThreadPool; 2] {
    [ThreadPool::new(1), ThreadPool::new(3)]
}

#[test]
fn fast_formats_are_exactly_these() {
    let fast: Vec<GgmlType> = GgmlType::ALL.iter().copied().filter(|&t| supports(t)).collect();
    assert_eq!(fast, {
        let mut f = FAST.to_vec();
        f.sort_by_key(|t| t.id());
        f
    });
    for t in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_1, GgmlType::Q5_1, GgmlType::Q8_K] {
        assert!(!supports(t), "{t} falls back to the exact kernels");
    }
}

#[test]
fn activation_quantization_rounds_to_nearest_level() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let pool = ThreadPool::new(3);
    for isa in Isa::supported() {
        for (fam, k) in [(Family::Legacy, 32), (Family::Legacy, 96), (Family::KQuant, 256), (Family::KQuant, 768)] {
            let (block, max) = (fam.act_block(), fam.act_max());
            for rows in [1, 7, 200] {
                let mut x = rng.vec(rows * k);
                x[0] = 0.0;
                if k == 96 {
                    // An all-zero block quantizes to zeros.
                    x[32..64].fill(0.0);
                }
                let q = QuantizedRows::new(&pool, isa, &x, rows, k, fam);
                let back = q.dequantized();
                for (i, (&a, &b)) in x.iter().zip(&back).enumerate() {
                    let amax = x[i / block * block..(i / block + 1) * block].iter().fold(0f32, |m, v| m.max(v.abs()));
                    assert!((a - b).abs() <= amax / max * 0.5 + amax * 2e-7, "{isa:?} block={block} x[{i}]={a} back={b}");
                }
                for r in 0..rows {
                    let row = q.row(r);
                    assert!(row.qs.iter().all(|&v| f32::from(v).abs() <= max));
                    if block == 256 {
                        for (g, &s) in row.sums.iter().enumerate() {
                            assert_eq!(s, row.qs[16 * g..16 * g + 16].iter().map(|&v| f32::from(v)).sum::<f32>());
                        }
                    } else {
                        assert!(row.sums.is_empty());
                    }
                }
                #[cfg(target_arch = "x86_64")]
                {
                    // Block-major scales for x86's legacy kernels; none for K-quant rows.
                    let len = rows.min(ROW_GROUP);
                    let g = q.group(0, len);
                    if fam == Family::Legacy {
                        for b in 0..k / block {
                            for i in 0..ROW_GROUP {
                                assert_eq!(g.d_t[ROW_GROUP * b + i], q.row(i.min(len - 1)).d[b], "{isa:?} rows={rows} b={b} i={i}");
                            }
                        }
                    } else {
                        assert!(g.d_t.is_empty() && q.select(0).group(0, 1).d_t.is_empty());
                    }
                }
            }
        }
    }
}

#[test]
fn non_finite_activations_get_a_nan_scale() {
    let pool = ThreadPool::new(1);
    for isa in Isa::supported() {
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut x = vec![0.25f32; 64];
            x[40] = bad;
            let q = QuantizedRows::new(&pool, isa, &x, 1, 64, Family::Legacy);
            let row = q.row(0);
            assert_eq!(row.d[0], 0.25 / 32767.0, "{isa:?}");
            assert!(row.d[1].is_nan(), "{isa:?} {bad}");
            assert!(row.qs[32..].iter().all(|&v| v == 0), "{isa:?} {bad}");
        }
    }
}

/// `(x · Wᵀ, |x| · |W|ᵀ)` in f64.
fn reference(deq: &[f32], x: &[f32], rows: usize, k: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut v, mut m) = (vec![0f64; rows * n], vec![0f64; rows * n]);
    for r in 0..rows {
        for j in 0..n {
            for i in 0..k {
                let p = deq[j * k + i] as f64 * x[r * k + i] as f64;
                v[r * n + j] += p;
                m[r * n + j] += p.abs();
            }
        }
    }
    (v, m)
}

#[test]
fn matmul_matches_f64_for_every_fast_format_isa_and_pool() {
    let mut rng = Rng(0x243f_6a88_85a3_08d3);
    let pools = pools();
    let mut checked = 0;
    for ty in FAST {
        let bs = ty.block_size();
        for k in [bs, 3 * bs] {
            for n in NS {
                let w = rng.vec(k * n);
                let packed = quantize(ty, &w).unwrap();
                let mut deq = vec![0f32; k * n];
                dequantize(ty, &packed, &mut deq).unwrap();
                let m = PackedMatrix::from_bytes(&packed, ty, k, n);
                for rows in ROWS {
                    let x = rng.vec(rows * k);
                    for isa in Isa::supported() {
                        let xq = QuantizedRows::new(&pools[0], isa, &x, rows, k, family(ty).unwrap()).dequantized();
                        let (want, mag) = reference(&deq, &xq, rows, k, n);
                        for pool in &pools {
                            let what = format!("{ty} k={k} n={n} rows={rows} {isa:?} threads={}", pool.threads());
                            let mut out = vec![f32::NAN; rows * n + 2];
                            out[rows * n..].fill(7.5);
                            matmul(pool, isa, &x, rows, &m, &mut out);
                            for e in 0..rows * n {
                                let err = (out[e] as f64 - want[e]).abs();
                                assert!(err <= REL_TOL * mag[e] + 1e-30, "{what}: out[{e}] = {} want {}", out[e], want[e]);
                            }
                            assert_eq!(out[rows * n..], [7.5, 7.5], "{what}: wrote past the output");
                            let mut best = vec![-2i32; rows];
                            matmul_argmax(pool, isa, &x, rows, &m, None, &mut best);
                            for r in 0..rows {
                                let row = &out[r * n..(r + 1) * n];
                                let want = (0..n).fold(0, |b, j| if row[j] > row[b] { j } else { b });
                                assert_eq!(best[r], want as i32, "{what}: argmax of row {r}");
                            }
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(checked >= FAST.len() * 2 * NS.len() * ROWS.len() * 2);
}

#[test]
fn simd_unpack_and_cores_equal_the_scalar_ones() {
    let mut rng = Rng(0x0dd_5eed);
    for ty in FAST {
        let k = 3 * ty.block_size().max(256);
        let packed = quantize(ty, &rng.vec(k * 3)).unwrap();
        let m = PackedMatrix::from_bytes(&packed, ty, k, 3);
        let x = rng.vec(5 * k);
        let pool = ThreadPool::new(1);
        let results: Vec<Vec<f32>> = Isa::supported()
            .into_iter()
            .map(|isa| {
                let mut out = vec![0f32; 5 * 3];
                matmul(&pool, isa, &x, 5, &m, &mut out);
                out
            })
            .collect();
        for r in &results[1..] {
            for (a, b) in r.iter().zip(&results[0]) {
                assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{ty}: {a} vs scalar {b}");
            }
        }
    }
}

/// The product kernels built for AVX-512 compute AVX2's integers with more registers: every fast
/// format's products are the same bits as AVX2's, for one row (decode, with its level bytes) and for
/// groups of every size (prefill, batched decode), over rows of one and of several blocks.
#[test]
fn avx512_products_equal_avx2_bit_for_bit() {
    if !Isa::supported().contains(&Isa::Avx512) {
        eprintln!("no AVX-512 (F, BW, VL, VNNI) on this CPU: its kernels cannot run here");
        return;
    }
    let mut rng = Rng(0x0a5c_512b);
    let pool = ThreadPool::new(2);
    for ty in FAST {
        for k in [ty.block_size().max(256), 7 * ty.block_size().max(256)] {
            let n = 19;
            let packed = quantize(ty, &rng.vec(k * n)).unwrap();
            let m = PackedMatrix::from_bytes(&packed, ty, k, n);
            for rows in [1, 2, 3, 5, 8, 9, 17] {
                let x = rng.vec(rows * k);
                let [avx2, avx512] = [Isa::Avx2Fma, Isa::Avx512].map(|isa| {
                    let mut out = vec![0f32; rows * n];
                    matmul(&pool, isa, &x, rows, &m, &mut out);
                    out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                });
                assert_eq!(avx512, avx2, "{ty} k={k} rows={rows}");
            }
        }
    }
}

#[test]
fn non_finite_products_give_minus_one() {
    let pool = ThreadPool::new(2);
    let k = 32;
    let packed = quantize(GgmlType::Q8_0, &vec![0.5f32; k * 4]).unwrap();
    let m = PackedMatrix::from_bytes(&packed, GgmlType::Q8_0, k, 4);
    for bad in [f32::INFINITY, f32::NAN] {
        let mut x = vec![1f32; k];
        x[3] = bad;
        for isa in Isa::supported() {
            let mut out = [0i32];
            matmul_argmax(&pool, isa, &x, 1, &m, None, &mut out);
            assert_eq!(out, [-1], "{isa:?} {bad}");
            let copy = make_screening_copy(&pool, isa, &m, &|_| {});
            matmul_argmax(&pool, isa, &x, 1, &m, Some(&copy), &mut out);
            assert_eq!(out, [-1], "{isa:?} {bad} screened");
        }
    }
}

#[test]
fn screened_argmax_equals_the_full_one() {
    let mut rng = Rng(0x5c12_ee4e);
    let pools = pools();
    for (ty, k, n) in [(GgmlType::Q8_0, 64, screen::MIN_ROWS), (GgmlType::Q6_K, 256, 3000), (GgmlType::Q5_0, 96, 777)] {
        let packed = quantize(ty, &rng.vec(k * n)).unwrap();
        let m = PackedMatrix::from_bytes(&packed, ty, k, n);
        assert_eq!(wants_screening_copy(&m), n >= screen::MIN_ROWS);
        let released = std::sync::atomic::AtomicUsize::new(0);
        let copy = make_screening_copy(&pools[1], Isa::Scalar, &m, &|b| {
            released.fetch_add(b.len(), std::sync::atomic::Ordering::Relaxed);
        });
        assert_eq!(released.into_inner(), packed.len(), "every byte read is handed to release once");
        for isa in Isa::supported() {
            assert!(make_screening_copy(&pools[0], isa, &m, &|_| {}) == copy, "{ty} n={n} {isa:?}: the same copy");
        }
        for rows in 1..=screen::MAX_ACT_ROWS {
            let x = rng.vec(rows * k);
            for isa in Isa::supported() {
                for pool in &pools {
                    let (mut full, mut screened) = (vec![0i32; rows], vec![0i32; rows]);
                    matmul_argmax(pool, isa, &x, rows, &m, None, &mut full);
                    matmul_argmax(pool, isa, &x, rows, &m, Some(&copy), &mut screened);
                    assert_eq!(screened, full, "{ty} n={n} rows={rows} {isa:?} threads={}", pool.threads());
                }
            }
        }
    }
}

/// The largest products the integer cores can meet (every level and integer scale at its extreme,
/// activations at the top level; one row, so AVX2's byte products too) still sum without overflow.
#[test]
fn extreme_levels_and_scales_do_not_overflow() {
    let pool = ThreadPool::new(1);
    let one_f16 = kiln_quant::f32_to_f16(1.0).to_le_bytes();
    // Q6_K: ql, qh all ones (level 63), scales -128, d = 1.
    let mut q6 = vec![0xffu8; 192];
    q6.extend([0x80u8; 16]);
    q6.extend(one_f16);
    // Q6_K: level 0 (-32), scales 127.
    let mut q6_low = vec![0u8; 192];
    q6_low.extend([0x7fu8; 16]);
    q6_low.extend(one_f16);
    // Q5_K: d = 1, dmin = 0, scales 63, levels 31.
    let mut q5 = one_f16.to_vec();
    q5.extend([0u8; 2]);
    q5.extend([0xffu8; 12 + 32 + 128]);
    // Q8_0: d = 1, levels -128.
    let mut q8 = one_f16.to_vec();
    q8.extend([0x80u8; 32]);
    for (ty, block) in [(GgmlType::Q6_K, q6), (GgmlType::Q6_K, q6_low), (GgmlType::Q5_K, q5), (GgmlType::Q8_0, q8)] {
        let k = ty.block_size();
        let mut deq = vec![0f32; k];
        dequantize(ty, &block, &mut deq).unwrap();
        let m = PackedMatrix::from_bytes(&block, ty, k, 1);
        for sign in [1f32, -1.0] {
            let x = vec![sign * 3.0; k];
            let want: f64 = deq.iter().map(|&w| f64::from(w) * f64::from(x[0])).sum();
            for isa in Isa::supported() {
                let mut out = [0f32];
                matmul(&pool, isa, &x, 1, &m, &mut out);
                assert!((f64::from(out[0]) - want).abs() <= 1e-5 * want.abs(), "{ty} {isa:?}: {} want {want}", out[0]);
            }
        }
    }
}

/// The score the screening copy defines for weight row `w` (real values) and activation row `x`:
/// the Q4_0 form of `w` with its block scales rounded to multiples of `max |d| / 127`, times the
/// 8-bit activation levels and their scale, in f64; and the sum of the terms' magnitudes.
fn screen_definition(w: &[f32], x: &[f32]) -> (f64, f64) {
    let q = quantize(GgmlType::Q4_0, w).unwrap();
    let d: Vec<f64> = q.chunks_exact(18).map(|b| f64::from(kiln_quant::f16_to_f32(u16::from_le_bytes([b[0], b[1]])))).collect();
    let base = d.iter().fold(0f64, |m, v| m.max(v.abs())) as f32 / 127.0;
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (da, ia) = (amax / 127.0, if amax > 0.0 { 127.0 / amax } else { 0.0 });
    let mut terms = Vec::new();
    for (b, blk) in q.chunks_exact(18).enumerate() {
        let m = if base > 0.0 { (d[b] as f32 / base).round() } else { 0.0 };
        for e in 0..32 {
            let level = if e < 16 { blk[2 + e] & 15 } else { blk[2 + e - 16] >> 4 };
            let a = (x[32 * b + e] * ia).round().clamp(-127.0, 127.0);
            terms.push(f64::from(base) * f64::from(m) * f64::from(i32::from(level) - 8) * f64::from(da) * f64::from(a));
        }
    }
    (terms.iter().sum(), terms.iter().map(|t| t.abs()).sum())
}

#[test]
fn simd_screen_scores_equal_the_scalar_ones_and_the_definition() {
    let mut rng = Rng(0x005e_ed0f_5c12);
    // One window of blocks, and three (the integer sums are converted per window).
    for k in [96, 32 * (2 * screen::WINDOW_BLOCKS + 3)] {
        let n = 13;
        let packed = quantize(GgmlType::Q8_0, &rng.vec(k * n)).unwrap();
        let m = PackedMatrix::from_bytes(&packed, GgmlType::Q8_0, k, n);
        let copy = make_screening_copy(&ThreadPool::new(1), Isa::detect(), &m, &|_| {});
        let x = rng.vec(3 * k);
        let acts = screen::ScreenActs::new(&x, 3, k);
        let group = &copy[..screen::group_len(k / 32)];
        let scores: Vec<[[f32; 8]; 3]> = Isa::supported()
            .into_iter()
            .map(|isa| {
                let mut out = [[[0f32; 8]; 3]];
                screen::group_scores(isa, group, k / 32, std::array::from_fn(|r| acts.row(r)), &mut out);
                out[0]
            })
            .collect();
        for (r, rows) in scores[0].iter().enumerate() {
            for (row, &v) in rows.iter().enumerate() {
                let mut w = vec![0f32; k];
                dequantize(GgmlType::Q8_0, m.row(row), &mut w).unwrap();
                let (want, mag) = screen_definition(&w, &x[r * k..(r + 1) * k]);
                assert!((f64::from(v) - want).abs() <= 1e-5 * mag, "k={k} row {row} act {r}: {v} vs {want}");
            }
        }
        for (isa, s) in Isa::supported().into_iter().zip(&scores).skip(1) {
            assert_eq!(s, &scores[0], "k={k} {isa:?} vs scalar");
        }
    }
}

/// The copy's Q4_0 encoding is `kiln_quant`'s on every instruction set, bit for bit: ties of
/// magnitude with either sign first, zero blocks, one value alone, tiny and large scales, sums that
/// round; the AVX2 encoder declines values that are not finite (the copy then takes `kiln_quant`'s,
/// which refuses them).
#[test]
fn screen_q4_0_blocks_are_kiln_quants() {
    let mut rng = Rng(0x0040_b10c);
    let mut rows: Vec<Vec<f32>> = vec![vec![0.0; 64], vec![-0.0; 64]];
    let mut tie = rng.vec(64);
    (tie[3], tie[17]) = (-2.0, 2.0);
    (tie[40], tie[33]) = (1.5, -1.5);
    rows.push(tie);
    let mut alone = vec![0.0; 64];
    (alone[31], alone[32]) = (-1e-3, 7.0);
    rows.push(alone);
    // Blocks of scale 1 (their first value -8) whose other values have 21 fractional bits: sums
    // (v + 8) that round.
    let mut bits = 0x7u64;
    rows.push(
        (0..32 * 64)
            .map(|i| {
                bits = bits.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                if i % 32 == 0 {
                    -8.0
                } else {
                    ((bits >> 40) % (1 << 25)) as f32 / (1 << 21) as f32 - 8.0
                }
            })
            .collect(),
    );
    for scale in [1e-30f32, 1e-6, 1.0, 1e4] {
        rows.push(rng.vec(32 * 40).iter().map(|v| v * scale).collect());
    }
    for x in &rows {
        let want = quantize(GgmlType::Q4_0, x).unwrap();
        for isa in Isa::supported() {
            let mut q = vec![0u8; want.len()];
            screen::q4_0_row(isa, x, &mut q);
            assert_eq!(q, want, "{isa:?} {:?}", &x[..4]);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if Isa::detect() == Isa::Avx2Fma {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = rng.vec(64);
            x[45] = bad;
            // SAFETY: the CPU has AVX2 (detected); the buffer holds x's two blocks.
            assert!(!unsafe { super::avx2::q4_0_blocks(&x, &mut [0u8; 36]) }, "{bad}");
        }
    }
}

/// Levels, multipliers and activations at their extremes over several windows do not overflow
/// the kernels' 16- and 32-bit sums.
#[test]
fn extreme_screen_sums_do_not_overflow() {
    let k = 32 * (screen::WINDOW_BLOCKS + 5);
    // Row 0 all -1 (levels -8, every multiplier 127), row 1 alternating ±1.
    let mut w = vec![-1f32; k];
    w.extend((0..k).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }));
    let packed = quantize(GgmlType::Q8_0, &w).unwrap();
    let m = PackedMatrix::from_bytes(&packed, GgmlType::Q8_0, k, 2);
    let copy = make_screening_copy(&ThreadPool::new(1), Isa::detect(), &m, &|_| {});
    for sign in [1f32, -1.0] {
        let x = vec![sign; k];
        let acts = screen::ScreenActs::new(&x, 1, k);
        for isa in Isa::supported() {
            let mut out = [[[0f32; 8]; 1]];
            screen::group_scores(isa, &copy, k / 32, [acts.row(0)], &mut out);
            for row in 0..2 {
                let (want, mag) = screen_definition(&w[row * k..(row + 1) * k], &x);
                let v = out[0][0][row];
                assert!((f64::from(v) - want).abs() <= 1e-5 * mag, "{isa:?} row {row} sign {sign}: {v} vs {want}");
            }
        }
    }
}

/// A row's screening scores do not depend on the rows screened with it, bit for bit.
#[test]
fn screen_scores_do_not_depend_on_the_rows_screened_together() {
    let mut rng = Rng(0x5c0e_0b17);
    let (k, n) = (160, 16);
    let packed = quantize(GgmlType::Q8_0, &rng.vec(k * n)).unwrap();
    let m = PackedMatrix::from_bytes(&packed, GgmlType::Q8_0, k, n);
    let copy = make_screening_copy(&ThreadPool::new(1), Isa::detect(), &m, &|_| {});
    let x = rng.vec(8 * k);
    let acts = screen::ScreenActs::new(&x, 8, k);
    for isa in Isa::supported() {
        // Two groups per call: a group's scores do not depend on the groups scored with it either.
        let (mut eight, mut four) = ([[[0f32; 8]; 8]; 2], [[[0f32; 8]; 4]; 2]);
        screen::group_scores::<8>(isa, &copy, k / 32, std::array::from_fn(|r| acts.row(r)), &mut eight);
        screen::group_scores::<4>(isa, &copy, k / 32, std::array::from_fn(|r| acts.row(r + 4)), &mut four);
        for g in 0..2 {
            let group = &copy[g * copy.len() / 2..(g + 1) * copy.len() / 2];
            for r in 0..8 {
                let mut one = [[[0f32; 8]; 1]];
                screen::group_scores::<1>(isa, group, k / 32, [acts.row(r)], &mut one);
                assert_eq!(one[0][0], eight[g][r], "{isa:?} group {g} row {r}");
                if r >= 4 {
                    assert_eq!(one[0][0], four[g][r - 4], "{isa:?} group {g} row {r}");
                }
            }
        }
    }
}

/// A row's product does not depend on the rows multiplied with it (batched decode equals decoding
/// alone, bit for bit).
#[test]
fn a_rows_products_do_not_depend_on_its_group() {
    let mut rng = Rng(0x0b17_f0a1);
    let pool = ThreadPool::new(2);
    for ty in FAST {
        let k = 3 * ty.block_size().max(96);
        let n = 7;
        let packed = quantize(ty, &rng.vec(k * n)).unwrap();
        let m = PackedMatrix::from_bytes(&packed, ty, k, n);
        let x = rng.vec(11 * k);
        for isa in Isa::supported() {
            let mut all = vec![0f32; 11 * n];
            matmul(&pool, isa, &x, 11, &m, &mut all);
            for r in 0..11 {
                let mut one = vec![0f32; n];
                matmul(&pool, isa, &x[r * k..(r + 1) * k], 1, &m, &mut one);
                assert_eq!(one, all[r * n..(r + 1) * n], "{ty} {isa:?} row {r}");
            }
        }
    }
}

//! Drawing a token from a row of logits or candidates: the one definition that the models'
//! sampler, the CPU's `Draw` kernel and the CUDA draw kernels (a port of it, bit for bit) share.
//!
//! A draw takes the sampling parameters and the state of the sequence's random generator
//! (xoshiro256**) from a [`DrawSpec`]; it uses the generator's next output and leaves the state
//! to its owner, who advances it by one after each draw of a positive temperature.

use std::cmp::Reverse;

use kiln_ir::{Among, CANDIDATES};

/// xoshiro256** seeded through splitmix64: small, fast, reproducible across platforms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rng(pub [u64; 4]);

impl Rng {
    /// The generator of `seed`.
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    /// The next output.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in [0, 1): the top 53 bits of the next output.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What a step needs to draw one sequence's next token on the device
/// ([`kiln_ir::OutputMode::Drawn`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrawSpec {
    /// Softmax temperature; 0: the likeliest token (no draw).
    pub temperature: f32,
    /// Among candidates: the `top_k` likeliest are the candidates (1 to `CANDIDATES - 1`; 0 is
    /// taken as 1).
    pub top_k: u32,
    /// Among candidates: the fewest likeliest whose probabilities reach this are kept (1: all).
    pub top_p: f32,
    /// Among candidates: those less likely than this times the likeliest are dropped (0: none).
    pub min_p: f32,
    /// The random generator's state before the draw.
    pub rng: Rng,
}

impl DrawSpec {
    /// A greedy choice: the likeliest token, no draw.
    pub fn greedy() -> Self {
        DrawSpec { temperature: 0.0, top_k: 1, top_p: 1.0, min_p: 0.0, rng: Rng([0; 4]) }
    }

    /// The draw of the sequence's next step: the generator one number on where this draw takes
    /// one (at a positive temperature; every choice at a positive temperature takes one).
    pub fn next(&self) -> DrawSpec {
        let mut d = *self;
        if d.temperature > 0.0 {
            d.rng.next_u64();
        }
        d
    }

    /// The uniform number in [0, 1) the draw uses: the generator's next output.
    pub fn uniform(&self) -> f64 {
        let mut rng = self.rng;
        rng.next_f64()
    }
}

/// The token drawn from `row` by `spec` (the [`kiln_ir::Op::Draw`] of one row): `among`
/// candidates, `row` is a top-k head's values then ids (as f32, likeliest first); among the
/// vocabulary, the logits. -1 where a value is not finite. `weights` is scratch.
pub fn draw_row(row: &[f32], among: Among, spec: &DrawSpec, weights: &mut Vec<f32>) -> i32 {
    match among {
        Among::Candidates => {
            let (values, ids) = row.split_at(row.len() / 2);
            if !crate::all_finite(values) {
                return -1;
            }
            let cand: Vec<(u32, f32)> = ids.iter().zip(values).map(|(&id, &v)| (id as u32, v)).collect();
            draw_among(&cand, spec) as i32
        }
        Among::Vocabulary => {
            if !crate::all_finite(row) {
                return -1;
            }
            draw_vocabulary(row, spec, weights) as i32
        }
    }
}

/// The token drawn from the candidates `cand` (at least [`CANDIDATES`]: id and logit, likeliest
/// first) under `spec`: of the `top_k` likeliest by scaled logit (the lower id first among
/// equals), those top-p and min-p keep, drawn by weight.
pub fn draw_among(cand: &[(u32, f32)], spec: &DrawSpec) -> u32 {
    debug_assert!(cand.len() >= CANDIDATES);
    let Some(&(first, top)) = cand.first() else { return 0 };
    let t = spec.temperature;
    if t == 0.0 {
        return first;
    }
    let mut keys: Vec<(u64, f32)> = cand.iter().map(|&(id, l)| (order_key(l / t, id), l)).collect();
    keys.sort_unstable_by_key(|k| Reverse(k.0));
    if !(top / t).is_finite() {
        // (No softmax: the first candidate.)
        return key_id(keys[0].0);
    }
    keys.truncate(spec.top_k.max(1) as usize);
    let kept = listed(keys.into_iter().map(|(k, l)| (key_id(k), l)), spec, top / t);
    draw_listed(&kept, spec.uniform())
}

/// The token drawn from every token's `logits` under `spec`'s temperature alone (no top-k, top-p
/// or min-p cut): by weight e^(l/T - max), walking the tokens in id order; the likeliest at
/// temperature 0 (the lowest id among equals).
pub fn draw_vocabulary(logits: &[f32], spec: &DrawSpec, weights: &mut Vec<f32>) -> u32 {
    let t = spec.temperature;
    if t == 0.0 {
        return argmax(logits);
    }
    let max = max_logit(logits) / t;
    if !max.is_finite() {
        return logits.iter().enumerate().map(|(i, &l)| order_key(l / t, i as u32)).max().map_or(0, key_id);
    }
    fill_weights(weights, logits, t, max);
    draw_weighted(weights, spec.uniform())
}

/// The kept tokens of a top-k list (`top`: id and logit, most likely first; `max`: the largest
/// scaled logit, finite) under `spec`'s temperature, top-p and min-p, with their weights.
pub fn listed(top: impl Iterator<Item = (u32, f32)>, spec: &DrawSpec, max: f32) -> Vec<(u32, f32)> {
    let mut cand: Vec<(u32, f32)> = top.map(|(i, l)| (i, exp_nonpositive(l / spec.temperature - max))).collect();
    let total = cand.iter().map(|c| c.1 as f64).sum();
    let keep = kept(&cand, total, spec, true).expect("a whole candidate list decides");
    cand.truncate(keep);
    cand
}

/// How many of `cand` (id and weight, most likely first: tokens past a prefix kept whole may come
/// in any order; `total`: the weights of all candidates) are kept under `spec`'s top-p and min-p,
/// or `None` if the list, not `complete` (more candidates follow), ends before that is decided.
/// (The largest weight, e^0, is 1: min-p's floor is `min_p` itself.)
pub fn kept(cand: &[(u32, f32)], total: f64, spec: &DrawSpec, complete: bool) -> Option<usize> {
    let target = spec.top_p as f64 * total;
    let mut cum = 0.0;
    for (i, c) in cand.iter().enumerate() {
        if c.1 <= 0.0 || (spec.min_p > 0.0 && c.1 < spec.min_p) {
            return Some(i.max(1));
        }
        cum += c.1 as f64;
        if spec.top_p < 1.0 && cum >= target {
            return Some(i + 1);
        }
    }
    complete.then_some(cand.len().max(1))
}

/// Draws one of `cand` (id, weight) with probability proportional to its weight, walking them in
/// their order, by `u` in [0, 1).
pub fn draw_listed(cand: &[(u32, f32)], u: f64) -> u32 {
    let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
    let mut r = u * total;
    for &(id, w) in cand {
        if r < w as f64 {
            return id;
        }
        r -= w as f64;
    }
    // (Rounding left r at the end: the last one with any weight.)
    cand.iter().rev().find(|c| c.1 > 0.0).unwrap_or(&cand[0]).0
}

/// The largest logit, NaN aside (-inf if none): eight interleaved maxima (a loop that vectorizes).
pub fn max_logit(logits: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 8];
    let mut chunks = logits.chunks_exact(8);
    for c in &mut chunks {
        for (m, &l) in m.iter_mut().zip(c) {
            *m = m.max(l);
        }
    }
    chunks.remainder().iter().chain(&m).fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// Tokens summed at a time by [`sum`] and [`draw_weighted`].
pub const RUN: usize = 1024;

/// Σ w over a run of weights, in f64: eight interleaved sums (a fixed order that vectorizes).
fn run_sum(w: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let mut chunks = w.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x as f64;
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        *a += x as f64;
    }
    acc.iter().fold(0.0, |s, &a| s + a)
}

/// Σ w over all weights, run by run (the mass that top-p cuts).
pub fn sum(w: &[f32]) -> f64 {
    w.chunks(RUN).map(run_sum).fold(0.0, |s, r| s + r)
}

/// A weight's share in a whole-vocabulary draw: w × 2^40 (w in [0, 1]) without its fraction.
/// Integer shares add up the same in any order, so the CUDA kernels find the drawn token with
/// parallel sums, not a walk; weights below 2^-40 of the likeliest token's are never drawn (at
/// most 2.4e-7 of the mass over 262,144 tokens). Their sum fits 64 bits for fewer than 2^24
/// tokens. (Computed as two 20-bit halves, each exact in f32 and converted as i32: a loop over
/// it vectorizes, where f32 to 64-bit conversions do not.)
#[inline(always)]
pub fn weight_share(w: f32) -> u64 {
    let (hi, lo) = share_halves(w);
    joined(hi, lo)
}

/// A share (or a sum of shares) from its high and low 20-bit parts.
#[inline(always)]
fn joined(hi: i32, lo: i32) -> u64 {
    ((hi as u64) << 20) + lo as u64
}

/// A weight's share as its high and low 20 bits (see [`weight_share`]).
#[inline(always)]
fn share_halves(w: f32) -> (i32, i32) {
    const HALF: f32 = (1u32 << 20) as f32;
    // (In [0, 2^20], NaN as 0, which `clamp` would keep: both conversions are in range, so they
    // need no saturation and the loop vectorizes.)
    #[allow(clippy::manual_clamp)]
    let x = (w * HALF).max(0.0).min(HALF);
    // SAFETY: x is finite and in [0, 2^20]; so is the fraction's 2^20 multiple, below 2^20.
    let hi: i32 = unsafe { x.to_int_unchecked() };
    (hi, unsafe { ((x - hi as f32) * HALF).to_int_unchecked() })
}

/// Σ [`weight_share`] over a run of at most [`RUN`] weights (each half's sum fits an i32: a loop
/// over i32 lanes; with AVX2 where the CPU has it).
fn share_sum(w: &[f32]) -> u64 {
    debug_assert!(w.len() <= RUN);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { share_sum_avx2(w) };
    }
    share_sum_in(w)
}

/// [`share_sum`]'s loop compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn share_sum_avx2(w: &[f32]) -> u64 {
    share_sum_in(w)
}

/// [`share_sum`]'s loop.
#[inline(always)]
fn share_sum_in(w: &[f32]) -> u64 {
    let (mut hi, mut lo) = (0i32, 0i32);
    for &x in w {
        let (h, l) = share_halves(x);
        hi += h;
        lo += l;
    }
    joined(hi, lo)
}

/// The point that `u` in [0, 1) (a multiple of 2^-53) picks in [0, `total`): ⌊u × total⌋,
/// exactly.
pub fn draw_point(u: f64, total: u64) -> u64 {
    (((u * (1u64 << 53) as f64) as u64 as u128 * total as u128) >> 53) as u64
}

/// The token of weights `w` (the likeliest's weight 1) that `u` in [0, 1) picks: the first
/// whose [`weight_share`]s, added in id order, pass [`draw_point`] of their total (found run by
/// run, then token by token).
pub fn draw_weighted(w: &[f32], u: f64) -> u32 {
    debug_assert!(w.len() < 1 << 24, "the shares of {} tokens may not fit 64 bits", w.len());
    let runs: Vec<u64> = w.chunks(RUN).map(share_sum).collect();
    let mut r = draw_point(u, runs.iter().sum());
    for (q, (&s, run)) in runs.iter().zip(w.chunks(RUN)).enumerate() {
        if r >= s {
            r -= s;
            continue;
        }
        for (i, &x) in run.iter().enumerate() {
            let s = weight_share(x);
            if r < s {
                return (q * RUN + i) as u32;
            }
            r -= s;
        }
    }
    // (Only where no share is positive, which a likeliest token of weight 1 rules out.)
    w.iter().rposition(|&x| x > 0.0).unwrap_or(0) as u32
}

/// A candidate's place as one integer, larger first: its scaled logit `s` (ordered as
/// `f32::total_cmp`), then the lower id.
pub fn order_key(s: f32, id: u32) -> u64 {
    let b = s.to_bits();
    let ordered = if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 };
    ((ordered as u64) << 32) | (u32::MAX - id) as u64
}

/// The id an [`order_key`] was made with.
pub fn key_id(key: u64) -> u32 {
    u32::MAX - key as u32
}

/// Sets `w` to e^(l/t - max) for every logit `l` (with AVX2 where the CPU has it: the same
/// values, twice the lanes).
pub fn fill_weights(w: &mut Vec<f32>, logits: &[f32], t: f32, max: f32) {
    w.clear();
    w.resize(logits.len(), 0.0);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { fill_weights_avx2(w, logits, t, max) };
    }
    fill_weights_in(w, logits, t, max)
}

/// [`fill_weights`]'s loop compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn fill_weights_avx2(w: &mut [f32], logits: &[f32], t: f32, max: f32) {
    fill_weights_in(w, logits, t, max)
}

/// [`fill_weights`]'s loop.
#[inline(always)]
fn fill_weights_in(w: &mut [f32], logits: &[f32], t: f32, max: f32) {
    for (o, &l) in w.iter_mut().zip(logits) {
        *o = exp_nonpositive(l / t - max);
    }
}

/// e^x for x <= 0 (relative error below 3e-7), 0 below -87 and for NaN: branch-free, so that
/// loops over it vectorize. (x = n ln 2 + r with n an integer and |r| <= ln 2 / 2, ln 2 in two
/// parts; e^r by Cephes' `expf` polynomial; 2^n built in the exponent field.) The CUDA draw
/// kernels repeat these operations one by one, unfused.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding and subtracting it rounds to an integer
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let m = (x * std::f32::consts::LOG2_E).max(-126.0) + ROUND;
    let n = m - ROUND;
    let r = (x.max(-88.0) - n * LN2_HI) - n * LN2_LO;
    let poly = ((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 0.166_666_65) * r + 0.5;
    let er = poly * r * r + r + 1.0;
    // (n sits in m's low mantissa bits: 2^n's exponent field without a float-to-integer
    // conversion.)
    let n = m.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let scale = f32::from_bits(((n + 127) as u32) << 23);
    if x >= -87.0 {
        er * scale
    } else {
        0.0
    }
}

/// Index of the largest logit (lowest index among equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` logits spread over ±`spread` (a fixed pseudo-random pattern).
    fn logits(n: usize, spread: f32, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * spread).collect()
    }

    #[test]
    fn weights_are_the_same_on_every_path() {
        // (AVX2 where this CPU has it, against the plain function token by token: bit for bit.)
        let logits = logits(1001, 20.0, 8);
        let mut w = Vec::new();
        fill_weights(&mut w, &logits, 0.7, 30.0);
        for (&l, &x) in logits.iter().zip(&w) {
            assert_eq!(x.to_bits(), exp_nonpositive(l / 0.7 - 30.0).to_bits(), "logit {l}");
        }
    }

    #[test]
    fn exp_matches_the_library() {
        for i in 0..=1990 {
            let x = -(i as f32) * 0.0437;
            let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
            assert!((got - want).abs() <= 3e-7 * want, "e^{x}: {got} against {want}");
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-88.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(f32::NAN), 0.0);
    }

    #[test]
    fn generator_matches_the_published_xoshiro256() {
        // xoshiro256** from the state (1, 2, 3, 4): the reference implementation's first outputs.
        let mut rng = Rng([1, 2, 3, 4]);
        let got: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
        assert_eq!(got, [11520, 0, 1509978240, 1215971899390074240]);
        let spec = DrawSpec { rng: Rng([1, 2, 3, 4]), ..DrawSpec::greedy() };
        assert_eq!(spec.uniform(), (11520u64 >> 11) as f64 / (1u64 << 53) as f64);
    }

    #[test]
    fn the_draw_point_is_exact() {
        let last = 1.0 - 1.0 / (1u64 << 53) as f64;
        assert_eq!(draw_point(0.0, 12345), 0);
        assert_eq!(draw_point(last, 1 << 40), (1 << 40) - 1);
        // ⌊(2^53 - 1) 2^60 / 2^53⌋ = 2^60 - 2^7: no f64 product could give it.
        assert_eq!(draw_point(last, 1 << 60), (1 << 60) - (1 << 7));
        assert_eq!(draw_point(0.5, 7), 3);
    }

    #[test]
    fn a_share_is_the_weight_times_2_to_the_40_truncated() {
        let mut rng = Rng::new(5);
        let edge = [1.0f32, 0.5, 0.999_999_94, 1e-38, 9.1e-13, 0.0, f32::MIN_POSITIVE, 3.3e-7, f32::NAN];
        let random = (0..100_000).map(|i| (rng.next_f64() as f32).powi(1 + i % 40));
        for w in edge.into_iter().chain(random) {
            assert_eq!(weight_share(w), (w as f64 * (1u64 << 40) as f64) as u64, "w {w:e}");
        }
    }

    #[test]
    fn a_draw_walks_the_shares_in_id_order() {
        // Shares 2^39, 2^40, 2^38: the points below 2/7 of the total pick 0, then 1 up to 6/7.
        let w = [0.5, 1.0, 0.25];
        assert_eq!(weight_share(0.25), 1 << 38);
        for (u, want) in [(0.0, 0), (0.28, 0), (0.29, 1), (0.85, 1), (0.86, 2), (1.0 - 1e-16, 2)] {
            assert_eq!(draw_weighted(&w, u), want, "u {u}");
        }
        // A weight below 2^-40 has no share: never drawn, even by the last point.
        assert_eq!(weight_share(5e-13), 0);
        assert_eq!(draw_weighted(&[1.0, 5e-13], 1.0 - 1e-16), 0);
    }

    #[test]
    fn a_row_with_a_value_that_is_not_finite_draws_nothing() {
        let spec = DrawSpec { temperature: 1.0, top_k: 10, ..DrawSpec::greedy() };
        let mut w = Vec::new();
        let mut row = logits(300, 5.0, 2);
        assert!(draw_row(&row, Among::Vocabulary, &spec, &mut w) >= 0);
        row[17] = f32::NAN;
        assert_eq!(draw_row(&row, Among::Vocabulary, &spec, &mut w), -1);
        let mut cand: Vec<f32> = (0..CANDIDATES).map(|i| -(i as f32)).chain((0..CANDIDATES).map(|i| i as f32)).collect();
        assert!(draw_row(&cand, Among::Candidates, &spec, &mut w) >= 0);
        cand[3] = f32::INFINITY;
        assert_eq!(draw_row(&cand, Among::Candidates, &spec, &mut w), -1);
    }

    #[test]
    fn temperature_zero_takes_the_likeliest() {
        let mut w = Vec::new();
        let spec = DrawSpec::greedy();
        assert_eq!(draw_row(&[0.5, 2.0, -1.0, 2.0], Among::Vocabulary, &spec, &mut w), 1);
        let cand: Vec<f32> = (0..CANDIDATES).map(|i| 10.0 - i as f32).chain((0..CANDIDATES).map(|i| (100 + i) as f32)).collect();
        assert_eq!(draw_row(&cand, Among::Candidates, &spec, &mut w), 100);
    }
}

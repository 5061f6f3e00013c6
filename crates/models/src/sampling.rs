//! Sampling: logit biases, penalties, temperature, top-k, top-p, min-p, and a seeded generator.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use kiln_ir::{Among, CANDIDATES};
use kiln_runtime::draw::{self, draw_listed, draw_weighted, fill_weights, kept, key_id, listed, max_logit, order_key, sum, DrawSpec, Rng};

use crate::ModelError;

/// How the next token is chosen from the logits.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0: none).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of tokens already seen by this (1: off).
    pub repetition_penalty: f32,
    /// Subtract `count * frequency_penalty` from each seen token's logit (0: off).
    pub frequency_penalty: f32,
    /// Subtract `presence_penalty` from each seen token's logit (0: off).
    pub presence_penalty: f32,
    /// Seed of the random generator: the same seed gives the same text.
    pub seed: u64,
    /// Added to these tokens' logits before anything else (OpenAI's `logit_bias`: -100 all but
    /// bans a token, 100 all but forces it).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Checks every field's range.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: &str| Err(ModelError::InvalidParameter(m.to_string()));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p must be in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty must be a finite number > 0");
        }
        if !self.frequency_penalty.is_finite() || !self.presence_penalty.is_finite() {
            return bad("frequency_penalty and presence_penalty must be finite");
        }
        if let Some((id, b)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return bad(&format!("the logit bias of token {id} must be a finite number, got {b}"));
        }
        Ok(())
    }

    /// Checks that every token the parameters name is one of the model's `vocab` tokens.
    pub fn check_vocabulary(&self, vocab: usize) -> Result<(), ModelError> {
        match self.logit_bias.iter().find(|&&(id, _)| id as usize >= vocab) {
            Some((id, _)) => {
                Err(ModelError::InvalidParameter(format!("the logit bias names token {id}, outside the vocabulary of {vocab} tokens")))
            }
            None => Ok(()),
        }
    }

    /// Whether the choice is a plain argmax of the raw logits (so it can run in the graph).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 && !self.has_penalties() && self.logit_bias.is_empty()
    }

    /// Whether any penalty is active.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.frequency_penalty != 0.0 || self.presence_penalty != 0.0
    }
}

/// Chooses tokens from logits under [`SamplingParams`], keeping the counts penalties need.
///
/// A choice costs a few passes over the logits and a sort of a few tokens, never a sort of the
/// vocabulary: the candidates are ordered (higher scaled logit first, then lower id) only as far
/// as top-k, top-p and min-p need to decide which are kept, and the kept ones are drawn from in
/// the order in which they were found (a fixed order: the same seed gives the same choices).
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    counts: std::collections::HashMap<u32, u32>,
    /// Every token's weight e^(l/T - max) in the last whole-vocabulary choice (kept: no
    /// allocation a token).
    weights: Vec<f32>,
}

impl Sampler {
    /// A sampler with `params` (validated).
    pub fn new(params: SamplingParams) -> Result<Self, ModelError> {
        params.validate()?;
        Ok(Sampler { rng: Rng::new(params.seed), params, counts: Default::default(), weights: Vec::new() })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a token of the sequence (prompt or generated) for the penalties.
    pub fn observe(&mut self, id: u32) {
        *self.counts.entry(id).or_insert(0) += 1;
    }

    /// Picks the next token from `logits` (modified in place by the logit biases and penalties).
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        self.adjust(logits);
        self.choose(logits)
    }

    /// Applies the logit biases and the penalties to `logits` (once per step).
    pub fn adjust(&self, logits: &mut [f32]) {
        let p = &self.params;
        for &(id, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        if p.has_penalties() {
            for (&id, &count) in &self.counts {
                let Some(l) = logits.get_mut(id as usize) else { continue };
                if p.repetition_penalty != 1.0 {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
                *l -= count as f32 * p.frequency_penalty + p.presence_penalty;
            }
        }
    }

    /// Picks a token from logits already [`adjust`](Sampler::adjust)ed; tokens at -inf are never
    /// picked while any other is finite.
    ///
    /// The candidates are the `top_k` likeliest tokens (all when 0), their probabilities the
    /// softmax of their logits over `temperature`; of those, most likely first, the kept ones are
    /// the fewest whose probabilities reach `top_p` and are at least `min_p` times the largest.
    pub fn choose(&mut self, logits: &[f32]) -> u32 {
        let kept = self.keep(logits);
        let u = self.next_uniform();
        match kept {
            Kept::One(id) => id,
            Kept::All => draw_weighted(&self.weights, u),
            Kept::Listed(cand) => draw_listed(&cand, u),
        }
    }

    /// The generator's next number in [0, 1), taken where a choice takes one
    /// ([`DrawSpec::next`], as a step's draw does: [`drew`](Sampler::drew)).
    fn next_uniform(&mut self) -> f64 {
        let spec = self.spec();
        self.rng = spec.next().rng;
        spec.uniform()
    }

    /// The tokens `choose` draws from.
    fn keep(&mut self, logits: &[f32]) -> Kept {
        let spec = self.spec();
        let p = &self.params;
        if p.temperature == 0.0 {
            return Kept::One(draw::argmax(logits));
        }
        let t = p.temperature;
        // (Division by T > 0 keeps the order: the largest scaled logit is the largest over T.)
        let top = max_logit(logits);
        let max = top / t;
        if !max.is_finite() {
            // Every logit -inf (or NaN), or one +inf: no softmax; the first candidate.
            return Kept::One(logits.iter().enumerate().map(|(i, &l)| order_key(l / t, i as u32)).max().map_or(0, key_id));
        }
        if p.top_k > 0 && p.top_k < logits.len() {
            return Kept::Listed(listed(top_keys(logits, t, p.top_k).into_iter().map(key_id).map(|i| (i, logits[i as usize])), &spec, max));
        }
        let weights = &mut self.weights;
        fill_weights(weights, logits, t, max);
        if p.top_p >= 1.0 && p.min_p <= 0.0 {
            return Kept::All;
        }
        let total = sum(weights);
        // The tokens by bucket of their scaled logit's distance below the largest: the weight
        // and the least weight of each bucket.
        // (On the raw logits: no division a token; the order is the scaled logits'.)
        let per = BUCKETS as f32 / (BUCKET_RANGE * t);
        let bucket = |l: f32| (((top - l) * per) as usize).min(BUCKETS - 1);
        // No token of the buckets before `b` weighs less than this (a margin for rounding and the
        // weights' error): most tokens are passed over by their weight alone.
        let least_before =
            |b: usize| if b >= BUCKETS { 0.0 } else { 0.99 * (-(b as f64) * (BUCKET_RANGE / BUCKETS as f32) as f64).exp() as f32 };
        // Every token of the buckets before the first where the cut may fall is kept, in any
        // order: there, top-p's sum may be reached (with a margin for the order of the sums) or a
        // weight is under min-p. From that bucket on, the buckets are sorted one by one until
        // the cut is found. (The nearest eighth of the buckets first: the cut of a peaked
        // distribution lies there.)
        let target = p.top_p as f64 * total * (1.0 - 1e-9);
        let (mut mass, mut least) = (vec![0f64; BUCKETS], vec![f32::INFINITY; BUCKETS]);
        let mut first = None;
        for limit in [BUCKETS / 8, BUCKETS] {
            mass.fill(0.0);
            least.fill(f32::INFINITY);
            let floor = least_before(limit);
            for (&l, &w) in logits.iter().zip(weights.iter()) {
                if w > 0.0 && w >= floor {
                    let b = bucket(l);
                    if b < limit {
                        mass[b] += w as f64;
                        least[b] = least[b].min(w);
                    }
                }
            }
            let mut cum = 0.0;
            first = (0..limit).find(|&b| {
                cum += mass[b];
                (p.top_p < 1.0 && cum >= target) || (p.min_p > 0.0 && least[b] < p.min_p)
            });
            if first.is_some() {
                break;
            }
        }
        let Some(first) = first else {
            return Kept::All;
        };
        let positive = weights.iter().filter(|&&w| w > 0.0).count();
        let mut cand: Vec<(u32, f32)> = Vec::new();
        let mut sorted: Vec<u64> = Vec::new();
        let floor = least_before(first + 1);
        for (i, (&l, &w)) in logits.iter().zip(weights.iter()).enumerate() {
            if w > 0.0 && w >= floor {
                match bucket(l).cmp(&first) {
                    Ordering::Less => cand.push((i as u32, w)),
                    Ordering::Equal => sorted.push(order_key(l / t, i as u32)),
                    Ordering::Greater => {}
                }
            }
        }
        let mut b = first;
        loop {
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            cand.extend(sorted.iter().map(|&k| (key_id(k), weights[key_id(k) as usize])));
            // (The last bucket holds every token left.)
            if let Some(keep) = kept(&cand, total, &spec, cand.len() == positive || b == BUCKETS - 1) {
                cand.truncate(keep);
                return Kept::Listed(cand);
            }
            b += 1;
            let floor = least_before(b + 1);
            sorted = logits
                .iter()
                .enumerate()
                .filter(|&(i, &l)| weights[i] > 0.0 && weights[i] >= floor && bucket(l) == b)
                .map(|(i, &l)| order_key(l / t, i as u32))
                .collect();
        }
    }

    /// Whether [`choose_among`](Sampler::choose_among) the [`CANDIDATES`] likeliest tokens chooses
    /// as [`sample`](Sampler::sample) over all of them would: greedy, or top-k below
    /// `CANDIDATES`, with no logit bias and no penalty.
    pub fn chooses_among_candidates(&self) -> bool {
        let p = &self.params;
        p.logit_bias.is_empty() && !p.has_penalties() && (p.temperature == 0.0 || (p.top_k > 0 && p.top_k < CANDIDATES))
    }

    /// What a step's in-graph draw ([`kiln_ir::OutputMode::Drawn`], by [`spec`](Sampler::spec))
    /// chooses among where it chooses as [`sample`](Sampler::sample) would, with the same number
    /// from the generator: a positive temperature, no logit bias, no penalty, and either a top-k
    /// below `CANDIDATES` (among the top-k head's candidates) or no top-k, top-p or min-p cut
    /// (among the whole vocabulary).
    pub fn draws_among(&self) -> Option<Among> {
        let p = &self.params;
        if p.temperature == 0.0 || !p.logit_bias.is_empty() || p.has_penalties() {
            None
        } else if p.top_k > 0 && p.top_k < CANDIDATES {
            Some(Among::Candidates)
        } else if p.top_k == 0 && p.top_p >= 1.0 && p.min_p <= 0.0 {
            Some(Among::Vocabulary)
        } else {
            None
        }
    }

    /// The parameters and the generator's present state, as a step's draw takes them.
    pub fn spec(&self) -> DrawSpec {
        let p = &self.params;
        let top_k = u32::try_from(p.top_k).unwrap_or(u32::MAX);
        DrawSpec { temperature: p.temperature, top_k, top_p: p.top_p, min_p: p.min_p, rng: self.rng }
    }

    /// Advances the generator past a draw a step made with [`spec`](Sampler::spec) (one number
    /// at a positive temperature, as [`choose`](Sampler::choose) takes).
    pub fn drew(&mut self) {
        self.next_uniform();
    }

    /// Picks the next token from the likeliest tokens `cand` (id and logit, likeliest first, as a
    /// top-k head gives them): the token [`sample`](Sampler::sample) picks from the whole
    /// vocabulary's logits, with the same draw, where
    /// [`chooses_among_candidates`](Sampler::chooses_among_candidates) holds (the draw of
    /// [`draw::draw_among`], as a step's in-graph draw). (Unless more than `CANDIDATES - top_k`
    /// logits round to one value over the temperature at the top-k's edge.) Fewer than
    /// `CANDIDATES` are the whole vocabulary.
    pub fn choose_among(&mut self, cand: &[(u32, f32)]) -> u32 {
        if cand.len() < CANDIDATES {
            // A vocabulary of fewer tokens: these are all its logits.
            let mut logits = vec![f32::NEG_INFINITY; cand.len()];
            for &(id, l) in cand {
                if let Some(x) = logits.get_mut(id as usize) {
                    *x = l;
                }
            }
            return self.choose(&logits);
        }
        let id = draw::draw_among(cand, &self.spec());
        self.drew();
        id
    }
}

/// What a choice draws from.
enum Kept {
    /// This token, no draw.
    One(u32),
    /// Every token, by the sampler's `weights`.
    All,
    /// These (id, weight).
    Listed(Vec<(u32, f32)>),
}

/// Buckets of a scaled logit's distance below the largest, over the distances whose weights are
/// not 0 (e^-87): how a whole-vocabulary cut is found without sorting the vocabulary.
const BUCKETS: usize = 4096;
const BUCKET_RANGE: f32 = 88.0;

/// ln Σ e^l over `logits` (whose largest must be finite for a meaningful sum).
pub(crate) fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = max_logit(logits);
    let mut w = Vec::new();
    fill_weights(&mut w, logits, 1.0, max);
    max as f64 + sum(&w).ln()
}

/// The ids of the `n` largest logits (at most all), largest first (the lower id first among
/// equals).
pub(crate) fn top_ids(logits: &[f32], n: usize) -> Vec<u32> {
    top_keys(logits, 1.0, n.min(logits.len())).into_iter().map(key_id).collect()
}

/// The `k` largest candidate keys of `logits` over temperature `t`, largest first. (Tokens come
/// in id order: one whose raw logit is below the least kept one's cannot displace it, and one
/// equal to it loses on the id, so most are passed over with one comparison.)
fn top_keys(logits: &[f32], t: f32, k: usize) -> Vec<u64> {
    let mut heap = BinaryHeap::with_capacity(k + 1);
    let mut least = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if heap.len() == k && l.partial_cmp(&least) != Some(Ordering::Greater) {
            continue;
        }
        let key = order_key(l / t, i as u32);
        if heap.len() < k {
            heap.push(Reverse((key, l.to_bits())));
        } else if heap.peek().is_some_and(|m| key > m.0 .0) {
            heap.pop();
            heap.push(Reverse((key, l.to_bits())));
        } else {
            continue;
        }
        if heap.len() == k {
            least = heap.peek().map_or(f32::NEG_INFINITY, |m| f32::from_bits(m.0 .1));
        }
    }
    let mut keys: Vec<u64> = heap.into_iter().map(|r| r.0 .0).collect();
    keys.sort_unstable_by(|a, b| b.cmp(a));
    keys
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_runtime::draw::exp_nonpositive;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, seed: 7, ..Default::default() }
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(params(0.0)).unwrap();
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.0, 3.0]), 1);
    }

    #[test]
    fn same_seed_same_choices() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..params(1.0) }).unwrap();
            (0..50).map(|_| s.sample(&mut logits.clone())).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(SamplingParams { top_k: 1, ..params(5.0) }).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&mut [0.0, 1.0, 0.5]), 1);
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // probabilities ~ [0.8, 0.1, 0.1]: top_p 0.5 and min_p 0.5 both keep only token 0
        let logits = [2.0794f32, 0.0, 0.0];
        for p in [SamplingParams { top_p: 0.5, ..params(1.0) }, SamplingParams { min_p: 0.5, ..params(1.0) }] {
            let mut s = Sampler::new(p).unwrap();
            for _ in 0..50 {
                assert_eq!(s.sample(&mut logits.clone()), 0);
            }
        }
    }

    #[test]
    fn repetition_penalty_discourages_seen_tokens() {
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 4.0, ..params(0.0) }).unwrap();
        s.observe(0);
        assert_eq!(s.sample(&mut [2.0, 1.0]), 1);
    }

    #[test]
    fn logit_bias_bans_and_boosts_tokens() {
        let logits = [0.1f32, 3.0, 2.0];
        let mut s = Sampler::new(SamplingParams { logit_bias: vec![(1, -100.0)], ..params(0.0) }).unwrap();
        assert!(!s.params().is_greedy(), "a biased choice cannot be the graph's argmax");
        assert_eq!(s.sample(&mut logits.clone()), 2);
        let mut s = Sampler::new(SamplingParams { logit_bias: vec![(0, 100.0)], ..params(1.0) }).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits.clone()), 0);
        }
        let p = SamplingParams { logit_bias: vec![(2, 1.0), (3, 1.0)], ..params(0.0) };
        assert!(p.check_vocabulary(4).is_ok());
        assert!(p.check_vocabulary(3).unwrap_err().to_string().contains("token 3, outside the vocabulary of 3 tokens"));
    }

    /// The kept set as the sampler once made it: every candidate sorted, the cut walked from
    /// the top (ids in increasing order).
    fn kept_by_sorting(logits: &[f32], p: &SamplingParams) -> Vec<u32> {
        let t = p.temperature;
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / t)).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let w: Vec<f64> = cand.iter().map(|c| exp_nonpositive(c.1 - max) as f64).collect();
        let total: f64 = w.iter().sum();
        let mut keep = w.iter().take_while(|&&w| w > 0.0).count().max(1);
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, w) in w.iter().enumerate() {
                cum += w;
                if cum >= p.top_p as f64 * total {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            keep = keep.min(w.iter().take_while(|&&w| w >= p.min_p as f64).count().max(1));
        }
        let mut ids: Vec<u32> = cand[..keep].iter().map(|c| c.0).collect();
        ids.sort();
        ids
    }

    /// Logits of `n` tokens: uniform in [-spread, spread], a few tokens `lift` higher, some -inf
    /// and some repeated values (ties).
    fn test_logits(n: usize, spread: f32, lift: f32, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        let mut l: Vec<f32> = (0..n).map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * spread).collect();
        for _ in 0..n / 50 + 1 {
            let i = (rng.next_u64() % n as u64) as usize;
            l[i] += lift;
        }
        for _ in 0..n / 20 {
            let i = (rng.next_u64() % n as u64) as usize;
            l[i] = f32::NEG_INFINITY;
        }
        for _ in 0..n / 20 {
            let (i, j) = ((rng.next_u64() % n as u64) as usize, (rng.next_u64() % n as u64) as usize);
            l[i] = l[j];
        }
        l
    }

    #[test]
    fn choosing_among_the_likeliest_is_choosing_from_all_logits() {
        let mut cases = 0;
        for (n, spread, lift) in [(7, 2.0, 1.0), (300, 1.0, 0.5), (5000, 30.0, 20.0), (70_000, 4.0, 3.0)] {
            let logits = test_logits(n, spread, lift, n as u64 + 1);
            let mut likeliest: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
            likeliest.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            likeliest.truncate(kiln_ir::CANDIDATES);
            for temperature in [0.0, 0.3, 1.0, 2.5] {
                for top_k in [1, 3, 40, kiln_ir::CANDIDATES - 1] {
                    for (top_p, min_p) in [(1.0, 0.0), (0.9, 0.0), (1.0, 0.05), (0.5, 0.2)] {
                        let p = SamplingParams { temperature, top_k, top_p, min_p, seed: cases, ..Default::default() };
                        let (mut all, mut among) = (Sampler::new(p.clone()).unwrap(), Sampler::new(p).unwrap());
                        assert!(among.chooses_among_candidates());
                        for draw in 0..6 {
                            assert_eq!(
                                all.choose(&logits),
                                among.choose_among(&likeliest),
                                "{n} tokens, T {temperature}, top-k {top_k}, top-p {top_p}, min-p {min_p}, draw {draw}"
                            );
                        }
                        cases += 1;
                    }
                }
            }
        }
        assert_eq!(cases, 256);
        // Where the likeliest tokens do not decide, the sampler needs every logit.
        let takes = |p: SamplingParams| Sampler::new(p).unwrap().chooses_among_candidates();
        assert!(takes(params(0.0)));
        assert!(!takes(SamplingParams { top_k: 0, ..params(1.0) }));
        assert!(!takes(SamplingParams { top_k: kiln_ir::CANDIDATES, ..params(1.0) }));
        assert!(!takes(SamplingParams { top_k: 5, logit_bias: vec![(1, 2.0)], ..params(1.0) }));
        assert!(!takes(SamplingParams { top_k: 5, presence_penalty: 0.5, ..params(1.0) }));
    }

    #[test]
    fn kept_tokens_are_those_of_a_full_sort() {
        let mut cases = 0;
        // (The last: one token 11 above a flat tail that holds most of the mass: the likeliest
        // few do not decide top-p.)
        let mut peak = test_logits(70_000, 1.0, 0.0, 9);
        peak[17] = 11.0;
        for (n, spread, lift) in
            [(7, 2.0, 1.0), (300, 1.0, 0.5), (3000, 8.0, 6.0), (5000, 30.0, 20.0), (70_000, 4.0, 3.0), (70_000, 0.0, 0.0)]
        {
            let logits = if spread > 0.0 { test_logits(n, spread, lift, n as u64) } else { peak.clone() };
            for temperature in [0.3, 1.0, 2.5] {
                for top_k in [0, 1, 3, 40, n - 1, n + 5] {
                    for (top_p, min_p) in [(1.0, 0.0), (0.95, 0.0), (0.5, 0.0), (0.01, 0.0), (1.0, 0.05), (1.0, 0.6), (0.9, 0.1)] {
                        let p = SamplingParams { temperature, top_k, top_p, min_p, ..Default::default() };
                        let mut s = Sampler::new(p.clone()).unwrap();
                        let mut ids: Vec<u32> = match s.keep(&logits) {
                            Kept::One(id) => vec![id],
                            Kept::All => (0..n as u32).filter(|&i| s.weights[i as usize] > 0.0).collect(),
                            Kept::Listed(c) => c.iter().map(|c| c.0).collect(),
                        };
                        ids.sort();
                        assert_eq!(ids, kept_by_sorting(&logits, &p), "n {n}, {p:?}");
                        cases += 1;
                    }
                }
            }
        }
        assert_eq!(cases, 6 * 3 * 6 * 7);
    }

    #[test]
    fn draws_follow_the_probabilities() {
        // 3000 tokens (runs of RUN walked past whole), the mass on a few spread over the runs:
        // each drawn about as often as its probability says (within 5 standard deviations).
        let mut logits = vec![f32::NEG_INFINITY; 3000];
        let hot = [(5usize, 0.0f32), (1023, 1.0), (1024, 0.5), (2047, -1.0), (2999, 2.0)];
        for &(i, l) in &hot {
            logits[i] = l;
        }
        let total: f64 = hot.iter().map(|h| (h.1 as f64).exp()).sum();
        for top_k in [0, 4] {
            let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k, seed: 5, ..Default::default() }).unwrap();
            let draws = 20_000;
            let mut counts = std::collections::HashMap::new();
            for _ in 0..draws {
                *counts.entry(s.choose(&logits)).or_insert(0usize) += 1;
            }
            // top-k 4 drops the least likely (2047) and renormalizes the others.
            let kept: Vec<(usize, f32)> = hot.iter().copied().filter(|&(i, _)| top_k == 0 || i != 2047).collect();
            let total = if top_k == 0 { total } else { total - (-1f64).exp() };
            assert_eq!(counts.len(), kept.len(), "{counts:?}");
            for (i, l) in kept {
                let q = (l as f64).exp() / total;
                let want = q * draws as f64;
                let sd = (draws as f64 * q * (1.0 - q)).sqrt();
                let got = counts[&(i as u32)] as f64;
                assert!((got - want).abs() < 5.0 * sd, "token {i}: {got} draws, {want:.0} expected (top_k {top_k})");
            }
        }
    }

    #[test]
    fn degenerate_logits_pick_the_first_candidate() {
        let mut s = Sampler::new(params(1.0)).unwrap();
        assert_eq!(s.choose(&[f32::NEG_INFINITY; 4]), 0);
        assert_eq!(s.choose(&[0.0, f32::INFINITY, 1.0, f32::INFINITY]), 1);
        for _ in 0..20 {
            assert_eq!(s.choose(&[f32::NEG_INFINITY, -3.0, f32::NEG_INFINITY]), 1, "the only finite logit");
        }
    }

    #[test]
    fn log_sum_exp_and_top_ids_match_plain_sums() {
        let logits = test_logits(5000, 12.0, 9.0, 3);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let want = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
        assert!((log_sum_exp(&logits) - want).abs() < 1e-6, "{} against {want}", log_sum_exp(&logits));
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        for n in [0, 1, 7, 4999, 5000, 6000] {
            assert_eq!(top_ids(&logits, n), order[..n.min(5000)], "n {n}");
        }
    }

    #[test]
    fn rejects_bad_params() {
        assert!(Sampler::new(params(-1.0)).is_err());
        assert!(Sampler::new(SamplingParams { top_p: 0.0, ..params(1.0) }).is_err());
        assert!(Sampler::new(SamplingParams { min_p: 2.0, ..params(1.0) }).is_err());
        assert!(Sampler::new(SamplingParams { repetition_penalty: 0.0, ..params(1.0) }).is_err());
        assert!(Sampler::new(SamplingParams { logit_bias: vec![(1, f32::NAN)], ..params(1.0) }).is_err());
    }
}

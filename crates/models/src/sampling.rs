//! Sampling: logit biases, penalties, temperature, top-k, top-p, min-p, and a seeded generator.

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

/// xoshiro256** seeded through splitmix64: small, fast, reproducible across platforms.
#[derive(Clone, Debug)]
struct Rng([u64; 4]);

impl Rng {
    fn new(seed: u64) -> Self {
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

    fn next_u64(&mut self) -> u64 {
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

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Chooses tokens from logits under [`SamplingParams`], keeping the counts penalties need.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    counts: std::collections::HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler with `params` (validated).
    pub fn new(params: SamplingParams) -> Result<Self, ModelError> {
        params.validate()?;
        Ok(Sampler { rng: Rng::new(params.seed), params, counts: Default::default() })
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
    pub fn choose(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        // Candidates, most likely first (top-k narrows the sort when set).
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)).collect();
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            cand.truncate(p.top_k);
        }
        cand.sort_unstable_by(by_logit);
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        // (Tokens at -inf have probability 0 and come last.)
        let mut keep = probs.iter().take_while(|&&q| q > 0.0).count().max(1);
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, q) in probs.iter().enumerate() {
                cum += q;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        let total: f64 = probs[..keep].iter().sum();
        let mut r = self.rng.next_f64() * total;
        for (c, q) in cand.iter().zip(&probs[..keep]) {
            if r < *q {
                return c.0;
            }
            r -= q;
        }
        cand[keep - 1].0
    }
}

/// Index of the largest logit (lowest index among equals).
fn argmax(logits: &[f32]) -> u32 {
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

    #[test]
    fn rejects_bad_params() {
        assert!(Sampler::new(params(-1.0)).is_err());
        assert!(Sampler::new(SamplingParams { top_p: 0.0, ..params(1.0) }).is_err());
        assert!(Sampler::new(SamplingParams { min_p: 2.0, ..params(1.0) }).is_err());
        assert!(Sampler::new(SamplingParams { repetition_penalty: 0.0, ..params(1.0) }).is_err());
        assert!(Sampler::new(SamplingParams { logit_bias: vec![(1, f32::NAN)], ..params(1.0) }).is_err());
    }
}

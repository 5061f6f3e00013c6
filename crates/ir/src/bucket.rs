//! Shape buckets: which static shape a request of a given length runs in.

/// The static shape a plan is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Bucket {
    /// Prompt processing of up to `rows` new tokens in one step, from up to `seqs` sequences
    /// (consecutive rows of one sequence each, with its own KV cache and positions).
    Prefill {
        /// Row capacity of the plan (active rows may be fewer).
        rows: usize,
        /// Sequences prefilled together (1 for a single prompt; a power of two above).
        seqs: usize,
    },
    /// One new token for each of up to `seqs` sequences (row r is sequence r, with its own KV
    /// cache and position), each attending to at most `past` earlier positions.
    Decode {
        /// Upper bound on the past length (a power of two, or the context size).
        past: usize,
        /// Row capacity: sequences decoded together in one step (a power of two).
        seqs: usize,
    },
}

impl Bucket {
    /// Row capacity of a plan compiled for this bucket.
    pub fn rows(&self) -> usize {
        match *self {
            Bucket::Prefill { rows, .. } => rows,
            Bucket::Decode { seqs, .. } => seqs,
        }
    }

    /// Sequences a plan compiled for this bucket takes in one step.
    pub fn seqs(&self) -> usize {
        match *self {
            Bucket::Prefill { seqs, .. } | Bucket::Decode { seqs, .. } => seqs,
        }
    }

    /// Upper bound on the number of positions already in the KV cache when this plan runs.
    pub fn max_past(&self, context: usize) -> usize {
        match *self {
            Bucket::Prefill { rows, .. } => context.saturating_sub(rows),
            Bucket::Decode { past, .. } => past,
        }
    }
}

/// The one bucket policy: maps real lengths to buckets.
///
/// Prefill: the next power of two when it wastes at most 1/8 of the rows, else the exact length,
/// capped at the context size, and a power-of-two ladder over the sequences prefilled together.
/// Decode: a power-of-two ladder over the longest past length of the
/// batch (starting at `min_decode_past`), capped at the context size, and a power-of-two ladder
/// over the number of sequences decoded together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketPolicy {
    /// Context size (the cap of every bucket).
    pub context: usize,
    /// Smallest decode bucket.
    pub min_decode_past: usize,
}

impl BucketPolicy {
    /// A policy for a context of `context` positions.
    pub fn new(context: usize) -> Self {
        BucketPolicy { context, min_decode_past: 64 }
    }

    /// The prefill bucket for `n` new tokens (`n >= 1`) of one sequence.
    pub fn prefill(&self, n: usize) -> Bucket {
        self.prefill_batch(n, 1)
    }

    /// The prefill bucket for `n` new tokens (`n >= 1`) from `seqs` sequences prefilled together.
    pub fn prefill_batch(&self, n: usize, seqs: usize) -> Bucket {
        let n = n.max(1);
        let pow2 = n.next_power_of_two();
        // waste (pow2 - n) / pow2 <= 1/8  <=>  8 * (pow2 - n) <= pow2
        let rows = if 8 * (pow2 - n) <= pow2 { pow2 } else { n };
        Bucket::Prefill { rows: rows.min(self.context.max(n)), seqs: seqs.clamp(1, n).next_power_of_two() }
    }

    /// The decode bucket for one sequence whose KV cache already holds `past` positions.
    pub fn decode(&self, past: usize) -> Bucket {
        self.decode_batch(past, 1)
    }

    /// The decode bucket for `seqs` sequences (`seqs >= 1`) decoded in one step, the longest of
    /// which already holds `max_past` positions.
    pub fn decode_batch(&self, max_past: usize, seqs: usize) -> Bucket {
        let need = (max_past + 1).max(self.min_decode_past);
        Bucket::Decode { past: need.next_power_of_two().min(self.context.max(need)), seqs: seqs.max(1).next_power_of_two() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_rounds_up_only_when_cheap() {
        let p = BucketPolicy::new(4096);
        assert_eq!(p.prefill(1), Bucket::Prefill { rows: 1, seqs: 1 });
        assert_eq!(p.prefill(6), Bucket::Prefill { rows: 6, seqs: 1 }); // 8 would waste 2/8
        assert_eq!(p.prefill(7), Bucket::Prefill { rows: 8, seqs: 1 }); // wastes 1/8
        assert_eq!(p.prefill(8), Bucket::Prefill { rows: 8, seqs: 1 });
        assert_eq!(p.prefill(9), Bucket::Prefill { rows: 9, seqs: 1 });
        assert_eq!(p.prefill(120), Bucket::Prefill { rows: 128, seqs: 1 });
        assert_eq!(p.prefill(111), Bucket::Prefill { rows: 111, seqs: 1 });
        assert_eq!(p.prefill(112), Bucket::Prefill { rows: 128, seqs: 1 });
        assert_eq!(p.prefill(700), Bucket::Prefill { rows: 700, seqs: 1 });
    }

    #[test]
    fn prefill_batch_ladder_over_sequences() {
        let p = BucketPolicy::new(4096);
        assert_eq!(p.prefill_batch(7, 1), p.prefill(7));
        assert_eq!(p.prefill_batch(98, 8), Bucket::Prefill { rows: 98, seqs: 8 });
        assert_eq!(p.prefill_batch(120, 5), Bucket::Prefill { rows: 128, seqs: 8 });
        assert_eq!(p.prefill_batch(3, 3), Bucket::Prefill { rows: 3, seqs: 4 });
        assert_eq!(p.prefill_batch(2, 0), Bucket::Prefill { rows: 2, seqs: 1 });
    }

    #[test]
    fn prefill_capped_at_context() {
        let p = BucketPolicy::new(60);
        assert_eq!(p.prefill(57), Bucket::Prefill { rows: 60, seqs: 1 });
        assert_eq!(p.prefill(60), Bucket::Prefill { rows: 60, seqs: 1 });
    }

    #[test]
    fn decode_ladder() {
        let p = BucketPolicy::new(1000);
        assert_eq!(p.decode(0), Bucket::Decode { past: 64, seqs: 1 });
        assert_eq!(p.decode(63), Bucket::Decode { past: 64, seqs: 1 });
        assert_eq!(p.decode(64), Bucket::Decode { past: 128, seqs: 1 });
        assert_eq!(p.decode(600), Bucket::Decode { past: 1000, seqs: 1 });
        for past in 0..999 {
            let Bucket::Decode { past: upper, .. } = p.decode(past) else { unreachable!() };
            assert!(upper > past && upper <= 1000);
        }
    }

    #[test]
    fn decode_batch_ladder() {
        let p = BucketPolicy::new(1000);
        assert_eq!(p.decode_batch(10, 1), p.decode(10));
        assert_eq!(p.decode_batch(10, 2), Bucket::Decode { past: 64, seqs: 2 });
        assert_eq!(p.decode_batch(100, 3), Bucket::Decode { past: 128, seqs: 4 });
        assert_eq!(p.decode_batch(100, 5), Bucket::Decode { past: 128, seqs: 8 });
        assert_eq!(p.decode_batch(100, 8), Bucket::Decode { past: 128, seqs: 8 });
        assert_eq!(p.decode_batch(0, 0).rows(), 1);
        assert_eq!(p.decode_batch(0, 32).rows(), 32);
    }
}

//! The compile cache: executables kept per bucket, least recently used evicted.

use kiln_ir::{Bucket, OutputMode};

use crate::{Executable, RuntimeError};

/// What identifies a compiled plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanKey {
    /// The plan's output.
    pub mode: OutputMode,
    /// Its static shape.
    pub bucket: Bucket,
}

struct Entry {
    key: PlanKey,
    exec: Box<dyn Executable>,
    last_used: u64,
}

/// Executables by [`PlanKey`], at most `capacity` of them.
pub struct CompileCache {
    capacity: usize,
    entries: Vec<Entry>,
    clock: u64,
    compiles: u64,
}

impl CompileCache {
    /// An empty cache holding at most `capacity` plans (at least one).
    pub fn new(capacity: usize) -> Self {
        CompileCache { capacity: capacity.max(1), entries: Vec::new(), clock: 0, compiles: 0 }
    }

    /// The executable for `key`, compiling it with `build` on a miss.
    pub fn get_or_compile(
        &mut self,
        key: PlanKey,
        build: impl FnOnce() -> Result<Box<dyn Executable>, RuntimeError>,
    ) -> Result<&mut dyn Executable, RuntimeError> {
        self.clock += 1;
        let idx = match self.entries.iter().position(|e| e.key == key) {
            Some(i) => i,
            None => {
                let exec = build()?;
                self.compiles += 1;
                if self.entries.len() >= self.capacity {
                    let lru = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used).unwrap_or(0);
                    self.entries.swap_remove(lru);
                }
                self.entries.push(Entry { key, exec, last_used: 0 });
                self.entries.len() - 1
            }
        };
        self.entries[idx].last_used = self.clock;
        Ok(self.entries[idx].exec.as_mut())
    }

    /// Keys of the plans held now.
    pub fn keys(&self) -> Vec<PlanKey> {
        self.entries.iter().map(|e| e.key).collect()
    }

    /// How many plans were compiled so far (misses).
    pub fn compiles(&self) -> u64 {
        self.compiles
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use kiln_ir::{Bucket, OutputMode};

    use super::*;
    use crate::{HostTensor, KvCache, Plan, StepInputs};

    /// An executable that only remembers which build made it (in its plan's arena size).
    struct Dummy(Plan);

    impl Executable for Dummy {
        fn plan(&self) -> &Plan {
            &self.0
        }

        fn run(&mut self, _: StepInputs<'_>, _: &mut dyn KvCache) -> Result<Vec<HostTensor>, RuntimeError> {
            Ok(Vec::new())
        }
    }

    fn key(rows: usize) -> PlanKey {
        PlanKey { mode: OutputMode::Logits, bucket: Bucket::Prefill { rows, seqs: 1 } }
    }

    /// Looks `k` up; builds a dummy tagged `tag` on a miss. Returns the tag of the executable
    /// handed back and whether `build` ran.
    fn get(cache: &mut CompileCache, k: PlanKey, tag: usize) -> (usize, bool) {
        let built = Cell::new(false);
        let exec = cache
            .get_or_compile(k, || {
                built.set(true);
                Ok(Box::new(Dummy(Plan { bucket: k.bucket, steps: Vec::new(), arena_words: tag, inputs: Vec::new(), outputs: Vec::new() })))
            })
            .unwrap();
        assert_eq!(exec.plan().bucket, k.bucket);
        (exec.plan().arena_words, built.get())
    }

    fn held(cache: &CompileCache) -> Vec<usize> {
        let mut rows: Vec<usize> = cache.keys().iter().map(|k| k.bucket.rows()).collect();
        rows.sort_unstable();
        rows
    }

    #[test]
    fn evicts_the_least_recently_used_plan() {
        let (a, b, c) = (key(1), key(2), key(3));
        let mut cache = CompileCache::new(2);
        assert_eq!(get(&mut cache, a, 10), (10, true));
        assert_eq!(get(&mut cache, b, 20), (20, true));
        assert_eq!(cache.compiles(), 2);
        // A hit: the first executable, not rebuilt; `a` is now the most recently used.
        assert_eq!(get(&mut cache, a, 11), (10, false));
        assert_eq!(cache.compiles(), 2);
        // Full: `c` evicts `b`, the least recently used.
        assert_eq!(get(&mut cache, c, 30), (30, true));
        assert_eq!(held(&cache), [1, 3]);
        // `b` comes back as a new build and evicts `a` (used before `c`).
        assert_eq!(get(&mut cache, b, 21), (21, true));
        assert_eq!(held(&cache), [2, 3]);
        assert_eq!(get(&mut cache, c, 31), (30, false));
        assert_eq!(get(&mut cache, a, 12), (12, true));
        assert_eq!(held(&cache), [1, 3]);
        assert_eq!(cache.compiles(), 5);
    }

    #[test]
    fn the_same_bucket_in_another_mode_is_another_plan() {
        let mut cache = CompileCache::new(2);
        let greedy = PlanKey { mode: OutputMode::NextToken, bucket: Bucket::Decode { past: 64, seqs: 1 } };
        let sampled = PlanKey { mode: OutputMode::Logits, ..greedy };
        assert_eq!(get(&mut cache, greedy, 1), (1, true));
        assert_eq!(get(&mut cache, sampled, 2), (2, true));
        assert_eq!(get(&mut cache, greedy, 3), (1, false));
        assert_eq!(cache.compiles(), 2);
    }

    #[test]
    fn a_failed_build_changes_nothing() {
        let (a, b, c) = (key(1), key(2), key(3));
        let mut cache = CompileCache::new(2);
        get(&mut cache, a, 10);
        get(&mut cache, b, 20);
        let err = cache.get_or_compile(c, || Err(RuntimeError::Compile("no such op".into()))).err().expect("the build failed");
        assert!(err.to_string().contains("no such op"), "{err}");
        assert_eq!(held(&cache), [1, 2]);
        assert_eq!(cache.compiles(), 2);
        // Both plans are still there, and the LRU order is intact: `a` is evicted next.
        assert_eq!(get(&mut cache, b, 21), (20, false));
        assert_eq!(get(&mut cache, c, 30), (30, true));
        assert_eq!(held(&cache), [2, 3]);
    }

    #[test]
    fn capacity_zero_still_holds_one_plan() {
        let mut cache = CompileCache::new(0);
        assert_eq!(get(&mut cache, key(1), 1), (1, true));
        assert_eq!(get(&mut cache, key(1), 2), (1, false));
        assert_eq!(get(&mut cache, key(2), 3), (3, true));
        assert_eq!(held(&cache), [2]);
        assert_eq!(cache.compiles(), 2);
    }
}

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

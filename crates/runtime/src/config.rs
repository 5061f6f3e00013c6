//! The one configuration struct of the engine, set from CLI flags.

/// Engine settings. Every knob of the runtime lives here; front ends fill it from their flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// CPU worker threads, the caller included (0: one per available core).
    pub threads: usize,
    /// Context size in tokens (0: the model's trained context length).
    pub context: usize,
    /// Most rows one prefill step processes; longer prompts run as several chunks.
    pub max_prefill_rows: usize,
    /// Most rows one prefill step processes when every row's logits are wanted (bounds the
    /// memory of a `[rows, vocab]` logits buffer).
    pub max_logit_rows: usize,
    /// Compiled plans kept in the compile cache (least recently used ones are evicted).
    pub plan_cache_capacity: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { threads: 0, context: 8192, max_prefill_rows: 512, max_logit_rows: 64, plan_cache_capacity: 16 }
    }
}

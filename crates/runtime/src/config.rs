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
    /// Which kernel family the backend runs: fast (integer-quantized activations, integer dot
    /// products) or exact (weights dequantized to f32, f32 accumulation; the reference path).
    pub kernels: KernelPrecision,
    /// Element type of the KV cache (f32: the reference's numerics; f16: half the memory and
    /// the cache reads, as llama.cpp's default).
    pub kv_type: KvType,
}

/// The element type a KV cache stores keys and values in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvType {
    /// 32-bit floats: what the step computes, stored unrounded.
    #[default]
    F32,
    /// IEEE half precision (rounded to nearest even; 11 significant bits, magnitudes up to 65504).
    F16,
}

impl KvType {
    /// Bytes of one stored element.
    pub fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }

    /// The name used on the command line and in messages (`f32`, `f16`).
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
        }
    }
}

/// The numerics of a backend's kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelPrecision {
    /// Activations quantized to integer blocks per row, integer dot products with the packed
    /// weights (as ggml does, at a finer level); formats without such a kernel fall back to the
    /// exact one.
    #[default]
    Fast,
    /// Weights dequantized exactly to f32 and dotted with f32 activations.
    Exact,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads: 0,
            context: 8192,
            max_prefill_rows: 512,
            max_logit_rows: 64,
            plan_cache_capacity: 16,
            kernels: KernelPrecision::Fast,
            kv_type: KvType::F32,
        }
    }
}

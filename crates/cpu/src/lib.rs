//! kiln's CPU backend: exact and fast (16-bit integer activation, integer dot product) kernels over packed
//! weights, a low-overhead thread pool, a host-resident KV cache, and the executor that runs
//! compiled plans.

mod exec;
mod fast;
mod kernels;
mod kv;
mod pool;
mod simd;
mod weights;

use std::sync::Arc;

use kiln_runtime::{Backend, DeviceWeights, EngineConfig, Executable, KernelPrecision, KvCache, KvLayout, Plan, RuntimeError, WeightStore};

pub use exec::CpuExecutable;
pub use kv::CpuKvCache;
pub use pool::ThreadPool;
pub use simd::Isa;
pub use weights::CpuWeights;

/// The CPU as a kiln device.
pub struct CpuBackend {
    pool: Arc<ThreadPool>,
    isa: Isa,
    kernels: KernelPrecision,
}

impl CpuBackend {
    /// A CPU backend with `threads` threads (0: one per core) running the exact kernels with the
    /// best instruction set.
    pub fn new(threads: usize) -> Self {
        Self::with_isa(threads, simd::active_isa(), KernelPrecision::Exact)
    }

    /// The backend `config` asks for: its thread count and kernel precision, the best instruction set.
    pub fn from_config(config: &EngineConfig) -> Self {
        Self::with_isa(config.threads, simd::active_isa(), config.kernels)
    }

    /// Forcing instruction-set variant `isa` and kernel family `kernels` (tests and comparisons).
    pub fn with_isa(threads: usize, isa: Isa, kernels: KernelPrecision) -> Self {
        CpuBackend { pool: Arc::new(ThreadPool::new(threads)), isa, kernels }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu ({:?}, {:?} kernels, {} threads)", self.isa, self.kernels, self.pool.threads())
    }

    fn load_weights(&self, store: &Arc<WeightStore>) -> Result<Arc<dyn DeviceWeights>, RuntimeError> {
        Ok(Arc::new(CpuWeights::new(store.clone())?))
    }

    fn prepare(&self, plan: Arc<Plan>, weights: &Arc<dyn DeviceWeights>) -> Result<Box<dyn Executable>, RuntimeError> {
        let weights = weights_of(weights)?;
        Ok(Box::new(CpuExecutable::new(plan, weights, self.pool.clone(), self.isa, self.kernels)?))
    }

    fn new_kv_cache(&self, layout: &KvLayout) -> Result<Box<dyn KvCache>, RuntimeError> {
        Ok(Box::new(CpuKvCache::new(layout)))
    }

    fn batches_from(&self) -> usize {
        2
    }

    fn takes_candidates(&self, _vocab: usize) -> bool {
        true
    }

    fn draws(&self, among: kiln_ir::Among, vocab: usize) -> bool {
        among == kiln_ir::Among::Vocabulary || vocab >= kiln_ir::CANDIDATES
    }
}

/// Recovers the CPU weights behind a `dyn DeviceWeights`.
fn weights_of(w: &Arc<dyn DeviceWeights>) -> Result<Arc<CpuWeights>, RuntimeError> {
    w.clone()
        .into_any()
        .downcast::<CpuWeights>()
        .map_err(|_| RuntimeError::Backend { backend: "cpu".into(), msg: "weights were loaded by another backend".into() })
}

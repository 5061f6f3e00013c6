//! kiln's CPU backend: exact kernels over packed weights, a low-overhead thread pool, a
//! host-resident KV cache, and the executor that runs compiled plans.

mod exec;
mod kernels;
mod kv;
mod pool;
mod simd;
mod weights;

use std::sync::Arc;

use kiln_runtime::{Backend, DeviceWeights, Executable, KvCache, KvLayout, Plan, RuntimeError, WeightStore};

pub use exec::CpuExecutable;
pub use kv::CpuKvCache;
pub use pool::ThreadPool;
pub use simd::Isa;
pub use weights::CpuWeights;

/// The CPU as a kiln device.
pub struct CpuBackend {
    pool: Arc<ThreadPool>,
    isa: Isa,
}

impl CpuBackend {
    /// A CPU backend with `threads` threads (0: one per core), using the best instruction set.
    pub fn new(threads: usize) -> Self {
        CpuBackend { pool: Arc::new(ThreadPool::new(threads)), isa: simd::active_isa() }
    }

    /// Same, forcing instruction-set variant `isa` (for tests and comparisons).
    pub fn with_isa(threads: usize, isa: Isa) -> Self {
        CpuBackend { pool: Arc::new(ThreadPool::new(threads)), isa }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu ({:?}, {} threads)", self.isa, self.pool.threads())
    }

    fn load_weights(&self, store: &Arc<WeightStore>) -> Result<Arc<dyn DeviceWeights>, RuntimeError> {
        Ok(Arc::new(CpuWeights::new(store.clone())?))
    }

    fn prepare(&self, plan: Arc<Plan>, weights: &Arc<dyn DeviceWeights>) -> Result<Box<dyn Executable>, RuntimeError> {
        let weights = weights_of(weights)?;
        Ok(Box::new(CpuExecutable::new(plan, weights, self.pool.clone(), self.isa)?))
    }

    fn new_kv_cache(&self, layout: &KvLayout) -> Result<Box<dyn KvCache>, RuntimeError> {
        Ok(Box::new(CpuKvCache::new(layout)))
    }
}

/// Recovers the CPU weights behind a `dyn DeviceWeights`.
fn weights_of(w: &Arc<dyn DeviceWeights>) -> Result<Arc<CpuWeights>, RuntimeError> {
    w.clone()
        .into_any()
        .downcast::<CpuWeights>()
        .map_err(|_| RuntimeError::Backend { backend: "cpu".into(), msg: "weights were loaded by another backend".into() })
}

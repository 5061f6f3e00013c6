//! kiln's CUDA backend: kernels in CUDA C compiled at run time by NVRTC for the device's
//! architecture (cached on disk), weights uploaded once in packed block form, a device-resident
//! KV cache, decode steps captured once per plan as CUDA graphs, and cuBLAS for prefill GEMMs.
//!
//! The CUDA libraries are loaded dynamically: the crate builds on machines without CUDA, and
//! [`CudaBackend::new`] reports a clear error where no driver or device is present.

mod device;
mod exec;
mod kv;
mod weights;

use std::sync::Arc;

use kiln_runtime::{Backend, DeviceWeights, Executable, KvCache, KvLayout, Plan, RuntimeError, WeightStore};

pub use device::Device;
pub use exec::CudaExecutable;
pub use kv::CudaKvCache;
pub use weights::CudaWeights;

/// An NVIDIA GPU as a kiln device.
pub struct CudaBackend {
    device: Arc<Device>,
    ordinal: usize,
    use_graphs: bool,
}

impl CudaBackend {
    /// The backend on device `ordinal`, with decode steps replayed as CUDA graphs.
    pub fn new(ordinal: usize) -> Result<Self, RuntimeError> {
        Ok(CudaBackend { device: Arc::new(Device::open(ordinal)?), ordinal, use_graphs: true })
    }

    /// Same, launching every kernel of every step from the host instead of replaying graphs
    /// (for tests and comparisons).
    pub fn without_graphs(ordinal: usize) -> Result<Self, RuntimeError> {
        Ok(CudaBackend { use_graphs: false, ..Self::new(ordinal)? })
    }

    /// Whether a CUDA driver and at least one device are present.
    pub fn available() -> bool {
        device::missing_library().is_none() && cudarc::driver::CudaContext::device_count().is_ok_and(|n| n > 0)
    }

    /// The device's name ("NVIDIA H200").
    pub fn device_name(&self) -> &str {
        &self.device.name
    }

    /// Kernels in the most recently captured decode graph (0 before the first capture).
    pub fn decode_graph_kernels(&self) -> usize {
        self.device.graph_kernels.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Decode graphs captured so far (one per decode bucket and cache context, whichever session
    /// runs it).
    pub fn decode_graphs_captured(&self) -> usize {
        self.device.graph_captures.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Measured device-memory read bandwidth in bytes per second (median of `reps` reads of a
    /// `bytes`-sized buffer).
    pub fn read_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64, RuntimeError> {
        device::read_bandwidth(&self.device, bytes, reps)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{} ({}, sm_{}{})", self.ordinal, self.device.name, self.device.arch.0, self.device.arch.1)
    }

    fn load_weights(&self, store: &Arc<WeightStore>) -> Result<Arc<dyn DeviceWeights>, RuntimeError> {
        Ok(Arc::new(CudaWeights::upload(self.device.clone(), store.clone())?))
    }

    fn prepare(&self, plan: Arc<Plan>, weights: &Arc<dyn DeviceWeights>) -> Result<Box<dyn Executable>, RuntimeError> {
        let weights =
            weights.clone().into_any().downcast::<CudaWeights>().map_err(|_| device::cuda_err("weights were loaded by another backend"))?;
        if !Arc::ptr_eq(&weights.device, &self.device) {
            return Err(device::cuda_err("weights were loaded on another CUDA device"));
        }
        Ok(Box::new(CudaExecutable::new(plan, weights, self.use_graphs)?))
    }

    fn new_kv_cache(&self, layout: &KvLayout) -> Result<Box<dyn KvCache>, RuntimeError> {
        Ok(Box::new(CudaKvCache::new(self.device.clone(), layout)?))
    }

    /// Measured on an H200 with the default model (`kiln bench -s`, bench/RESULTS.md): 2 sequences
    /// in one step ran at 1,522 tokens/s against 2,080 one after another (a several-row plan
    /// lacks the one-row plan's fused and streamed kernels), 4 at 2,361, 8 at 3,218 (since
    /// `mmq` takes 4-8 rows of short rows, synthetic 270M: 4 at 2,871, 8 at 5,566).
    fn batches_from(&self) -> usize {
        4
    }

    /// Up to 262,144 tokens: a row's slices' survivors must fit one block's shared memory.
    fn takes_candidates(&self, vocab: usize) -> bool {
        exec::top_k_takes(vocab, kiln_ir::CANDIDATES)
    }

    /// Among the candidates of a top-k head (at least 64 tokens), or among all logits.
    fn draws(&self, among: kiln_ir::Among, vocab: usize) -> bool {
        among == kiln_ir::Among::Vocabulary || (vocab >= kiln_ir::CANDIDATES && self.takes_candidates(vocab))
    }
}

#[cfg(test)]
mod tests {
    use super::{device, CudaBackend};

    #[test]
    fn opening_a_device_without_cuda_is_an_error_that_names_what_is_missing() {
        match CudaBackend::new(0) {
            Ok(_) => assert!(CudaBackend::available()),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("CUDA"), "{msg}");
                if device::missing_library().is_some() {
                    assert!(!CudaBackend::available() && msg.contains("library was not found"), "{msg}");
                }
            }
        }
    }
}

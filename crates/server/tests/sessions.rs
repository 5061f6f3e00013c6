//! The scheduler's sequences: the KV caches of `--parallel` sequences are allocated once, when
//! the server starts (a failure there is a start-up error naming them), and reused by request
//! after request.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use kiln_cpu::CpuBackend;
use kiln_runtime::{Backend, DeviceWeights, Executable, KvCache, KvLayout, Plan, RuntimeError, WeightStore};
use serde_json::json;

/// The CPU backend with room for at most `caches` KV caches over its lifetime, as a device whose
/// memory holds that many: every cache asked for after those fails.
struct CacheLimited {
    cpu: CpuBackend,
    caches: AtomicUsize,
}

impl CacheLimited {
    fn new(caches: usize) -> Arc<CacheLimited> {
        Arc::new(CacheLimited { cpu: CpuBackend::new(2), caches: AtomicUsize::new(caches) })
    }
}

impl Backend for CacheLimited {
    fn name(&self) -> String {
        self.cpu.name()
    }

    fn load_weights(&self, store: &Arc<WeightStore>) -> Result<Arc<dyn DeviceWeights>, RuntimeError> {
        self.cpu.load_weights(store)
    }

    fn prepare(&self, plan: Arc<Plan>, weights: &Arc<dyn DeviceWeights>) -> Result<Box<dyn Executable>, RuntimeError> {
        self.cpu.prepare(plan, weights)
    }

    fn new_kv_cache(&self, layout: &KvLayout) -> Result<Box<dyn KvCache>, RuntimeError> {
        if self.caches.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_err() {
            return Err(RuntimeError::Backend { backend: "test".into(), msg: "out of memory for another KV cache".into() });
        }
        self.cpu.new_kv_cache(layout)
    }

    fn batches_from(&self) -> usize {
        self.cpu.batches_from()
    }
}

#[test]
fn caches_are_allocated_at_start_and_reused_by_every_request() {
    // Room for 2 caches, 3 sequences asked for: the server does not start, and says why.
    let e = try_start(CacheLimited::new(2), 3, 4).err().expect("3 caches do not fit in room for 2").to_string();
    assert!(e.contains("KV caches of 3 concurrent sequences") && e.contains("--parallel") && e.contains("out of memory"), "{e}");

    // Room for 2, 2 sequences: more requests than caches, one after another and 4 at once, all
    // answered from the two caches allocated at start.
    let server = try_start(CacheLimited::new(2), 2, 8).expect("2 caches fit");
    let addr = server.addr();
    let ask = |prompt: &str| {
        let r = post(addr, "/v1/completions", &json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": 4, "temperature": 0}));
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let first = ask("The capital of France is");
    for _ in 0..2 {
        assert_eq!(ask("The capital of France is"), first, "a reused cache starts empty");
    }
    let texts: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(|| ask("The capital of France is"))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(texts.iter().all(|t| *t == first), "{texts:?} against {first:?}");
    assert_eq!(metric(addr, "kiln_requests_finished_total{outcome=\"failed\"}"), 0.0);
    assert_eq!(metric(addr, "kiln_requests_finished_total{outcome=\"completed\"}"), 7.0);
    server.shutdown().unwrap();
}

//! Device-resident KV cache: per layer, sliding-window layers as rings of `window` rows.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kiln_runtime::{KvCache, KvLayout, KvType, LayerKv, RuntimeError};

use crate::device::{gib, while_doing, Device, DeviceBuffer};

/// One layer's keys and values on the device: `rows` rows of `k_width`/`v_width` elements.
pub(crate) struct DeviceLayer {
    pub(crate) spec: LayerKv,
    pub(crate) k: DeviceBuffer,
    pub(crate) v: DeviceBuffer,
}

/// A sequence's KV cache on the device. Positions are appended by the plans' attention steps.
pub struct CudaKvCache {
    pub(crate) device: Arc<Device>,
    pub(crate) layers: Vec<DeviceLayer>,
    pub(crate) len: usize,
    pub(crate) context: usize,
    /// What the keys and values are stored as.
    pub(crate) elem: KvType,
    /// This cache among every cache of the process, and the steps run on it and clears of it so
    /// far: a greedy step launched ahead is taken only if nothing ran on its cache since
    /// (exec.rs `greedy_step`).
    pub(crate) id: u64,
    pub(crate) steps: u64,
}

/// The next cache's `id`.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

impl CudaKvCache {
    /// A cache with room for `layout.context` positions (rings of `window` rows on sliding layers).
    pub(crate) fn new(device: Arc<Device>, layout: &KvLayout) -> Result<Self, RuntimeError> {
        let bytes = |spec: &LayerKv, width: usize| spec.stored_rows(layout.context) * width * layout.elem.bytes();
        let total: usize = layout.layers.iter().map(|l| bytes(l, l.k_width()) + bytes(l, l.v_width())).sum();
        let what = || format!("the KV cache of {} positions ({}, {} in all)", layout.context, layout.elem.name(), gib(total));
        let mut layers = Vec::with_capacity(layout.layers.len());
        for spec in &layout.layers {
            layers.push(DeviceLayer {
                spec: *spec,
                k: DeviceBuffer::new(&device.ctx, bytes(spec, spec.k_width())).map_err(|e| while_doing(e, what()))?,
                v: DeviceBuffer::new(&device.ctx, bytes(spec, spec.v_width())).map_err(|e| while_doing(e, what()))?,
            });
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(CudaKvCache { device, layers, len: 0, context: layout.context, elem: layout.elem, id, steps: 0 })
    }
}

impl KvCache for CudaKvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn clear(&mut self) {
        self.len = 0;
        self.steps += 1;
    }

    fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.k.bytes() + l.v.bytes()).sum()
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Drop for CudaKvCache {
    fn drop(&mut self) {
        // The buffers may still be read by queued work.
        let _ = self.device.sync_exclusive();
    }
}

//! Host-resident KV cache: per layer, sliding-window layers as rings of `window` rows.

use std::any::Any;

use kiln_runtime::{KvCache, KvLayout, LayerKv};

/// One layer's keys and values, row per position.
pub struct LayerStore {
    spec: LayerKv,
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
}

impl LayerStore {
    fn new(spec: LayerKv) -> Self {
        LayerStore { spec, k: Vec::new(), v: Vec::new(), len: 0 }
    }

    /// Positions appended so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The layout of this layer.
    pub fn spec(&self) -> &LayerKv {
        &self.spec
    }

    fn slot(&self, pos: usize) -> usize {
        self.spec.window.map_or(pos, |w| pos % w)
    }

    /// Key row of absolute position `pos` (which must still be held).
    pub fn k_row(&self, pos: usize) -> &[f32] {
        let w = self.spec.k_width();
        let s = self.slot(pos);
        &self.k[s * w..(s + 1) * w]
    }

    /// Value row of absolute position `pos` (which must still be held).
    pub fn v_row(&self, pos: usize) -> &[f32] {
        let w = self.spec.v_width();
        let s = self.slot(pos);
        &self.v[s * w..(s + 1) * w]
    }

    /// Appends `rows` positions (keys `k`, values `v`, row-major).
    pub fn append(&mut self, k: &[f32], v: &[f32], rows: usize) {
        let (kw, vw) = (self.spec.k_width(), self.spec.v_width());
        for r in 0..rows {
            let s = self.slot(self.len);
            let (kr, vr) = (&k[r * kw..(r + 1) * kw], &v[r * vw..(r + 1) * vw]);
            if s * kw == self.k.len() {
                self.k.extend_from_slice(kr);
                self.v.extend_from_slice(vr);
            } else {
                self.k[s * kw..(s + 1) * kw].copy_from_slice(kr);
                self.v[s * vw..(s + 1) * vw].copy_from_slice(vr);
            }
            self.len += 1;
        }
    }
}

/// A sequence's KV cache on the host.
pub struct CpuKvCache {
    layers: Vec<LayerStore>,
    context: usize,
}

impl CpuKvCache {
    /// An empty cache with `layout`.
    pub fn new(layout: &KvLayout) -> Self {
        CpuKvCache { layers: layout.layers.iter().map(|l| LayerStore::new(*l)).collect(), context: layout.context }
    }

    /// Most positions the cache may hold.
    pub fn context(&self) -> usize {
        self.context
    }

    /// One layer, if it exists.
    pub fn layer_mut(&mut self, layer: usize) -> Option<&mut LayerStore> {
        self.layers.get_mut(layer)
    }
}

impl KvCache for CpuKvCache {
    fn len(&self) -> usize {
        self.layers.iter().map(|l| l.len).min().unwrap_or(0)
    }

    fn clear(&mut self) {
        for l in &mut self.layers {
            l.k.clear();
            l.v.clear();
            l.len = 0;
        }
    }

    fn bytes(&self) -> usize {
        self.layers.iter().map(|l| (l.k.capacity() + l.v.capacity()) * 4).sum()
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sliding_layer_keeps_only_the_window() {
        let spec = LayerKv { kv_heads: 1, head_dim_k: 2, head_dim_v: 2, window: Some(3) };
        let mut l = LayerStore::new(spec);
        for p in 0..10 {
            let row = [p as f32, -(p as f32)];
            l.append(&row, &row, 1);
        }
        assert_eq!(l.len(), 10);
        assert_eq!(l.k.len(), 3 * 2);
        for p in 7..10 {
            assert_eq!(l.k_row(p), &[p as f32, -(p as f32)]);
        }
    }

    #[test]
    fn global_layer_keeps_everything() {
        let spec = LayerKv { kv_heads: 1, head_dim_k: 1, head_dim_v: 1, window: None };
        let mut l = LayerStore::new(spec);
        let rows: Vec<f32> = (0..5).map(|x| x as f32).collect();
        l.append(&rows, &rows, 5);
        assert_eq!((0..5).map(|p| l.v_row(p)[0]).collect::<Vec<_>>(), rows);
    }
}

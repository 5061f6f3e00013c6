//! Host-resident KV cache: per layer, sliding-window layers as rings of `window` rows, stored as
//! f32 or as f16 (`KvType`).

use std::any::Any;

use kiln_runtime::{KvCache, KvLayout, KvType, LayerKv};

use crate::simd::{self, Isa};

/// Rows as stored: f32, or the bits of IEEE halves.
enum Rows {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

impl Rows {
    fn new(elem: KvType) -> Self {
        match elem {
            KvType::F32 => Rows::F32(Vec::new()),
            KvType::F16 => Rows::F16(Vec::new()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Rows::F32(v) => v.len(),
            Rows::F16(v) => v.len(),
        }
    }

    fn clear(&mut self) {
        match self {
            Rows::F32(v) => v.clear(),
            Rows::F16(v) => v.clear(),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Rows::F32(v) => v.capacity() * 4,
            Rows::F16(v) => v.capacity() * 2,
        }
    }

    /// Stores `src` at element `at` (at most the current length: appends past it).
    fn store(&mut self, isa: Isa, at: usize, src: &[f32]) {
        match self {
            Rows::F32(v) => {
                v.resize(v.len().max(at + src.len()), 0.0);
                v[at..at + src.len()].copy_from_slice(src);
            }
            Rows::F16(v) => {
                v.resize(v.len().max(at + src.len()), 0);
                simd::f32_to_f16(isa, src, &mut v[at..at + src.len()]);
            }
        }
    }

    fn row(&self, at: usize, len: usize) -> StoredRow<'_> {
        match self {
            Rows::F32(v) => StoredRow::F32(&v[at..at + len]),
            Rows::F16(v) => StoredRow::F16(&v[at..at + len]),
        }
    }
}

/// A key or value row as stored.
#[derive(Clone, Copy, Debug)]
pub enum StoredRow<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// IEEE half bits.
    F16(&'a [u16]),
}

impl StoredRow<'_> {
    /// The row's elements `range` as f32 into `out` (exact: every half is an f32).
    pub fn read_f32(self, isa: Isa, range: std::ops::Range<usize>, out: &mut [f32]) {
        match self {
            StoredRow::F32(r) => out.copy_from_slice(&r[range]),
            StoredRow::F16(r) => simd::f16_to_f32(isa, &r[range], out),
        }
    }
}

/// One layer's keys and values, row per position.
pub struct LayerStore {
    spec: LayerKv,
    elem: KvType,
    k: Rows,
    v: Rows,
    len: usize,
}

impl LayerStore {
    fn new(spec: LayerKv, elem: KvType) -> Self {
        LayerStore { spec, elem, k: Rows::new(elem), v: Rows::new(elem), len: 0 }
    }

    /// Positions appended so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The layout of this layer.
    pub fn spec(&self) -> &LayerKv {
        &self.spec
    }

    /// What the rows are stored as.
    pub fn elem(&self) -> KvType {
        self.elem
    }

    fn slot(&self, pos: usize) -> usize {
        self.spec.window.map_or(pos, |w| pos % w)
    }

    /// Key row of absolute position `pos` (which must still be held).
    pub fn k_row(&self, pos: usize) -> StoredRow<'_> {
        let w = self.spec.k_width();
        self.k.row(self.slot(pos) * w, w)
    }

    /// Value row of absolute position `pos` (which must still be held).
    pub fn v_row(&self, pos: usize) -> StoredRow<'_> {
        let w = self.spec.v_width();
        self.v.row(self.slot(pos) * w, w)
    }

    /// Appends `rows` positions (keys `k`, values `v`, row-major), rounded to the stored type.
    pub fn append(&mut self, isa: Isa, k: &[f32], v: &[f32], rows: usize) {
        let (kw, vw) = (self.spec.k_width(), self.spec.v_width());
        for r in 0..rows {
            let s = self.slot(self.len);
            debug_assert!(s * kw <= self.k.len());
            self.k.store(isa, s * kw, &k[r * kw..(r + 1) * kw]);
            self.v.store(isa, s * vw, &v[r * vw..(r + 1) * vw]);
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
        CpuKvCache { layers: layout.layers.iter().map(|l| LayerStore::new(*l, layout.elem)).collect(), context: layout.context }
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
        self.layers.iter().map(|l| l.k.bytes() + l.v.bytes()).sum()
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_row(r: StoredRow<'_>, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; n];
        r.read_f32(Isa::Scalar, 0..n, &mut out);
        out
    }

    #[test]
    fn sliding_layer_keeps_only_the_window() {
        let spec = LayerKv { kv_heads: 1, head_dim_k: 2, head_dim_v: 2, window: Some(3) };
        for elem in [KvType::F32, KvType::F16] {
            let mut l = LayerStore::new(spec, elem);
            for p in 0..10 {
                let row = [p as f32, -(p as f32)];
                l.append(Isa::Scalar, &row, &row, 1);
            }
            assert_eq!(l.len(), 10);
            assert_eq!(l.k.len(), 3 * 2);
            for p in 7..10 {
                assert_eq!(f32_row(l.k_row(p), 2), [p as f32, -(p as f32)]);
            }
        }
    }

    #[test]
    fn global_layer_keeps_everything() {
        let spec = LayerKv { kv_heads: 1, head_dim_k: 1, head_dim_v: 1, window: None };
        let mut l = LayerStore::new(spec, KvType::F32);
        let rows: Vec<f32> = (0..5).map(|x| x as f32).collect();
        l.append(Isa::Scalar, &rows, &rows, 5);
        assert_eq!((0..5).map(|p| f32_row(l.v_row(p), 1)[0]).collect::<Vec<_>>(), rows);
    }

    #[test]
    fn half_cache_stores_rows_rounded_to_nearest_even_in_half_the_bytes() {
        let spec = LayerKv { kv_heads: 2, head_dim_k: 8, head_dim_v: 8, window: None };
        let row: Vec<f32> = (0..16).map(|i| (i as f32 - 7.3) * 0.377 + 1e-3 * (i * i) as f32).collect();
        let caches = [KvType::F32, KvType::F16].map(|elem| {
            let mut cache = CpuKvCache::new(&KvLayout { layers: vec![spec], context: 4, elem });
            cache.layer_mut(0).unwrap().append(Isa::Scalar, &row, &row, 1);
            cache
        });
        let [mut full, mut half] = caches;
        let want: Vec<f32> = row.iter().map(|&x| kiln_quant::f16_to_f32(kiln_quant::f32_to_f16(x))).collect();
        assert_ne!(want, row, "the test rows must need rounding");
        let layer = half.layer_mut(0).unwrap();
        assert_eq!(layer.elem(), KvType::F16);
        assert_eq!(f32_row(layer.k_row(0), 16), want);
        assert_eq!(f32_row(layer.v_row(0), 16), want);
        assert_eq!(f32_row(full.layer_mut(0).unwrap().k_row(0), 16), row);
        assert_eq!(2 * half.bytes(), full.bytes());
    }
}

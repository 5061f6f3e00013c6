//! KV cache layout: what each layer keeps.

use crate::KvType;

/// What one layer's KV cache holds per position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerKv {
    /// Number of key/value heads.
    pub kv_heads: usize,
    /// Key head size.
    pub head_dim_k: usize,
    /// Value head size.
    pub head_dim_v: usize,
    /// Sliding window: the layer keeps only the last `window` positions (a ring); none keeps all.
    pub window: Option<usize>,
}

impl LayerKv {
    /// Elements per position for keys.
    pub fn k_width(&self) -> usize {
        self.kv_heads * self.head_dim_k
    }

    /// Elements per position for values.
    pub fn v_width(&self) -> usize {
        self.kv_heads * self.head_dim_v
    }

    /// Positions this layer stores when the sequence has `len` positions.
    pub fn stored_rows(&self, len: usize) -> usize {
        self.window.map_or(len, |w| len.min(w))
    }
}

/// The KV cache layout of a model: one entry per layer, the context size and the element type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Per-layer layout.
    pub layers: Vec<LayerKv>,
    /// Most positions a sequence may hold.
    pub context: usize,
    /// What keys and values are stored as.
    pub elem: KvType,
}

//! The CPU's copy of the weights: the mapped file itself (nothing copied), plus small vectors
//! (norm weights) expanded to f32 once.

use std::any::Any;
use std::sync::{Arc, OnceLock};

use kiln_quant::{dequantize, GgmlType};
use kiln_runtime::{DeviceWeights, RuntimeError, WeightId, WeightStore};

/// Largest tensor (in elements) expanded to f32 at load time.
const EXPAND_LIMIT: usize = 1 << 16;

/// Weights as the CPU kernels read them.
pub struct CpuWeights {
    store: Arc<WeightStore>,
    /// Small tensors expanded to f32, by weight id.
    expanded: Vec<Option<Vec<f32>>>,
    /// Q4_0 screening copies of greedy-head matrices (fast kernels), made on first use, by weight id.
    screens: Vec<OnceLock<Vec<u8>>>,
}

/// A packed weight matrix: `n` rows of `k` elements in block format `ty`.
#[derive(Clone, Copy)]
pub struct PackedMatrix<'a> {
    /// Packed bytes, row after row.
    pub bytes: &'a [u8],
    /// Block format.
    pub ty: GgmlType,
    /// Elements per row.
    pub k: usize,
    /// Rows.
    pub n: usize,
    row_bytes: usize,
}

impl PackedMatrix<'_> {
    /// The packed bytes of rows `rows`.
    pub fn rows_bytes(&self, rows: std::ops::Range<usize>) -> &[u8] {
        &self.bytes[rows.start * self.row_bytes..rows.end * self.row_bytes]
    }

    /// The packed bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        &self.bytes[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Dequantizes row `r` into `dst` (`k` elements).
    pub fn row_into(&self, r: usize, dst: &mut [f32]) {
        let src = self.row(r);
        // Formats and sizes are validated when the weights are loaded (CpuWeights::new).
        dequantize(self.ty, src, &mut dst[..self.k]).expect("weight layout validated at load");
    }
}

#[cfg(test)]
impl<'a> PackedMatrix<'a> {
    /// A matrix over raw packed bytes (kernel tests); panics unless the layout is consistent.
    pub(crate) fn from_bytes(bytes: &'a [u8], ty: GgmlType, k: usize, n: usize) -> Self {
        let row_bytes = ty.row_bytes(k).expect("k is a whole number of blocks");
        assert!(ty.can_dequantize() && bytes.len() == row_bytes * n, "bad test matrix layout");
        PackedMatrix { bytes, ty, k, n, row_bytes }
    }
}

impl CpuWeights {
    /// Validates every tensor's layout and expands the small ones.
    pub fn new(store: Arc<WeightStore>) -> Result<Self, RuntimeError> {
        let mut expanded = Vec::with_capacity(store.infos().len());
        for (i, info) in store.infos().iter().enumerate() {
            let id = WeightId(i);
            let bytes = store.bytes(id);
            let row_bytes = info.ty.row_bytes(info.row_len)?;
            if !info.ty.can_dequantize() || bytes.len() != row_bytes * info.n_rows {
                expanded.push(None);
                continue;
            }
            let numel = info.row_len * info.n_rows;
            if numel <= EXPAND_LIMIT {
                let mut v = vec![0f32; numel];
                dequantize(info.ty, bytes, &mut v)?;
                expanded.push(Some(v));
            } else {
                expanded.push(None);
            }
        }
        let screens = (0..expanded.len()).map(|_| OnceLock::new()).collect();
        Ok(CpuWeights { store, expanded, screens })
    }

    /// A small tensor as f32 (norm weights), if it was expanded.
    pub fn vector(&self, id: WeightId) -> Result<&[f32], RuntimeError> {
        self.expanded[id.0].as_deref().ok_or_else(|| {
            RuntimeError::Compile(format!("tensor '{}' is used as a vector but is too large or not computable", self.store.info(id).name))
        })
    }

    /// A weight matrix in packed form.
    pub fn matrix(&self, id: WeightId) -> Result<PackedMatrix<'_>, RuntimeError> {
        let info = self.store.info(id);
        if !info.ty.can_dequantize() {
            return Err(RuntimeError::UnsupportedWeightType { name: info.name.clone(), ty: info.ty });
        }
        let row_bytes = info.ty.row_bytes(info.row_len)?;
        let bytes = self.store.bytes(id);
        if bytes.len() != row_bytes * info.n_rows {
            return Err(RuntimeError::Compile(format!(
                "tensor '{}' has {} bytes, expected {}",
                info.name,
                bytes.len(),
                row_bytes * info.n_rows
            )));
        }
        Ok(PackedMatrix { bytes, ty: info.ty, k: info.row_len, n: info.n_rows, row_bytes })
    }
}

impl CpuWeights {
    /// The screening copy (see `fast::screen`) of greedy-head matrix `id` (made now if needed),
    /// when the fast kernels want one for it.
    pub fn screening_copy(&self, id: WeightId, pool: &crate::pool::ThreadPool) -> Result<Option<&[u8]>, RuntimeError> {
        let m = self.matrix(id)?;
        if !crate::fast::wants_screening_copy(&m) {
            return Ok(None);
        }
        Ok(Some(self.screens[id.0].get_or_init(|| {
            crate::fast::make_screening_copy(pool, &m, &|b| {
                self.store.release_pages(b);
            })
        })))
    }
}

impl DeviceWeights for CpuWeights {
    fn device_bytes(&self) -> usize {
        self.expanded.iter().flatten().map(|v| v.len() * 4).sum::<usize>()
            + self.screens.iter().filter_map(|s| s.get()).map(Vec::len).sum::<usize>()
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

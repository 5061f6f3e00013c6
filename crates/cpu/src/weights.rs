//! The CPU's copy of the weights: the mapped file itself (nothing copied), plus small vectors
//! (norm weights) expanded to f32 once.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use kiln_quant::{dequantize, GgmlType};
use kiln_runtime::{DeviceWeights, RuntimeError, WeightId, WeightStore};

/// Largest tensor (in elements) expanded to f32 at load time.
const EXPAND_LIMIT: usize = 1 << 16;

/// Rows read from a screened matrix (see [`CpuWeights::note_rows_read`]) between two releases of
/// its mapped pages. A released matrix faults in only the pages a row read touches (no
/// read-around), so at most this many rows' pages (16-32 MiB) pile up: about every 60
/// one-sequence decode steps (a gathered embedding and 64 rescored head rows per step), every 8
/// steps of 8 sequences.
const RELEASE_AFTER_ROWS: usize = 4096;

/// Weights as the CPU kernels read them.
pub struct CpuWeights {
    store: Arc<WeightStore>,
    /// Small tensors expanded to f32, by weight id.
    expanded: Vec<Option<Vec<f32>>>,
    /// Q4_0 screening copies of greedy-head matrices (fast kernels), made on first use, by weight id.
    screens: Vec<OnceLock<Vec<u8>>>,
    /// Rows read from each screened matrix since its pages were last released.
    rows_read: Vec<AtomicUsize>,
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
        let rows_read = (0..expanded.len()).map(|_| AtomicUsize::new(0)).collect();
        Ok(CpuWeights { store, expanded, screens, rows_read })
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
            crate::fast::make_screening_copy(pool, crate::simd::active_isa(), &m, &|b| {
                self.store.release_pages(b);
            })
        })))
    }

    /// Notes that a step read `rows` rows of matrix `id` (gathered embeddings, or head rows
    /// rescored for the next tokens) and, once it has a screening copy and
    /// [`RELEASE_AFTER_ROWS`] rows have been noted since the last time, drops its resident mapped
    /// pages: only the pages of the rows read are resident then, and they would pile up next to
    /// the copy step after step. Later reads fault
    /// them back in from the page cache, unchanged.
    pub fn note_rows_read(&self, id: WeightId, rows: usize) {
        if self.screens[id.0].get().is_none() {
            return;
        }
        let read = self.rows_read[id.0].fetch_add(rows, Ordering::Relaxed) + rows;
        if read >= RELEASE_AFTER_ROWS {
            self.rows_read[id.0].store(0, Ordering::Relaxed);
            self.store.release_pages(self.store.bytes(id));
        }
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

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use crate::pool::ThreadPool;
    use kiln_gguf::{GgufFile, GgufWriter};
    use kiln_quant::quantize;

    /// Resident bytes of the mapping that holds `bytes`, from `/proc/self/smaps`.
    fn resident_bytes_of_mapping(bytes: &[u8]) -> usize {
        let at = bytes.as_ptr() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-') && !r.ends_with(':')) {
                let (lo, hi) = range.split_once('-').unwrap();
                let (lo, hi) = (usize::from_str_radix(lo, 16).unwrap(), usize::from_str_radix(hi, 16).unwrap());
                inside = lo <= at && at < hi;
            } else if inside && line.starts_with("Rss:") {
                return line.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * 1024;
            }
        }
        panic!("no mapping holds the tensor");
    }

    #[test]
    fn a_screened_matrix_drops_its_mapped_pages_after_enough_rows() {
        // Enough rows to get a screening copy (asserted below).
        let (k, n) = (32, 1 << 15);
        let data: Vec<f32> = (0..k * n).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let mut w = GgufWriter::new(3).unwrap();
        w.add_tensor("output.weight", &[k as u64, n as u64], GgmlType::Q8_0, quantize(GgmlType::Q8_0, &data).unwrap()).unwrap();
        let path = std::env::temp_dir().join(format!("kiln-cpu-release-{}.gguf", std::process::id()));
        w.write(&path).unwrap();
        let file = GgufFile::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let store = Arc::new(WeightStore::new(Arc::new(file)).unwrap());
        let weights = CpuWeights::new(store.clone()).unwrap();
        let id = store.id("output.weight").unwrap();
        let pool = ThreadPool::new(2);
        let bytes = weights.matrix(id).unwrap().bytes;
        let touch = || std::hint::black_box(bytes.iter().step_by(1024).map(|b| *b as usize).sum::<usize>());
        // Before a screening copy exists, reads stay resident whatever their number.
        touch();
        weights.note_rows_read(id, RELEASE_AFTER_ROWS);
        assert!(resident_bytes_of_mapping(bytes) >= bytes.len() / 2, "released before a copy was made");
        assert!(weights.screening_copy(id, &pool).unwrap().is_some());
        touch();
        weights.note_rows_read(id, RELEASE_AFTER_ROWS - 1);
        assert!(resident_bytes_of_mapping(bytes) >= bytes.len() / 2, "released too early");
        weights.note_rows_read(id, 1);
        assert!(resident_bytes_of_mapping(bytes) < 64 << 10, "not released");
        // The rows read back unchanged.
        let mut row = vec![0f32; k];
        weights.matrix(id).unwrap().row_into(n - 1, &mut row);
        let mut want = vec![0f32; k];
        kiln_quant::dequantize(GgmlType::Q8_0, &quantize(GgmlType::Q8_0, &data[(n - 1) * k..]).unwrap(), &mut want).unwrap();
        assert_eq!(row, want);
    }
}

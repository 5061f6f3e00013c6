//! The device's single copy of the weights: every matrix uploaded once in its packed block form
//! (formats with unaligned blocks rearranged planar, same bytes), vectors (norm weights) expanded
//! to f32; shared by every plan.

use std::any::Any;
use std::sync::Arc;

use kiln_quant::{dequantize, GgmlType};
use kiln_runtime::{DeviceWeights, RuntimeError, WeightId, WeightStore};

use crate::device::{cuda_err, gib, while_doing, Device, DeviceBuffer};

/// Largest tensor (in elements) also kept expanded to f32 (norm weights).
const EXPAND_LIMIT: usize = 1 << 16;

/// The kernel-name suffix of a block format the CUDA kernels read, if any.
pub(crate) fn format_name(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q3_K => "q3_k",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
        _ => return None,
    })
}

/// The fields of a block format stored planar on the device, as (offset, bytes) within the block
/// in plane order, for the formats whose blocks are not 16-byte aligned (the kernels' `sub32`,
/// `Chunk` and `mmq` tiles of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K and Q6_K read this layout: their
/// `mmq` tiles copy each field with aligned asynchronous copies; Q2_K's 84-byte blocks, 4-byte
/// aligned, keep ggml's layout and its tiles copy 4 bytes at a time).
pub(crate) fn planar_fields(ty: GgmlType) -> Option<&'static [(usize, usize)]> {
    match ty {
        GgmlType::Q4_0 => Some(&[(2, 16), (0, 2)]),
        GgmlType::Q4_1 => Some(&[(4, 16), (0, 4)]),
        GgmlType::Q5_1 => Some(&[(8, 16), (4, 4), (0, 4)]),
        GgmlType::Q8_0 => Some(&[(2, 32), (0, 2)]),
        GgmlType::Q5_0 => Some(&[(6, 16), (2, 4), (0, 2)]),
        GgmlType::Q3_K => Some(&[(0, 32), (32, 64), (96, 12), (108, 2)]),
        GgmlType::Q6_K => Some(&[(0, 128), (128, 64), (192, 16), (208, 2)]),
        _ => None,
    }
}

/// Zero bytes after a planar matrix: the kernels copy 2-byte scales in aligned 4-byte pairs, which
/// may reach past the last block.
const PLANAR_PAD: usize = 16;

/// `src` (whole blocks of `ty`) rearranged planar: each field of every block contiguous, in block
/// order, fields in `planar_fields` order, then `PLANAR_PAD` zero bytes. Same bytes; every field
/// naturally aligned.
fn to_planar(src: &[u8], block_bytes: usize, fields: &[(usize, usize)]) -> Vec<u8> {
    let blocks = src.len() / block_bytes;
    let mut out = Vec::with_capacity(src.len() + PLANAR_PAD);
    for &(off, len) in fields {
        for b in src.chunks_exact(block_bytes) {
            out.extend_from_slice(&b[off..off + len]);
        }
    }
    debug_assert_eq!(out.len(), blocks * block_bytes);
    out.resize(out.len() + PLANAR_PAD, 0);
    out
}

/// A packed matrix on the device.
pub(crate) struct DeviceMatrix {
    pub(crate) buf: DeviceBuffer,
    pub(crate) ty: GgmlType,
    /// Elements per row.
    pub(crate) k: usize,
    /// Rows.
    pub(crate) n: usize,
    pub(crate) row_bytes: usize,
    /// Blocks in the whole matrix.
    pub(crate) blocks: usize,
}

/// Weights as the CUDA kernels read them.
pub struct CudaWeights {
    pub(crate) device: Arc<Device>,
    store: Arc<WeightStore>,
    matrices: Vec<Option<DeviceMatrix>>,
    vectors: Vec<Option<DeviceBuffer>>,
    bytes: usize,
}

impl CudaWeights {
    /// Uploads every tensor of `store` that the kernels can read.
    pub(crate) fn upload(device: Arc<Device>, store: Arc<WeightStore>) -> Result<Self, RuntimeError> {
        let (mut matrices, mut vectors, mut bytes) = (Vec::new(), Vec::new(), 0);
        // Synchronous copies may not run while another thread captures a graph.
        let guard = device.lock.lock().map_err(|_| cuda_err("a previous CUDA step panicked"))?;
        device.ctx.bind_to_thread().map_err(cuda_err)?;
        let file_bytes: usize = (0..store.infos().len()).map(|i| store.bytes(WeightId(i)).len()).sum();
        let uploading = |name: &str| format!("uploading the weights ({} in the file) at tensor '{name}'", gib(file_bytes));
        for (i, info) in store.infos().iter().enumerate() {
            let src = store.bytes(WeightId(i));
            let row_bytes = info.ty.row_bytes(info.row_len)?;
            let consistent = info.ty.can_dequantize() && src.len() == row_bytes * info.n_rows;
            let numel = info.row_len * info.n_rows;
            let vector = if consistent && numel <= EXPAND_LIMIT {
                let mut v = vec![0f32; numel];
                dequantize(info.ty, src, &mut v)?;
                Some(upload_bytes(&device, as_bytes(&v)).map_err(|e| while_doing(e, uploading(&info.name)))?)
            } else {
                None
            };
            let matrix = if consistent && !info.is_vector() && format_name(info.ty).is_some() && info.row_len.is_multiple_of(32) {
                let buf = match planar_fields(info.ty) {
                    Some(fields) => upload_bytes(&device, &to_planar(src, info.ty.type_size(), fields)),
                    None => upload_bytes(&device, src),
                }
                .map_err(|e| while_doing(e, uploading(&info.name)))?;
                let blocks = info.n_rows * (info.row_len / info.ty.block_size());
                Some(DeviceMatrix { buf, ty: info.ty, k: info.row_len, n: info.n_rows, row_bytes, blocks })
            } else {
                None
            };
            bytes += vector.as_ref().map_or(0, |b| b.bytes()) + matrix.as_ref().map_or(0, |m| m.buf.bytes());
            vectors.push(vector);
            matrices.push(matrix);
        }
        device.sync()?;
        drop(guard);
        Ok(CudaWeights { device, store, matrices, vectors, bytes })
    }

    /// A packed matrix, or an error naming the tensor and why the kernels cannot read it.
    pub(crate) fn matrix(&self, id: WeightId) -> Result<&DeviceMatrix, RuntimeError> {
        self.matrices[id.0].as_ref().ok_or_else(|| {
            let info = self.store.info(id);
            if format_name(info.ty).is_none() {
                RuntimeError::UnsupportedWeightType { name: info.name.clone(), ty: info.ty }
            } else {
                cuda_err(format!(
                    "tensor '{}' ({:?}, rows of {}) is not a matrix the CUDA kernels can read (rows must be whole 32-element blocks)",
                    info.name, info.ty, info.row_len
                ))
            }
        })
    }

    /// A small tensor as f32 on the device (norm weights).
    pub(crate) fn vector(&self, id: WeightId) -> Result<&DeviceBuffer, RuntimeError> {
        self.vectors[id.0].as_ref().ok_or_else(|| {
            cuda_err(format!("tensor '{}' is used as a vector but is too large or not computable", self.store.info(id).name))
        })
    }
}

/// The bytes of a float slice.
pub(crate) fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// A new device buffer holding `src`.
pub(crate) fn upload_bytes(device: &Device, src: &[u8]) -> Result<DeviceBuffer, RuntimeError> {
    let buf = DeviceBuffer::new(&device.ctx, src.len())?;
    // SAFETY: `buf` holds `src.len()` bytes; the copy from pageable memory completes before return.
    unsafe { cudarc::driver::result::memcpy_htod_sync(buf.ptr(), src) }.map_err(cuda_err)?;
    Ok(buf)
}

impl DeviceWeights for CudaWeights {
    fn device_bytes(&self) -> usize {
        self.bytes
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planar_layout_keeps_every_byte_and_aligns_fields() {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q3_K, GgmlType::Q6_K] {
            let fields = planar_fields(ty).unwrap();
            let bytes = ty.type_size();
            assert_eq!(fields.iter().map(|f| f.1).sum::<usize>(), bytes, "{ty:?}");
            let blocks = 3;
            let src: Vec<u8> = (0..blocks * bytes).map(|i| (i * 7 + 1) as u8).collect();
            let out = to_planar(&src, bytes, fields);
            assert_eq!(out.len(), blocks * bytes + PLANAR_PAD, "{ty:?}");
            assert!(out[blocks * bytes..].iter().all(|&b| b == 0), "{ty:?}: padding");
            let mut base = 0;
            for &(off, len) in fields {
                assert_eq!(base % len.min(16), 0, "{ty:?}: plane at {base} is not aligned for {len}-byte fields");
                for b in 0..blocks {
                    assert_eq!(&out[base + b * len..base + (b + 1) * len], &src[b * bytes + off..b * bytes + off + len]);
                }
                base += len * blocks;
            }
        }
    }
}

//! Tensor descriptors and their shape validation.

use crate::GgufError;
use kiln_quant::GgmlType;

/// Most dimensions a ggml tensor can have (GGML_MAX_DIMS).
pub const MAX_DIMS: usize = 4;

/// A tensor's name, shape, type and the location of its data in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name, e.g. "blk.0.attn_q.weight".
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the contiguous row length.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Absolute file offset of the data.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Total number of elements (1 for a tensor without dimensions).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |n, &d| n.saturating_mul(d))
    }

    /// Elements per row (`dims[0]`, or 1 without dimensions).
    pub fn row_len(&self) -> usize {
        self.dims.first().map_or(1, |&d| usize::try_from(d).unwrap_or(usize::MAX))
    }

    /// Number of rows (product of `dims[1..]`).
    pub fn n_rows(&self) -> usize {
        let rows = self.dims.iter().skip(1).fold(1u64, |n, &d| n.saturating_mul(d));
        usize::try_from(rows).unwrap_or(usize::MAX)
    }
}

/// Validates a tensor shape for `ty` and returns its data size in bytes.
///
/// Checks the dimension count, that every dimension and the element count fit in i64 (as in ggml),
/// that the row length is a whole number of blocks, and that the byte size does not overflow.
pub(crate) fn data_size(name: &str, dims: &[u64], ty: GgmlType) -> Result<u64, GgufError> {
    let invalid = |reason: String| GgufError::InvalidTensor { name: name.to_string(), reason };
    if dims.len() > MAX_DIMS {
        return Err(GgufError::TooManyDims { name: name.to_string(), n_dims: dims.len() as u64, max: MAX_DIMS });
    }
    let limit = i64::MAX as u64;
    let mut n_elements = 1u64;
    for (i, &d) in dims.iter().enumerate() {
        if d > limit {
            return Err(invalid(format!("dimension {i} is {d}, larger than the maximum {limit}")));
        }
        n_elements = n_elements
            .checked_mul(d)
            .filter(|&n| n <= limit)
            .ok_or_else(|| invalid(format!("element count of dimensions {dims:?} overflows")))?;
    }
    let row_len = dims.first().copied().unwrap_or(1);
    let block_size = ty.block_size() as u64;
    if row_len % block_size != 0 {
        return Err(invalid(format!("row length {row_len} is not a multiple of the {ty} block size {block_size}")));
    }
    (n_elements / block_size).checked_mul(ty.type_size() as u64).ok_or_else(|| invalid(format!("byte size of {ty} {dims:?} overflows")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_shape_helpers() {
        assert_eq!(data_size("t", &[256, 3], GgmlType::Q4_K).unwrap(), 3 * 144);
        assert_eq!(data_size("t", &[], GgmlType::F32).unwrap(), 4);
        assert_eq!(data_size("t", &[5, 0], GgmlType::F16).unwrap(), 0);
        let t = TensorInfo { name: "t".into(), dims: vec![64, 3, 2], ty: GgmlType::F32, offset: 0, n_bytes: 0 };
        assert_eq!((t.n_elements(), t.row_len(), t.n_rows()), (384, 64, 6));
        let scalar = TensorInfo { dims: vec![], ..t };
        assert_eq!((scalar.n_elements(), scalar.row_len(), scalar.n_rows()), (1, 1, 1));
    }

    #[test]
    fn invalid_shapes() {
        let e = data_size("w", &[100], GgmlType::Q8_0).unwrap_err().to_string();
        assert_eq!(e, "tensor 'w': row length 100 is not a multiple of the Q8_0 block size 32");
        let e = data_size("w", &[1 << 40, 1 << 40], GgmlType::F32).unwrap_err().to_string();
        assert!(e.starts_with("tensor 'w': element count of dimensions") && e.ends_with("overflows"), "{e}");
        let e = data_size("w", &[u64::MAX], GgmlType::F32).unwrap_err().to_string();
        assert!(e.contains("dimension 0 is 18446744073709551615"), "{e}");
        let e = data_size("w", &[1 << 62], GgmlType::F64).unwrap_err().to_string();
        assert!(e.contains("byte size of F64") && e.contains("overflows"), "{e}");
        let e = data_size("w", &[1, 1, 1, 1, 1], GgmlType::F32).unwrap_err().to_string();
        assert_eq!(e, "tensor 'w': 5 dimensions, at most 4 are supported");
    }
}

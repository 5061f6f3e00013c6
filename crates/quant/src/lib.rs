//! GGML tensor element types and block formats: the type table, bit-exact reference dequantization
//! (as ggml's `dequantize_row_*`), and simple round-to-nearest quantizers.
//!
//! Dequantization is supported for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants
//! Q2_K..Q8_K; every other ggml type is known (ids and sizes) but has no codec. Also llama.cpp's
//! file types (which mix of formats a file is in), by number and name.

mod block;
mod file_type;
mod half;
mod kquants;
mod legacy;
mod simple;
mod types;

pub use file_type::{file_type_name, file_type_named, file_type_of};
pub use half::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
pub use kquants::{unpack_q3_scales, unpack_scale_min_k4};
pub use types::GgmlType;

/// Errors from sizing, dequantizing or quantizing GGML data.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    /// The element count is not a whole number of blocks.
    #[error("{ty}: {n} elements is not a multiple of the block size {block_size}")]
    NotBlockMultiple {
        /// The element type.
        ty: GgmlType,
        /// The element count.
        n: usize,
        /// Elements per block of `ty`.
        block_size: usize,
    },
    /// The byte size of the element count does not fit in `usize`.
    #[error("{ty}: byte size of {n} elements overflows usize")]
    SizeOverflow {
        /// The element type.
        ty: GgmlType,
        /// The element count.
        n: usize,
    },
    /// The source buffer does not hold exactly the bytes of the requested elements.
    #[error("{ty}: source has {actual} bytes, but {n} elements take {expected} bytes")]
    SrcLength {
        /// The element type.
        ty: GgmlType,
        /// Elements requested (the destination length).
        n: usize,
        /// Bytes those elements take.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// The type has no codec in this crate.
    #[error("{ty}: {op} is not supported for this type")]
    Unsupported {
        /// The element type.
        ty: GgmlType,
        /// "dequantize" or "quantize".
        op: &'static str,
    },
    /// A block format cannot encode NaN or infinity.
    #[error("{ty}: cannot quantize non-finite value {value} at index {index}")]
    NonFinite {
        /// The element type.
        ty: GgmlType,
        /// Index of the offending element.
        index: usize,
        /// The offending value.
        value: f32,
    },
    /// A block's values are too large for its f16 scale.
    #[error("{ty}: block {block} (elements {start}..{end}) has values too large for its f16 scale")]
    ScaleOverflow {
        /// The element type.
        ty: GgmlType,
        /// Index of the offending block.
        block: usize,
        /// First element of the block.
        start: usize,
        /// One past the last element of the block.
        end: usize,
    },
}

/// Decodes whole blocks; sizes are checked by [`dequantize`].
type Decoder = fn(&[u8], &mut [f32]);

/// Encodes whole blocks; the error is the index of a block whose scale overflowed.
type Encoder = fn(&[f32]) -> Result<Vec<u8>, usize>;

/// A row decoder and encoder for one type.
#[derive(Clone, Copy)]
pub(crate) struct Codec {
    /// The decoder.
    dequantize: Decoder,
    /// The encoder.
    quantize: Encoder,
}

/// The codec of `ty`, or `None` if this crate cannot convert it: the one list of supported formats.
pub(crate) fn codec(ty: GgmlType) -> Option<Codec> {
    use GgmlType as T;
    let (dequantize, quantize): (Decoder, Encoder) = match ty {
        T::F32 => (simple::dequantize_f32, |x| Ok(simple::quantize_f32(x))),
        T::F16 => (simple::dequantize_f16, |x| Ok(simple::quantize_f16(x))),
        T::BF16 => (simple::dequantize_bf16, |x| Ok(simple::quantize_bf16(x))),
        T::Q4_0 => (legacy::dequantize_q4_0, legacy::quantize_q4_0),
        T::Q4_1 => (legacy::dequantize_q4_1, legacy::quantize_q4_1),
        T::Q5_0 => (legacy::dequantize_q5_0, legacy::quantize_q5_0),
        T::Q5_1 => (legacy::dequantize_q5_1, legacy::quantize_q5_1),
        T::Q8_0 => (legacy::dequantize_q8_0, legacy::quantize_q8_0),
        T::Q2_K => (kquants::dequantize_q2_k, kquants::quantize_q2_k),
        T::Q3_K => (kquants::dequantize_q3_k, kquants::quantize_q3_k),
        T::Q4_K => (kquants::dequantize_q4_k, kquants::quantize_q4_k),
        T::Q5_K => (kquants::dequantize_q5_k, kquants::quantize_q5_k),
        T::Q6_K => (kquants::dequantize_q6_k, kquants::quantize_q6_k),
        T::Q8_K => (kquants::dequantize_q8_k, kquants::quantize_q8_k),
        _ => return None,
    };
    Some(Codec { dequantize, quantize })
}

/// Decodes `dst.len()` elements of type `ty` from `src`, which must hold exactly `ty.row_bytes(dst.len())` bytes.
///
/// Bit-identical to ggml's `dequantize_row_*` and gguf-py's numpy dequantizers; does not allocate.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let codec = codec(ty).ok_or(QuantError::Unsupported { ty, op: "dequantize" })?;
    let expected = ty.row_bytes(dst.len())?;
    if src.len() != expected {
        return Err(QuantError::SrcLength { ty, n: dst.len(), expected, actual: src.len() });
    }
    (codec.dequantize)(src, dst);
    Ok(())
}

/// Encodes `src` as type `ty` (round-to-nearest; `src.len()` must be a multiple of the block size).
///
/// Block formats reject NaN/infinity and values too large for their f16 scales; F16/BF16 round to nearest even.
pub fn quantize(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let codec = codec(ty).ok_or(QuantError::Unsupported { ty, op: "quantize" })?;
    ty.row_bytes(src.len())?;
    let block_size = ty.block_size();
    if block_size > 1 {
        if let Some((index, &value)) = src.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(QuantError::NonFinite { ty, index, value });
        }
    }
    (codec.quantize)(src).map_err(|block| QuantError::ScaleOverflow { ty, block, start: block * block_size, end: (block + 1) * block_size })
}

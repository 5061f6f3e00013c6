//! Unblocked float formats: F32, F16 and BF16.

use crate::half::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// Decodes little-endian f32 values.
pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// Decodes little-endian f16 values.
pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    // Four values per 8-byte word: LLVM turns this into vector loads (a per-element byte pair does not).
    let mut words = src.chunks_exact(8);
    let mut outs = dst.chunks_exact_mut(4);
    for (b, y) in (&mut words).zip(&mut outs) {
        let w = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
        for (i, v) in y.iter_mut().enumerate() {
            *v = f16_to_f32((w >> (16 * i)) as u16);
        }
    }
    for (b, y) in words.remainder().chunks_exact(2).zip(outs.into_remainder()) {
        *y = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// Decodes little-endian bf16 values.
pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *y = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// Encodes little-endian f32 values.
pub(crate) fn quantize_f32(src: &[f32]) -> Vec<u8> {
    src.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Encodes little-endian f16 values (round to nearest even).
pub(crate) fn quantize_f16(src: &[f32]) -> Vec<u8> {
    src.iter().flat_map(|&x| f32_to_f16(x).to_le_bytes()).collect()
}

/// Encodes little-endian bf16 values (round to nearest even).
pub(crate) fn quantize_bf16(src: &[f32]) -> Vec<u8> {
    src.iter().flat_map(|&x| f32_to_bf16(x).to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let x = [0.0f32, -1.5, 3.25, 65504.0, f32::INFINITY, 1e-7];
        let mut y = [0f32; 6];
        dequantize_f32(&quantize_f32(&x), &mut y);
        assert_eq!(x, y);
        dequantize_f16(&quantize_f16(&x), &mut y);
        assert_eq!(y[..5], x[..5]);
        assert_eq!(y[5], f16_to_f32(f32_to_f16(1e-7)));
        dequantize_bf16(&quantize_bf16(&x[..3]), &mut y[..3]);
        assert_eq!(y[..3], x[..3]);
    }

    #[test]
    fn f16_rows_of_every_length() {
        // The word-at-a-time loop and its remainder both decode correctly.
        let x: Vec<f32> = (0..11).map(|i| i as f32 - 5.5).collect();
        for n in 0..=x.len() {
            let mut y = vec![f32::NAN; n];
            dequantize_f16(&quantize_f16(&x[..n]), &mut y);
            assert_eq!(y, x[..n]);
        }
    }
}

//! Shared block plumbing: fixed-size block iteration and small numeric helpers.

use crate::half::{f16_to_f32, f32_to_f16};

/// Applies `decode` to every (`B`-byte block, `N`-value output) pair; sizes were checked by the caller.
#[inline(always)]
pub(crate) fn dequantize_blocks<const B: usize, const N: usize>(src: &[u8], dst: &mut [f32], decode: impl Fn(&[u8; B], &mut [f32; N])) {
    for (b, y) in src.chunks_exact(B).zip(dst.chunks_exact_mut(N)) {
        if let (Ok(b), Ok(y)) = (b.try_into(), y.try_into()) {
            decode(b, y);
        }
    }
}

/// Encodes every `N`-value input block with `encode` (`src.len()` was checked to be a multiple of `N`).
/// `encode` returns `None` when a block scale does not fit its storage type; the error is that block's index.
pub(crate) fn quantize_blocks<const B: usize, const N: usize>(
    src: &[f32],
    encode: impl Fn(&[f32; N]) -> Option<[u8; B]>,
) -> Result<Vec<u8>, usize> {
    let mut out = Vec::with_capacity(src.len() / N * B);
    for (i, x) in src.chunks_exact(N).enumerate() {
        if let Ok(x) = x.try_into() {
            out.extend_from_slice(&encode(x).ok_or(i)?);
        }
    }
    Ok(out)
}

/// Reads a little-endian f16 at byte `at` of a block, as f32.
#[inline(always)]
pub(crate) fn read_f16(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// `x` rounded to f16 precision, or `None` if it overflows f16.
#[inline]
pub(crate) fn f16_round(x: f32) -> Option<f32> {
    Some(f16_to_f32(f32_to_f16(x))).filter(|v| v.is_finite())
}

/// Writes `x` as a little-endian f16 at byte `at`, returning the value the decoder will see
/// (`None` if `x` overflows f16).
#[inline]
pub(crate) fn write_f16(b: &mut [u8], at: usize, x: f32) -> Option<f32> {
    let h = f32_to_f16(x);
    b[at..at + 2].copy_from_slice(&h.to_le_bytes());
    Some(f16_to_f32(h)).filter(|v| v.is_finite())
}

/// The element of largest magnitude, sign kept (first one on ties; 0 for an empty slice).
pub(crate) fn signed_absmax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// Minimum and maximum of a non-empty slice.
pub(crate) fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

/// `x / step` rounded to nearest (ties to even) and clamped to `lo..=hi`; 0 when `step` is 0.
#[inline]
pub(crate) fn quant_level(x: f32, step: f32, lo: i32, hi: i32) -> i32 {
    if step == 0.0 {
        return 0.clamp(lo, hi);
    }
    ((x / step).round_ties_even() as i32).clamp(lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers() {
        assert_eq!(signed_absmax(&[1.0, -3.0, 2.0, 3.0]), -3.0);
        assert_eq!(signed_absmax(&[]), 0.0);
        assert_eq!(min_max(&[2.0, -1.0, 5.0]), (-1.0, 5.0));
        assert_eq!(quant_level(2.5, 1.0, -4, 3), 2);
        assert_eq!(quant_level(-9.0, 1.0, -4, 3), -4);
        assert_eq!(quant_level(1.0, 0.0, 1, 3), 1);
        let mut b = [0u8; 4];
        assert_eq!(write_f16(&mut b, 2, 0.1), Some(read_f16(&b, 2)));
        assert_eq!(b[..2], [0, 0]);
        assert_eq!(write_f16(&mut b, 0, 1e6), None);
        assert_eq!(f16_round(1e6), None);
        assert_eq!(f16_round(0.5), Some(0.5));
    }
}

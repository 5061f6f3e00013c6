//! IEEE binary16 (f16) and bfloat16 conversions by bit manipulation.

/// Converts IEEE binary16 bits to f32 exactly (subnormals, infinities and NaN payloads included).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let shifted = (h & 0x7fff) << 13; // exponent and mantissa in f32 position
    let exp = shifted & 0x0f80_0000;
    // Rebias the exponent (15 -> 127). All three candidates are computed and combined with masks so
    // the compiler vectorizes row loops; no step depends on denormal support.
    let normal = shifted + (112 << 23);
    let inf_nan = normal + (112 << 23);
    // Subnormal: 2^-14 * (1 + m/1024) - 2^-14 = m * 2^-24, exact.
    let subnormal = (f32::from_bits(normal + (1 << 23)) - f32::from_bits(113 << 23)).to_bits();
    let is_inf_nan = u32::from(exp == 0x0f80_0000).wrapping_neg();
    let is_subnormal = u32::from(exp == 0).wrapping_neg();
    let bits = (normal & !(is_inf_nan | is_subnormal)) | (inf_nan & is_inf_nan) | (subnormal & is_subnormal);
    f32::from_bits(bits | sign)
}

/// Converts f32 to IEEE binary16 bits, rounding to nearest even (overflow gives infinity, NaN stays NaN).
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let abs = bits & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        // NaN: keep the top payload bits and force a quiet NaN.
        return sign | 0x7e00 | ((abs >> 13) & 0x3ff) as u16;
    }
    if abs >= 0x477f_f000 {
        // >= 65520 rounds to infinity (includes infinity itself).
        return sign | 0x7c00;
    }
    if abs >= 0x3880_0000 {
        // Normal range: rebias the exponent, then round the 13 dropped bits to nearest even.
        let v = abs - (112 << 23);
        let rounded = v + 0x0fff + ((v >> 13) & 1);
        return sign | (rounded >> 13) as u16;
    }
    if abs < 0x3300_0000 {
        // Below half the smallest subnormal (2^-25): rounds to zero.
        return sign;
    }
    // Subnormal result: value in units of 2^-24 is mantissa >> shift, rounded to nearest even.
    let exp = abs >> 23;
    let man = (abs & 0x007f_ffff) | 0x0080_0000;
    let shift = 126 - exp;
    let q = man >> shift;
    let rem = man & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    let round_up = rem > half || (rem == half && q & 1 == 1);
    sign | (q + u32::from(round_up)) as u16
}

/// Converts bfloat16 bits to f32 (exact).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Converts f32 to bfloat16 bits, rounding to nearest even (NaN stays a quiet NaN), as ggml does.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 0x40) as u16;
    }
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slow reference: decode a binary16 value with f64 arithmetic.
    fn f16_reference(h: u16) -> f64 {
        let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
        let exp = i32::from((h >> 10) & 0x1f);
        let man = f64::from(h & 0x3ff);
        match exp {
            0 => sign * man * 2f64.powi(-24),
            31 if man == 0.0 => sign * f64::INFINITY,
            31 => f64::NAN,
            _ => sign * (1.0 + man / 1024.0) * 2f64.powi(exp - 15),
        }
    }

    #[test]
    fn f16_decode_exhaustive() {
        for h in 0..=u16::MAX {
            let got = f16_to_f32(h);
            let want = f16_reference(h);
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(f64::from(got), want, "{h:#06x}");
                assert_eq!(got.is_sign_negative(), h & 0x8000 != 0, "{h:#06x}");
            }
        }
    }

    #[test]
    fn f16_round_trip_exhaustive() {
        for h in 0..=u16::MAX {
            let back = f32_to_f16(f16_to_f32(h));
            if f16_to_f32(h).is_nan() {
                assert!(f16_to_f32(back).is_nan(), "{h:#06x}");
            } else {
                assert_eq!(back, h, "{h:#06x}");
            }
        }
    }

    #[test]
    fn f16_encode_rounds_to_nearest_even() {
        // Midpoints between consecutive f16 values must round to the even neighbour; values just
        // beside the midpoint must round to the nearer neighbour.
        for h in 0..0x7bffu16 {
            let (a, b) = (f64::from(f16_to_f32(h)), f64::from(f16_to_f32(h + 1)));
            let mid = (a + b) / 2.0;
            let even = if h & 1 == 0 { h } else { h + 1 };
            assert_eq!(f32_to_f16(mid as f32), even, "midpoint after {h:#06x}");
            let below = f32::from_bits((mid as f32).to_bits() - 1);
            let above = f32::from_bits((mid as f32).to_bits() + 1);
            assert_eq!(f32_to_f16(below), h, "below midpoint after {h:#06x}");
            assert_eq!(f32_to_f16(above), h + 1, "above midpoint after {h:#06x}");
            assert_eq!(f32_to_f16(-below), h | 0x8000);
        }
    }

    #[test]
    fn f16_encode_edges() {
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(65519.99), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(1e10), 0x7c00);
        assert_eq!(f32_to_f16(f32::NEG_INFINITY), 0xfc00);
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0);
        assert_eq!(f32_to_f16(f32::from_bits(2f32.powi(-25).to_bits() + 1)), 1);
        assert_eq!(f32_to_f16(1e-30), 0);
        assert_eq!(f32_to_f16(-0.0), 0x8000);
        assert!(f16_to_f32(f32_to_f16(f32::NAN)).is_nan());
    }

    #[test]
    fn bf16_conversions() {
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0xc000), -2.0);
        assert_eq!(bf16_to_f32(0x0001), f32::from_bits(0x0001_0000));
        assert_eq!(bf16_to_f32(0x7f80), f32::INFINITY);
        assert!(bf16_to_f32(0x7fc1).is_nan());
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (down).
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        for h in 0..=u16::MAX {
            if !bf16_to_f32(h).is_nan() {
                assert_eq!(f32_to_bf16(bf16_to_f32(h)), h);
            }
        }
    }
}

//! Format definitions checked by hand-built blocks, gguf-py fixtures, quantize round trips and error paths.

use kiln_quant::{dequantize, f16_to_f32, quantize, GgmlType, QuantError};
use serde_json::Value;

const GGUF_PY_REFS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/gguf_py_refs.json");

/// Decodes one block (or `n` scalar elements) of `ty`.
fn decode(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / ty.type_size() * ty.block_size();
    let mut out = vec![f32::NAN; n];
    dequantize(ty, bytes, &mut out).unwrap();
    out
}

/// Packs Q4_K/Q5_K scales and mins (six bits each) following ggml's `get_scale_min_k4` layout.
fn pack_k4_scales(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | (sc[j + 4] >> 4) << 6;
        s[j + 4] = mn[j] | (mn[j + 4] >> 4) << 6;
        s[j + 8] = (sc[j + 4] & 15) | (mn[j + 4] & 15) << 4;
    }
    s
}

#[test]
fn f16_hand_values() {
    let halves: [u16; 11] = [0x3c00, 0xc000, 0x0001, 0x7bff, 0x7c00, 0xfc00, 0x7e00, 0x8000, 0x3555, 0x0400, 0x03ff];
    let bytes: Vec<u8> = halves.iter().flat_map(|h| h.to_le_bytes()).collect();
    let y = decode(GgmlType::F16, &bytes);
    assert_eq!(y[0], 1.0);
    assert_eq!(y[1], -2.0);
    assert_eq!(y[2], 2f32.powi(-24));
    assert_eq!(y[3], 65504.0);
    assert_eq!(y[4], f32::INFINITY);
    assert_eq!(y[5], f32::NEG_INFINITY);
    assert!(y[6].is_nan());
    assert_eq!(y[7].to_bits(), 0x8000_0000);
    assert_eq!(y[8], 1365.0 / 4096.0);
    assert_eq!(y[9], 2f32.powi(-14));
    assert_eq!(y[10], 1023.0 * 2f32.powi(-24));
}

#[test]
fn bf16_hand_values() {
    let halves: [u16; 7] = [0x3f80, 0xc049, 0x0001, 0x7f80, 0xff80, 0x7fc0, 0x4120];
    let bytes: Vec<u8> = halves.iter().flat_map(|h| h.to_le_bytes()).collect();
    let y = decode(GgmlType::BF16, &bytes);
    assert_eq!(y[0], 1.0);
    assert_eq!(y[1], -3.140625);
    assert_eq!(y[2].to_bits(), 0x0001_0000);
    assert_eq!(y[3], f32::INFINITY);
    assert_eq!(y[4], f32::NEG_INFINITY);
    assert!(y[5].is_nan());
    assert_eq!(y[6], 10.0);
}

#[test]
fn q4_0_hand_block() {
    // d = 0.5; nibble j low = j, high = 15 - j; value = (q - 8) * d.
    let mut b = vec![0x00, 0x38];
    b.extend((0..16u8).map(|j| j | (15 - j) << 4));
    let y = decode(GgmlType::Q4_0, &b);
    assert_eq!((y[0], y[8], y[15], y[16], y[31]), (-4.0, 0.0, 3.5, 3.5, -4.0));
    for j in 0..16 {
        assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
        assert_eq!(y[j + 16], (7.0 - j as f32) * 0.5);
    }
}

#[test]
fn q4_1_hand_block() {
    // d = 0.25, m = -1.5; value = q * d + m.
    let mut b = vec![0x00, 0x34, 0x00, 0xbe];
    b.extend((0..16u8).map(|j| j | (15 - j) << 4));
    let y = decode(GgmlType::Q4_1, &b);
    assert_eq!((y[0], y[6], y[15], y[16], y[31]), (-1.5, 0.0, 2.25, 2.25, -1.5));
}

#[test]
fn q5_0_hand_block() {
    // d = 1; qh bits 1 and 16 set (elements 1 and 16 get +16); low = high nibble = j; value = q - 16.
    let mut b = vec![0x00, 0x3c];
    b.extend(0x0001_0002u32.to_le_bytes());
    b.extend((0..16u8).map(|j| j | j << 4));
    let y = decode(GgmlType::Q5_0, &b);
    assert_eq!((y[0], y[1], y[2], y[16], y[17], y[31]), (-16.0, 1.0, -14.0, 0.0, -15.0, -1.0));
}

#[test]
fn q5_1_hand_block() {
    // d = 0.125, m = 2; qh bits 0 and 31 set; low = high nibble = j; value = q * d + m.
    let mut b = vec![0x00, 0x30, 0x00, 0x40];
    b.extend(0x8000_0001u32.to_le_bytes());
    b.extend((0..16u8).map(|j| j | j << 4));
    let y = decode(GgmlType::Q5_1, &b);
    assert_eq!((y[0], y[1], y[15], y[16], y[31]), (4.0, 2.125, 3.875, 2.0, 5.875));
}

#[test]
fn q8_0_hand_block() {
    // d = -0.5; q = j - 16.
    let mut b = vec![0x00, 0xb8];
    b.extend((0..32i8).map(|j| (j - 16) as u8));
    let y = decode(GgmlType::Q8_0, &b);
    assert_eq!((y[0], y[16], y[31]), (8.0, 0.0, -7.5));
}

#[test]
fn q2_k_hand_block() {
    // Sub-block k (16 elements) has scale k and min 15 - k; every qs byte is 0b11_10_01_00, so the
    // 2-bit level of element p is its shift group (p % 128) / 32. d = 0.5, dmin = 0.25.
    let mut b: Vec<u8> = (0..16u8).map(|k| k | (15 - k) << 4).collect();
    b.extend([0xe4u8; 64]);
    b.extend([0x00, 0x38, 0x00, 0x34]);
    let y = decode(GgmlType::Q2_K, &b);
    // value = d * scale * level - dmin * min
    assert_eq!(y[0], -3.75); // k 0, level 0
    assert_eq!(y[16], -3.5); // k 1, level 0
    assert_eq!(y[40], -2.25); // k 2, level 1: 1 - 3.25
    assert_eq!(y[127], 8.5); // k 7, level 3: 10.5 - 2
    assert_eq!(y[200], 11.25); // k 12, level 2: 12 - 0.75
    assert_eq!(y[255], 22.5); // k 15, level 3
}

#[test]
fn q3_k_hand_block() {
    // Sub-block i has 6-bit biased scale 24 + i, i.e. scale i - 8; every qs byte is 0b11_10_01_00
    // (low level = shift group (p % 128) / 32); the high-mask bit is set everywhere except for
    // element 0 and element 255, which therefore get -4. d = 0.5.
    let mut hmask = [0xffu8; 32];
    hmask[0] = 0xfe; // bit 0 (group 0) of byte 0: element 0
    hmask[31] = 0x7f; // bit 7 (group 7) of byte 31: element 128 + 96 + 31 = 255
    let mut scales = [0u8; 12];
    for i in 0..16 {
        let v = 24 + i as u8;
        if i < 8 {
            scales[i] |= v & 15;
        } else {
            scales[i - 8] |= (v & 15) << 4;
        }
        scales[8 + i % 4] |= (v >> 4) << (2 * (i / 4));
    }
    let mut b = hmask.to_vec();
    b.extend([0xe4u8; 64]);
    b.extend(scales);
    b.extend([0x00, 0x38]);
    let y = decode(GgmlType::Q3_K, &b);
    // value = d * (scale) * (level - (hmask bit ? 0 : 4))
    assert_eq!(y[0], 16.0); // scale -8, level 0 - 4
    assert_eq!(y[1], 0.0); // scale -8, level 0
    assert_eq!(y[40], -3.0); // scale -6, level 1
    assert_eq!(y[100], -3.0); // scale -2, level 3
    assert_eq!(y[200], 4.0); // scale 4, level 2
    assert_eq!(y[255], -3.5); // scale 7, level 3 - 4
}

#[test]
fn q4_k_hand_block() {
    // d = 1, dmin = 0.5; sub-block s (32 elements) has scale s + 1 and min 2s; qs bytes 0x3a
    // (low nibble 10 for even sub-blocks, high nibble 3 for odd ones).
    let mut b = vec![0x00, 0x3c, 0x00, 0x38];
    b.extend(pack_k4_scales([1, 2, 3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10, 12, 14]));
    b.extend([0x3au8; 128]);
    let y = decode(GgmlType::Q4_K, &b);
    assert_eq!((y[0], y[33], y[64], y[130], y[255]), (10.0, 5.0, 28.0, 46.0, 17.0));
}

#[test]
fn q4_k_large_scales_use_high_bits() {
    // Scales/mins >= 16 in sub-blocks 4..8 need the top two bits stored in bytes 0..8.
    let mut b = vec![0x00, 0x3c, 0x00, 0x3c];
    b.extend(pack_k4_scales([0, 0, 0, 0, 63, 16, 33, 48], [0, 0, 0, 0, 0, 62, 0, 17]));
    b.extend([0x11u8; 128]);
    let y = decode(GgmlType::Q4_K, &b);
    assert_eq!((y[128], y[160], y[192], y[224]), (63.0, 16.0 - 62.0, 33.0, 48.0 - 17.0));
}

#[test]
fn q5_k_hand_block() {
    // As the Q4_K block, plus qh bit 0 set for every byte: sub-block 0 gets +16.
    let mut b = vec![0x00, 0x3c, 0x00, 0x38];
    b.extend(pack_k4_scales([1, 2, 3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10, 12, 14]));
    b.extend([0x01u8; 32]);
    b.extend([0x3au8; 128]);
    let y = decode(GgmlType::Q5_K, &b);
    assert_eq!((y[0], y[33], y[64], y[130], y[255]), (26.0, 5.0, 28.0, 46.0, 17.0));
}

#[test]
fn q6_k_hand_block() {
    // d = 0.5; scale of sub-block k is k - 8; ql bytes 0x21 (low 1, high 2); qh bytes 0b11_10_01_00
    // give the four 32-element groups of each half high bits 0, 1, 2, 3. value = d * scale * (q - 32).
    let mut b = vec![0x21u8; 128];
    b.extend([0xe4u8; 64]);
    b.extend((0..16i8).map(|k| (k - 8) as u8));
    b.extend([0x00, 0x38]);
    let y = decode(GgmlType::Q6_K, &b);
    assert_eq!(y[0], 0.5 * -8.0 * (1.0 - 32.0)); // group 0: low nibble 1, high bits 0
    assert_eq!(y[32], 0.5 * -6.0 * (1.0 + 16.0 - 32.0)); // group 1: low nibble, high bits 1
    assert_eq!(y[64], 0.5 * -4.0 * (2.0 + 32.0 - 32.0)); // group 2: high nibble, high bits 2
    assert_eq!(y[255], 0.5 * 7.0 * (2.0 + 48.0 - 32.0)); // group 3 of the second half
}

#[test]
fn q8_k_hand_block() {
    // d = 0.5 (f32); q_j = j as i8; bsums are not used by the decoder.
    let mut b = 0.5f32.to_le_bytes().to_vec();
    b.extend((0..=255u8).collect::<Vec<_>>());
    b.extend([0u8; 32]);
    let y = decode(GgmlType::Q8_K, &b);
    assert_eq!((y[0], y[1], y[127], y[128], y[255]), (0.0, 0.5, 63.5, -64.0, -0.5));
}

#[test]
fn matches_gguf_py_on_random_blocks() {
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(GGUF_PY_REFS).unwrap()).unwrap();
    let cases = refs["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 12);
    for case in cases {
        let name = case["type"].as_str().unwrap();
        let ty = *GgmlType::ALL.iter().find(|t| t.name() == name).unwrap();
        let hex = |s: &str| -> Vec<u8> { (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect() };
        let bytes = hex(case["bytes_hex"].as_str().unwrap());
        let want: Vec<u32> =
            hex(case["f32_bits_hex"].as_str().unwrap()).chunks(4).map(|c| u32::from_be_bytes(c.try_into().unwrap())).collect();
        let n = case["n"].as_u64().unwrap() as usize;
        let mut got = vec![0f32; n];
        dequantize(ty, &bytes, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), *w, "{name} element {i}: {g} vs {}", f32::from_bits(*w));
        }
    }
}

/// xorshift64* pseudo-random numbers.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Roughly normal (sum of four uniforms), mean 0, std ~1.
    fn normal(&mut self) -> f32 {
        ((0..4).map(|_| self.unit()).sum::<f32>() - 2.0) * 1.732
    }
}

/// Random test data: blocks of varying magnitude, some with an offset, one all-zero block.
fn test_data(rng: &mut Rng, n: usize, block: usize) -> Vec<f32> {
    let mut x = vec![0f32; n];
    for (b, chunk) in x.chunks_mut(block.max(32)).enumerate() {
        let scale = 10f32.powf(rng.unit() * 4.0 - 3.0);
        let offset = if b % 3 == 1 { scale * 2.0 } else { 0.0 };
        if b == 2 {
            continue;
        }
        for v in chunk {
            *v = rng.normal() * scale + offset;
        }
    }
    x
}

#[test]
fn quantize_dequantize_round_trip_error_bounds() {
    // (type, max |error| as a fraction of the block's max |x| (or of |x| for float types), max rmse/rms);
    // the rmse is over blocks of very different magnitudes, so the large blocks dominate it.
    let cases = [
        (GgmlType::F32, 0.0, 0.0),
        (GgmlType::F16, 1.0 / 2048.0, 1e-3),
        (GgmlType::BF16, 1.0 / 256.0, 4e-3),
        (GgmlType::Q8_0, 0.006, 0.007),
        (GgmlType::Q4_0, 0.13, 0.15),
        (GgmlType::Q4_1, 0.07, 0.12),
        (GgmlType::Q5_0, 0.07, 0.06),
        (GgmlType::Q5_1, 0.035, 0.05),
        (GgmlType::Q2_K, 0.35, 0.4),
        (GgmlType::Q3_K, 0.3, 0.2),
        (GgmlType::Q4_K, 0.08, 0.1),
        (GgmlType::Q5_K, 0.04, 0.05),
        (GgmlType::Q6_K, 0.035, 0.025),
        (GgmlType::Q8_K, 0.005, 0.008),
    ];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (ty, max_rel, max_rmse) in cases {
        let bs = ty.block_size();
        for blocks in [1, 3, 17] {
            let n = bs * blocks * if bs == 1 { 64 } else { 1 };
            let x = test_data(&mut rng, n, bs);
            let q = quantize(ty, &x).unwrap();
            assert_eq!(q.len(), ty.row_bytes(n).unwrap(), "{ty}");
            let mut y = vec![f32::NAN; n];
            dequantize(ty, &q, &mut y).unwrap();
            let (mut se, mut ss) = (0f64, 0f64);
            for (xb, yb) in x.chunks(bs.max(32)).zip(y.chunks(bs.max(32))) {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (&a, &b) in xb.iter().zip(yb) {
                    let err = (a - b).abs();
                    // float types: relative to |x|, plus half of f16's smallest subnormal
                    let bound = if bs == 1 { max_rel * a.abs() + 3e-8 } else { max_rel * amax };
                    assert!(err <= bound, "{ty} n={n}: {a} decoded as {b} (block amax {amax})");
                    se += f64::from(err).powi(2);
                    ss += f64::from(a).powi(2);
                }
            }
            let rel_rmse = (se / ss).sqrt();
            assert!(rel_rmse <= max_rmse, "{ty} n={n}: relative rmse {rel_rmse}");
        }
    }
}

#[test]
fn quantizers_follow_ggml_reference_rounding() {
    // Q8_0: d = amax / 127, q = round(x / d).
    let x: Vec<f32> = (0..32).map(|i| i as f32 - 16.0).collect();
    let q = quantize(GgmlType::Q8_0, &x).unwrap();
    let d = f16_to_f32(u16::from_le_bytes([q[0], q[1]]));
    assert_eq!(d, f16_to_f32(kiln_quant::f32_to_f16(16.0 / 127.0)));
    assert_eq!(q[2] as i8, -127);
    assert_eq!(q[2 + 16] as i8, 0);
    // Q4_0: the largest-magnitude value maps exactly to level 0 (d = max / -8).
    let mut x = [1.0f32; 32];
    x[5] = -8.0;
    let q = quantize(GgmlType::Q4_0, &x).unwrap();
    assert_eq!(&q[..2], &[0x00, 0x3c]); // d = 1.0
    let y = decode(GgmlType::Q4_0, &q);
    assert_eq!(y[5], -8.0);
    assert_eq!(y[0], 1.0);
    // Q8_K: d = max / -127 stored as f32, bsums are the 16-element sums of the quants; integers in
    // -127..=127 whose largest magnitude is 127 are therefore exact.
    let x: Vec<f32> = (0..256).map(|i| ((i * 37) % 255) as f32 - 127.0).collect();
    let q = quantize(GgmlType::Q8_K, &x).unwrap();
    let qs: Vec<i32> = q[4..260].iter().map(|&b| i32::from(b as i8)).collect();
    for k in 0..16 {
        let bsum = i16::from_le_bytes([q[260 + 2 * k], q[261 + 2 * k]]);
        assert_eq!(i32::from(bsum), qs[16 * k..16 * k + 16].iter().sum::<i32>());
    }
    assert_eq!(decode(GgmlType::Q8_K, &q), x);
}

#[test]
fn all_zero_input_round_trips_exactly() {
    for &ty in GgmlType::ALL.iter().filter(|t| t.can_dequantize()) {
        let x = vec![0f32; 512];
        let y = decode(ty, &quantize(ty, &x).unwrap());
        assert!(y.iter().all(|&v| v == 0.0), "{ty}");
    }
}

#[test]
fn error_wrong_src_length() {
    let mut dst = [0f32; 256];
    let e = dequantize(GgmlType::Q4_K, &[0u8; 143], &mut dst).unwrap_err();
    assert!(matches!(e, QuantError::SrcLength { expected: 144, actual: 143, n: 256, .. }));
    assert_eq!(e.to_string(), "Q4_K: source has 143 bytes, but 256 elements take 144 bytes");
    let e = dequantize(GgmlType::F32, &[0u8; 12], &mut dst[..4]).unwrap_err();
    assert_eq!(e.to_string(), "F32: source has 12 bytes, but 4 elements take 16 bytes");
}

#[test]
fn error_not_block_multiple() {
    let mut dst = [0f32; 100];
    let e = dequantize(GgmlType::Q8_0, &[0u8; 34 * 3], &mut dst).unwrap_err();
    assert_eq!(e.to_string(), "Q8_0: 100 elements is not a multiple of the block size 32");
    let e = quantize(GgmlType::Q6_K, &[0f32; 300]).unwrap_err();
    assert_eq!(e.to_string(), "Q6_K: 300 elements is not a multiple of the block size 256");
}

#[test]
fn error_unsupported_types() {
    let mut dst = [0f32; 256];
    let e = dequantize(GgmlType::IQ2_XXS, &[0u8; 66], &mut dst).unwrap_err();
    assert_eq!(e.to_string(), "IQ2_XXS: dequantize is not supported for this type");
    let e = quantize(GgmlType::Q8_1, &[0f32; 32]).unwrap_err();
    assert_eq!(e.to_string(), "Q8_1: quantize is not supported for this type");
    for &ty in GgmlType::ALL.iter().filter(|t| !t.can_dequantize()) {
        let n = ty.block_size();
        let src = vec![0u8; ty.type_size()];
        let mut dst = vec![0f32; n];
        assert!(matches!(dequantize(ty, &src, &mut dst), Err(QuantError::Unsupported { .. })), "{ty}");
    }
}

#[test]
fn error_non_finite_and_overflowing_input() {
    let mut x = vec![0.5f32; 64];
    x[40] = f32::NAN;
    let e = quantize(GgmlType::Q4_0, &x).unwrap_err();
    assert_eq!(e.to_string(), "Q4_0: cannot quantize non-finite value NaN at index 40");
    x[40] = f32::INFINITY;
    assert!(matches!(quantize(GgmlType::Q5_K, &[f32::NEG_INFINITY; 256]), Err(QuantError::NonFinite { index: 0, .. })));
    // F16 represents infinity, so it is encoded rather than rejected.
    assert_eq!(decode(GgmlType::F16, &quantize(GgmlType::F16, &x).unwrap())[40], f32::INFINITY);
    let mut x = vec![1.0f32; 64];
    x[33] = 1e7;
    let e = quantize(GgmlType::Q8_0, &x).unwrap_err();
    assert_eq!(e.to_string(), "Q8_0: block 1 (elements 32..64) has values too large for its f16 scale");
    for ty in [GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
        assert!(matches!(quantize(ty, &[3e9; 256]), Err(QuantError::ScaleOverflow { block: 0, .. })), "{ty}");
    }
    // Q8_K's scale is f32: large values are fine.
    assert_eq!(decode(GgmlType::Q8_K, &quantize(GgmlType::Q8_K, &[3e9; 256]).unwrap())[0], 3e9);
}

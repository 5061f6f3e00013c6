//! The ggml type table: ids, names, block sizes and byte sizes of every ggml tensor type.

use crate::QuantError;
use std::fmt;

/// Declares [`GgmlType`] and its per-type constants from one table.
macro_rules! ggml_types {
    ($( $(#[$doc:meta])* $variant:ident = $id:literal, $block:expr, $bytes:expr; )*) => {
        /// A ggml tensor element type, with its ggml/GGUF numeric id.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum GgmlType {
            $( $(#[$doc])* $variant, )*
        }

        impl GgmlType {
            /// Every ggml type, in ggml id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$variant),*];

            /// The type with ggml id `id`, or `None` for unknown or removed ids.
            pub fn from_id(id: u32) -> Option<GgmlType> {
                match id {
                    $( $id => Some(GgmlType::$variant), )*
                    _ => None,
                }
            }

            /// The ggml/GGUF numeric id of this type.
            pub fn id(self) -> u32 {
                match self { $( GgmlType::$variant => $id, )* }
            }

            /// ggml's name of this type ("F32", "Q4_K", "IQ2_XXS", ...).
            pub fn name(self) -> &'static str {
                match self { $( GgmlType::$variant => stringify!($variant), )* }
            }

            /// Number of elements per block (1 for plain scalar types).
            pub fn block_size(self) -> usize {
                match self { $( GgmlType::$variant => $block, )* }
            }

            /// Number of bytes per block.
            pub fn type_size(self) -> usize {
                match self { $( GgmlType::$variant => $bytes, )* }
            }
        }
    };
}

/// Elements per K-quant super-block.
const QK_K: usize = 256;

ggml_types! {
    /// 32-bit IEEE float.
    F32 = 0, 1, 4;
    /// 16-bit IEEE half float.
    F16 = 1, 1, 2;
    /// 4-bit, scale only (d: f16, 16 nibbles).
    Q4_0 = 2, 32, 2 + 16;
    /// 4-bit, scale and minimum.
    Q4_1 = 3, 32, 2 + 2 + 16;
    /// 5-bit, scale only.
    Q5_0 = 6, 32, 2 + 4 + 16;
    /// 5-bit, scale and minimum.
    Q5_1 = 7, 32, 2 + 2 + 4 + 16;
    /// 8-bit, scale only.
    Q8_0 = 8, 32, 2 + 32;
    /// 8-bit, scale and block sum (an activation format).
    Q8_1 = 9, 32, 2 + 2 + 32;
    /// 2-bit K-quant.
    Q2_K = 10, QK_K, QK_K / 16 + QK_K / 4 + 2 + 2;
    /// 3-bit K-quant.
    Q3_K = 11, QK_K, QK_K / 8 + QK_K / 4 + 12 + 2;
    /// 4-bit K-quant.
    Q4_K = 12, QK_K, 2 + 2 + 12 + QK_K / 2;
    /// 5-bit K-quant.
    Q5_K = 13, QK_K, 2 + 2 + 12 + QK_K / 8 + QK_K / 2;
    /// 6-bit K-quant.
    Q6_K = 14, QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
    /// 8-bit K-quant (f32 scale, with 16-element sums).
    Q8_K = 15, QK_K, 4 + QK_K + QK_K / 8;
    /// 2.06-bit importance quant.
    IQ2_XXS = 16, QK_K, 2 + QK_K / 4;
    /// 2.31-bit importance quant.
    IQ2_XS = 17, QK_K, 2 + QK_K / 4 + QK_K / 32;
    /// 3.06-bit importance quant.
    IQ3_XXS = 18, QK_K, 2 + QK_K / 4 + QK_K / 8;
    /// 1.56-bit importance quant.
    IQ1_S = 19, QK_K, 2 + QK_K / 8 + QK_K / 16;
    /// 4-bit non-linear quant, 32-element blocks.
    IQ4_NL = 20, 32, 2 + 16;
    /// 3.44-bit importance quant.
    IQ3_S = 21, QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4;
    /// 2.5-bit importance quant.
    IQ2_S = 22, QK_K, 2 + QK_K / 4 + QK_K / 16;
    /// 4.25-bit non-linear quant, 256-element blocks.
    IQ4_XS = 23, QK_K, 2 + 2 + QK_K / 2 + QK_K / 64;
    /// 8-bit signed integer.
    I8 = 24, 1, 1;
    /// 16-bit signed integer.
    I16 = 25, 1, 2;
    /// 32-bit signed integer.
    I32 = 26, 1, 4;
    /// 64-bit signed integer.
    I64 = 27, 1, 8;
    /// 64-bit IEEE float.
    F64 = 28, 1, 8;
    /// 1.75-bit importance quant.
    IQ1_M = 29, QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32;
    /// bfloat16.
    BF16 = 30, 1, 2;
    /// Ternary quant, 1.69 bits.
    TQ1_0 = 34, QK_K, 2 + 4 * 13;
    /// Ternary quant, 2.06 bits.
    TQ2_0 = 35, QK_K, 2 + 64;
    /// Microscaling FP4 (E2M1 values, E8M0 shared exponent).
    MXFP4 = 39, 32, 1 + 16;
}

impl GgmlType {
    /// Bytes needed for `n` elements; `n` must be a multiple of the block size.
    pub fn row_bytes(self, n: usize) -> Result<usize, QuantError> {
        let block_size = self.block_size();
        #[allow(clippy::manual_is_multiple_of)]
        // `is_multiple_of` needs Rust 1.87; the workspace MSRV is 1.85
        if n % block_size != 0 {
            return Err(QuantError::NotBlockMultiple { ty: self, n, block_size });
        }
        (n / block_size).checked_mul(self.type_size()).ok_or(QuantError::SizeOverflow { ty: self, n })
    }

    /// Whether [`crate::dequantize`] and [`crate::quantize`] support this type.
    pub fn can_dequantize(self) -> bool {
        crate::codec(self).is_some()
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        assert_eq!(GgmlType::ALL.len(), 32);
        for &ty in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(ty.id()), Some(ty));
        }
        for id in [4, 5, 31, 32, 33, 36, 37, 38, 40, u32::MAX] {
            assert_eq!(GgmlType::from_id(id), None, "id {id}");
        }
        assert!(GgmlType::ALL.windows(2).all(|w| w[0].id() < w[1].id()));
    }

    #[test]
    fn known_sizes_and_names() {
        let expect = [
            (GgmlType::F32, 0, "F32", 1, 4),
            (GgmlType::BF16, 30, "BF16", 1, 2),
            (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
            (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
            (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
            (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
            (GgmlType::Q2_K, 10, "Q2_K", 256, 84),
            (GgmlType::Q3_K, 11, "Q3_K", 256, 110),
            (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
            (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
            (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
            (GgmlType::Q8_K, 15, "Q8_K", 256, 292),
            (GgmlType::IQ2_XXS, 16, "IQ2_XXS", 256, 66),
            (GgmlType::IQ1_S, 19, "IQ1_S", 256, 50),
            (GgmlType::IQ3_S, 21, "IQ3_S", 256, 110),
            (GgmlType::IQ4_XS, 23, "IQ4_XS", 256, 136),
            (GgmlType::IQ1_M, 29, "IQ1_M", 256, 56),
            (GgmlType::TQ1_0, 34, "TQ1_0", 256, 54),
            (GgmlType::TQ2_0, 35, "TQ2_0", 256, 66),
            (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
        ];
        for (ty, id, name, bs, ts) in expect {
            assert_eq!((ty.id(), ty.name(), ty.block_size(), ty.type_size()), (id, name, bs, ts));
            assert_eq!(ty.to_string(), name);
        }
    }

    #[test]
    fn row_bytes_checks() {
        assert_eq!(GgmlType::Q4_K.row_bytes(512).unwrap(), 288);
        assert_eq!(GgmlType::F16.row_bytes(3).unwrap(), 6);
        assert_eq!(GgmlType::Q8_0.row_bytes(0).unwrap(), 0);
        let e = GgmlType::Q4_K.row_bytes(100).unwrap_err().to_string();
        assert!(e.contains("Q4_K") && e.contains("100") && e.contains("256"), "{e}");
        let e = GgmlType::F64.row_bytes(usize::MAX).unwrap_err().to_string();
        assert!(e.contains("F64") && e.contains("overflow"), "{e}");
    }

    #[test]
    fn dequantizable_set() {
        let n = GgmlType::ALL.iter().filter(|t| t.can_dequantize()).count();
        assert_eq!(n, 14);
        assert!(!GgmlType::Q8_1.can_dequantize());
        assert!(!GgmlType::IQ2_XXS.can_dequantize());
    }
}

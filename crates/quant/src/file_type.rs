//! llama.cpp's file types (`llama_ftype`, stored in a GGUF file as `general.file_type`): which
//! mix of formats a file's matrices are in, by number and by the name llama.cpp prints.

use crate::GgmlType;

/// Every file type kiln names: its number, llama.cpp's name, and the format of most of its
/// matrices. A format's first entry is the file type of a file whose every matrix is in it
/// (llama-quantize names an all-Q4_K file "Q4_K - Small").
const FILE_TYPES: &[(u32, &str, GgmlType)] = &[
    (0, "all F32", GgmlType::F32),
    (1, "F16", GgmlType::F16),
    (2, "Q4_0", GgmlType::Q4_0),
    (3, "Q4_1", GgmlType::Q4_1),
    (7, "Q8_0", GgmlType::Q8_0),
    (8, "Q5_0", GgmlType::Q5_0),
    (9, "Q5_1", GgmlType::Q5_1),
    (10, "Q2_K - Medium", GgmlType::Q2_K),
    (11, "Q3_K - Small", GgmlType::Q3_K),
    (12, "Q3_K - Medium", GgmlType::Q3_K),
    (13, "Q3_K - Large", GgmlType::Q3_K),
    (14, "Q4_K - Small", GgmlType::Q4_K),
    (15, "Q4_K - Medium", GgmlType::Q4_K),
    (16, "Q5_K - Small", GgmlType::Q5_K),
    (17, "Q5_K - Medium", GgmlType::Q5_K),
    (18, "Q6_K", GgmlType::Q6_K),
    (32, "BF16", GgmlType::BF16),
];

/// llama.cpp's name of file type `id` ("Q4_K - Medium" for 15), if kiln knows it.
pub fn file_type_name(id: u32) -> Option<&'static str> {
    FILE_TYPES.iter().find(|e| e.0 == id).map(|e| e.1)
}

/// The file type llama.cpp names `name`, if kiln knows it.
pub fn file_type_named(name: &str) -> Option<u32> {
    FILE_TYPES.iter().find(|e| e.1 == name).map(|e| e.0)
}

/// The file type of a file whose every matrix is in format `ty` (`None`: llama.cpp has none).
pub fn file_type_of(ty: GgmlType) -> Option<u32> {
    FILE_TYPES.iter().find(|e| e.2 == ty).map(|e| e.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers_are_llama_cpps() {
        assert_eq!(file_type_name(15), Some("Q4_K - Medium"));
        assert_eq!(file_type_name(0), Some("all F32"));
        assert_eq!(file_type_name(4), None);
        assert_eq!(file_type_named("Q4_K - Medium"), Some(15));
        assert_eq!(file_type_named("Q4_K_M"), None);
        // A single format takes its small variant, as llama-quantize names it.
        assert_eq!(file_type_of(GgmlType::Q4_K), Some(14));
        assert_eq!(file_type_of(GgmlType::Q3_K), Some(11));
        assert_eq!(file_type_of(GgmlType::Q8_0), Some(7));
        assert_eq!(file_type_of(GgmlType::Q8_K), None);
        for &(id, name, _) in FILE_TYPES {
            assert_eq!(file_type_named(name), Some(id), "{name}");
            assert_eq!(FILE_TYPES.iter().filter(|e| e.0 == id).count(), 1, "{id}");
        }
    }
}

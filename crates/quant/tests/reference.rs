//! Bit-exactness against gguf-py: dequantize tensors of the real model and compare with
//! `shared/refs/dequant_refs.json` (first 64 values, sampled indices, sha256 of all values, f64 stats).
//!
//! The model is fetched (once, cached) through kiln-hub.

use kiln_quant::{dequantize, GgmlType};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

const REFS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/refs/dequant_refs.json");

/// The cached default model (downloaded through kiln-hub on first use).
fn model_path() -> PathBuf {
    kiln_hub::ensure_default_model().expect("default model")
}

/// Lower-case hex digest.
fn hex(h: Sha256) -> String {
    format!("{:x}", h.finalize())
}

fn read_range(path: &PathBuf, offset: u64, len: usize) -> Vec<u8> {
    let mut f = std::fs::File::open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut buf = vec![0u8; len];
    f.read_exact(&mut buf).unwrap();
    buf
}

fn sha256_hex(bytes: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(bytes);
    hex(h)
}

/// A reference value, which is an f32 printed as f64. serde_json's default float parsing may be off by
/// an ulp of f64, which rounding to f32 removes, so f32 comparisons are exact.
fn as_f32(v: &Value) -> f32 {
    v.as_f64().unwrap() as f32
}

/// Checks one tensor of the reference list; returns its element count.
fn check_tensor(path: &PathBuf, t: &Value) -> usize {
    let name = t["name"].as_str().unwrap();
    let ty = GgmlType::from_id(t["ggml_type_id"].as_u64().unwrap() as u32).unwrap();
    assert_eq!(ty.name(), t["ggml_type"].as_str().unwrap());
    let ne: Vec<usize> = t["ne"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let row_len = ne[0];
    let n_rows: usize = ne[1..].iter().product();
    let n_bytes = t["n_bytes"].as_u64().unwrap() as usize;
    assert_eq!(ty.row_bytes(row_len).unwrap() * n_rows, n_bytes, "{name}");
    let raw = read_range(path, t["data_offset"].as_u64().unwrap(), n_bytes);
    assert_eq!(sha256_hex(&raw), t["raw_sha256"].as_str().unwrap(), "{name}: raw bytes");

    // Row by row, as the CPU kernels call it.
    let row_bytes = ty.row_bytes(row_len).unwrap();
    let mut row = vec![0f32; row_len];
    let mut hash = Sha256::new();
    let mut le = Vec::with_capacity(row_len * 4);
    let (mut sum, mut abs_sum) = (0f64, 0f64);
    let (mut min, mut max) = (f32::INFINITY, f32::NEG_INFINITY);
    let mut first64 = Vec::new();
    let samples: Vec<(usize, f32)> =
        t["sample_indices"].as_object().unwrap().iter().map(|(k, v)| (k.parse().unwrap(), as_f32(v))).collect();
    for (r, src) in raw.chunks_exact(row_bytes).enumerate() {
        dequantize(ty, src, &mut row).unwrap();
        le.clear();
        for &v in &row {
            le.extend_from_slice(&v.to_le_bytes());
            sum += f64::from(v);
            abs_sum += f64::from(v).abs();
            min = min.min(v);
            max = max.max(v);
        }
        hash.update(&le);
        if first64.len() < 64 {
            first64.extend(row.iter().take(64 - first64.len()).copied());
        }
        for &(i, want) in &samples {
            if i / row_len == r {
                assert_eq!(row[i % row_len], want, "{name}: value {i}");
            }
        }
    }
    let want_first: Vec<f32> = t["first64"].as_array().unwrap().iter().map(as_f32).collect();
    assert_eq!(first64, want_first, "{name}: first64");
    assert_eq!(hex(hash), t["f32_sha256"].as_str().unwrap(), "{name}: sha256 of all values");
    let tol = 1e-9 * t["abs_sum_f64"].as_f64().unwrap();
    assert!((sum - t["sum_f64"].as_f64().unwrap()).abs() <= tol, "{name}: sum {sum}");
    assert!((abs_sum - t["abs_sum_f64"].as_f64().unwrap()).abs() <= tol, "{name}: abs sum {abs_sum}");
    assert_eq!(min, as_f32(&t["min"]), "{name}: min");
    assert_eq!(max, as_f32(&t["max"]), "{name}: max");

    // The whole tensor in one call gives the same values as row by row (skip the 640 MB embedding).
    if row_len * n_rows <= 4 << 20 {
        let mut all = vec![0f32; row_len * n_rows];
        dequantize(ty, &raw, &mut all).unwrap();
        let mut h = Sha256::new();
        let bytes: Vec<u8> = all.iter().flat_map(|v| v.to_le_bytes()).collect();
        h.update(&bytes);
        assert_eq!(hex(h), t["f32_sha256"].as_str().unwrap(), "{name}: whole-tensor call");
    }
    row_len * n_rows
}

#[test]
fn real_model_tensors_match_gguf_py_bit_for_bit() {
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(REFS).unwrap()).unwrap();
    let path = model_path();
    let tensors = refs["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 10);
    let mut seen = std::collections::BTreeSet::new();
    for t in tensors {
        check_tensor(&path, t);
        seen.insert(t["ggml_type"].as_str().unwrap().to_string());
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]);
}

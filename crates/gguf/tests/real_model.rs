//! The real default model (gemma-3-270m Q4_K_M) opens and matches `shared/refs/dequant_refs.json`.

use kiln_gguf::{GgufFile, GgufWriter, MetaValue};
use kiln_quant::GgmlType;
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Instant;

const REFS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/refs/dequant_refs.json");

fn open_model() -> GgufFile {
    let path = kiln_hub::ensure_default_model().expect("default model");
    let start = Instant::now();
    let file = GgufFile::open(&path).unwrap();
    let took = start.elapsed();
    eprintln!("open took {took:?}");
    if !cfg!(debug_assertions) {
        assert!(took.as_secs_f64() < 1.0, "open took {took:?}");
    }
    file
}

#[test]
fn real_model_header_metadata_and_tensors() {
    let f = open_model();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.architecture().unwrap(), "gemma3");
    assert_eq!(f.metadata().len(), 33);
    assert_eq!(f.metadata()[0].0, "general.architecture");
    assert_eq!(f.get_u32("gemma3.block_count").unwrap(), 18);
    assert_eq!(f.get_u32("gemma3.embedding_length").unwrap(), 640);
    assert_eq!(f.get_u32("gemma3.attention.head_count_kv").unwrap(), 1);
    assert_eq!(f.get_u32("gemma3.attention.sliding_window").unwrap(), 512);
    assert_eq!(f.get_f32("gemma3.attention.layer_norm_rms_epsilon").unwrap(), 1e-6);
    assert_eq!(f.get_f32("gemma3.rope.freq_base").unwrap(), 1e6);
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "llama");
    assert!(f.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert!(!f.get_bool("tokenizer.ggml.add_eos_token").unwrap());
    assert_eq!(f.get_u32("tokenizer.ggml.bos_token_id").unwrap(), 2);
    assert_eq!(f.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 1);

    let tokens = f.get_array("tokenizer.ggml.tokens").unwrap().as_strings().unwrap();
    assert_eq!(tokens.len(), 262_144);
    assert_eq!(&tokens[..3], ["<pad>", "<eos>", "<bos>"]);
    assert_eq!(tokens[105], "<start_of_turn>");
    assert_eq!(f.get_array("tokenizer.ggml.scores").unwrap().as_f32s().unwrap().len(), 262_144);
    assert_eq!(f.get_array("tokenizer.ggml.token_type").unwrap().as_i32s().unwrap().len(), 262_144);
    let summary = f.get("tokenizer.ggml.tokens").unwrap().summary(2);
    assert_eq!(summary, r#"[string; 262144] ["<pad>", "<eos>", ...]"#);

    let e = f.get_str("gemma3.block_count").unwrap_err().to_string();
    assert_eq!(e, "metadata key 'gemma3.block_count': expected string, found u32");
    let e = f.get_u32("no.such.key").unwrap_err().to_string();
    assert_eq!(e, "metadata key 'no.such.key' not found");

    assert_eq!(f.tensors().len(), 236);
    let mut counts = BTreeMap::new();
    for t in f.tensors() {
        *counts.entry(t.ty.name()).or_insert(0) += 1;
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes, "{}", t.name);
        assert_eq!(t.offset % 32, 0);
        assert_eq!(t.n_elements(), (t.row_len() * t.n_rows()) as u64);
    }
    let want: BTreeMap<&str, i32> = [("F32", 109), ("Q5_0", 81), ("Q4_K", 27), ("Q8_0", 10), ("Q6_K", 9)].into();
    assert_eq!(counts, want);
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!((embd.dims.as_slice(), embd.ty), (&[640u64, 262_144][..], GgmlType::Q8_0));
    assert!(f.tensor("missing.weight").is_none());
}

#[test]
fn real_model_offsets_match_references() {
    let f = open_model();
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(REFS).unwrap()).unwrap();
    for r in refs["tensors"].as_array().unwrap() {
        let name = r["name"].as_str().unwrap();
        let t = f.tensor(name).unwrap();
        assert_eq!(t.offset, r["data_offset"].as_u64().unwrap(), "{name}");
        assert_eq!(t.n_bytes, r["n_bytes"].as_u64().unwrap(), "{name}");
        assert_eq!(t.ty.id() as u64, r["ggml_type_id"].as_u64().unwrap(), "{name}");
        let ne: Vec<u64> = r["ne"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert_eq!(t.dims, ne, "{name}");
        let hex: String = f.tensor_data(t)[..t.ty.type_size()].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, r["raw_first_block_hex"].as_str().unwrap(), "{name}");
    }
    let by_type = refs["tensor_names_by_type"].as_object().unwrap();
    for (ty, names) in by_type {
        for n in names.as_array().unwrap() {
            assert_eq!(f.tensor(n.as_str().unwrap()).unwrap().ty.name(), ty);
        }
    }
}

#[test]
fn rewriting_the_real_model_reproduces_it_byte_for_byte() {
    let path = kiln_hub::ensure_default_model().unwrap();
    let f = GgufFile::open(&path).unwrap();
    let mut w = GgufWriter::new(f.version()).unwrap();
    for (k, v) in f.metadata() {
        w.add_metadata(k.clone(), v.clone()).unwrap();
    }
    for t in f.tensors() {
        w.add_tensor(t.name.clone(), &t.dims, t.ty, f.tensor_data(t).to_vec()).unwrap();
    }
    let bytes = w.to_bytes();
    let original = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len(), original.len());
    assert!(bytes == original, "rewritten file differs");
    let g = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(g.metadata(), f.metadata());
    assert_eq!(g.tensors(), f.tensors());
    assert!(matches!(g.get("general.alignment"), None | Some(MetaValue::U32(32))));
}

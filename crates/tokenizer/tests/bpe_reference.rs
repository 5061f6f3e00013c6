//! Byte-level BPE tokenizers (vocab-only GGUF files written by `tools/fixtures/make_fixtures.py`,
//! trained with Hugging Face `tokenizers`) against the ids `tokenizers` gives for a set of texts.

use std::path::PathBuf;

use kiln_gguf::{GgufFile, GgufWriter, MetaArray, MetaValue};
use kiln_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};
use serde_json::Value;

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");

fn reference() -> Value {
    let path = PathBuf::from(DATA).join("bpe_reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("valid json")
}

fn load(name: &str) -> (GgufFile, Tokenizer) {
    let path = PathBuf::from(DATA).join(format!("{name}.gguf"));
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let tok = Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("tokenizer {name}: {e}"));
    (file, tok)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id array").iter().map(|x| u32::try_from(x.as_u64().expect("id")).expect("u32 id")).collect()
}

#[test]
fn every_pre_tokenizer_matches_the_reference_ids() {
    let r = reference();
    let models = r.as_object().expect("object of tokenizers");
    assert_eq!(models.len(), 3, "default, llama-bpe and qwen2");
    for (name, m) in models {
        let (_, tok) = load(name);
        let bos = m["bos"].as_u64().map(|b| b as u32);
        assert_eq!(tok.bos_id(), bos, "{name}");
        let cases = m["cases"].as_array().expect("cases");
        assert!(cases.len() >= 20, "{name}: {} cases", cases.len());
        let mut failures = Vec::new();
        for case in cases {
            let text = case["text"].as_str().expect("text");
            let want = ids(&case["ids"]);
            let got = tok.encode_with(text, false);
            if got != want {
                failures.push(format!("{text:?}: kiln {got:?} reference {want:?}"));
            }
            // With BOS when the model adds one.
            let with_bos = tok.encode(text);
            let expected: Vec<u32> =
                if m["add_bos"].as_bool().expect("add_bos") { bos.into_iter().chain(want.iter().copied()).collect() } else { want.clone() };
            assert_eq!(with_bos, expected, "{name}: {text:?} with specials");
            // Decoding gives the text back, also through the streaming decoder one id at a time.
            assert_eq!(tok.decode(&got, false), text, "{name}: decode {got:?}");
            let mut d = StreamDecoder::new(false);
            let mut streamed: String = got.iter().map(|&id| d.push(&tok, id)).collect();
            streamed.push_str(&d.finish());
            assert_eq!(streamed, text, "{name}: stream decode");
        }
        assert!(failures.is_empty(), "{name}:\n{}", failures.join("\n"));
    }
}

#[test]
fn special_tokens_are_matched_and_skipped_on_decode() {
    let (_, tok) = load("bpe_llama_bpe");
    let bot = tok.token_id("<|begin_of_text|>").expect("bos token");
    let eot = tok.token_id("<|eot_id|>").expect("eot token");
    assert_eq!(tok.bos_id(), Some(bot));
    assert!(tok.is_control(eot) && tok.is_end_of_generation(eot));
    let x = tok.encode_with("a<|eot_id|>b", false);
    assert_eq!(x.len(), 3);
    assert_eq!(x[1], eot);
    assert_eq!(tok.decode(&x, true), "ab");
    assert_eq!(tok.decode(&x, false), "a<|eot_id|>b");
}

/// Builds a tokenizer from a GGUF holding the vocabulary of `bpe_qwen2` with `kvs` changed.
fn variant(kvs: Vec<(&str, MetaValue)>) -> Result<Tokenizer, TokenizerError> {
    let (file, _) = load("bpe_qwen2");
    let mut w = GgufWriter::new(3).expect("writer");
    let tokens = file.get_array("tokenizer.ggml.tokens").expect("tokens").clone();
    w.add_metadata("tokenizer.ggml.tokens", MetaValue::Array(tokens)).expect("tokens");
    let replaced: Vec<&str> = kvs.iter().map(|(k, _)| *k).collect();
    if !replaced.contains(&"tokenizer.ggml.merges") {
        let merges = file.get_array("tokenizer.ggml.merges").expect("merges").clone();
        w.add_metadata("tokenizer.ggml.merges", MetaValue::Array(merges)).expect("merges");
    }
    for (k, v) in kvs {
        w.add_metadata(k, v).expect("metadata");
    }
    let file = GgufFile::from_bytes(w.to_bytes()).expect("valid gguf");
    Tokenizer::from_gguf(&file)
}

fn string(s: &str) -> MetaValue {
    MetaValue::String(s.to_owned())
}

#[test]
fn gguf_errors_name_what_is_wrong() {
    let err = variant(vec![("tokenizer.ggml.model", string("gpt2")), ("tokenizer.ggml.pre", string("starcoder"))])
        .expect_err("unknown pre-tokenizer");
    assert!(matches!(&err, TokenizerError::UnsupportedPreTokenizer(p) if p == "starcoder"));
    assert!(err.to_string().contains("tokenizer.ggml.pre"), "{err}");

    let err = variant(vec![
        ("tokenizer.ggml.model", string("gpt2")),
        ("tokenizer.ggml.merges", MetaValue::Array(MetaArray::String(vec!["nospace".into()]))),
    ])
    .expect_err("bad merge");
    assert!(matches!(err, TokenizerError::BadMerge { rank: 0, .. }), "{err}");

    let err = variant(vec![("tokenizer.ggml.model", string("gpt2")), ("tokenizer.ggml.merges", MetaValue::Array(MetaArray::I32(vec![1])))])
        .expect_err("merges of the wrong type");
    assert!(err.to_string().contains("tokenizer.ggml.merges"), "{err}");
}

#[test]
fn gpt2_defaults_without_optional_keys() {
    // No pre name: GPT-2's regex; no special ids; no BOS added.
    let t = variant(vec![("tokenizer.ggml.model", string("gpt2"))]).expect("defaults");
    assert_eq!((t.bos_id(), t.eos_id(), t.unk_id()), (None, None, None));
    let r = reference();
    let case = &r["bpe_default"]["cases"][1];
    let (_, default) = load("bpe_default");
    let text = case["text"].as_str().expect("text");
    // Same vocabulary as qwen2 but GPT-2 pre-tokenization: decodes back to the text.
    assert_eq!(t.decode(&t.encode(text), false), text);
    assert_eq!(default.encode(text), ids(&case["ids"]));
}

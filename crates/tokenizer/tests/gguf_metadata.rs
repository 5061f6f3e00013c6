//! `Tokenizer::from_gguf` on small hand-written GGUF files: defaults, errors.

use kiln_gguf::{GgufFile, GgufWriter, MetaArray, MetaValue};
use kiln_tokenizer::{Tokenizer, TokenizerError};

/// Shorthand for a string value.
fn string(s: &str) -> MetaValue {
    MetaValue::String(s.to_owned())
}

/// Builds a tokenizer from an in-memory GGUF file holding `kvs` and no tensors.
fn build(kvs: Vec<(&str, MetaValue)>) -> Result<Tokenizer, TokenizerError> {
    let mut w = GgufWriter::new(3).expect("writer");
    for (key, value) in kvs {
        w.add_metadata(key, value).expect("metadata");
    }
    let file = GgufFile::from_bytes(w.to_bytes()).expect("valid gguf");
    Tokenizer::from_gguf(&file)
}

fn words(ws: &[&str]) -> MetaValue {
    MetaValue::Array(MetaArray::String(ws.iter().map(|w| w.to_string()).collect()))
}

#[test]
fn minimal_llama_vocab_uses_llama_cpp_defaults() {
    let t =
        build(vec![("tokenizer.ggml.model", string("llama")), ("tokenizer.ggml.tokens", words(&["<unk>", "<s>", "</s>", "▁a", "a", "▁"]))])
            .expect("minimal vocabulary");
    assert_eq!(t.vocab_size(), 6);
    assert_eq!((t.bos_id(), t.eos_id(), t.unk_id(), t.pad_id()), (Some(1), Some(2), Some(0), None));
    // BOS added, space prefix added, no scores: merges by position (all 0, leftmost first).
    assert_eq!(t.encode("a a"), vec![1, 3, 3]);
    // Without types all tokens are normal, so "<s>" is not parsed as a special token.
    assert!(!t.is_control(1));
    assert_eq!(t.decode(&[1, 3, 3], true), "<s> a a");
    assert_eq!(t.end_of_generation_ids(), &[2]);
}

#[test]
fn explicit_metadata_is_used() {
    let t = build(vec![
        ("tokenizer.ggml.model", string("llama")),
        ("tokenizer.ggml.tokens", words(&["<pad>", "<eos>", "<bos>", "<unk>", "<eot>", "a", "aa"])),
        ("tokenizer.ggml.scores", MetaValue::Array(MetaArray::F32(vec![0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0]))),
        ("tokenizer.ggml.token_type", MetaValue::Array(MetaArray::I32(vec![3, 3, 3, 2, 3, 1, 1]))),
        ("tokenizer.ggml.bos_token_id", MetaValue::U32(2)),
        ("tokenizer.ggml.eos_token_id", MetaValue::U32(1)),
        ("tokenizer.ggml.unknown_token_id", MetaValue::U32(3)),
        ("tokenizer.ggml.padding_token_id", MetaValue::U32(0)),
        ("tokenizer.ggml.eot_token_id", MetaValue::U32(4)),
        ("tokenizer.ggml.add_bos_token", MetaValue::Bool(false)),
        ("tokenizer.ggml.add_eos_token", MetaValue::Bool(true)),
        ("tokenizer.ggml.add_space_prefix", MetaValue::Bool(false)),
    ])
    .expect("explicit vocabulary");
    assert_eq!(t.encode("aaa<eot>"), vec![6, 5, 4, 1]);
    assert_eq!(t.encode_with("aaa", false), vec![6, 5]);
    // No byte tokens: unknown characters fall back to <unk>.
    assert_eq!(t.encode_with("b", false), vec![3]);
    assert_eq!(t.end_of_generation_ids(), &[1, 4]);
    assert!(t.is_control(4));
}

#[test]
fn unsupported_model_is_named() {
    for model in ["bert", "rwkv"] {
        let err = build(vec![("tokenizer.ggml.model", string(model))]).expect_err("unsupported");
        assert!(matches!(&err, TokenizerError::UnsupportedModel(m) if m == model));
        assert!(err.to_string().contains(model), "{err}");
    }
}

#[test]
fn missing_and_bad_keys_are_named() {
    let err = build(vec![]).expect_err("no model");
    assert!(err.to_string().contains("tokenizer.ggml.model"), "{err}");

    let err = build(vec![("tokenizer.ggml.model", string("llama"))]).expect_err("no tokens");
    assert!(err.to_string().contains("tokenizer.ggml.tokens"), "{err}");

    let err = build(vec![
        ("tokenizer.ggml.model", string("llama")),
        ("tokenizer.ggml.tokens", words(&["a", "b"])),
        ("tokenizer.ggml.scores", MetaValue::Array(MetaArray::I32(vec![0, 0]))),
    ])
    .expect_err("scores of the wrong type");
    assert!(err.to_string().contains("tokenizer.ggml.scores"), "{err}");

    let err = build(vec![
        ("tokenizer.ggml.model", string("llama")),
        ("tokenizer.ggml.tokens", words(&["a", "b"])),
        ("tokenizer.ggml.scores", MetaValue::Array(MetaArray::F32(vec![0.0]))),
    ])
    .expect_err("too few scores");
    assert!(matches!(err, TokenizerError::LengthMismatch { what: "scores", got: 1, expected: 2 }));

    let err = build(vec![
        ("tokenizer.ggml.model", string("llama")),
        ("tokenizer.ggml.tokens", words(&["a", "b"])),
        ("tokenizer.ggml.bos_token_id", MetaValue::U32(7)),
    ])
    .expect_err("bos out of range");
    assert!(matches!(err, TokenizerError::SpecialIdOutOfRange { name: "bos", id: 7, n_vocab: 2 }));

    let err = build(vec![
        ("tokenizer.ggml.model", string("llama")),
        ("tokenizer.ggml.tokens", words(&["a", "b"])),
        ("tokenizer.ggml.bos_token_id", string("1")),
    ])
    .expect_err("bos of the wrong type");
    assert!(err.to_string().contains("tokenizer.ggml.bos_token_id"), "{err}");

    let err = build(vec![
        ("tokenizer.ggml.model", string("llama")),
        ("tokenizer.ggml.tokens", words(&["a", "<0xZZ>"])),
        ("tokenizer.ggml.token_type", MetaValue::Array(MetaArray::I32(vec![1, 6]))),
    ])
    .expect_err("bad byte token");
    assert!(matches!(err, TokenizerError::BadByteToken { id: 1, .. }));
}

//! The tokenizers embedded in the model-family fixtures (`crates/models/tests/fixtures/families`,
//! written by `tools/fixtures/make_fixtures.py`) give the token ids of the reference cases.

use std::path::PathBuf;

use kiln_gguf::GgufFile;
use kiln_tokenizer::Tokenizer;
use serde_json::Value;

const FAMILIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tests/fixtures/families");

#[test]
fn every_family_fixture_tokenizes_its_reference_texts() {
    let mut checked = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(FAMILIES)
        .expect("families fixture directory")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    entries.sort();
    for json_path in entries {
        let r: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).expect("read json")).expect("valid json");
        let family = r["family"].as_str().expect("family");
        let file = GgufFile::open(&json_path.with_extension("gguf")).expect("open gguf");
        let tok = Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{family}: {e}"));
        for case in r["cases"].as_array().expect("cases") {
            let Some(text) = case["text"].as_str() else {
                continue;
            };
            let want: Vec<u32> = case["ids"].as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect();
            assert_eq!(tok.encode(text), want, "{family} {}", case["name"]);
            assert_eq!(tok.decode(&want, true), text, "{family} decode");
        }
        checked.push(family.to_owned());
    }
    for family in ["gemma", "gemma2", "llama", "qwen2", "qwen3"] {
        assert!(checked.iter().any(|f| f == family), "no {family} fixture");
    }
}

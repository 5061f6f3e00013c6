//! Checks the tokenizer of the default model (Gemma 3 270M) against the reference outputs in
//! `shared/refs` (produced with transformers, cross-checked with a llama.cpp-style re-implementation).

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use kiln_tokenizer::{gemma_chat_prompt, ChatMessage, StreamDecoder, Tokenizer};
use serde_json::Value;

const REFS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/refs");
const PROMPTS: [&str; 10] = ["p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8", "long"];

fn load_tokenizer() -> Tokenizer {
    let path = kiln_hub::ensure_default_model().expect("default model");
    let start = Instant::now();
    let file = kiln_gguf::GgufFile::open(&path).expect("open gguf");
    let opened = start.elapsed();
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer from gguf");
    eprintln!("timing: open gguf {opened:?}, build tokenizer {:?}", start.elapsed() - opened);
    tok
}

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(load_tokenizer)
}

fn json(name: &str) -> Value {
    let path = PathBuf::from(REFS).join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("valid json")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id array").iter().map(|x| u32::try_from(x.as_u64().expect("id")).expect("u32 id")).collect()
}

fn text(v: &Value) -> &str {
    v.as_str().expect("string")
}

/// The prompt of a reference file; the long one is read from `long_passage.txt` as-is.
fn prompt(name: &str, r: &Value) -> String {
    if name == "long" {
        let p = std::fs::read_to_string(PathBuf::from(REFS).join("long_passage.txt")).expect("long passage");
        assert_eq!(p, text(&r["prompt"]));
        p
    } else {
        text(&r["prompt"]).to_owned()
    }
}

#[test]
fn prompts_encode_like_reference() {
    let t = tok();
    for name in PROMPTS {
        let r = json(&format!("{name}.json"));
        let p = prompt(name, &r);
        let want = ids(&r["input_ids"]);
        assert_eq!(t.encode(&p), want, "{name}: encode");
        assert_eq!(t.encode_with(&p, false), ids(&r["input_ids_add_special_tokens_false"]), "{name}: no BOS");
        // transformers shows spaces inside user-defined tokens as `▁` ("  " -> "▁▁").
        let pieces: Vec<String> = want.iter().map(|&id| t.piece(id).expect("piece").replace(' ', "\u{2581}")).collect();
        let want_pieces: Vec<&str> = r["input_pieces"].as_array().expect("pieces").iter().map(text).collect();
        assert_eq!(pieces, want_pieces, "{name}: pieces");
    }
}

#[test]
fn prompts_decode_like_reference() {
    let t = tok();
    for name in PROMPTS {
        let r = json(&format!("{name}.json"));
        let p = prompt(name, &r);
        let input = ids(&r["input_ids"]);
        assert_eq!(t.decode(&input, false), text(&r["decode_roundtrip"]), "{name}: roundtrip");
        let skipped = t.decode(&input, true);
        if name == "p6" {
            assert_eq!(skipped, "user\nWhat is 2+2?\nmodel\n");
        } else {
            assert_eq!(skipped, p, "{name}: skip_special");
        }
        let g = &r["greedy"];
        let new = ids(&g["ids"]);
        assert_eq!(t.decode(&new, false), text(&g["text"]), "{name}: greedy text");
        let all: Vec<u32> = input.iter().chain(&new).copied().collect();
        assert_eq!(t.decode(&all, false), text(&g["full_text"]), "{name}: full text");
    }
}

#[test]
fn cross_check_strings() {
    let t = tok();
    let entries = json("tokenizer_xcheck.json");
    let entries = entries.as_array().expect("array");
    assert_eq!(entries.len(), 30);
    for e in entries {
        let s = text(&e["text"]);
        let want = ids(&e["hf"]);
        assert_eq!(t.encode(s), want, "encode {s:?}");
        assert_eq!(ids(&e["llamacpp_style"]), want);
        // No normalization and byte fallback: decoding is lossless.
        assert_eq!(t.decode(&t.encode_with(s, false), false), s, "roundtrip {s:?}");
        assert_eq!(t.decode(&want, false), format!("<bos>{s}"));
    }
}

/// Streams `ids` one at a time and checks the pieces against `Tokenizer::decode`.
fn check_stream(t: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
    let mut d = StreamDecoder::new(skip_special);
    let mut parts: Vec<String> = ids.iter().map(|&id| d.push(t, id)).collect();
    parts.push(d.finish());
    let full = t.decode(ids, skip_special);
    assert_eq!(parts.concat(), full);
    if !full.contains(char::REPLACEMENT_CHARACTER) {
        assert!(parts.iter().all(|p| !p.contains(char::REPLACEMENT_CHARACTER)), "{parts:?}");
    }
    parts
}

#[test]
fn stream_decoder_yields_whole_characters() {
    let t = tok();
    // Fraktur letters, fullwidth letters, emoji and CJK; several go through byte tokens.
    for s in ["ℌ𝔢𝔩𝔩𝔬 ＡＢＣ", "🙂🙃 日本語のテキスト 🦀🧪", "naïve café — ünïcödé 日本語 🙂", "\u{a0}nbsp\r\n"]
    {
        let ids = t.encode(s);
        let bytes = ids.iter().filter(|&&id| t.piece(id).is_some_and(|p| p.starts_with("<0x"))).count();
        let parts = check_stream(t, &ids, true);
        assert_eq!(parts.concat(), s);
        if bytes > 1 {
            assert!(parts.iter().any(String::is_empty), "{s:?}: some byte tokens must be held back");
        }
        check_stream(t, &ids, false);
    }
    for name in PROMPTS {
        let r = json(&format!("{name}.json"));
        let all: Vec<u32> = ids(&r["input_ids"]).into_iter().chain(ids(&r["greedy"]["ids"])).collect();
        check_stream(t, &all, false);
        check_stream(t, &all, true);
    }
}

#[test]
fn chat_template_encodes_like_reference() {
    let t = tok();
    let user = |c: &str| ChatMessage { role: "user".into(), content: c.into() };
    let p6 = json("p6.json");
    assert_eq!(gemma_chat_prompt(&[user("What is 2+2?")], true), text(&p6["prompt"]));
    assert_eq!(t.encode(&gemma_chat_prompt(&[user("What is 2+2?")], true)), ids(&p6["input_ids"]));

    let conv = [user("Hi"), ChatMessage { role: "assistant".into(), content: "Hello! How can I help?".into() }, user("Tell me a joke.")];
    let prompt = gemma_chat_prompt(&conv, true);
    assert_eq!(
        prompt,
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello! How can I help?<end_of_turn>\n\
         <start_of_turn>user\nTell me a joke.<end_of_turn>\n<start_of_turn>model\n"
    );
    let ids = t.encode(&prompt);
    let sot = t.token_id("<start_of_turn>").expect("<start_of_turn>");
    let eot = t.token_id("<end_of_turn>").expect("<end_of_turn>");
    assert_eq!((sot, eot), (105, 106));
    assert_eq!(ids.iter().filter(|&&i| i == sot).count(), 4);
    assert_eq!(ids.iter().filter(|&&i| i == eot).count(), 3);
    assert_eq!(&ids[..4], &[2, 105, 2364, 107]);
    assert_eq!(&ids[ids.len() - 3..], &[105, 4368, 107]);
    assert_eq!(t.decode(&ids, false), format!("<bos>{prompt}"));

    let sys = [ChatMessage { role: "system".into(), content: "Answer briefly.".into() }, user("What is 2+2?")];
    assert_eq!(gemma_chat_prompt(&sys, true), "<start_of_turn>user\nAnswer briefly.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n");
}

#[test]
fn special_tokens_and_metadata() {
    let t = tok();
    assert_eq!(t.vocab_size(), 262_144);
    assert_eq!((t.bos_id(), t.eos_id(), t.unk_id(), t.pad_id()), (Some(2), Some(1), Some(3), Some(0)));
    assert!(t.is_end_of_generation(1) && t.is_end_of_generation(106));
    assert!(!t.is_end_of_generation(2) && !t.is_end_of_generation(107));
    assert!(t.end_of_generation_ids().contains(&1) && t.end_of_generation_ids().contains(&106));
    for id in [0, 1, 2, 3, 105, 106] {
        assert!(t.is_control(id), "{id}");
    }
    for id in [107, 138, 238, 818, 262_144, u32::MAX] {
        assert!(!t.is_control(id), "{id}");
    }
    assert_eq!(t.piece(138), Some("  "));
    assert_eq!(t.piece(262_144), None);
    assert_eq!(t.token_id("\n\n"), Some(108));
    assert_eq!(t.token_id("<0x0A>"), Some(248));
    assert_eq!(t.token_id("no such token at all"), None);
    // Ids outside the vocabulary are ignored when decoding.
    assert_eq!(t.decode(&[818, 262_144, u32::MAX, 5279], true), "The capital");
}

#[test]
fn arbitrary_input_does_not_panic_and_roundtrips() {
    let t = tok();
    let mut x: u32 = 12345;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    for _ in 0..200 {
        let len = next() % 64;
        let s: String = (0..len).filter_map(|_| char::from_u32(next() % 0x3_0000)).collect();
        let s = s + "<start_of_turn><0x41>  \n\t<unused0>";
        assert_eq!(t.decode(&t.encode_with(&s, false), false), s);
        let ids: Vec<u32> = (0..len).map(|_| next() % 300_000).collect();
        let mut d = StreamDecoder::new(false);
        let streamed: String = ids.iter().map(|&id| d.push(t, id)).collect::<String>() + &d.finish();
        assert_eq!(streamed, t.decode(&ids, false));
    }
}

#[test]
fn long_passage_encodes_quickly() {
    let t = tok();
    let p = std::fs::read_to_string(PathBuf::from(REFS).join("long_passage.txt")).expect("long passage");
    let rounds = 50;
    let start = Instant::now();
    let mut n = 0;
    for _ in 0..rounds {
        n = t.encode(&p).len();
    }
    let per = start.elapsed() / rounds;
    eprintln!("timing: encode long passage ({} bytes, {n} tokens) {per:?}", p.len());
    assert_eq!(n, 700);
}

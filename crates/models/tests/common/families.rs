//! The checks of a model family against its fixture (`tests/fixtures/families/F.gguf`: a tiny
//! random-weight model written with llama.cpp's converter conventions, and `F.json`: the outputs of
//! the family's Hugging Face `transformers` class on the dequantized weights; made by
//! `tools/fixtures/make_fixtures.py`), shared by the CPU tests (`crates/models/tests/families.rs`)
//! and the CUDA tests (`crates/cuda/tests/cuda.rs`, which include this file by its path), each with
//! the bounds of its kernels.

use std::path::PathBuf;

use kiln_models::{Model, OutputMode, StepOutput};
use serde_json::Value;

/// The fixture file `family.ext`.
pub fn fixture_path(family: &str, ext: &str) -> PathBuf {
    // (From either crate that includes this file: both lie beside `models`.)
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tests/fixtures/families")).join(format!("{family}.{ext}"))
}

/// The fixture's reference outputs.
pub fn reference(family: &str) -> Value {
    let text = std::fs::read_to_string(fixture_path(family, "json")).expect("fixture json");
    serde_json::from_str(&text).expect("valid json")
}

/// A JSON array of token ids.
pub fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// A JSON array of numbers.
pub fn f64s(v: &Value) -> Vec<f64> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number")).collect()
}

/// `log_softmax(logits)[id]`.
pub fn log_softmax_at(logits: &[f32], id: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    logits[id] as f64 - lse
}

/// Relative L2 distance of `a` from `b`.
pub fn rel_l2_to(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let err = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum::<f64>().sqrt();
    err / b.iter().map(|y| y * y).sum::<f64>().sqrt()
}

/// The first index of the largest value.
pub fn argmax_of(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

/// How close a backend's outputs must come to the reference.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Largest relative L2 error of the last-position logits.
    pub logits: f64,
    /// Largest per-token log-likelihood difference (nats).
    pub logprob: f64,
    /// Largest difference between the last-logits mode and the all-logits mode's last row.
    pub modes: f32,
    /// Largest relative L2 distance between the logits of the prompt decoded token by token and
    /// the prompt's rows in one prefill.
    pub decode: f64,
    /// A greedy step whose reference gap (top-1 minus top-2 logit) is below this is a near-tie:
    /// the free-running continuation is compared up to the first one, the teacher-forced steps
    /// at every other step.
    pub tie: f64,
    /// Fewest greedy steps before the first near-tie a case must have (whether it is informative).
    pub trusted: usize,
}

/// Checks every case of `family`'s fixture on `model`: token ids, last-position logits and their
/// top-1, per-token log-likelihoods, the last-logits mode against the all-logits one, the prompt
/// decoded token by token against its prefill, the greedy continuation (in-graph argmax, one decode
/// step per token) up to the first near-tie, and each non-tied greedy step with the reference's
/// tokens fed (teacher forcing); one case is a prompt longer than the sliding window.
pub fn check_family(model: &Model, family: &str, b: &Bounds) {
    let r = reference(family);
    assert_eq!(model.architecture().name(), r["architecture"].as_str().unwrap(), "{family}: architecture");
    let vocab = model.architecture().vocab_size();
    let window = r["hf_config"]["sliding_window"].as_u64().map(|w| w as usize);
    for case in r["cases"].as_array().unwrap() {
        let name = format!("{family}/{}", case["name"].as_str().unwrap());
        let ids = u32s(&case["ids"]);
        if let Some(text) = case["text"].as_str() {
            assert_eq!(model.tokenizer().encode(text), ids, "{name}: token ids");
        }
        if case["name"] == "long" {
            if let Some(w) = window {
                assert!(ids.len() > w, "{name}: {} tokens do not exceed the window of {w}", ids.len());
            }
        }
        let want_greedy = u32s(&case["greedy_ids"]);
        let gaps = f64s(&case["greedy_gaps"]);

        // Every position's logits: the last row, and the log-likelihood of every next token.
        let mut s = model.new_session().unwrap();
        let StepOutput::AllLogits { rows, data } = s.forward(&ids, OutputMode::AllLogits).unwrap() else { panic!() };
        assert_eq!((rows, data.len()), (ids.len(), ids.len() * vocab));
        let last = &data[(rows - 1) * vocab..];
        let want = f64s(&case["last_logits"]);
        assert_eq!(want.len(), vocab, "{name}: reference logits width");
        let e = rel_l2_to(last, &want);
        println!("{name}: last logits relative L2 error {e:.2e}");
        assert!(e < b.logits, "{name}: relative L2 error {e}");
        if gaps[0] >= b.tie {
            assert_eq!(argmax_of(last), want_greedy[0], "{name}: top-1");
        }
        let want_lp = f64s(&case["token_logprobs"]);
        assert_eq!(want_lp.len(), ids.len() - 1);
        let worst = (1..ids.len())
            .map(|i| (log_softmax_at(&data[(i - 1) * vocab..i * vocab], ids[i] as usize) - want_lp[i - 1]).abs())
            .fold(0f64, f64::max);
        println!("{name}: worst per-token log-likelihood difference {worst:.2e} nats");
        assert!(worst < b.logprob, "{name}: log-likelihood off by {worst}");

        // The last-logits mode agrees with the all-rows one.
        let mut s = model.new_session().unwrap();
        let StepOutput::Logits(l) = s.forward(&ids, OutputMode::Logits).unwrap() else { panic!() };
        let diff = l.iter().zip(last).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!("{name}: last-logits mode against the all-logits mode's last row, largest difference {diff:.2e}");
        assert!(diff < b.modes, "{name}: logits mode differs from all-logits mode by {diff}");

        // The prompt decoded one token at a time gives its prefill's rows.
        let mut s = model.new_session().unwrap();
        let mut worst = 0f64;
        for (i, &t) in ids.iter().enumerate() {
            let StepOutput::Logits(l) = s.forward(&[t], OutputMode::Logits).unwrap() else { panic!() };
            let row: Vec<f64> = data[i * vocab..(i + 1) * vocab].iter().map(|&x| x as f64).collect();
            worst = worst.max(rel_l2_to(&l, &row));
        }
        println!("{name}: decode against prefill, worst relative L2 {worst:.2e}");
        assert!(worst <= b.decode, "{name}: decoding the prompt token by token differs from its prefill by {worst}");

        // Greedy continuation up to the first near-tie.
        let trusted = gaps.iter().position(|&g| g < b.tie).unwrap_or(gaps.len());
        assert!(trusted >= b.trusted, "{name}: the reference has a near-tie at step {trusted}; the fixture is not informative");
        let mut s = model.new_session().unwrap();
        let mut out = s.forward(&ids, OutputMode::NextToken).unwrap();
        let mut got = Vec::new();
        while got.len() < trusted {
            let StepOutput::Token(t) = out else { panic!() };
            got.push(t);
            out = s.forward(&[t], OutputMode::NextToken).unwrap();
        }
        assert_eq!(got, want_greedy[..trusted], "{name}: greedy continuation (first {trusted} steps)");

        // Teacher forcing: after the reference's tokens, each step's argmax where it is no near-tie.
        let mut s = model.new_session().unwrap();
        let mut out = s.forward(&ids, OutputMode::NextToken).unwrap();
        for (i, (&want, &gap)) in want_greedy.iter().zip(&gaps).enumerate() {
            let StepOutput::Token(t) = out else { panic!() };
            assert!(gap < b.tie || t == want, "{name}: greedy step {i} after the reference's tokens gives {t}, not {want} (gap {gap:.3})");
            out = s.forward(&[want], OutputMode::NextToken).unwrap();
        }
    }
}

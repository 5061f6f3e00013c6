//! Numerics of the exact CPU path against the Hugging Face float32 reference
//! (`../shared/refs`, see its README): token ids, last-position logits, per-token
//! log-likelihoods and greedy continuations, for every reference prompt.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kiln_cpu::CpuBackend;
use kiln_models::{Model, OutputMode, StepOutput};
use kiln_runtime::EngineConfig;
use serde_json::Value;

fn refs() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/refs"))
}

fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = kiln_hub::ensure_default_model().expect("default model");
        Model::load(&path, Arc::new(CpuBackend::new(0)), EngineConfig::default()).expect("load model")
    })
}

fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(refs().join(format!("{name}.json"))).expect("reference json");
    serde_json::from_str(&text).expect("valid json")
}

/// Reads a little-endian float32 `.npy` vector.
fn read_npy_f32(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).expect("npy file");
    assert_eq!(&bytes[..6], b"\x93NUMPY", "not an npy file");
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
    };
    let header = std::str::from_utf8(&bytes[start..start + header_len]).expect("ascii header");
    assert!(header.contains("'descr': '<f4'") && header.contains("'fortran_order': False"), "{header}");
    bytes[start + header_len..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

fn log_softmax_at(logits: &[f32], id: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    logits[id] as f64 - lse
}

fn check_prompt(name: &str) {
    let r = reference(name);
    let m = model();
    let vocab = m.architecture().vocab_size();

    // Token ids.
    let prompt = r["prompt"].as_str().expect("prompt");
    let want_ids = ids(&r["input_ids"]);
    assert_eq!(m.tokenizer().encode(prompt), want_ids, "{name}: token ids");

    // Every position's logits: last-position logits and per-token log-likelihoods.
    let mut s = m.new_session().unwrap();
    let StepOutput::AllLogits { rows, data } = s.forward(&want_ids, OutputMode::AllLogits).unwrap() else { panic!() };
    assert_eq!(rows, want_ids.len());
    let last = &data[(rows - 1) * vocab..];
    let want = read_npy_f32(&refs().join(format!("{name}_last_logits.npy")));
    let err: f64 = last.iter().zip(&want).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
    println!("{name}: last logits relative L2 error {:.2e}", err / norm);
    assert!(err / norm < 1e-3, "{name}: relative L2 error {}", err / norm);
    assert_eq!(argmax(last), argmax(&want), "{name}: top-1");
    let mut worst = 0f64;
    for t in r["per_token_nll"].as_array().unwrap() {
        let pos = t["pos"].as_u64().unwrap() as usize;
        let id = t["id"].as_u64().unwrap() as usize;
        let lp = log_softmax_at(&data[(pos - 1) * vocab..pos * vocab], id);
        worst = worst.max((lp - t["logprob"].as_f64().unwrap()).abs());
    }
    println!("{name}: worst per-token log-likelihood difference {worst:.2e} nats");
    assert!(worst < 1e-2, "{name}: log-likelihood off by {worst}");

    // The last-logits output mode agrees with the all-rows one.
    let mut s = m.new_session().unwrap();
    let StepOutput::Logits(l) = s.forward(&want_ids, OutputMode::Logits).unwrap() else { panic!() };
    let diff = l.iter().zip(last).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(diff < 1e-3, "{name}: logits mode differs from all-logits mode by {diff}");

    // Greedy continuation, up to the first near-tie.
    let g = &r["greedy"];
    let want_greedy = ids(&g["ids"]);
    let steps = g["steps"].as_array().unwrap();
    let trusted = steps.iter().position(|st| st["gap_top1_top2"].as_f64().unwrap() < 1e-3).unwrap_or(steps.len());
    let mut s = m.new_session().unwrap();
    let mut out = s.forward(&want_ids, OutputMode::NextToken).unwrap();
    let mut got = Vec::new();
    while got.len() < trusted {
        let StepOutput::Token(t) = out else { panic!() };
        got.push(t);
        out = s.forward(&[t], OutputMode::NextToken).unwrap();
    }
    assert_eq!(got, want_greedy[..trusted], "{name}: greedy continuation (first {trusted} steps)");
}

macro_rules! prompts {
    ($($name:ident),*) => {$(
        #[test]
        fn $name() {
            check_prompt(stringify!($name));
        }
    )*};
}

prompts!(p0, p1, p2, p3, p4, p5, p6, p7, p8, long);
